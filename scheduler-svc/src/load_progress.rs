//! Showing a worker's model load (its `LoadProgress` events, before `Ready`).

use std::io::IsTerminal;
use std::sync::OnceLock;

use rivulet_ipc::LoadProgress;

/// The bars of replicas loading at once, drawn together.
static BARS: OnceLock<indicatif::MultiProgress> = OnceLock::new();

/// How a worker's model load is shown: a progress bar when the log is a terminal (and not JSON),
/// else a log line every quarter, so a slow load (a big model, a cold disk) is visible without
/// flooding the log.
pub struct LoadShown {
    last_quarter: Option<u32>,
    bar: Option<indicatif::ProgressBar>,
    terminal: bool,
}

impl LoadShown {
    pub fn new(json_logs: bool) -> Self {
        Self {
            last_quarter: None,
            bar: None,
            terminal: !json_logs && std::io::stderr().is_terminal(),
        }
    }

    pub fn show(&mut self, pid: u32, progress: LoadProgress) {
        let tensors = format!("{}/{} tensors", progress.tensors_loaded, progress.tensors_total);
        if self.terminal {
            let bar = self.bar.get_or_insert_with(|| {
                let style = indicatif::ProgressStyle::with_template(
                    "worker {prefix} loading the model [{bar:30}] {bytes}/{total_bytes} {msg}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
                let bars = BARS.get_or_init(indicatif::MultiProgress::new);
                let bar = bars.add(indicatif::ProgressBar::new(progress.bytes_total).with_style(style));
                bar.set_prefix(pid.to_string());
                bar
            });
            bar.set_length(progress.bytes_total);
            bar.set_position(progress.bytes_loaded);
            bar.set_message(tensors);
            if progress.tensors_loaded == progress.tensors_total {
                bar.finish_and_clear();
            }
            return;
        }
        let quarter = progress.percent() / 25;
        if self.last_quarter.is_none_or(|last| quarter > last) {
            self.last_quarter = Some(quarter);
            tracing::info!(
                worker_pid = pid,
                percent = progress.percent(),
                tensors,
                megabytes = format!("{}/{}", progress.bytes_loaded >> 20, progress.bytes_total >> 20),
                "loading the model"
            );
        }
    }
}

impl Drop for LoadShown {
    /// A load that failed midway leaves no bar behind.
    fn drop(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}
