//! The attach socket (`worker.attach_socket`): workers started elsewhere connect here to join the
//! pool. Each connection is handed to the engine, which gives it a replica and a driver.

use std::io;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// How often the listener looks for a new connection (a worker's attach is not latency-bound).
const ACCEPT_POLL: Duration = Duration::from_millis(100);

/// Listens until dropped; dropping it removes the socket file.
pub struct AttachListener {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl AttachListener {
    /// Binds `path` (replacing a stale socket file left by an earlier run, never one that a live
    /// scheduler listens on) and passes every connection to `on_connection`.
    pub fn bind(path: &Path, on_connection: impl Fn(UnixStream) + Send + 'static) -> io::Result<Self> {
        if let Some(dir) = path.parent().filter(|dir| !dir.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        if UnixStream::connect(path).is_ok() {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                "another process is listening on it",
            ));
        }
        // A stale socket (its server gone) is replaced; anything else at the path is the user's.
        match std::fs::symlink_metadata(path) {
            Ok(metadata) if metadata.file_type().is_socket() => std::fs::remove_file(path)?,
            Ok(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    "something other than a socket is there (it is left alone)",
                ))
            }
            Err(error) if error.kind() == io::ErrorKind::NotFound => {}
            Err(error) => return Err(error),
        }
        let listener = UnixListener::bind(path)?;
        // Polled, so that stopping never depends on waking a blocked accept.
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::Builder::new()
            .name("attach-listener".to_owned())
            .spawn(move || {
                while !stopping.load(Ordering::Acquire) {
                    match listener.accept() {
                        Ok((stream, _)) => match stream.set_nonblocking(false) {
                            Ok(()) => on_connection(stream),
                            Err(error) => tracing::warn!(%error, "attach socket: connection unusable"),
                        },
                        Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                            std::thread::sleep(ACCEPT_POLL);
                        }
                        Err(error) => {
                            tracing::warn!(%error, "attach socket: accept failed");
                            std::thread::sleep(ACCEPT_POLL);
                        }
                    }
                }
            })?;
        tracing::info!(socket = %path.display(), "workers may attach");
        Ok(Self {
            path: path.to_owned(),
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for AttachListener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}
