//! Before spawning workers, the scheduler asks the worker binary which scheduler ⇄ worker
//! protocol it speaks (`rivulet-worker --protocol-version`). A binary left over from another build
//! would otherwise fail later, mid-handshake, with a decoding error that names nothing useful —
//! or, worse, decode a step buffer laid out differently. Attached workers say their version in
//! their hello instead (`worker_client::WorkerClient::attach`).

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
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
    #[error(
        "the worker binary `{binary}` did not tell its protocol version (`--protocol-version`): \
         {detail}; is it a rivulet-worker of this build? (set worker.binary)"
    )]
    NoAnswer { binary: String, detail: String },
}

/// Runs `binary --protocol-version` and checks the answer against this scheduler's version.
pub fn check_worker_protocol(binary: &Path) -> Result<(), WorkerProtocolError> {
    let no_answer = |detail: String| WorkerProtocolError::NoAnswer {
        binary: binary.display().to_string(),
        detail,
    };
    let mut child = Command::new(binary)
        .arg("--protocol-version")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| no_answer(format!("could not run it: {e}")))?;
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
            Err(e) => return Err(no_answer(e.to_string())),
        }
    };
    // The answer is one short line, well under a pipe's buffer: reading after exit cannot block.
    let mut stdout = String::new();
    let mut stderr = String::new();
    if let Some(mut out) = child.stdout.take() {
        let _ = out.read_to_string(&mut stdout);
    }
    if let Some(mut err) = child.stderr.take() {
        let _ = err.read_to_string(&mut stderr);
    }
    if !status.success() {
        let said = stderr.lines().find(|line| !line.trim().is_empty()).unwrap_or("").trim();
        return Err(no_answer(format!("it exited with {status}: {said}")));
    }
    match stdout.trim().parse::<u32>() {
        Ok(theirs) if theirs == PROTOCOL_VERSION => Ok(()),
        Ok(theirs) => Err(WorkerProtocolError::Mismatch {
            binary: binary.display().to_string(),
            theirs,
        }),
        Err(_) => Err(no_answer(format!("it printed {:?}", stdout.trim()))),
    }
}
