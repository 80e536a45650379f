//! Keeps glibc from returning large freed blocks to the OS between steps.
//!
//! Every step allocates temporaries of several MiB (gathered keys and values, logits). By default
//! glibc serves allocations above 128 KiB with a fresh `mmap` and unmaps them on free, so each step
//! page-faults and zeroes that memory again; a profile of a decode batch of 32 showed ~15% of the
//! step in the kernel's page-fault path. Raising the mmap and trim thresholds lets freed blocks be
//! reused from the heap instead.

/// glibc's largest allowed `M_MMAP_THRESHOLD` on 64-bit (`DEFAULT_MMAP_THRESHOLD_MAX`).
const MMAP_THRESHOLD: libc::c_int = 32 << 20;
/// Keep up to 1 GiB of freed heap before trimming.
const TRIM_THRESHOLD: libc::c_int = 1 << 30;

/// Applies the thresholds; returns whether glibc accepted both.
pub fn keep_freed_memory() -> bool {
    // SAFETY: mallopt only changes allocator parameters; called once at start-up before the
    // worker allocates its tensors.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    }
}

/// Returns the heap's free memory to the OS once, after loading: the model file's bytes and the
/// load's temporaries were freed, but the raised trim threshold would keep them resident.
pub fn release_freed_memory() {
    // SAFETY: malloc_trim only returns free heap pages to the OS; no live allocation moves.
    unsafe {
        libc::malloc_trim(0);
    }
}
