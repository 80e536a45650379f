//! `rivulet-bench compare`: the mean of each side's rounds (JSON lines written by `run --json`),
//! printed side by side with the ratio left/right for every metric, then the output throughput's
//! ratio round by round.

use std::path::PathBuf;

use anyhow::Context;
use serde_json::Value;

use crate::metrics::Summary;
use crate::report;

#[derive(clap::Args, Debug)]
pub struct CompareArgs {
    /// NAME=FILE: the left-hand runs (the ratio's numerator).
    #[arg(long)]
    left: String,
    /// NAME=FILE: the right-hand runs.
    #[arg(long)]
    right: String,
}

pub fn print(args: &CompareArgs) -> anyhow::Result<()> {
    let (left_name, left, left_rounds) = load_side(&args.left)?;
    let (right_name, right, right_rounds) = load_side(&args.right)?;
    print!("{}", report::comparison(&left_name, &left, &right_name, &right));
    print!("{}", report::round_ratios(&left_rounds, &right_rounds));
    Ok(())
}

/// A side's name, the mean of its rounds and each round.
fn load_side(spec: &str) -> anyhow::Result<(String, Summary, Vec<Summary>)> {
    let (name, path) = spec.split_once('=').context("expected NAME=FILE")?;
    let path = PathBuf::from(path);
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let summaries = text
        .lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            let record: Value = serde_json::from_str(line)?;
            Ok(record.get("summary").cloned().unwrap_or(Value::Null))
        })
        .collect::<anyhow::Result<Vec<Value>>>()?;
    let mean = mean_of(&summaries).with_context(|| format!("{} holds no runs", path.display()))?;
    let rounds = summaries
        .into_iter()
        .map(serde_json::from_value)
        .collect::<Result<Vec<Summary>, _>>()?;
    Ok((name.to_owned(), serde_json::from_value(mean)?, rounds))
}

/// The field-by-field mean of JSON documents with the same shape (numbers averaged, recursively).
pub fn mean_of(values: &[Value]) -> Option<Value> {
    let first = values.first()?;
    Some(match first {
        Value::Number(_) => {
            let numbers: Vec<f64> = values.iter().filter_map(Value::as_f64).collect();
            let mean = numbers.iter().sum::<f64>() / numbers.len().max(1) as f64;
            if first.is_u64() && values.iter().all(Value::is_u64) {
                Value::from(mean.round() as u64)
            } else {
                Value::from(mean)
            }
        }
        Value::Object(map) => Value::Object(
            map.keys()
                .filter_map(|key| {
                    let fields: Vec<Value> = values.iter().filter_map(|v| v.get(key).cloned()).collect();
                    Some((key.clone(), mean_of(&fields)?))
                })
                .collect(),
        ),
        other => other.clone(),
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn rounds_are_averaged_field_by_field() {
        let mean = mean_of(&[
            json!({"completed": 4, "ttft_ms": {"p50": 10.0}}),
            json!({"completed": 6, "ttft_ms": {"p50": 20.0}}),
        ]);
        assert_eq!(mean, Some(json!({"completed": 5, "ttft_ms": {"p50": 15.0}})));
        assert_eq!(mean_of(&[]), None);
    }
}
