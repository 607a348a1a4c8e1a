//! Placement: which GPU, which CPUs and which memory node each local rank
//! gets (reference/gpu-pid1.md 3.1, 3.2 and 8.8). Pure and table-tested;
//! the spawner applies the result.
//!
//! Local rank i gets GPU i (visibility order: PCI bus order unless
//! CUDA_VISIBLE_DEVICES reorders). Its CPUs are the GPU's local CPUs (else
//! its NUMA node's) intersected with the agent's own affinity (the pod's
//! cpuset). In `cpu` mode the ranks that share those CPUs split them evenly
//! and without overlap, whole cores at a time (SMT siblings together); in
//! `numa` mode each gets all of them. An empty intersection falls back to
//! the whole allowed set, flagged so the caller can log it: binding never
//! fails a job.

use std::collections::{BTreeMap, HashMap};

use super::{CpuSet, Gpu};

/// `--pin`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PinMode {
    /// No GPU assignment and no binding.
    None,
    /// GPU assignment only.
    Gpu,
    /// GPU, plus an exclusive share of the GPU's local CPUs.
    Cpu,
    /// GPU, plus all of its NUMA node's allowed CPUs and a preferred memory node.
    Numa,
    /// `cpu` with a preferred memory node when there are GPUs; `none` without.
    Auto,
}

impl PinMode {
    /// Parse `--pin`/`TRAINLET_PIN`, or torchrun's `--numa-binding`.
    pub fn parse(v: &str) -> Option<Self> {
        match v.trim() {
            "none" | "off" => Some(Self::None),
            "gpu" => Some(Self::Gpu),
            "cpu" | "exclusive" => Some(Self::Cpu),
            "numa" | "node" => Some(Self::Numa),
            "auto" => Some(Self::Auto),
            _ => None,
        }
    }
}

impl std::fmt::Display for PinMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::None => "none",
            Self::Gpu => "gpu",
            Self::Cpu => "cpu",
            Self::Numa => "numa",
            Self::Auto => "auto",
        })
    }
}

/// `--gpu-visibility`: what CUDA_VISIBLE_DEVICES a worker with a GPU sees.
///
/// `All` is the default because it is torchrun's: scripts call
/// `torch.cuda.set_device(LOCAL_RANK)` unchanged, and every rank can still
/// open its peers' GPUs for CUDA IPC and P2P (NCCL's intra-node paths).
/// `Single` isolates each worker on its own GPU (by UUID), with LOCAL_RANK 0
/// as torchrun's `--virtual-local-rank` does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Visibility {
    /// Every worker sees every GPU; LOCAL_RANK picks its own.
    #[default]
    All,
    /// Each worker sees only its GPU.
    Single,
}

impl std::fmt::Display for Visibility {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::All => "all",
            Self::Single => "single",
        })
    }
}

/// Variables a worker gets for its placement: CUDA_DEVICE_ORDER=PCI_BUS_ID
/// so CUDA ordinals follow bus order (unless the user chose an order), and
/// with [`Visibility::Single`] its own GPU and LOCAL_RANK 0. `narrowed`:
/// `gpus` are some of the pod's GPUs (a run on some of its worker slots,
/// `crate::serve::lane`): with [`Visibility::All`] the worker sees those
/// alone, in order, so that LOCAL_RANK picks its own among them.
pub fn rank_env(
    p: &RankPlacement,
    gpus: &[Gpu],
    vis: Visibility,
    (user_order, narrowed): (bool, bool),
) -> Vec<(String, String)> {
    let Some(gpu) = p.gpu.and_then(|i| gpus.get(i)) else { return narrowed_env(gpus, vis, narrowed) };
    let id = |g: &Gpu| g.uuid.clone().unwrap_or_else(|| g.ordinal.to_string());
    let mut env = Vec::new();
    if !user_order {
        env.push(("CUDA_DEVICE_ORDER".to_string(), "PCI_BUS_ID".to_string()));
    }
    match vis {
        Visibility::Single => {
            env.push(("CUDA_VISIBLE_DEVICES".to_string(), id(gpu)));
            env.push(("LOCAL_RANK".to_string(), "0".to_string()));
        }
        Visibility::All => env.extend(narrowed_env(gpus, vis, narrowed)),
    }
    env
}

/// A narrowed run's worker sees its run's GPUs alone, placed or not
/// (`--pin none` places nobody): CUDA_VISIBLE_DEVICES names them.
pub fn narrowed_env(gpus: &[Gpu], vis: Visibility, narrowed: bool) -> Vec<(String, String)> {
    if !narrowed || vis != Visibility::All || gpus.is_empty() {
        return Vec::new();
    }
    let ids: Vec<String> = gpus.iter().map(|g| g.uuid.clone().unwrap_or_else(|| g.ordinal.to_string())).collect();
    vec![("CUDA_VISIBLE_DEVICES".to_string(), ids.join(","))]
}

/// NCCL's NIC selection for a rank (`--nic-hint`): the HCAs
/// (NCCL_IB_HCA) and socket interfaces (NCCL_SOCKET_IFNAME) on its GPU's
/// NUMA node, as exact-match lists, each only when `user_set` says the user
/// has not set it and there is such a NIC.
pub fn nic_env(
    p: &RankPlacement,
    gpus: &[Gpu],
    nics: &[super::sysfs::Nic],
    user_set: impl Fn(&str) -> bool,
) -> Vec<(String, String)> {
    let Some(node) = p.gpu.and_then(|i| gpus.get(i)).and_then(|g| g.numa_node) else { return Vec::new() };
    let mut env = Vec::new();
    for (var, ib) in [("NCCL_IB_HCA", true), ("NCCL_SOCKET_IFNAME", false)] {
        let near: Vec<&str> =
            nics.iter().filter(|n| n.ib == ib && n.numa_node == Some(node)).map(|n| n.name.as_str()).collect();
        if !near.is_empty() && !user_set(var) {
            env.push((var.to_string(), format!("={}", near.join(","))));
        }
    }
    env
}

/// What one local rank gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankPlacement {
    /// The local rank.
    pub local_rank: u32,
    /// Its GPU (an index into the visible GPUs), if it has one.
    pub gpu: Option<usize>,
    /// CPUs to run on, if bound.
    pub cpus: Option<CpuSet>,
    /// Preferred memory node, if any.
    pub mem_node: Option<u32>,
    /// The GPU's local CPUs and the allowed set did not meet: `cpus` is the
    /// whole allowed set.
    pub fell_back: bool,
}

/// The machine as the planner needs it.
#[derive(Debug, Clone, Default)]
pub struct Topology {
    /// The agent's own affinity (the pod's cpuset).
    pub allowed: CpuSet,
    /// CPUs of each NUMA node.
    pub nodes: BTreeMap<u32, CpuSet>,
    /// SMT siblings of each CPU (a CPU missing here is its own core).
    pub siblings: HashMap<u32, CpuSet>,
}

impl Topology {
    /// The cores (sibling groups) that make up `cpus`, each cut to `cpus`,
    /// ordered by their lowest CPU.
    fn cores(&self, cpus: &CpuSet) -> Vec<CpuSet> {
        let mut seen = CpuSet::default();
        let mut cores = Vec::new();
        for c in cpus.iter() {
            if seen.contains(c) {
                continue;
            }
            let core = self.siblings.get(&c).cloned().unwrap_or_else(|| CpuSet::of([c])).intersect(cpus);
            let core = if core.is_empty() { CpuSet::of([c]) } else { core };
            seen = seen.union(&core);
            cores.push(core);
        }
        cores
    }
}

/// Place `nproc` local ranks on `gpus` (visible, in CUDA order).
pub fn plan(gpus: &[Gpu], nproc: u32, topo: &Topology, mode: PinMode) -> Vec<RankPlacement> {
    let mode = match mode {
        PinMode::Auto if gpus.is_empty() => PinMode::None,
        m => m,
    };
    let bind = matches!(mode, PinMode::Cpu | PinMode::Numa | PinMode::Auto);
    let gpu_of =
        |r: u32| (mode != PinMode::None).then(|| usize::try_from(r).ok()).flatten().filter(|i| *i < gpus.len());
    let mut placements: Vec<RankPlacement> = (0..nproc)
        .map(|r| {
            let gpu = gpu_of(r);
            // The CPUs the rank may use before any split; a rank without a
            // GPU is not bound.
            let local = gpu.filter(|_| bind).map(|i| {
                let g = &gpus[i];
                let near = if g.local_cpus.is_empty() {
                    g.numa_node.and_then(|n| topo.nodes.get(&n).cloned()).unwrap_or_default()
                } else {
                    g.local_cpus.clone()
                };
                near.intersect(&topo.allowed)
            });
            let fell_back = local.as_ref().is_some_and(CpuSet::is_empty);
            let cpus = if fell_back { Some(topo.allowed.clone()) } else { local };
            let mem_node = (matches!(mode, PinMode::Numa | PinMode::Auto) && !fell_back)
                .then(|| gpu.and_then(|g| gpus[g].numa_node))
                .flatten();
            RankPlacement { local_rank: r, gpu, cpus, mem_node, fell_back }
        })
        .collect();
    if matches!(mode, PinMode::Cpu | PinMode::Auto) {
        split_shared(&mut placements, topo);
    }
    placements
}

/// Ranks whose CPU sets are equal share them: give each a contiguous,
/// non-overlapping run of whole cores, sizes differing by at most one.
fn split_shared(placements: &mut [RankPlacement], topo: &Topology) {
    let mut groups: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (i, p) in placements.iter().enumerate() {
        if let Some(c) = &p.cpus {
            groups.entry(c.to_string()).or_default().push(i);
        }
    }
    for members in groups.values() {
        let Some(set) = placements[members[0]].cpus.clone() else { continue };
        let cores = topo.cores(&set);
        let (k, n) = (members.len(), cores.len());
        if k < 2 {
            continue;
        }
        for (j, &i) in members.iter().enumerate() {
            let share = if n >= k {
                // Cores [j*n/k, (j+1)*n/k): contiguous, sizes differ by at most one.
                cores[j * n / k..(j + 1) * n / k].iter().fold(CpuSet::default(), |a, c| a.union(c))
            } else {
                cores[j % n].clone() // more ranks than cores: they must share
            };
            placements[i].cpus = Some(share);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_narrowed_run_sees_its_slots_gpus_alone_in_order() {
        let gpu = |ordinal: u32| Gpu {
            bus_id: format!("0000:{:02x}:00.0", ordinal),
            uuid: Some(format!("GPU-{ordinal}")),
            model: None,
            minor: Some(ordinal),
            ordinal,
            numa_node: None,
            local_cpus: crate::process::CpuSet::default(),
        };
        let gpus = [gpu(2), gpu(3)];
        let at = |gpu| RankPlacement { local_rank: 1, gpu, cpus: None, mem_node: None, fell_back: false };
        let env = |vis, narrowed| rank_env(&at(Some(1)), &gpus, vis, (false, narrowed));
        let cuda =
            |env: Vec<(String, String)>| env.into_iter().find(|(k, _)| k == "CUDA_VISIBLE_DEVICES").map(|(_, v)| v);
        assert_eq!(cuda(env(Visibility::All, true)).as_deref(), Some("GPU-2,GPU-3"), "LOCAL_RANK 1 is GPU-3");
        assert_eq!(cuda(env(Visibility::All, false)), None, "a run alone sees the pod's GPUs");
        assert_eq!(cuda(env(Visibility::Single, true)).as_deref(), Some("GPU-3"));
        assert_eq!(cuda(rank_env(&at(None), &gpus, Visibility::All, (false, true))).as_deref(), Some("GPU-2,GPU-3"));
        assert!(rank_env(&at(None), &gpus, Visibility::All, (false, false)).is_empty(), "no GPU, nothing");
        assert_eq!(cuda(narrowed_env(&gpus, Visibility::All, true)).as_deref(), Some("GPU-2,GPU-3"), "unplaced");
    }

    use super::*;
    use crate::gpu::Inventory;
    use crate::gpu::sysfs::{Sysfs, fake};

    fn dgx() -> (Vec<Gpu>, Topology) {
        let d = tempfile::tempdir().expect("tmp");
        fake::dgx(d.path()).expect("tree");
        let s = Sysfs::new(d.path());
        let allowed = CpuSet::parse("0-63").expect("set");
        let topo = Topology { siblings: s.siblings(&allowed), allowed, nodes: s.node_cpus().expect("nodes") };
        (s.gpus().expect("gpus"), topo)
    }

    #[test]
    fn eight_ranks_on_two_sockets_split_whole_cores() {
        let (gpus, topo) = dgx();
        let p = plan(&gpus, 8, &topo, PinMode::Cpu);
        let got: Vec<String> = p.iter().map(|r| r.cpus.as_ref().expect("bound").to_string()).collect();
        assert_eq!(
            got,
            [
                "0-3,32-35",
                "4-7,36-39",
                "8-11,40-43",
                "12-15,44-47",
                "16-19,48-51",
                "20-23,52-55",
                "24-27,56-59",
                "28-31,60-63"
            ]
        );
        assert!(p.iter().enumerate().all(|(i, r)| r.gpu == Some(i) && !r.fell_back));
        assert!(p.iter().all(|r| r.mem_node.is_none()), "cpu mode binds no memory");
        let auto = plan(&gpus, 8, &topo, PinMode::Auto);
        assert_eq!(auto[5].mem_node, Some(1));
        assert_eq!(auto[5].cpus, p[5].cpus);
    }

    #[test]
    fn a_restricted_cpuset_is_never_left() {
        let (gpus, mut topo) = dgx();
        topo.allowed = CpuSet::parse("2-9,34-41").expect("set"); // node 0 only, 8 cores
        let p = plan(&gpus, 8, &topo, PinMode::Cpu);
        for r in &p {
            let cpus = r.cpus.as_ref().expect("bound");
            assert!(cpus.is_subset(&topo.allowed), "rank {} got {cpus}", r.local_rank);
        }
        // GPUs on node 1 share nothing with the cpuset: they fall back to the
        // whole allowed set (flagged), which node 0's ranks then share with
        // them: 8 ranks, 8 cores, one core each, no overlap.
        assert!(!p[0].fell_back && p[4].fell_back);
        assert_eq!(p[0].cpus.as_ref().expect("bound").to_string(), "2,34");
        assert_eq!(p[4].cpus.as_ref().expect("bound").to_string(), "6,38");
        let mut seen = CpuSet::default();
        for r in &p {
            let cpus = r.cpus.as_ref().expect("bound");
            assert!(cpus.intersect(&seen).is_empty(), "overlap at rank {}", r.local_rank);
            seen = seen.union(cpus);
        }
    }

    #[test]
    fn nic_hints_follow_the_gpus_node_unless_the_user_chose() {
        let (gpus, topo) = dgx();
        let p = plan(&gpus, 8, &topo, PinMode::Auto);
        let nic = |name: &str, ib, numa| crate::gpu::sysfs::Nic { name: name.into(), ib, numa_node: numa };
        let nics = [
            nic("eth0", false, Some(0)),
            nic("mlx5_0", true, Some(0)),
            nic("mlx5_1", true, Some(1)),
            nic("mlx5_2", true, Some(1)),
        ];
        assert_eq!(
            nic_env(&p[1], &gpus, &nics, |_| false),
            [
                ("NCCL_IB_HCA".to_string(), "=mlx5_0".to_string()),
                ("NCCL_SOCKET_IFNAME".to_string(), "=eth0".to_string())
            ]
        );
        // Node 1 has HCAs but no socket interface.
        assert_eq!(
            nic_env(&p[6], &gpus, &nics, |_| false),
            [("NCCL_IB_HCA".to_string(), "=mlx5_1,mlx5_2".to_string())]
        );
        assert_eq!(nic_env(&p[6], &gpus, &nics, |v| v == "NCCL_IB_HCA"), []);
    }

    #[test]
    fn numa_mode_gives_the_whole_node_and_memory() {
        let (gpus, topo) = dgx();
        let p = plan(&gpus, 8, &topo, PinMode::Numa);
        assert_eq!(p[1].cpus.as_ref().expect("bound").to_string(), "0-15,32-47");
        assert_eq!((p[1].mem_node, p[6].mem_node), (Some(0), Some(1)));
    }

    #[test]
    fn numa_less_asymmetric_and_gpu_less_machines() {
        let g = |bus: &str, numa: Option<u32>, cpus: &str| Gpu {
            bus_id: bus.into(),
            uuid: None,
            model: None,
            minor: None,
            ordinal: 0,
            numa_node: numa,
            local_cpus: CpuSet::parse(cpus).expect("set"),
        };
        let topo = Topology { allowed: CpuSet::parse("0-5").expect("set"), ..Default::default() };
        // NUMA-less: every GPU local to all CPUs; 3 ranks split 6 CPUs.
        let gpus = vec![g("0000:01:00.0", None, "0-5"), g("0000:02:00.0", None, "0-5"), g("0000:03:00.0", None, "0-5")];
        let p = plan(&gpus, 3, &topo, PinMode::Auto);
        let got: Vec<String> = p.iter().map(|r| r.cpus.as_ref().expect("bound").to_string()).collect();
        assert_eq!(got, ["0-1", "2-3", "4-5"]);
        assert!(p.iter().all(|r| r.mem_node.is_none()));
        // Asymmetric: one GPU alone on its CPUs, two sharing theirs.
        let gpus = vec![
            g("0000:01:00.0", Some(0), "0-1"),
            g("0000:02:00.0", Some(1), "2-5"),
            g("0000:03:00.0", Some(1), "2-5"),
        ];
        let p = plan(&gpus, 3, &topo, PinMode::Cpu);
        let got: Vec<String> = p.iter().map(|r| r.cpus.as_ref().expect("bound").to_string()).collect();
        assert_eq!(got, ["0-1", "2-3", "4-5"]);
        // More ranks than GPUs: the extra ranks get no GPU and no binding.
        let p = plan(&gpus[..1], 2, &topo, PinMode::Cpu);
        assert_eq!((p[1].gpu, p[1].cpus.as_ref()), (None, None));
        // No GPU at all: auto pins nothing.
        assert!(plan(&[], 2, &topo, PinMode::Auto).iter().all(|r| r.gpu.is_none() && r.cpus.is_none()));
        // More ranks sharing than cores: they share cores rather than fail.
        let one = Topology { allowed: CpuSet::of([0]), ..Default::default() };
        let p = plan(&gpus[1..], 2, &one, PinMode::Cpu);
        assert!(p.iter().all(|r| r.fell_back && r.cpus == Some(CpuSet::of([0]))));
    }
}
