//! How many pods and workers: `--nnodes` (N or MIN:MAX), the node rank
//! (with JOB_COMPLETION_INDEX as the last fallback) and
//! `--nproc-per-node` (`auto`/`gpu`/`cpu` count what [`Machine`] found).
//! JAX and XGBoost pods read their framework's names too
//! ([`Framework::nnodes_env`]); XGBoost's `DMLC_NUM_WORKER` counts workers,
//! not pods, and is divided by the workers per pod Trainer assumed.
//! `--spares K` ([`spares`]) keeps K of the pods warm beside those that train.

use super::framework::Framework;
use super::machine::Machine;
use super::setting::{Settings, invalid, lookup, parse_u32};
use super::{Error, Source};
use crate::cli::RunArgs;
use crate::env;

/// The pods and workers of the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Nodes {
    pub min_nodes: u32,
    pub nnodes: u32,
    pub node_rank: u32,
    pub nproc: u32,
}

/// Resolve the node counts, this pod's rank and its workers.
pub(super) fn resolve(args: &RunArgs, s: &mut Settings<'_>, machine: &Machine, fw: Framework) -> Result<Nodes, Error> {
    let env = s.env;
    // nnodes: N or MIN:MAX.
    let pods_of_workers;
    let mut l = lookup(args.nnodes.as_deref(), "--nnodes", env, fw.nnodes_env());
    if l.value.is_none()
        && fw == Framework::Xgboost
        && let Some(v) = env.get(env::DMLC_NUM_WORKER)
    {
        // Trainer sets numNodes x (GPUs per node, or 1).
        let per_pod = machine.gpus.len().max(1);
        let workers = v.trim().parse::<usize>().ok().filter(|n| *n > 0);
        let pods = workers.filter(|w| w % per_pod == 0).map(|w| w / per_pod).ok_or_else(|| {
            invalid(
                env::DMLC_NUM_WORKER,
                v,
                &format!("a worker count >= 1 that is a multiple of this pod's {per_pod} GPU(s) (or set PET_NNODES / --nnodes)"),
            )
        })?;
        pods_of_workers = pods.to_string();
        l = super::setting::Lookup {
            value: Some(&pods_of_workers),
            source: Source::Derived(format!("{} {v} / {per_pod} per pod", env::DMLC_NUM_WORKER)),
        };
    }
    let (min_nodes, nnodes) = match l.value {
        None => (1, 1),
        Some(v) => {
            let expected = "a node count N >= 1 or MIN:MAX";
            let num = |s: &str| s.trim().parse::<u32>().ok().filter(|n| *n > 0);
            match v.split_once(':') {
                None => {
                    let n = num(v).ok_or_else(|| invalid(&l.origin(), v, expected))?;
                    (n, n)
                }
                Some((a, b)) => {
                    let (min, max) = (
                        num(a).ok_or_else(|| invalid(&l.origin(), v, expected))?,
                        num(b).ok_or_else(|| invalid(&l.origin(), v, expected))?,
                    );
                    if min > max {
                        return Err(invalid(&l.origin(), v, "MIN <= MAX"));
                    }
                    (min, max)
                }
            }
        }
    };
    let spec = if min_nodes == nnodes { nnodes.to_string() } else { format!("{min_nodes}:{nnodes}") };
    s.prov.push(("nnodes", spec, l.source.clone()));

    // node rank, with JOB_COMPLETION_INDEX as the last fallback.
    let l = lookup(args.node_rank.as_deref(), "--node-rank", env, fw.node_rank_env());
    let node_rank = parse_u32(&l, 0, "a node rank >= 0")?;
    if node_rank >= nnodes {
        return Err(invalid(
            &l.origin(),
            l.value.unwrap_or("0"),
            &format!("a node rank below nnodes ({nnodes}), i.e. 0..={}", nnodes - 1),
        ));
    }
    s.prov.push(("node rank", node_rank.to_string(), l.source));
    s.prov.push((
        "gpus",
        machine.gpus.len().to_string(),
        Source::Derived(format!("{} and sysfs", machine.gpu_root.join("proc/driver/nvidia/gpus").display())),
    ));

    // nproc per node.
    let l = lookup(args.nproc_per_node.as_deref(), "--nproc-per-node", env, &[env::PET_NPROC_PER_NODE]);
    let (nproc, src) = match l.value.map(str::trim) {
        // XGBoost runs one worker per GPU (what DMLC_NUM_WORKER counted).
        None if fw == Framework::Xgboost && !machine.gpus.is_empty() => {
            let gpus = machine.gpus.len();
            (gpus, Source::Derived(format!("xgboost: one worker per GPU, {gpus} visible")))
        }
        None => (1, l.source.clone()),
        Some("auto") => {
            let gpus = machine.gpus.len();
            if gpus > 0 {
                (gpus, Source::Derived(format!("auto: {gpus} visible GPUs")))
            } else {
                let cpus = machine.cpus;
                (cpus, Source::Derived(format!("auto: no GPU, {cpus} CPUs")))
            }
        }
        Some("cpu") => {
            let cpus = machine.cpus;
            (cpus, Source::Derived(format!("cpu: {cpus} CPUs")))
        }
        Some("gpu") => {
            let gpus = machine.gpus.len();
            if gpus == 0 {
                return Err(invalid(
                    &l.origin(),
                    "gpu",
                    "auto, cpu or an integer: no GPU is usable here (none in /proc/driver/nvidia/gpus, \
                         or hidden by CUDA_VISIBLE_DEVICES/NVIDIA_VISIBLE_DEVICES)",
                ));
            }
            (gpus, Source::Derived(format!("gpu: {gpus} visible GPUs")))
        }
        Some(v) => (
            v.parse::<usize>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| invalid(&l.origin(), v, "an integer >= 1, auto, cpu or gpu"))?,
            l.source.clone(),
        ),
    };
    let nproc = u32::try_from(nproc).map_err(|_| invalid(&l.origin(), &nproc.to_string(), "fewer workers"))?;
    s.prov.push(("nproc per node", nproc.to_string(), src));
    Ok(Nodes { min_nodes, nnodes, node_rank, nproc })
}

/// `--spares K` (env `TRAINLET_SPARES`): of the job's pods, K wait warm
/// and the others train; at least one trains (an elastic job's MIN of
/// them). Torch and PMI jobs only: JAX's process 0 and XGBoost's tracker
/// are tied to node rank 0.
pub(super) fn spares(args: &RunArgs, s: &mut Settings<'_>, nodes: Nodes, fw: Framework) -> Result<u32, Error> {
    let l = lookup(args.spares.as_deref(), "--spares", s.env, &[env::TRAINLET_SPARES]);
    let k = parse_u32(&l, 0, "a number of spare pods >= 0")?;
    if k == 0 {
        return Ok(0);
    }
    let v = l.value.unwrap_or_default();
    if matches!(fw, Framework::Jax | Framework::Xgboost) {
        let why = format!(
            "no spares for {} jobs: their process 0 runs on node rank 0, so a spare cannot take every rank; drop it",
            fw.name()
        );
        return Err(invalid(&l.origin(), v, &why));
    }
    let trained = nodes.nnodes.saturating_sub(k);
    let elastic = nodes.min_nodes != nodes.nnodes;
    if trained == 0 || (elastic && trained < nodes.min_nodes) {
        let within = if !elastic {
            format!("fewer than the job's {} pod{} (--nnodes)", nodes.nnodes, if nodes.nnodes == 1 { "" } else { "s" })
        } else {
            format!(
                "at most MAX - MIN = {} of --nnodes {}:{}",
                nodes.nnodes - nodes.min_nodes,
                nodes.min_nodes,
                nodes.nnodes
            )
        };
        return Err(invalid(&l.origin(), v, &format!("a number of spares {within}, so that the others can train")));
    }
    let world = if !elastic { trained.to_string() } else { format!("{}:{trained}", nodes.min_nodes) };
    s.prov.push(("spares", format!("{k} (the others train: {world} pods)"), l.source));
    Ok(k)
}
