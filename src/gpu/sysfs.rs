//! The pod's GPUs from sysfs and the driver's procfs (reference/gpu-pid1.md
//! 2.4), under a root path so tests can point it at a fake tree.
//!
//! sysfs is not namespaced: it shows every GPU of the host. The NVIDIA
//! container runtime masks `/proc/driver/nvidia/gpus` down to the GPUs the
//! container was given and bind-mounts only their `/dev/nvidiaN`, so the
//! inventory is the NVIDIA PCI functions of sysfs that also appear there
//! (and whose device node exists, when the minor is known). No driver
//! procfs means no usable GPU.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use super::{CpuSet, Gpu, GpuError, Inventory, normalize_bus_id};

/// NVIDIA's PCI vendor id.
const NVIDIA: &str = "0x10de";

/// sysfs/procfs under `root` (`/` in production).
#[derive(Debug, Clone)]
pub struct Sysfs {
    root: PathBuf,
}

impl Sysfs {
    /// Read the tree under `root`.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.root.join(rel.trim_start_matches('/'))
    }

    fn read(&self, path: &Path) -> Result<String, GpuError> {
        std::fs::read_to_string(path).map_err(|source| GpuError::Read { path: path.to_path_buf(), source })
    }

    /// `/proc/driver/nvidia/gpus/<bdf>/information`, by normalised bus id.
    fn driver_gpus(&self) -> Result<HashMap<String, HashMap<String, String>>, GpuError> {
        let dir = self.path("proc/driver/nvidia/gpus");
        let Ok(entries) = std::fs::read_dir(&dir) else { return Ok(HashMap::new()) };
        let mut out = HashMap::new();
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(bdf) = normalize_bus_id(&name) else { continue };
            let info = std::fs::read_to_string(e.path().join("information")).unwrap_or_default();
            let fields = info
                .lines()
                .filter_map(|l| l.split_once(':'))
                .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                .collect();
            out.insert(bdf, fields);
        }
        Ok(out)
    }

    /// Online NUMA nodes and their CPUs (empty on a NUMA-less machine).
    pub fn node_cpus(&self) -> Result<BTreeMap<u32, CpuSet>, GpuError> {
        let dir = self.path("sys/devices/system/node");
        let Ok(entries) = std::fs::read_dir(&dir) else { return Ok(BTreeMap::new()) };
        let mut out = BTreeMap::new();
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(n) = name.strip_prefix("node").and_then(|n| n.parse::<u32>().ok()) else { continue };
            let path = e.path().join("cpulist");
            let cpus = CpuSet::parse(&self.read(&path)?)
                .map_err(|err| GpuError::Invalid { path: path.clone(), what: err.to_string() })?;
            out.insert(n, cpus);
        }
        Ok(out)
    }

    /// SMT siblings of each CPU in `cpus` (a CPU without topology
    /// information is its own core).
    pub fn siblings(&self, cpus: &CpuSet) -> HashMap<u32, CpuSet> {
        cpus.iter()
            .map(|c| {
                let p = self.path(&format!("sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list"));
                let s = std::fs::read_to_string(p).ok().and_then(|t| CpuSet::parse(&t).ok());
                (c, s.filter(|s| s.contains(c)).unwrap_or_else(|| CpuSet::of([c])))
            })
            .collect()
    }
}

/// A network device with a PCI function (`/sys/class/net/<name>/device`)
/// or an InfiniBand HCA (`/sys/class/infiniband/<name>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nic {
    /// Interface or HCA name (`eth0`, `mlx5_0`).
    pub name: String,
    /// An InfiniBand/RoCE HCA (NCCL_IB_HCA) rather than a socket interface.
    pub ib: bool,
    /// Its NUMA node, when known.
    pub numa_node: Option<u32>,
}

impl Sysfs {
    /// Physical NICs and HCAs with their NUMA nodes, by name (virtual
    /// interfaces such as `lo`, bridges and veths have no `device`).
    pub fn nics(&self) -> Vec<Nic> {
        let mut out = Vec::new();
        for (dir, ib) in [("sys/class/infiniband", true), ("sys/class/net", false)] {
            let Ok(entries) = std::fs::read_dir(self.path(dir)) else { continue };
            for e in entries.flatten() {
                let dev = e.path().join("device");
                if !dev.exists() {
                    continue;
                }
                let numa_node = std::fs::read_to_string(dev.join("numa_node"))
                    .ok()
                    .and_then(|n| n.trim().parse::<i64>().ok())
                    .and_then(|n| u32::try_from(n).ok());
                out.push(Nic { name: e.file_name().to_string_lossy().into_owned(), ib, numa_node });
            }
        }
        out.sort_by(|a, b| (a.ib, &a.name).cmp(&(b.ib, &b.name)));
        out
    }
}

impl Inventory for Sysfs {
    fn gpus(&self) -> Result<Vec<Gpu>, GpuError> {
        let given = self.driver_gpus()?;
        if given.is_empty() {
            return Ok(Vec::new());
        }
        let dir = self.path("sys/bus/pci/devices");
        let entries = std::fs::read_dir(&dir).map_err(|source| GpuError::Read { path: dir.clone(), source })?;
        let mut gpus = Vec::new();
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(bus_id) = normalize_bus_id(&name) else { continue };
            let dev = e.path();
            let field =
                |f: &str| std::fs::read_to_string(dev.join(f)).map(|s| s.trim().to_string()).unwrap_or_default();
            let class = field("class");
            if field("vendor") != NVIDIA || !(class.starts_with("0x0302") || class.starts_with("0x0300")) {
                continue;
            }
            let Some(info) = given.get(&bus_id) else { continue };
            let minor = info.get("Device Minor").and_then(|m| m.parse::<u32>().ok());
            if let Some(m) = minor
                && !self.path(&format!("dev/nvidia{m}")).exists()
            {
                continue; // the runtime did not give us its device node
            }
            let numa_node = field("numa_node").parse::<i64>().ok().and_then(|n| u32::try_from(n).ok());
            let local_cpus = CpuSet::parse(&field("local_cpulist"))
                .map_err(|err| GpuError::Invalid { path: dev.join("local_cpulist"), what: err.to_string() })?;
            gpus.push(Gpu {
                ordinal: 0, // numbered by in_bus_order
                bus_id,
                uuid: info.get("GPU UUID").cloned(),
                model: info.get("Model").cloned(),
                minor,
                numa_node,
                local_cpus,
            });
        }
        Ok(super::in_bus_order(gpus))
    }
}

/// Fake machines for tests and benchmarks: a sysfs/procfs tree under a
/// directory, read through `TRAINLET_SYSFS_ROOT`.
#[doc(hidden)]
pub mod fake {
    use std::path::Path;

    /// One GPU of a fake machine.
    #[derive(Debug)]
    pub struct FakeGpu<'a> {
        /// sysfs bus id.
        pub bdf: &'a str,
        /// `numa_node` (-1 = none).
        pub numa: i32,
        /// `local_cpulist`.
        pub cpus: &'a str,
        /// Given to the container (driver procfs entry and device node).
        pub given: bool,
    }

    fn write(root: &Path, rel: &str, text: &str) -> std::io::Result<()> {
        let p = root.join(rel);
        if let Some(dir) = p.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(p, text)
    }

    /// Write a machine: NUMA nodes (cpulists), SMT pairs `(cpu, sibling)`
    /// when `smt`, GPUs, and one non-NVIDIA PCI device.
    pub fn machine(root: &Path, nodes: &[&str], cpus: u32, smt: bool, gpus: &[FakeGpu<'_>]) -> std::io::Result<()> {
        for (n, list) in nodes.iter().enumerate() {
            write(root, &format!("sys/devices/system/node/node{n}/cpulist"), list)?;
        }
        let half = cpus / 2;
        for c in 0..cpus {
            let sib = if smt { format!("{},{}", c % half, c % half + half) } else { c.to_string() };
            write(root, &format!("sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list"), &sib)?;
        }
        write(root, "sys/bus/pci/devices/0000:00:1f.0/vendor", "0x8086\n")?;
        write(root, "sys/bus/pci/devices/0000:00:1f.0/class", "0x060100\n")?;
        for (minor, g) in gpus.iter().enumerate() {
            let dev = format!("sys/bus/pci/devices/{}", g.bdf);
            write(root, &format!("{dev}/vendor"), "0x10de\n")?;
            write(root, &format!("{dev}/class"), "0x030200\n")?;
            write(root, &format!("{dev}/numa_node"), &format!("{}\n", g.numa))?;
            write(root, &format!("{dev}/local_cpulist"), &format!("{}\n", g.cpus))?;
            if g.given {
                // The driver procfs names the domain with 8 digits, upper case.
                let proc_name = format!("0000{}", g.bdf.to_ascii_uppercase());
                write(
                    root,
                    &format!("proc/driver/nvidia/gpus/{proc_name}/information"),
                    &format!(
                        "Model: \t\t NVIDIA H100 80GB HBM3\nGPU UUID: \t GPU-0000000{minor}-fake\nBus Location: \t {proc_name}\nDevice Minor: \t {minor}\n"
                    ),
                )?;
                write(root, &format!("dev/nvidia{minor}"), "")?;
            }
        }
        Ok(())
    }

    /// A NIC (`ib`: an HCA under /sys/class/infiniband, else a net
    /// interface) on NUMA node `numa`.
    pub fn nic(root: &Path, name: &str, ib: bool, numa: i32) -> std::io::Result<()> {
        let class = if ib { "infiniband" } else { "net" };
        write(root, &format!("sys/class/{class}/{name}/device/numa_node"), &format!("{numa}\n"))
    }

    /// Bus ids of the 8 GPUs of [`dgx`] and [`dgx_on_two_cpus`], in order.
    pub const DGX_BUS: [&str; 8] = [
        "0000:18:00.0",
        "0000:2a:00.0",
        "0000:3a:00.0",
        "0000:5d:00.0",
        "0000:9a:00.0",
        "0000:ab:00.0",
        "0000:ba:00.0",
        "0000:db:00.0",
    ];

    /// 8 GPUs, 4 per NUMA node, the nodes' CPUs given.
    fn eight_gpus(root: &Path, node_cpus: [&str; 2], cpus: u32, smt: bool) -> std::io::Result<()> {
        let gpus: Vec<FakeGpu<'_>> = DGX_BUS
            .iter()
            .enumerate()
            .map(|(i, bdf)| FakeGpu { bdf, numa: i32::from(i >= 4), cpus: node_cpus[usize::from(i >= 4)], given: true })
            .collect();
        machine(root, &node_cpus, cpus, smt, &gpus)
    }

    /// A 2-socket machine with 8 GPUs, 4 per NUMA node, 64 CPUs with SMT:
    /// node 0 = cores 0-15 + siblings 32-47, node 1 = 16-31 + 48-63.
    pub fn dgx(root: &Path) -> std::io::Result<()> {
        eight_gpus(root, ["0-15,32-47", "16-31,48-63"], 64, true)
    }

    /// The same 8 GPUs on two single-CPU nodes, CPU 0 and CPU 1: a binding
    /// planned on it can be applied on any machine with two CPUs and read
    /// back from /proc (integration tests, the pinning benchmark).
    pub fn dgx_on_two_cpus(root: &Path) -> std::io::Result<()> {
        eight_gpus(root, ["0", "1"], 2, false)
    }
}

#[cfg(test)]
mod tests {
    use super::fake::{FakeGpu, dgx, machine};
    use super::*;

    #[test]
    fn the_eight_gpu_machine() {
        let d = tempfile::tempdir().expect("tmp");
        dgx(d.path()).expect("tree");
        let s = Sysfs::new(d.path());
        let gpus = s.gpus().expect("gpus");
        assert_eq!(gpus.len(), 8);
        assert_eq!(gpus[0].bus_id, "0000:18:00.0");
        assert_eq!(gpus[0].uuid.as_deref(), Some("GPU-00000000-fake"));
        assert_eq!(gpus[0].minor, Some(0));
        assert_eq!((gpus[3].numa_node, gpus[4].numa_node), (Some(0), Some(1)));
        assert_eq!(gpus[7].local_cpus.to_string(), "16-31,48-63");
        let nodes = s.node_cpus().expect("nodes");
        assert_eq!(nodes.len(), 2);
        let sib = s.siblings(&CpuSet::parse("0,33").expect("set"));
        assert_eq!(sib[&0].to_string(), "0,32");
        assert_eq!(sib[&33].to_string(), "1,33");
    }

    #[test]
    fn only_the_gpus_the_container_was_given() {
        let d = tempfile::tempdir().expect("tmp");
        let g = |bdf, given| FakeGpu { bdf, numa: -1, cpus: "0-3", given };
        machine(d.path(), &[], 4, false, &[g("0000:07:00.0", false), g("0000:08:00.0", true), g("0000:09:00.0", true)])
            .expect("tree");
        // The device node of the last one is missing.
        std::fs::remove_file(d.path().join("dev/nvidia2")).expect("rm");
        let gpus = Sysfs::new(d.path()).gpus().expect("gpus");
        assert_eq!(gpus.iter().map(|g| g.bus_id.as_str()).collect::<Vec<_>>(), ["0000:08:00.0"]);
        assert_eq!(gpus[0].numa_node, None, "numa_node -1 means no NUMA information");
        assert!(Sysfs::new(d.path()).node_cpus().expect("nodes").is_empty());
    }

    #[test]
    fn nics_with_their_nodes() {
        let d = tempfile::tempdir().expect("tmp");
        super::fake::nic(d.path(), "mlx5_1", true, 1).expect("nic");
        super::fake::nic(d.path(), "mlx5_0", true, 0).expect("nic");
        super::fake::nic(d.path(), "eth0", false, -1).expect("nic");
        std::fs::create_dir_all(d.path().join("sys/class/net/lo")).expect("lo");
        let got = Sysfs::new(d.path()).nics();
        let names: Vec<(&str, bool, Option<u32>)> = got.iter().map(|n| (n.name.as_str(), n.ib, n.numa_node)).collect();
        assert_eq!(names, [("eth0", false, None), ("mlx5_0", true, Some(0)), ("mlx5_1", true, Some(1))]);
    }

    #[test]
    fn no_driver_no_gpus() {
        let d = tempfile::tempdir().expect("tmp");
        machine(d.path(), &["0-3"], 4, false, &[FakeGpu { bdf: "0000:08:00.0", numa: 0, cpus: "0-3", given: false }])
            .expect("tree");
        assert!(Sysfs::new(d.path()).gpus().expect("gpus").is_empty());
    }
}
