//! How a device is spelled: by `worker.device`/`worker.devices` in the scheduler's configuration
//! and by a worker's `--device`. Read here once, so that the scheduler refuses at start what its
//! workers would refuse; whether the machine has the device only a worker can tell.

/// A device, as spelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    /// The first CUDA device when there is one, else the CPU.
    Auto,
    Cpu,
    Cuda(usize),
}

impl DeviceSpec {
    /// `auto`, `cpu`, `cuda` (device 0) or `cuda:N`, in any case, with spaces around; `None` for
    /// anything else.
    pub fn parse(spec: &str) -> Option<Self> {
        let spec = spec.trim().to_ascii_lowercase();
        match spec.as_str() {
            "auto" => Some(Self::Auto),
            "cpu" => Some(Self::Cpu),
            _ => match spec.strip_prefix("cuda")? {
                "" => Some(Self::Cuda(0)),
                rest => rest.strip_prefix(':')?.parse().ok().map(Self::Cuda),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spellings_workers_accept() {
        assert_eq!(DeviceSpec::parse(" Auto "), Some(DeviceSpec::Auto));
        assert_eq!(DeviceSpec::parse("cpu"), Some(DeviceSpec::Cpu));
        assert_eq!(DeviceSpec::parse("cuda"), Some(DeviceSpec::Cuda(0)));
        assert_eq!(DeviceSpec::parse("CUDA:3"), Some(DeviceSpec::Cuda(3)));
        for bad in ["gpu", "cuda:", "cuda:x", "cuda0", ""] {
            assert_eq!(DeviceSpec::parse(bad), None, "{bad:?}");
        }
    }
}
