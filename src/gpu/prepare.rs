//! The GPU steps of a launch, shared by `trainlet run` and `trainlet
//! doctor`: pre-flight checks (with the NVML probe), per-attempt placement,
//! and the topology table doctor prints.

use std::fmt::Write;
use std::path::PathBuf;
use std::time::Duration;

use super::nvml::{self, Report};
use super::plan::{self, RankPlacement};
use super::preflight::{self, Status, Verdict};
use super::{PinMode, Topology};
use crate::process::spawn::Spawner;

/// GPUs, binding and pre-flight checks.
#[derive(Debug, Clone)]
pub struct GpuPlan {
    /// Root of the sysfs/procfs tree the inventory reads (`/` in production).
    pub root: PathBuf,
    /// The GPUs workers may use, in CUDA order.
    pub gpus: Vec<super::Gpu>,
    /// `--pin`.
    pub pin: PinMode,
    /// `--gpu-visibility`.
    pub visibility: super::Visibility,
    /// CUDA_DEVICE_ORDER is the user's: trainlet does not set it.
    pub user_order: bool,
    /// `--preflight`.
    pub checks: Vec<super::preflight::Check>,
    /// What the checks expect.
    pub expect: super::preflight::Expect,
    /// Bound on one NVML probe.
    pub nvml_timeout: Duration,
    /// `--nic-hint`.
    pub nic_hint: bool,
    /// `--metrics-addr`.
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// `gpus` are some of the pod's, the GPUs of a run's worker slots
    /// (`crate::serve::lane`): its workers see those alone.
    pub narrowed: bool,
}

/// Pre-flight checks of `g`, with the NVML report they used (or why there
/// is none). The probe runs only when there are GPUs and a check needs it.
/// Blocking: call from a blocking task.
pub fn preflight(g: &GpuPlan, spawner: &Spawner) -> (Vec<Verdict>, Result<Report, String>) {
    let need = !g.gpus.is_empty() && g.checks.iter().any(|c| c.needs_nvml());
    let report = if need {
        nvml::probe(spawner, g.nvml_timeout)
    } else if g.gpus.is_empty() {
        Err("no GPU".to_string())
    } else {
        Err("no check needs it".to_string())
    };
    if let Err(e) = &report
        && need
    {
        tracing::warn!(
            error = %e,
            "NVML is unavailable; using sysfs alone, and skipping the pre-flight checks that need NVML"
        );
    }
    let verdicts = preflight::run(&g.checks, &g.gpus, &g.expect, report.as_ref().map_err(String::as_str));
    (verdicts, report)
}

/// The GPUs' health before a round (the pre-flight's checks but the count,
/// which does not change): the exit code and message of the first
/// failure. Without NVML nothing is said (the start said so once).
/// Blocking: call from a blocking task.
pub fn health(g: &GpuPlan, spawner: &Spawner) -> Option<(u8, String)> {
    let checks: Vec<preflight::Check> =
        g.checks.iter().copied().filter(|c| *c != preflight::Check::Count && c.needs_nvml()).collect();
    if g.gpus.is_empty() || checks.is_empty() {
        return None;
    }
    let report = match nvml::probe(spawner, g.nvml_timeout) {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!(error = %e, "NVML is unavailable; the GPUs' health is not checked");
            return None;
        }
    };
    let verdicts = preflight::run(&checks, &g.gpus, &g.expect, Ok(&report));
    preflight::first_failure(&verdicts).map(|(code, msg)| (code, msg.to_string()))
}

/// Fill what sysfs did not say (local CPUs, NUMA node: some VMs publish
/// neither) from the NVML report, matched by bus id.
pub fn enrich(gpus: &mut [super::Gpu], report: &Report) {
    for g in gpus.iter_mut() {
        let Some(n) = report.gpus.iter().find(|n| n.bus_id == g.bus_id) else { continue };
        if g.local_cpus.is_empty()
            && let Some(c) = n.cpus.as_deref().and_then(|c| super::CpuSet::parse(c).ok())
        {
            g.local_cpus = c;
        }
        g.numa_node = g.numa_node.or(n.numa_node);
        g.uuid = g.uuid.take().or_else(|| n.uuid.clone());
        g.model = g.model.take().or_else(|| n.name.clone());
    }
}

/// Where each local rank runs this attempt. The topology (the agent's own
/// cpuset included) is read now, since kubelet may change the cpuset
/// between attempts. Logs each rank's placement and any fallback.
pub fn placements(g: &GpuPlan, nproc: u32) -> (Vec<RankPlacement>, Option<Topology>) {
    let binds = !g.gpus.is_empty() && matches!(g.pin, PinMode::Cpu | PinMode::Numa | PinMode::Auto);
    let topo = if binds {
        match super::topology(&g.root) {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::warn!(error = %crate::error::error_chain(&e), "cannot read the CPU topology; GPUs are assigned but CPUs are not bound");
                None
            }
        }
    } else {
        None
    };
    let mode = match (&topo, g.pin) {
        (None, PinMode::Cpu | PinMode::Numa | PinMode::Auto) => PinMode::Gpu,
        (_, m) => m,
    };
    let p = plan::plan(&g.gpus, nproc, topo.as_ref().unwrap_or(&Topology::default()), mode);
    for r in &p {
        let Some(i) = r.gpu else { continue };
        let gpu = &g.gpus[i];
        if r.fell_back {
            tracing::warn!(
                local_rank = r.local_rank,
                gpu = %gpu.bus_id,
                local_cpus = %gpu.local_cpus,
                allowed = %topo.as_ref().map(|t| t.allowed.to_string()).unwrap_or_default(),
                "none of the GPU's local CPUs are in this pod's cpuset; binding to the whole cpuset"
            );
        }
        tracing::info!(
            local_rank = r.local_rank,
            gpu = %gpu.bus_id,
            cpus = %r.cpus.as_ref().map(ToString::to_string).unwrap_or_else(|| "unbound".into()),
            mem_node = ?r.mem_node,
            "placement"
        );
    }
    (p, topo)
}

/// `trainlet doctor`'s GPU section: the topology table and the pre-flight
/// results.
pub fn describe(
    g: &GpuPlan,
    placed: &[RankPlacement],
    topo: Option<&Topology>,
    verdicts: &[Verdict],
    report: &Result<Report, String>,
) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "gpus ({} usable, inventory under {})", g.gpus.len(), g.root.display());
    if g.gpus.is_empty() {
        let _ = writeln!(s, "  no GPU: workers are not pinned");
    } else {
        let _ = writeln!(
            s,
            "  {:<4} {:<13} {:<42} {:<5} {:<16} {:<5} {:<16} mem node",
            "cuda", "bus id", "uuid", "numa", "local cpus", "rank", "rank cpus"
        );
        for (i, gpu) in g.gpus.iter().enumerate() {
            let r = placed.iter().find(|r| r.gpu == Some(i));
            let dash = || "-".to_string();
            let _ = writeln!(
                s,
                "  {:<4} {:<13} {:<42} {:<5} {:<16} {:<5} {:<16} {}",
                i,
                gpu.bus_id,
                gpu.uuid.clone().unwrap_or_else(dash),
                gpu.numa_node.map_or_else(dash, |n| n.to_string()),
                gpu.local_cpus.to_string(),
                r.map_or_else(dash, |r| r.local_rank.to_string()),
                r.and_then(|r| r.cpus.as_ref()).map_or_else(
                    || "unbound".to_string(),
                    |c| format!("{c}{}", if r.is_some_and(|r| r.fell_back) { " (fallback)" } else { "" })
                ),
                r.and_then(|r| r.mem_node).map_or_else(dash, |n| n.to_string()),
            );
        }
    }
    if let Some(t) = topo {
        let _ = writeln!(s, "  agent cpus {} (sched_getaffinity), numa nodes {}", t.allowed, t.nodes.len());
    }
    let _ = writeln!(s, "  pin {}, visibility {}", g.pin, g.visibility);
    match report {
        Ok(r) => {
            let _ = writeln!(s, "nvml: driver {}, {} GPUs", r.driver.as_deref().unwrap_or("?"), r.gpus.len());
        }
        Err(e) => {
            let _ = writeln!(s, "nvml: unavailable ({e})");
        }
    }
    let _ = writeln!(s, "pre-flight");
    if verdicts.is_empty() {
        let _ = writeln!(s, "  off (--preflight none)");
    }
    for v in verdicts {
        let (word, text) = match &v.status {
            Status::Pass(t) => ("pass", t.clone()),
            Status::Skip(t) => ("skip", t.clone()),
            Status::Fail(code, t) => ("FAIL", format!("exit {code}: {t}")),
        };
        let _ = writeln!(s, "  {:<6} {word:<5} {text}", v.check.name());
    }
    s
}
