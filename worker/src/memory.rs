//! How much memory the KV cache may take: a fixed number of bytes, or a fraction of the device's
//! free memory (CUDA: `cudaMemGetInfo` after the weights are loaded; CPU: `MemAvailable`).

use tch::Device;

use crate::error::WorkerError;

/// The KV cache budget as configured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvBudget {
    Bytes(usize),
    /// Of the device's free memory, in (0, 1].
    FreeFraction(f64),
}

impl KvBudget {
    pub fn resolve(self, device: Device) -> Result<usize, WorkerError> {
        match self {
            Self::Bytes(bytes) => Ok(bytes),
            Self::FreeFraction(fraction) => {
                if !(fraction > 0.0 && fraction <= 1.0) {
                    return Err(WorkerError::KvCache(format!(
                        "kv_cache_memory_fraction {fraction} is not in (0, 1]"
                    )));
                }
                let free = match device {
                    Device::Cuda(_) => cuda_free_bytes()?,
                    _ => cpu_available_bytes()?,
                };
                Ok((free as f64 * fraction) as usize)
            }
        }
    }
}

fn cpu_available_bytes() -> Result<usize, WorkerError> {
    let meminfo =
        std::fs::read_to_string("/proc/meminfo").map_err(|e| WorkerError::KvCache(format!("/proc/meminfo: {e}")))?;
    meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemAvailable:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
        .map(|kib| kib * 1024)
        .ok_or_else(|| WorkerError::KvCache("MemAvailable is missing from /proc/meminfo".to_owned()))
}

/// Free bytes on the current CUDA device, from the CUDA runtime libtorch already loaded.
fn cuda_free_bytes() -> Result<usize, WorkerError> {
    type MemGetInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> libc::c_int;
    // SAFETY: dlsym looks a symbol up in the libraries already loaded (libtorch_cuda links the CUDA
    // runtime); the function has the C signature `cudaError_t cudaMemGetInfo(size_t*, size_t*)`.
    unsafe {
        let symbol = libc::dlsym(libc::RTLD_DEFAULT, c"cudaMemGetInfo".as_ptr());
        if symbol.is_null() {
            return Err(WorkerError::KvCache(
                "cudaMemGetInfo is not available; set kv_cache_memory in bytes".to_owned(),
            ));
        }
        let mem_get_info: MemGetInfo = std::mem::transmute::<*mut libc::c_void, MemGetInfo>(symbol);
        let (mut free, mut total) = (0usize, 0usize);
        let status = mem_get_info(&mut free, &mut total);
        if status != 0 {
            return Err(WorkerError::KvCache(format!(
                "cudaMemGetInfo failed with error {status}"
            )));
        }
        Ok(free)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fractions_of_cpu_memory_are_bounded_and_checked() {
        let half = KvBudget::FreeFraction(0.5).resolve(Device::Cpu).expect("meminfo");
        assert!(half > 0);
        assert!(KvBudget::FreeFraction(1.5).resolve(Device::Cpu).is_err());
        assert_eq!(KvBudget::Bytes(123).resolve(Device::Cpu).expect("bytes"), 123);
    }
}
