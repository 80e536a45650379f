//! Choosing the device and the compute dtype: f32 on CPU; bf16 on CUDA.

use rivulet_ipc::device::DeviceSpec;
use tch::{Device, Kind};

use crate::error::WorkerError;

/// Parses `auto`, `cpu` or `cuda:N` (also `cuda` for `cuda:0`).
pub fn select_device(spec: &str) -> Result<Device, WorkerError> {
    let refused = |why: String| WorkerError::Device(spec.trim().to_owned(), why);
    match DeviceSpec::parse(spec).ok_or_else(|| refused("expected auto, cpu or cuda:N".to_owned()))? {
        DeviceSpec::Auto => Ok(if tch::Cuda::is_available() {
            Device::Cuda(0)
        } else {
            Device::Cpu
        }),
        DeviceSpec::Cpu => Ok(Device::Cpu),
        DeviceSpec::Cuda(index) => {
            let count = tch::Cuda::device_count() as usize;
            if index >= count {
                return Err(refused(format!("{count} CUDA devices found")));
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
