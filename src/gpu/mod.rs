//! GPUs of this pod and where each worker should run: the inventory (what
//! the container was given, from sysfs/procfs), device visibility
//! (CUDA_VISIBLE_DEVICES, NVIDIA_VISIBLE_DEVICES) and the pure placement
//! planner (reference/gpu-pid1.md 2.4 and 3).
//!
//! # Design
//! sysfs/procfs is the primary source: it needs no library and cannot
//! crash the agent. NVML (a second source, for health and metrics) will run
//! only in a child process of trainlet, because a static-glibc binary that
//! dlopens libnvidia-ml.so.1 loads a second libc (reference/gpu-pid1.md 2).
//! Nothing here starts a process or changes an affinity; the spawner applies
//! the plan.

pub(crate) mod nvml;
pub(crate) mod plan;
pub(crate) mod preflight;
pub(crate) mod prepare;
pub mod sysfs;
pub(crate) mod visible;

use std::path::{Path, PathBuf};

pub use crate::process::CpuSet;
pub use plan::{PinMode, Topology, Visibility};
pub use prepare::GpuPlan;

use crate::env::{self, Env};

/// One NVIDIA GPU of this pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// PCI bus id, normalised to lower-case `dddd:bb:dd.f`.
    pub bus_id: String,
    /// `GPU-...` UUID, when the driver's procfs gives it.
    pub uuid: Option<String>,
    /// Model name, when known.
    pub model: Option<String>,
    /// Device minor (`/dev/nvidia<minor>`), when known.
    pub minor: Option<u32>,
    /// Position among the pod's GPUs in PCI bus order: the CUDA ordinal
    /// under `CUDA_DEVICE_ORDER=PCI_BUS_ID` before CUDA_VISIBLE_DEVICES.
    pub ordinal: u32,
    /// NUMA node; None when the machine has no NUMA information (-1).
    pub numa_node: Option<u32>,
    /// CPUs local to the GPU (sysfs `local_cpulist`).
    pub local_cpus: CpuSet,
}

/// Why the GPUs could not be listed.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// A file of the inventory could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: std::path::PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A value in it made no sense.
    #[error("{path}: {what}")]
    Invalid {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong.
        what: String,
    },
}

/// A source of the pod's GPUs, in PCI bus order.
pub trait Inventory {
    /// The GPUs this container was given.
    fn gpus(&self) -> Result<Vec<Gpu>, GpuError>;
}

/// A fixed list, for tests and for callers that already know.
#[derive(Debug, Clone, Default)]
pub struct Fake(pub Vec<Gpu>);

impl Inventory for Fake {
    fn gpus(&self) -> Result<Vec<Gpu>, GpuError> {
        Ok(in_bus_order(self.0.clone()))
    }
}

/// Sort by PCI bus id and number the GPUs in that order ([`Gpu::ordinal`]).
fn in_bus_order(mut gpus: Vec<Gpu>) -> Vec<Gpu> {
    gpus.sort_by(|a, b| a.bus_id.cmp(&b.bus_id));
    for (i, g) in gpus.iter_mut().enumerate() {
        g.ordinal = u32::try_from(i).unwrap_or(u32::MAX);
    }
    gpus
}

/// Where the inventory reads sysfs, procfs and /dev: `/`, or
/// `TRAINLET_SYSFS_ROOT`.
pub fn root(env: &Env) -> PathBuf {
    env.get(env::TRAINLET_SYSFS_ROOT).map_or_else(|| PathBuf::from("/"), PathBuf::from)
}

/// The GPUs workers may use, in CUDA order (local rank i gets entry i).
pub fn discover(inventory: &dyn Inventory, env: &Env) -> Result<Vec<Gpu>, GpuError> {
    Ok(visible::visible(inventory.gpus()?, env.get(env::NVIDIA_VISIBLE_DEVICES), env.raw(env::CUDA_VISIBLE_DEVICES)))
}

/// The machine as the planner needs it, with the agent's own affinity read
/// now (it is the pod's cpuset, which kubelet may change between attempts).
pub fn topology(root: &Path) -> Result<Topology, GpuError> {
    let s = sysfs::Sysfs::new(root);
    let allowed = CpuSet::of(crate::sys::allowed_cpus());
    Ok(Topology { siblings: s.siblings(&allowed), nodes: s.node_cpus()?, allowed })
}

/// Normalise a PCI bus id from NVML (`00000000:18:00.0`), sysfs
/// (`0000:18:00.0`) or short (`18:00.0`) form to `dddd:bb:dd.f`.
pub fn normalize_bus_id(id: &str) -> Option<String> {
    let id = id.trim().to_ascii_lowercase();
    let (domain, rest) = match id.matches(':').count() {
        2 => id.split_once(':')?,
        1 => ("0", id.as_str()),
        _ => return None,
    };
    let (bus, devfn) = rest.split_once(':')?;
    let (dev, func) = devfn.split_once('.')?;
    let domain = u32::from_str_radix(domain, 16).ok()?;
    let bus = u8::from_str_radix(bus, 16).ok()?;
    let dev = u8::from_str_radix(dev, 16).ok()?;
    let func = u8::from_str_radix(func, 16).ok()?;
    (domain <= 0xffff && dev < 32 && func < 8).then(|| format!("{domain:04x}:{bus:02x}:{dev:02x}.{func:x}"))
}

/// `n` GPUs on consecutive buses from `first_bus`, UUIDs `GPU-<i><tag>`,
/// for unit tests.
#[cfg(test)]
pub fn test_gpus(n: u32, first_bus: u32, tag: &str) -> Vec<Gpu> {
    (0..n)
        .map(|i| Gpu {
            bus_id: format!("0000:{:02x}:00.0", first_bus + i),
            uuid: Some(format!("GPU-{i}{tag}")),
            model: None,
            minor: Some(i),
            ordinal: i,
            numa_node: None,
            local_cpus: CpuSet::default(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    #[test_case("00000000:18:00.0", Some("0000:18:00.0"); "nvml form")]
    #[test_case("0000:AF:00.0", Some("0000:af:00.0"); "sysfs upper case")]
    #[test_case("3b:00.0", Some("0000:3b:00.0"); "short form")]
    #[test_case("0001:3b:1f.7", Some("0001:3b:1f.7"); "domain and function")]
    #[test_case("gpu0", None; "not a bus id")]
    #[test_case("0000:3b:20.0", None; "device out of range")]
    fn bus_ids(raw: &str, want: Option<&str>) {
        assert_eq!(normalize_bus_id(raw).as_deref(), want);
    }
}

/// NVML's clocks event (throttle) reasons, by bit (`nvml.h`).
const CLOCK_REASONS: &[(u64, &str)] = &[
    (0x1, "idle"),
    (0x2, "applications clocks setting"),
    (0x4, "software power cap"),
    (0x8, "hardware slowdown"),
    (0x10, "sync boost"),
    (0x20, "software thermal slowdown"),
    (0x40, "hardware thermal slowdown"),
    (0x80, "hardware power brake"),
    (0x100, "display clock setting"),
];

/// The reasons of NVML's bit mask that slow a busy GPU, in words (idle,
/// which only says no kernel runs, is left out; unknown bits are named by
/// their value).
pub fn clock_reasons(bits: u64) -> Vec<String> {
    let mut out: Vec<String> =
        CLOCK_REASONS.iter().filter(|(b, _)| bits & b != 0 && *b != 0x1).map(|(_, n)| (*n).to_string()).collect();
    let known = CLOCK_REASONS.iter().fold(0, |all, (b, _)| all | b);
    if bits & !known != 0 {
        out.push(format!("reason {:#x}", bits & !known));
    }
    out
}

#[cfg(test)]
mod clock_tests {
    #[test]
    fn clock_reasons_are_named_and_idle_is_not_a_slowdown() {
        assert!(super::clock_reasons(0x1).is_empty());
        assert_eq!(super::clock_reasons(0x4 | 0x40), ["software power cap", "hardware thermal slowdown"]);
        assert_eq!(super::clock_reasons(0x8 | 0x1000), ["hardware slowdown", "reason 0x1000"]);
    }
}
