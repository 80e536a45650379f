//! CUDA graphs: a sequence of libtorch ops recorded once and replayed as one launch.
//!
//! tch does not wrap `at::cuda::CUDAGraph`, so `cuda/graph_shim.cpp` exposes the calls the worker
//! needs behind a C interface; the build compiles it where the torch installation has CUDA (see
//! `build.rs`, `cfg(rivulet_cuda_graphs)`). Elsewhere [`Graph::capture`] answers
//! [`GraphError::Unavailable`] and the caller runs its ops eagerly.
//!
//! `unsafe` here is the FFI calls alone. Their invariants: a [`Graph`] owns its C++ object from
//! `rivulet_graph_new` until `Drop` deletes it, once; every call gets that live pointer; an error
//! string the shim returns goes to [`crate::cuda_shim::check`]. A capture runs on the
//! calling thread, between `capture_begin` and `capture_end`, with no other CUDA work issued from
//! elsewhere in the process (the worker runs its steps on one thread).

#[derive(Debug, thiserror::Error)]
pub enum GraphError {
    #[error("this build has no CUDA graph support")]
    Unavailable,
    #[error("CUDA graph: {0}")]
    Cuda(String),
    #[error("CUDA graph capture: an op failed while recording: {0}")]
    Recording(String),
}

#[cfg(rivulet_cuda_graphs)]
mod ffi {
    use std::ffi::{c_char, c_int, c_void};

    extern "C" {
        pub fn rivulet_graph_new() -> *mut c_void;
        pub fn rivulet_graph_delete(graph: *mut c_void);
        pub fn rivulet_graph_capture_begin(graph: *mut c_void, pool_source: *mut c_void, device: c_int) -> *mut c_char;
        pub fn rivulet_graph_capture_end(graph: *mut c_void) -> *mut c_char;
        pub fn rivulet_graph_replay(graph: *mut c_void) -> *mut c_char;
    }

    pub use crate::cuda_shim::check;
}

/// A captured, instantiated graph.
pub struct Graph {
    #[cfg(rivulet_cuda_graphs)]
    raw: std::ptr::NonNull<std::ffi::c_void>,
}

impl Graph {
    /// Records the CUDA work `record` issues on device `device_index` (nothing runs then: buffers
    /// it writes keep their contents until a replay) and returns the graph with what `record`
    /// returned — the tensors it allocated stay the graph's, rewritten by every replay. Graphs given
    /// `share_pool_with` draw their intermediate memory from that graph's pool: safe for graphs
    /// replayed one at a time, each one's outputs read before the next replays.
    pub fn capture<T>(
        device_index: usize,
        share_pool_with: Option<&Graph>,
        record: impl FnOnce() -> T,
    ) -> Result<(Graph, T), GraphError> {
        #[cfg(rivulet_cuda_graphs)]
        {
            // SAFETY: see the module's invariants; the pointer is checked for null.
            let raw = std::ptr::NonNull::new(unsafe { ffi::rivulet_graph_new() })
                .ok_or_else(|| GraphError::Cuda("could not create a graph".to_owned()))?;
            let graph = Graph { raw };
            let pool = share_pool_with.map_or(std::ptr::null_mut(), |g| g.raw.as_ptr());
            // SAFETY: `graph.raw` is live; `pool` is null or another live graph.
            ffi::check(unsafe { ffi::rivulet_graph_capture_begin(graph.raw.as_ptr(), pool, device_index as i32) })
                .map_err(GraphError::Cuda)?;
            // tch reports a failing op by panicking; the capture must end either way.
            let recorded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(record));
            // SAFETY: `graph.raw` is live and capturing.
            let ended = ffi::check(unsafe { ffi::rivulet_graph_capture_end(graph.raw.as_ptr()) });
            let value = recorded.map_err(|panic| GraphError::Recording(crate::error::panic_message(&panic)))?;
            ended.map_err(GraphError::Cuda)?;
            Ok((graph, value))
        }
        #[cfg(not(rivulet_cuda_graphs))]
        {
            let _ = (device_index, share_pool_with, record);
            Err(GraphError::Unavailable)
        }
    }

    /// Runs the recorded work again, after the work already queued on the current stream.
    pub fn replay(&self) -> Result<(), GraphError> {
        #[cfg(rivulet_cuda_graphs)]
        {
            // SAFETY: `self.raw` is live and was captured.
            ffi::check(unsafe { ffi::rivulet_graph_replay(self.raw.as_ptr()) }).map_err(GraphError::Cuda)
        }
        #[cfg(not(rivulet_cuda_graphs))]
        Err(GraphError::Unavailable)
    }
}

#[cfg(rivulet_cuda_graphs)]
impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: `self.raw` came from `rivulet_graph_new` and is deleted once, here.
        unsafe { ffi::rivulet_graph_delete(self.raw.as_ptr()) }
    }
}

/// Whether this build can capture graphs (a CUDA torch with the CUDA runtime's headers).
pub const fn supported() -> bool {
    cfg!(rivulet_cuda_graphs)
}
