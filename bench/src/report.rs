//! The end-of-run table (vLLM's layout) and the side-by-side comparison of two runs.

use std::fmt::Write;

use crate::metrics::{Distribution, Summary};

/// Every row of the report: label and value.
fn rows(summary: &Summary) -> Vec<(String, f64)> {
    let mut rows = vec![
        ("Successful requests".to_owned(), summary.completed as f64),
        ("Failed requests".to_owned(), summary.failed as f64),
        ("Benchmark duration (s)".to_owned(), summary.duration_s),
        ("Total input tokens".to_owned(), summary.total_input_tokens as f64),
        ("Total generated tokens".to_owned(), summary.total_output_tokens as f64),
        ("Request throughput (req/s)".to_owned(), summary.request_throughput),
        ("Output token throughput (tok/s)".to_owned(), summary.output_throughput),
        (
            "Total token throughput (tok/s)".to_owned(),
            summary.total_token_throughput,
        ),
    ];
    let mut latency = |name: &str, d: &Distribution| {
        rows.push((format!("Mean {name} (ms)"), d.mean));
        rows.push((format!("P50 {name} (ms)"), d.p50));
        rows.push((format!("P90 {name} (ms)"), d.p90));
        rows.push((format!("P99 {name} (ms)"), d.p99));
    };
    latency("TTFT", &summary.ttft_ms);
    latency("TPOT", &summary.tpot_ms);
    latency("ITL", &summary.itl_ms);
    latency("E2E", &summary.e2e_ms);
    rows
}

fn format_value(value: f64) -> String {
    if value.fract() == 0.0 && value.abs() < 1e12 {
        format!("{value:.0}")
    } else {
        format!("{value:.2}")
    }
}

pub fn table(title: &str, summary: &Summary) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{:=^60}", format!(" {title} "));
    for (label, value) in rows(summary) {
        let _ = writeln!(out, "{label:<44}{:>16}", format_value(value));
    }
    let _ = writeln!(out, "{}", "=".repeat(60));
    out
}

/// Two runs of the same workload side by side, with `left / right` for every metric.
pub fn comparison(left_name: &str, left: &Summary, right_name: &str, right: &Summary) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{:<36}{left_name:>14}{right_name:>14}{:>10}", "metric", "ratio");
    for ((label, a), (_, b)) in rows(left).into_iter().zip(rows(right)) {
        let ratio = ratio(a, b);
        let _ = writeln!(
            out,
            "{label:<36}{:>14}{:>14}{ratio:>10}",
            format_value(a),
            format_value(b)
        );
    }
    out
}

/// Output throughput `left / right` round by round (the rounds paired in the order they ran),
/// so that a mean ratio can be told from one carried by a single round.
pub fn round_ratios(left: &[Summary], right: &[Summary]) -> String {
    let ratios: Vec<String> = left
        .iter()
        .zip(right)
        .map(|(a, b)| ratio(a.output_throughput, b.output_throughput))
        .collect();
    format!("{:<36}{}\n", "Output tok/s ratio, round by round", ratios.join(" "))
}

/// `a / b` to two places, or `-` where `b` is zero.
fn ratio(a: f64, b: f64) -> String {
    if b != 0.0 {
        format!("{:.2}", a / b)
    } else {
        "-".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comparison_divides_left_by_right() {
        let left = Summary {
            output_throughput: 30.0,
            ..Summary::default()
        };
        let right = Summary {
            output_throughput: 20.0,
            ..Summary::default()
        };
        let text = comparison("rivulet", &left, "peer", &right);
        let line = text
            .lines()
            .find(|l| l.starts_with("Output token throughput"))
            .unwrap_or_default();
        assert!(line.ends_with("1.50"), "{line}");
        assert!(table("run", &left).contains("30"));
    }

    #[test]
    fn round_ratios_pair_rounds_in_order() {
        let runs = |throughputs: &[f64]| -> Vec<Summary> {
            throughputs
                .iter()
                .map(|&output_throughput| Summary {
                    output_throughput,
                    ..Summary::default()
                })
                .collect()
        };
        let text = round_ratios(&runs(&[30.0, 10.0, 5.0]), &runs(&[20.0, 40.0]));
        assert!(text.trim_end().ends_with("1.50 0.25"), "{text}");
        assert!(round_ratios(&runs(&[1.0]), &runs(&[0.0])).trim_end().ends_with('-'));
    }
}
