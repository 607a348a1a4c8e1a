//! Which framework the workers are (torch, JAX, XGBoost): from
//! `--framework`, else `TRAINLET_FRAMEWORK`, else the env Trainer's ML
//! policy plugins inject (reference/kubeflow.md 2.2, 2.3), and the env names
//! each framework's pod counts, rank and endpoint come from.

use super::setting::{Settings, invalid, lookup};
use super::{Error, Source};
use crate::cli::RunArgs;
use crate::env;

/// What the workers are, and so which environment they get and what
/// trainlet runs for them besides the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Framework {
    /// torchrun's environment (RANK, MASTER_ADDR, ...).
    #[default]
    Torch,
    /// `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`: one
    /// JAX process per pod unless `--nproc-per-node` says more; process 0
    /// serves the coordinator on a port of the store host picked per round.
    Jax,
    /// `DMLC_TRACKER_URI`/`PORT`, `DMLC_TASK_ID`, `DMLC_NUM_WORKER`: one
    /// worker per GPU (or `--nproc-per-node` on CPU), and XGBoost's
    /// RabitTracker run by trainlet on the store host per round.
    Xgboost,
    /// MPI ranks without mpirun or SSH: each pod's agent starts its ranks
    /// and serves them PMI-1/PMI-2 on a pre-connected `PMI_FD`
    /// (`crate::mpi::pmi`); the key-value space is the job's store. Pod counts
    /// and the store endpoint come from torch's names (Trainer's torch
    /// policy, which a runtime without a launcher uses): `PET_*`.
    Mpi,
}

impl Framework {
    /// Its name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Framework::Torch => "torch",
            Framework::Jax => "jax",
            Framework::Xgboost => "xgboost",
            Framework::Mpi => "mpi",
        }
    }

    /// Env names for the pod count, after `PET_NNODES`.
    pub(super) fn nnodes_env(self) -> &'static [&'static str] {
        match self {
            Framework::Torch | Framework::Xgboost | Framework::Mpi => &[env::PET_NNODES],
            Framework::Jax => &[env::PET_NNODES, env::JAX_NUM_PROCESSES],
        }
    }

    /// Env names for the node rank, with the completion index last.
    pub(super) fn node_rank_env(self) -> &'static [&'static str] {
        match self {
            Framework::Torch | Framework::Mpi => &[env::PET_NODE_RANK, env::JOB_COMPLETION_INDEX],
            Framework::Jax => &[env::PET_NODE_RANK, env::JAX_PROCESS_ID, env::JOB_COMPLETION_INDEX],
            Framework::Xgboost => &[env::PET_NODE_RANK, env::DMLC_TASK_ID, env::JOB_COMPLETION_INDEX],
        }
    }

    /// Env names for the store endpoint `host:port`.
    pub(super) fn endpoint_env(self) -> &'static [&'static str] {
        match self {
            Framework::Torch | Framework::Xgboost | Framework::Mpi => &[env::PET_RDZV_ENDPOINT],
            Framework::Jax => &[env::PET_RDZV_ENDPOINT, env::JAX_COORDINATOR_ADDRESS],
        }
    }

    /// Env names for the store host.
    pub(super) fn addr_env(self) -> &'static [&'static str] {
        match self {
            Framework::Torch | Framework::Jax | Framework::Mpi => &[env::PET_MASTER_ADDR],
            Framework::Xgboost => &[env::PET_MASTER_ADDR, env::DMLC_TRACKER_URI],
        }
    }

    /// Env names for the store port.
    pub(super) fn port_env(self) -> &'static [&'static str] {
        match self {
            Framework::Torch | Framework::Jax | Framework::Mpi => &[env::PET_MASTER_PORT],
            Framework::Xgboost => &[env::PET_MASTER_PORT, env::DMLC_TRACKER_PORT],
        }
    }
}

/// `--framework`, else `TRAINLET_FRAMEWORK`, else detected: PET_* means
/// torch, JAX_* jax, DMLC_* xgboost, nothing torch (mpi is only ever asked for).
pub(super) fn resolve(args: &RunArgs, s: &mut Settings<'_>) -> Result<Framework, Error> {
    let env = s.env;
    let l = lookup(args.framework.as_deref(), "--framework", env, &[env::TRAINLET_FRAMEWORK]);
    let (fw, source) = match l.value.map(str::trim) {
        Some("torch" | "pytorch") => (Framework::Torch, l.source),
        Some("jax") => (Framework::Jax, l.source),
        Some("xgboost") => (Framework::Xgboost, l.source),
        Some("mpi") => (Framework::Mpi, l.source),
        Some(v) => return Err(invalid(&l.origin(), v, "torch, jax, xgboost or mpi")),
        None => {
            let has = |names: &[&'static str]| -> Option<&'static str> {
                names.iter().find(|n| env.get(n).is_some()).copied()
            };
            if let Some(n) = has(&[env::PET_NNODES, env::PET_NODE_RANK, env::PET_MASTER_ADDR]) {
                (Framework::Torch, Source::Derived(format!("{n} is set")))
            } else if let Some(n) = has(&[env::JAX_COORDINATOR_ADDRESS, env::JAX_NUM_PROCESSES]) {
                (Framework::Jax, Source::Derived(format!("{n} is set")))
            } else if let Some(n) = has(&[env::DMLC_TRACKER_URI, env::DMLC_NUM_WORKER]) {
                (Framework::Xgboost, Source::Derived(format!("{n} is set")))
            } else {
                (Framework::Torch, Source::Default)
            }
        }
    };
    s.prov.push(("framework", fw.name().to_string(), source));
    Ok(fw)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::Env;
    use clap::Parser;
    use test_case::test_case;

    fn args(a: &[&str]) -> RunArgs {
        crate::cli::TorchrunCli::try_parse_from(std::iter::once("torchrun").chain(a.iter().copied()))
            .expect("parse")
            .run
    }

    #[test_case(&[], &[], Framework::Torch; "nothing is torch")]
    #[test_case(&[], &[("JAX_COORDINATOR_ADDRESS", "j-node-0-0.j:29500")], Framework::Jax; "jax env")]
    #[test_case(&[], &[("DMLC_TRACKER_URI", "x-node-0-0.x")], Framework::Xgboost; "xgboost env")]
    #[test_case(&[], &[("PET_NNODES", "2"), ("DMLC_TRACKER_URI", "h")], Framework::Torch; "torch env wins")]
    #[test_case(&["--framework", "jax"], &[("TRAINLET_FRAMEWORK", "xgboost")], Framework::Jax; "flag over env")]
    #[test_case(&[], &[("TRAINLET_FRAMEWORK", "mpi"), ("PET_NNODES", "2")], Framework::Mpi; "mpi is asked for")]
    #[test_case(&[], &[("TRAINLET_FRAMEWORK", "xgboost"), ("JAX_NUM_PROCESSES", "2")], Framework::Xgboost; "env over detection")]
    fn detected(a: &[&str], e: &[(&str, &str)], want: Framework) {
        let env = Env::from_pairs(e.iter().copied());
        let mut s = Settings::new(&env);
        assert_eq!(resolve(&args(&[a, &["t.py"]].concat()), &mut s).expect("resolve"), want);
    }

    #[test]
    fn an_unknown_framework_is_named() {
        let env = Env::default();
        let mut s = Settings::new(&env);
        let e = resolve(&args(&["--framework", "tensorflow", "t.py"]), &mut s).expect_err("bad");
        assert!(e.to_string().contains("--framework") && e.to_string().contains("torch, jax, xgboost or mpi"), "{e}");
    }
}
