//! Starting workers: their environment (exactly torchrun's) and the one
//! long-lived spawner thread that forks them.
//!
//! Spawning happens on a dedicated thread because PR_SET_PDEATHSIG fires when
//! the *thread* that forked the child exits (reference/gpu-pid1.md 4.6), and
//! tokio's blocking threads come and go. The child is never waited on here:
//! the `Child` handle is dropped after its pipes are taken; the signals thread
//! reaps it.

use std::os::fd::OwnedFd;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::oneshot;

use crate::config::env as names;
use crate::sys;

/// Why a worker could not be started.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    /// exec failed (not found, not executable, ...).
    #[error("cannot start {program}")]
    Exec {
        /// What we tried to run.
        program: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The spawner thread is gone.
    #[error("spawner thread is not running")]
    Gone,
}

/// A process to start.
#[derive(Debug, Clone)]
pub struct WorkerSpec {
    /// Program to exec.
    pub program: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// Variables set on top of the agent's environment.
    pub env: Vec<(String, String)>,
    /// Variables of the agent's environment it does not get.
    pub unset: Vec<String>,
    /// How its stdio is connected.
    pub stdio: StdioMode,
    /// Working directory (default: the agent's).
    pub cwd: Option<std::path::PathBuf>,
    /// CPUs to bind it to (set in the child before exec).
    pub cpus: Option<crate::gpu::CpuSet>,
    /// NUMA node its memory should come from (MPOL_PREFERRED), best effort.
    pub mem_node: Option<u32>,
}

impl WorkerSpec {
    /// A worker the torch way: stdin `/dev/null`, stdout/stderr piped.
    pub fn piped(program: String, args: Vec<String>, env: Vec<(String, String)>) -> Self {
        Self { program, args, env, unset: Vec::new(), stdio: StdioMode::Piped, cwd: None, cpus: None, mem_node: None }
    }
}

/// How a spawned process's stdio is connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StdioMode {
    /// stdin `/dev/null`; stdout and stderr piped to us (torch workers).
    Piped,
    /// stdin, stdout and stderr all piped (remote commands of `trainlet sshd`).
    AllPiped,
    /// stdin `/dev/null`; stdout and stderr are ours (mpirun under `trainlet mpi`).
    Inherit,
}

/// A started worker.
#[derive(Debug)]
pub struct Spawned {
    /// Its pid, also its process group id.
    pub pid: i32,
    /// Just before the fork (for [`super::reaper::Reaper::watch`]).
    pub forked: std::time::Instant,
    /// Write end of its stdin ([`StdioMode::AllPiped`] only).
    pub stdin: Option<OwnedFd>,
    /// Read end of its stdout (None with [`StdioMode::Inherit`]).
    pub stdout: Option<OwnedFd>,
    /// Read end of its stderr (None with [`StdioMode::Inherit`]).
    pub stderr: Option<OwnedFd>,
}

/// Cleared after the first refused set_mempolicy: it is logged once, and
/// later workers get CPU binding only.
static MEMPOLICY: AtomicBool = AtomicBool::new(true);

type Request = (WorkerSpec, oneshot::Sender<Result<Spawned, SpawnError>>);

/// Handle to the spawner thread.
#[derive(Debug, Clone)]
pub struct Spawner {
    tx: std::sync::mpsc::Sender<Request>,
}

impl Spawner {
    /// Start the spawner thread. It lives as long as the process.
    pub fn start() -> std::io::Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel::<Request>();
        std::thread::Builder::new().name("trainlet-spawner".into()).spawn(move || {
            for (spec, reply) in rx {
                let _ = reply.send(spawn_now(&spec));
            }
        })?;
        Ok(Self { tx })
    }

    /// Start one process from outside the async runtime (or a blocking
    /// task); must not be called on a runtime worker thread.
    pub fn spawn_blocking(&self, spec: WorkerSpec) -> Result<Spawned, SpawnError> {
        self.request(spec)?.blocking_recv().map_err(|_| SpawnError::Gone)?
    }

    fn request(&self, spec: WorkerSpec) -> Result<oneshot::Receiver<Result<Spawned, SpawnError>>, SpawnError> {
        let (reply, rx) = oneshot::channel();
        self.tx.send((spec, reply)).map_err(|_| SpawnError::Gone)?;
        Ok(rx)
    }

    /// Start one worker.
    pub async fn spawn(&self, spec: WorkerSpec) -> Result<Spawned, SpawnError> {
        self.request(spec)?.await.map_err(|_| SpawnError::Gone)?
    }
}

fn spawn_now(spec: &WorkerSpec) -> Result<Spawned, SpawnError> {
    let mut cmd = Command::new(&spec.program);
    for name in &spec.unset {
        cmd.env_remove(name);
    }
    cmd.args(&spec.args).envs(spec.env.iter().map(|(k, v)| (k, v)));
    let (stdin, out) = match spec.stdio {
        StdioMode::Piped => (Stdio::null(), true),
        StdioMode::AllPiped => (Stdio::piped(), true),
        StdioMode::Inherit => (Stdio::null(), false),
    };
    cmd.stdin(stdin);
    if out {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    }
    if let Some(dir) = &spec.cwd {
        cmd.current_dir(dir);
    }
    sys::prepare_worker(&mut cmd, spec.cpus.as_ref().map(|c| sys::cpu_mask(c.iter())));
    // The memory policy is set on this thread around the fork, so the child
    // inherits it and a refusal can be logged here (the child cannot log).
    let preferred = spec.mem_node.filter(|_| MEMPOLICY.load(Ordering::Relaxed)).filter(|&node| {
        sys::set_preferred_node(Some(node))
            .inspect_err(|e| {
                MEMPOLICY.store(false, Ordering::Relaxed);
                let why = if e.raw_os_error() == Some(libc::EPERM) {
                    "set_mempolicy is not permitted (seccomp's default profile needs CAP_SYS_NICE)"
                } else {
                    "set_mempolicy refused the node"
                };
                tracing::warn!(node, error = %e, "NUMA memory binding is off: {why}; workers are bound to CPUs only");
            })
            .is_ok()
    });
    let forked = std::time::Instant::now();
    let child = cmd.spawn();
    if preferred.is_some() {
        let _ = sys::set_preferred_node(None);
    }
    let mut child = child.map_err(|source| SpawnError::Exec { program: spec.program.clone(), source })?;
    let pid = i32::try_from(child.id()).unwrap_or(i32::MAX);
    let spawned = Spawned {
        pid,
        forked,
        stdin: child.stdin.take().map(OwnedFd::from),
        stdout: child.stdout.take().map(OwnedFd::from),
        stderr: child.stderr.take().map(OwnedFd::from),
    };
    // Dropping `child` neither waits nor kills: the reaper owns its exit.
    drop(child);
    Ok(spawned)
}

/// What one attempt's workers on this pod have in common.
#[derive(Debug, Clone)]
pub struct WorldView<'a> {
    /// The resolved plan.
    pub plan: &'a crate::config::Plan,
    /// Address workers dial for their store.
    pub master_addr: &'a str,
    /// Port of this attempt's worker store.
    pub master_port: u16,
    /// Job-wide restarts so far (TORCHELASTIC_RESTART_COUNT).
    pub restarts: u32,
    /// This pod's group rank in the round.
    pub group_rank: u32,
    /// Pods in the round.
    pub nnodes: u32,
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
        ("ROLE_NAME", p.role.clone()),
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
            inherited.get(names::TORCH_NCCL_ASYNC_ERROR_HANDLING).unwrap_or("1").to_string(),
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
    env
}

/// Substitute torchrun's `${local_rank}` macro in worker arguments.
pub fn substitute(args: &[String], local_rank: u32) -> Vec<String> {
    args.iter().map(|a| a.replace("${local_rank}", &local_rank.to_string())).collect()
}
