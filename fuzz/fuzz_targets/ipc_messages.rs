//! What the scheduler decodes from a worker: IPC events (postcard, as ipc-channel sends them) and
//! the attach socket's JSON hello. Garbage must be an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rivulet_ipc::attach::AttachHello;
use rivulet_ipc::WorkerEvent;

fuzz_target!(|data: &[u8]| {
    let _ = postcard::from_bytes::<WorkerEvent>(data);
    let _ = serde_json::from_slice::<AttachHello>(data);
});
