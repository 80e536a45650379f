//! The stop-string matcher and character limit on arbitrary stop strings and text deltas (split
//! anywhere, multi-byte characters included): never panics, and never sends text past a stop
//! string it was asked to trim.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rivulet_scheduler::completion::{OutputText, TextProgress};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let mut parts = text.split('\u{1}');
    let stops: Vec<String> = parts
        .next()
        .unwrap_or_default()
        .split('\u{2}')
        .filter(|s| !s.is_empty())
        .take(8)
        .map(str::to_owned)
        .collect();
    let max_chars = (data.first().copied().unwrap_or(0) % 64) as usize;
    let mut output = OutputText::new(stops.clone(), false, (max_chars > 0).then_some(max_chars));
    let mut sent = String::new();
    for delta in parts {
        match output.push(delta, true) {
            TextProgress::Continue(t) => sent.push_str(&t),
            TextProgress::StopString(t)
            | TextProgress::CharLimit(t) => {
                sent.push_str(&t);
                break;
            }
        }
    }
    for stop in &stops {
        assert!(!sent.contains(stop.as_str()), "sent {sent:?} contains the stop string {stop:?}");
    }
});
