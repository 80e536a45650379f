//! Choosing the device and the compute dtype: f32 on CPU; bf16 on CUDA.

use tch::{Device, Kind};

use crate::error::WorkerError;

/// Parses `auto`, `cpu` or `cuda:N` (also `cuda` for `cuda:0`).
pub fn select_device(spec: &str) -> Result<Device, WorkerError> {
    let spec = spec.trim().to_ascii_lowercase();
    match spec.as_str() {
        "auto" => Ok(if tch::Cuda::is_available() {
            Device::Cuda(0)
        } else {
            Device::Cpu
        }),
        "cpu" => Ok(Device::Cpu),
        _ => {
            let index = match spec.strip_prefix("cuda") {
                Some("") => 0,
                Some(rest) => rest
                    .strip_prefix(':')
                    .and_then(|n| n.parse::<usize>().ok())
                    .ok_or_else(|| WorkerError::Device(spec.clone(), "expected auto, cpu or cuda:N".to_owned()))?,
                None => {
                    return Err(WorkerError::Device(
                        spec.clone(),
                        "expected auto, cpu or cuda:N".to_owned(),
                    ))
                }
            };
            let count = tch::Cuda::device_count() as usize;
            if index >= count {
                return Err(WorkerError::Device(spec, format!("{count} CUDA devices found")));
            }
            Ok(Device::Cuda(index))
        }
    }
}

pub fn compute_kind(device: Device) -> Kind {
    match device {
        Device::Cpu => Kind::Float,
        _ => Kind::BFloat16,
    }
}

pub fn describe(device: Device) -> String {
    match device {
        Device::Cuda(i) => format!("cuda:{i}"),
        _ => "cpu".to_owned(),
    }
}
