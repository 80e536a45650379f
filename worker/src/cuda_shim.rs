//! The answers of the C++ shims over libtorch's CUDA (`cuda/shim_answer.h`): null on success, else
//! an error message the shim allocated, which is read once here and handed back to be freed.
//! Shared by [`crate::cuda_graph`] and [`crate::paged_attention`].
//!
//! `unsafe` here is the FFI call alone: a non-null answer is a NUL-terminated string from the
//! shim, read once, then freed once by the shim's own `free`.

use std::ffi::c_char;

extern "C" {
    fn rivulet_shim_free_error(message: *mut c_char);
}

/// Turns a shim's answer into a result, freeing its message.
pub fn check(message: *mut c_char) -> Result<(), String> {
    if message.is_null() {
        return Ok(());
    }
    // SAFETY: see the module's invariants.
    let text = unsafe { std::ffi::CStr::from_ptr(message) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: see the module's invariants; `message` is not used again.
    unsafe { rivulet_shim_free_error(message) };
    Err(text)
}
