//! A worker's environment: torchrun's (reference/torch.md 3.2) for every
//! framework, and on top the variables JAX or XGBoost read
//! ([`framework_env`]); and the argument macros. The process itself is
//! started by [`crate::process::spawn`], which knows nothing of frameworks.

use crate::config::Framework;
use crate::env as names;
use crate::sys;

/// What one attempt's workers on this pod have in common.
#[derive(Debug, Clone)]
pub struct WorldView<'a> {
    /// The resolved plan.
    pub plan: &'a crate::config::Plan,
    /// Address workers dial for their store.
    pub master_addr: &'a str,
    /// Port of this attempt's worker store.
    pub master_port: u16,
    /// The round's second port on the store host: JAX's coordinator or
    /// XGBoost's tracker.
    pub aux_port: u16,
    /// Job-wide restarts so far (TORCHELASTIC_RESTART_COUNT).
    pub restarts: u32,
    /// This pod's group rank in the round.
    pub group_rank: u32,
    /// Pods in the round.
    pub nnodes: u32,
    /// The pod's status endpoint, when workers report progress to trainlet.
    pub status: Option<&'a StatusLink>,
    /// Where workers' lines also go (a served run's log shipper).
    pub tap: Option<crate::supervise::output::LineTap>,
    /// Why this pod cannot start the workers at all (a served run whose
    /// files could not be unpacked): each is recorded as not started.
    pub unstartable: Option<&'a str>,
    /// The Python zygote python workers are forked from (`--preload`).
    pub zygote: Option<&'a std::sync::Arc<crate::supervise::zygote::Zygote>>,
    /// An actor in survivors mode: its workers live on through a round's
    /// failure or regroup, and rejoin the next round through this.
    pub survivors: Option<&'a dyn Rejoin>,
    /// TorchFT's Lighthouse (`--replica-groups`): its address.
    pub lighthouse: Option<&'a str>,
    /// The round's PMI service (`--framework mpi`).
    pub pmi: Option<&'a crate::mpi::pmi::round::Link>,
}

/// How kept workers rejoin a round (an actor's bridge in survivors mode;
/// see `crate::supervise::carry`).
pub trait Rejoin: std::fmt::Debug + Sync {
    /// The run the workers belong to.
    fn seq(&self) -> u64;
    /// Is worker `pid` ready: connected, and instantiated or rejoined? Only
    /// ready workers are kept at a round's end (one still in `__init__` or
    /// in its rejoin could never take a call). Between two rounds: is kept
    /// worker `pid` still connected?
    fn ready(&self, pid: i32) -> bool;
    /// Worker `pid` (started at `start`) is rank `rank` of the round that
    /// starts: hand it the round's variables, `env`, so it rejoins. A
    /// worker that cannot is killed (its rank then restarts).
    fn rejoin(&self, pid: i32, start: u64, rank: u32, env: Vec<(String, String)>);
}

/// The pod's status endpoint as its workers reach it.
#[derive(Debug, Clone)]
pub struct StatusLink {
    /// Its port on 127.0.0.1.
    pub port: u16,
    /// The file holding its bearer token.
    pub token_file: std::path::PathBuf,
    /// What the workers reported.
    pub board: std::sync::Arc<crate::status::Board>,
}

impl StatusLink {
    /// Trainer's variables, pointing worker `local_rank` at the endpoint.
    /// (Trainer's CA variable is removed: the endpoint is plain HTTP on
    /// loopback, which both Trainer clients accept.)
    pub fn env(&self, local_rank: u32) -> Vec<(String, String)> {
        vec![
            (
                names::KUBEFLOW_TRAINER_SERVER_URL.to_string(),
                format!("http://127.0.0.1:{}/ranks/{local_rank}/status", self.port),
            ),
            (names::KUBEFLOW_TRAINER_SERVER_TOKEN.to_string(), self.token_file.display().to_string()),
        ]
    }
}

/// The environment torchrun gives a worker (reference/torch.md 3.2), on top
/// of the inherited one. `error_file` is its TORCHELASTIC_ERROR_FILE.
pub fn worker_env(
    w: &WorldView<'_>,
    local_rank: u32,
    error_file: &str,
    inherited: &names::Env,
) -> Vec<(String, String)> {
    let p = w.plan;
    let rank = w.group_rank * p.nproc + local_rank;
    let world = w.nnodes * p.nproc;
    let mut env: Vec<(String, String)> = [
        ("RANK", rank.to_string()),
        ("LOCAL_RANK", local_rank.to_string()),
        ("GROUP_RANK", w.group_rank.to_string()),
        ("ROLE_RANK", rank.to_string()),
        ("ROLE_NAME", p.output.role.clone()),
        ("LOCAL_WORLD_SIZE", p.nproc.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("GROUP_WORLD_SIZE", w.nnodes.to_string()),
        ("ROLE_WORLD_SIZE", world.to_string()),
        ("MASTER_ADDR", w.master_addr.to_string()),
        ("MASTER_PORT", w.master_port.to_string()),
        ("TORCHELASTIC_RESTART_COUNT", w.restarts.to_string()),
        ("TORCHELASTIC_MAX_RESTARTS", p.max_restarts.to_string()),
        ("TORCHELASTIC_RUN_ID", p.run_id.clone()),
        ("TORCHELASTIC_USE_AGENT_STORE", "True".to_string()),
        (names::TORCHELASTIC_ERROR_FILE, error_file.to_string()),
        (
            names::TORCH_NCCL_ASYNC_ERROR_HANDLING,
            // 1: a failed collective aborts the communicator and ends the
            // process (torchrun's). Survivors mode keeps processes through a
            // peer's death: 2 aborts the communicator only, so the
            // collective raises and the worker lives to rejoin.
            inherited
                .get(names::TORCH_NCCL_ASYNC_ERROR_HANDLING)
                .unwrap_or(if w.survivors.is_some() { "2" } else { "1" })
                .to_string(),
        ),
        (
            names::TORCHELASTIC_SIGNALS_TO_HANDLE,
            p.stop_signals.iter().map(|s| sys::signal_name(*s)).collect::<Vec<_>>().join(","),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    if let Some(omp) = &p.omp_default {
        env.push((names::OMP_NUM_THREADS.to_string(), omp.clone()));
    }
    if let (Some(g), Some(url)) = (&p.groups, w.lighthouse) {
        env.extend(crate::config::replica_env(g, url, |name| inherited.get(name).is_some()));
    }
    env
}

/// What JAX or XGBoost read, for the worker of `local_rank` placed on
/// `gpu` (an index into the visible GPUs; its CUDA ordinal, or 0 when it
/// sees only its own). These replace what Trainer gave the pod: those name
/// the pod (process id = pod index, tracker port = trainlet's store), these
/// name the worker and the round's coordinator.
pub fn framework_env(w: &WorldView<'_>, local_rank: u32, gpu: Option<usize>) -> Vec<(String, String)> {
    let p = w.plan;
    let rank = (w.group_rank * p.nproc + local_rank).to_string();
    let world = (w.nnodes * p.nproc).to_string();
    let addr = w.master_addr.to_string();
    let pairs: Vec<(&str, String)> = match p.framework {
        Framework::Torch => Vec::new(),
        Framework::Jax => {
            let mut v = vec![
                (names::JAX_COORDINATOR_ADDRESS, format!("{addr}:{}", w.aux_port)),
                (names::JAX_NUM_PROCESSES, world),
                (names::JAX_PROCESS_ID, rank),
            ];
            // One process per GPU: each uses its own; one per pod uses all.
            if let (Some(i), true) = (gpu, p.nproc > 1) {
                let id = if p.gpu.visibility == crate::gpu::Visibility::Single { 0 } else { i };
                v.push((names::JAX_LOCAL_DEVICE_IDS, id.to_string()));
            }
            v
        }
        Framework::Xgboost => vec![
            (names::DMLC_TRACKER_URI, addr),
            (names::DMLC_TRACKER_PORT, w.aux_port.to_string()),
            (names::DMLC_TASK_ID, rank),
            (names::DMLC_NUM_WORKER, world),
        ],
        // The rank's PMI socket is its fd 3 (`crate::mpi::pmi::round`).
        Framework::Mpi => vec![
            (names::PMI_FD, crate::mpi::pmi::round::RANK_FD.to_string()),
            (names::PMI_RANK, rank.clone()),
            (names::PMI_ID, rank),
            (names::PMI_SIZE, world),
            (names::PMI_JOBID, w.pmi.map(|l| l.kvsname().to_string()).unwrap_or_default()),
            (names::MPI_LOCALRANKID, local_rank.to_string()),
            (names::MPI_LOCALNRANKS, p.nproc.to_string()),
        ],
    };
    pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

/// Substitute torchrun's `${local_rank}` macro in worker arguments.
pub fn substitute(args: &[String], local_rank: u32) -> Vec<String> {
    args.iter().map(|a| a.replace("${local_rank}", &local_rank.to_string())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn plan(a: &[&str]) -> crate::config::Plan {
        let args =
            crate::cli::TorchrunCli::try_parse_from(["torchrun", "--python", "py", "--nnodes", "2"].iter().chain(a))
                .expect("parse")
                .run;
        let env = names::Env::from_pairs([("PATH", "/usr/bin:/bin"), ("TRAINLET_SYSFS_ROOT", "/nonexistent")]);
        crate::config::Plan::resolve(&args, &env, true).expect("plan")
    }

    #[derive(Debug)]
    struct Kept;

    impl Rejoin for Kept {
        fn seq(&self) -> u64 {
            1
        }
        fn ready(&self, _: i32) -> bool {
            true
        }
        fn rejoin(&self, _: i32, _: u64, _: u32, _: Vec<(String, String)>) {}
    }

    #[test]
    fn survivors_mode_has_nccl_abort_the_communicator_not_the_process() {
        let p = plan(&["t.py"]);
        let nccl = |survivors: Option<&dyn Rejoin>, inherited: &[(&str, &str)]| {
            let w = WorldView {
                plan: &p,
                master_addr: "a",
                master_port: 1,
                aux_port: 2,
                restarts: 0,
                group_rank: 0,
                nnodes: 1,
                status: None,
                tap: None,
                unstartable: None,
                zygote: None,
                survivors,
                lighthouse: None,
                pmi: None,
            };
            let env = worker_env(&w, 0, "e", &names::Env::from_pairs(inherited.iter().copied()));
            env.into_iter().find(|(k, _)| k == names::TORCH_NCCL_ASYNC_ERROR_HANDLING).map(|(_, v)| v)
        };
        assert_eq!(nccl(None, &[]).as_deref(), Some("1"), "torchrun's");
        assert_eq!(nccl(Some(&Kept), &[]).as_deref(), Some("2"), "the communicator only");
        let pod = [(names::TORCH_NCCL_ASYNC_ERROR_HANDLING, "3")];
        assert_eq!(nccl(Some(&Kept), &pod).as_deref(), Some("3"), "the pod's own wins");
    }

    fn env_of(p: &crate::config::Plan, local_rank: u32, gpu: Option<usize>) -> Vec<(String, String)> {
        let w = WorldView {
            plan: p,
            master_addr: "job-node-0-0.job",
            master_port: 4000,
            aux_port: 4001,
            restarts: 0,
            group_rank: 1,
            nnodes: 2,
            status: None,
            tap: None,
            unstartable: None,
            zygote: None,
            survivors: None,
            lighthouse: None,
            pmi: None,
        };
        framework_env(&w, local_rank, gpu)
    }

    fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter().map(|(k, v)| ((*k).to_string(), (*v).to_string())).collect()
    }

    #[test]
    fn jax_and_xgboost_variables_name_the_worker_and_the_rounds_coordinator() {
        let jax = plan(&["--framework", "jax", "--nproc-per-node", "2", "t.py"]);
        assert_eq!(
            env_of(&jax, 1, Some(3)),
            pairs(&[
                ("JAX_COORDINATOR_ADDRESS", "job-node-0-0.job:4001"),
                ("JAX_NUM_PROCESSES", "4"),
                ("JAX_PROCESS_ID", "3"),
                ("JAX_LOCAL_DEVICE_IDS", "3"),
            ])
        );
        assert_eq!(env_of(&jax, 1, None).len(), 3, "no GPU, no device ids");
        let single = plan(&["--framework", "jax", "--nproc-per-node", "2", "--gpu-visibility", "single", "t.py"]);
        assert!(env_of(&single, 0, Some(5)).contains(&("JAX_LOCAL_DEVICE_IDS".into(), "0".into())));
        let one = plan(&["--framework", "jax", "t.py"]);
        assert_eq!(env_of(&one, 0, Some(0)).len(), 3, "one process per pod sees every GPU");
        let xgb = plan(&["--framework", "xgboost", "--nproc-per-node", "2", "t.py"]);
        assert_eq!(
            env_of(&xgb, 0, None),
            pairs(&[
                ("DMLC_TRACKER_URI", "job-node-0-0.job"),
                ("DMLC_TRACKER_PORT", "4001"),
                ("DMLC_TASK_ID", "2"),
                ("DMLC_NUM_WORKER", "4"),
            ])
        );
        assert!(env_of(&plan(&["t.py"]), 0, Some(0)).is_empty(), "torch workers get torchrun's env only");
    }
}
