//! Before spawning workers, the scheduler asks the worker binary which scheduler ⇄ worker
//! protocol it speaks (`rivulet-worker --protocol-version`). A binary left over from another build
//! would otherwise fail later, mid-handshake, with a decoding error that names nothing useful —
//! or, worse, decode a step buffer laid out differently. Attached workers say their version in
//! their hello instead (`worker_client::WorkerClient::attach`).

use std::io::Read;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use rivulet_ipc::attach::PROTOCOL_VERSION;

/// Loading libtorch's shared libraries is the slow part of the answer; a binary silent this long
/// is not a worker.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum WorkerProtocolError {
    #[error(
        "the worker binary `{binary}` speaks protocol version {theirs}, this scheduler speaks \
         {PROTOCOL_VERSION}: build both from the same source (set worker.binary)"
    )]
    Mismatch { binary: String, theirs: u32 },
    #[error("the worker binary `{binary}` could not be run (set worker.binary)")]
    Run {
        binary: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the worker binary `{binary}` did not tell its protocol version (`--protocol-version`): \
         {detail}; is it a rivulet-worker of this build? (set worker.binary)"
    )]
    NoAnswer { binary: String, detail: String },
}

/// Runs `binary --protocol-version` and checks the answer against this scheduler's version.
pub fn check_worker_protocol(binary: &Path) -> Result<(), WorkerProtocolError> {
    let name = binary.display().to_string();
    let no_answer = |detail: String| WorkerProtocolError::NoAnswer {
        binary: name.clone(),
        detail,
    };
    let mut child = Command::new(binary)
        .arg("--protocol-version")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| WorkerProtocolError::Run {
            binary: name.clone(),
            source,
        })?;
    // Both pipes drained while waiting, so that a chatty binary cannot fill one and block.
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let deadline = Instant::now() + ANSWER_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(no_answer(format!("no answer within {ANSWER_TIMEOUT:?}")));
            }
            Err(error) => return Err(no_answer(error.to_string())),
        }
    };
    let output = Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    };
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let said = stderr.lines().find(|line| !line.trim().is_empty()).unwrap_or("").trim();
        return Err(no_answer(format!("it exited with {}: {said}", output.status)));
    }
    match parse_answer(&String::from_utf8_lossy(&output.stdout)) {
        Some(theirs) if theirs == PROTOCOL_VERSION => Ok(()),
        Some(theirs) => Err(WorkerProtocolError::Mismatch { binary: name, theirs }),
        None => Err(no_answer(format!(
            "it printed {:?}",
            String::from_utf8_lossy(&output.stdout).trim()
        ))),
    }
}

/// Reads a pipe to its end on a thread of its own.
fn drain(pipe: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_end(&mut bytes);
        }
        bytes
    })
}

/// The version in the worker's answer: one number on a line of its own.
fn parse_answer(stdout: &str) -> Option<u32> {
    stdout.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_answer_is_one_number() {
        assert_eq!(parse_answer("2\n"), Some(2));
        assert_eq!(parse_answer("  7 "), Some(7));
        assert_eq!(parse_answer("rivulet-worker 0.1.0\n"), None);
        assert_eq!(parse_answer(""), None);
        assert_eq!(parse_answer("-1"), None);
    }

    #[test]
    fn a_missing_binary_is_named() {
        let error = check_worker_protocol(Path::new("/nonexistent/rivulet-worker")).expect_err("missing");
        assert!(matches!(error, WorkerProtocolError::Run { .. }), "{error:?}");
        assert!(error.to_string().contains("/nonexistent/rivulet-worker"), "{error}");
    }
}
