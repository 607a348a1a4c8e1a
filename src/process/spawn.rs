//! Starting processes: the one long-lived spawner thread that forks them.
//! What a torch worker's environment holds is [`crate::supervise::worker`]'s
//! business; this file knows programs, arguments, stdio, CPUs and memory.
//!
//! Spawning happens on a dedicated thread because PR_SET_PDEATHSIG fires when
//! the *thread* that forked the child exits (reference/gpu-pid1.md 4.6), and
//! tokio's blocking threads come and go. The child is never waited on here:
//! the `Child` handle is dropped after its pipes are taken; the signals thread
//! reaps it.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::oneshot;

use crate::sys;

/// Why a worker could not be started.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    /// exec failed (not found, not executable, argument list too long, ...).
    #[error("cannot execute {program}")]
    Exec {
        /// What we tried to run.
        program: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// fork failed: no process or memory could be had.
    #[error(
        "fork failed starting {program}: the pod's process limit (pids cgroup, RLIMIT_NPROC) or memory is exhausted, \
         often by processes an earlier attempt left behind"
    )]
    Fork {
        /// What we tried to run.
        program: String,
        /// EAGAIN or ENOMEM.
        #[source]
        source: std::io::Error,
    },
    /// The child could not enter its working directory.
    #[error("cannot change to the working directory {dir} for {program}")]
    Chdir {
        /// What we tried to run.
        program: String,
        /// The directory.
        dir: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The program, an argument or an environment entry holds a NUL byte,
    /// pipes could not be made, or the child could not set itself up.
    #[error("cannot prepare {program}")]
    Prepare {
        /// What we tried to run.
        program: String,
        /// What was wrong.
        #[source]
        source: std::io::Error,
    },
    /// The spawner thread is gone.
    #[error("spawner thread is not running")]
    Gone,
}

impl SpawnError {
    /// The exit status a shell would give for this failure: 126 (found but
    /// not executable), 127 (not found), or None when it is not an exec
    /// failure (fork: [`crate::exit::FORK_FAILED`]).
    pub fn exec_code(&self) -> Option<u8> {
        match self {
            SpawnError::Exec { source, .. } => Some(match source.raw_os_error() {
                Some(libc::ENOENT | libc::ENOTDIR | libc::ELOOP | libc::ENAMETOOLONG) => crate::exit::WORKER_NOT_FOUND,
                _ => crate::exit::WORKER_NOT_EXECUTABLE,
            }),
            SpawnError::Chdir { .. } | SpawnError::Prepare { .. } => Some(crate::exit::WORKER_NOT_EXECUTABLE),
            SpawnError::Fork { .. } | SpawnError::Gone => None,
        }
    }

    /// Is this a transient fork failure worth retrying?
    pub fn is_fork(&self) -> bool {
        matches!(self, SpawnError::Fork { .. })
    }
}

/// A process to start.
#[derive(Debug, Clone)]
pub struct WorkerSpec {
    /// Program to exec.
    pub program: String,
    /// Its `argv[0]`, when not `program` (the agent starting itself again
    /// under the name it was started by).
    pub argv0: Option<String>,
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
    pub cpus: Option<super::CpuSet>,
    /// NUMA node its memory should come from (MPOL_PREFERRED), best effort.
    pub mem_node: Option<u32>,
    /// Its `oom_score_adj` (best effort): workers get a higher one than the
    /// agent so the kernel's OOM killer prefers them.
    pub oom_score_adj: Option<i32>,
    /// One of the agent's own helpers (the Python zygote, the TorchFT
    /// Lighthouse, the NVML probe): the sweeps spare it from its fork on
    /// ([`super::sweep::start_kept`]); the caller releases it.
    pub helper: bool,
    /// A descriptor the process gets as fd 3 (an MPI rank's `PMI_FD`).
    pub pass_fd: Option<std::sync::Arc<std::os::fd::OwnedFd>>,
}

impl WorkerSpec {
    /// A worker the torch way: stdin `/dev/null`, stdout/stderr piped.
    pub fn piped(program: String, args: Vec<String>, env: Vec<(String, String)>) -> Self {
        Self {
            program,
            argv0: None,
            args,
            env,
            unset: Vec::new(),
            stdio: StdioMode::Piped,
            cwd: None,
            cpus: None,
            mem_node: None,
            oom_score_adj: None,
            helper: false,
            pass_fd: None,
        }
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

/// First and longest pause between spawn attempts after a failed fork.
const FORK_RETRY: (std::time::Duration, std::time::Duration) =
    (std::time::Duration::from_millis(50), std::time::Duration::from_secs(2));

impl Spawner {
    /// Spawn, retrying a failed fork (EAGAIN/ENOMEM: the pids limit is
    /// often reached by what an earlier attempt left, which the sweep is
    /// removing) with backoff for up to `budget`; other failures are final
    /// at once.
    pub async fn spawn_retrying(&self, spec: WorkerSpec, budget: std::time::Duration) -> Result<Spawned, SpawnError> {
        let until = tokio::time::Instant::now() + budget;
        let mut pause = FORK_RETRY.0;
        let mut tries = 1u32;
        loop {
            match self.spawn(spec.clone()).await {
                Err(e) if e.is_fork() && tokio::time::Instant::now() + pause <= until => {
                    tracing::warn!(
                        program = %spec.program,
                        tries,
                        retry_in_ms = pause.as_millis(),
                        error = %crate::error::error_chain(&e),
                        "fork failed; retrying"
                    );
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(FORK_RETRY.1);
                    tries += 1;
                }
                other => return other,
            }
        }
    }

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
    let plan = exec_plan(spec).map_err(|source| SpawnError::Prepare { program: spec.program.clone(), source })?;
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
    let child =
        if spec.helper { super::sweep::start_kept(|| sys::fork_exec(&plan), |c| c.pid) } else { sys::fork_exec(&plan) };
    if preferred.is_some() {
        let _ = sys::set_preferred_node(None);
    }
    let program = || spec.program.clone();
    let io = |e: nix::errno::Errno| std::io::Error::from_raw_os_error(e as i32);
    let child = child.map_err(|e| match e {
        sys::ForkExecError::Fork(errno) => SpawnError::Fork { program: program(), source: io(errno) },
        sys::ForkExecError::Exec(errno) => SpawnError::Exec { program: program(), source: io(errno) },
        sys::ForkExecError::Chdir(errno) => SpawnError::Chdir {
            program: program(),
            dir: spec.cwd.as_ref().map(|d| d.display().to_string()).unwrap_or_default(),
            source: io(errno),
        },
        sys::ForkExecError::Setup(errno) | sys::ForkExecError::ChildSetup(errno) => {
            SpawnError::Prepare { program: program(), source: io(errno) }
        }
    })?;
    Ok(Spawned { pid: child.pid, forked, stdin: child.stdin, stdout: child.stdout, stderr: child.stderr })
}

/// Build the argv, environment and PATH candidates before the fork (the
/// child may not allocate). The environment is the agent's, less `unset`,
/// with `env` on top (later entries win), as `Command::envs` does.
fn exec_plan(spec: &WorkerSpec) -> std::io::Result<sys::ExecPlan> {
    use std::ffi::CString;
    use std::os::unix::ffi::{OsStrExt, OsStringExt};
    let c = |bytes: Vec<u8>| {
        CString::new(bytes).map_err(|_| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "a NUL byte in an argument or the environment")
        })
    };
    let env = merged_env(spec);
    let path = env.iter().find(|(k, _)| k == "PATH").map(|(_, v)| v.clone());
    let candidates =
        candidates(&spec.program, path.as_deref()).into_iter().map(|p| c(p.into_vec())).collect::<Result<_, _>>()?;
    let mut argv = vec![c(spec.argv0.as_ref().unwrap_or(&spec.program).clone().into_bytes())?];
    for a in &spec.args {
        argv.push(c(a.clone().into_bytes())?);
    }
    let envp = env
        .into_iter()
        .map(|(k, v)| {
            let mut kv = k.into_vec();
            kv.push(b'=');
            kv.extend_from_slice(v.as_bytes());
            c(kv)
        })
        .collect::<Result<_, _>>()?;
    let cwd = spec.cwd.as_ref().map(|d| c(d.as_os_str().as_bytes().to_vec())).transpose()?;
    let stdio = match spec.stdio {
        StdioMode::Piped => [sys::ChildIo::Null, sys::ChildIo::Pipe, sys::ChildIo::Pipe],
        StdioMode::AllPiped => [sys::ChildIo::Pipe; 3],
        StdioMode::Inherit => [sys::ChildIo::Null, sys::ChildIo::Inherit, sys::ChildIo::Inherit],
    };
    Ok(sys::ExecPlan {
        candidates,
        argv,
        envp,
        cwd,
        stdio,
        affinity: spec.cpus.as_ref().map(|cpus| sys::cpu_mask(cpus.iter())),
        oom_score_adj: spec.oom_score_adj,
        pass_fd: spec.pass_fd.as_ref().map(|fd| std::os::fd::AsRawFd::as_raw_fd(&**fd)),
    })
}

/// The agent's environment less `spec.unset` and less what only this
/// agent may read (a lane agent's `TRAINLET_LANE`), with `spec.env` on
/// top (later entries win), as `Command::envs` does.
fn merged_env(spec: &WorkerSpec) -> Vec<(std::ffi::OsString, std::ffi::OsString)> {
    use std::ffi::{OsStr, OsString};
    let mut env: Vec<(OsString, OsString)> = std::env::vars_os().collect();
    env.retain(|(k, _)| k != OsStr::new(crate::env::TRAINLET_LANE) && !spec.unset.iter().any(|u| OsStr::new(u) == k));
    for (k, v) in &spec.env {
        env.retain(|(old, _)| old != OsStr::new(k));
        env.push((k.into(), v.into()));
    }
    env
}

/// The environment an exec'd `spec` gets, as text (None when a name or
/// value is not UTF-8): what a worker forked from the zygote is given.
pub fn worker_env_utf8(spec: &WorkerSpec) -> Option<std::collections::BTreeMap<String, String>> {
    merged_env(spec).into_iter().map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?))).collect()
}

/// Paths execvp would try for `program`: itself when it has a slash, else
/// each PATH entry (the child's PATH; an empty entry is the working
/// directory; glibc's default when PATH is unset).
fn candidates(program: &str, path: Option<&std::ffi::OsStr>) -> Vec<std::ffi::OsString> {
    use std::os::unix::ffi::OsStrExt;
    if program.contains('/') {
        return vec![program.into()];
    }
    if program.is_empty() {
        return Vec::new();
    }
    let path = path.map_or(b"/bin:/usr/bin".as_slice(), OsStrExt::as_bytes);
    path.split(|b| *b == b':')
        .map(|dir| {
            let dir = if dir.is_empty() { b".".as_slice() } else { dir };
            let mut p = std::path::PathBuf::from(std::ffi::OsStr::from_bytes(dir));
            p.push(program);
            p.into_os_string()
        })
        .collect()
}
