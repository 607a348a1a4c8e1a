//! What resolution needs to know of the machine (GPUs, CPUs, host name,
//! memory), discovered once and
//! passed in, so that [`super::Plan::resolve_on`] itself reads no file and
//! is table-tested with any machine.

use std::path::PathBuf;

use super::Error;
use crate::env::Env;

/// The machine a plan is resolved for.
#[derive(Debug, Clone)]
pub struct Machine {
    /// Root of the sysfs/procfs tree the GPU inventory was read from.
    pub gpu_root: PathBuf,
    /// The usable GPUs, in CUDA order.
    pub gpus: Vec<crate::gpu::Gpu>,
    /// CPUs this process may run on.
    pub cpus: usize,
    /// This pod's host name.
    pub hostname: String,
    /// The store's default memory budget: a quarter of the container's
    /// memory limit (cgroup v2 or v1), else of the machine's memory.
    pub store_memory: u64,
}

impl Machine {
    /// Look at this machine: GPUs (as `env` restricts them), CPUs, host
    /// name, memory.
    pub fn discover(env: &Env) -> Result<Self, Error> {
        let gpu_root = crate::gpu::root(env);
        let gpus = crate::gpu::discover(&crate::gpu::sysfs::Sysfs::new(&gpu_root), env)?;
        Ok(Self {
            gpu_root,
            gpus,
            cpus: crate::sys::cpu_count(),
            hostname: crate::sys::hostname().unwrap_or_else(|| "localhost".into()),
            store_memory: crate::store::default_budget(std::path::Path::new("/")),
        })
    }
}
