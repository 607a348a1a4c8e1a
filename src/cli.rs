//! Command-line definitions (clap derive). No I/O, no defaults that depend
//! on the environment: every torchrun option is an `Option` here so that
//! `config` can apply CLI > env > default in one place and say where each
//! value came from.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// trainlet: the per-pod agent of a distributed training job.
#[derive(Debug, Parser)]
#[command(name = "trainlet", version, about, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Sub,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Sub {
    /// Launch and supervise a distributed PyTorch job (torchrun-compatible).
    #[command(
        override_usage = "trainlet run [OPTIONS] SCRIPT [ARGS]...\n       trainlet run [OPTIONS] --no-python PROGRAM [ARGS]..."
    )]
    Run(RunArgs),
    /// Print the resolved plan (ranks, world, store, how each value was found), the GPU topology with each rank's placement, and the pre-flight results; launch nothing. Exits with the pre-flight failure's code, if any.
    Doctor(RunArgs),
    /// Serve a standalone c10d-compatible TCPStore until SIGTERM.
    Store(StoreArgs),
    /// MPI worker role: embedded SSH server (exec only) in place of sshd.
    Sshd(SshdArgs),
    /// ssh(1)-compatible client for MPI launchers (also argv[0] `ssh`).
    #[command(disable_help_flag = true)]
    Ssh {
        /// ssh(1) arguments: options, `[user@]host`, command words.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// MPI launcher role: wait for the workers, then run `mpirun` with trainlet as its remote shell.
    Mpi(MpiArgs),
    /// Generate a job SSH key pair and print the Kubernetes Secret(s) for it.
    Keygen(KeygenArgs),
    /// Kubeflow Trainer's dataset/model initializer: fetch STORAGE_URI into the shared volume, exactly once.
    Init(InitArgs),
    /// Internal: load NVML in this child process and print JSON reports.
    #[command(hide = true)]
    NvmlProbe {
        /// Print a report every SECS instead of once.
        #[arg(long, value_parser = seconds, value_name = "SECS")]
        every: Option<std::time::Duration>,
    },
    /// Internal: emit Kubernetes Events as the agent does (the same queue, series and rate limit), then write them within 2 s and exit (the cluster tests; a runtime's smoke test of its RBAC).
    #[command(hide = true)]
    Event(EventArgs),
    /// Print every worker's stacks as this container's agents read them now (Python frames of every thread, native frames of blocked ones).
    Stacks {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Stop this container's trainlet agents as SIGTERM would, and wait for them (a preStop hook, whatever PID 1 is).
    Stop {
        /// Give up (exit 1) if an agent still runs after this long, e.g. `60`, `2m`.
        #[arg(long, value_parser = sshd_time, default_value = "60")]
        timeout: std::time::Duration,
    },
}

/// `trainlet event`.
#[derive(Debug, Args)]
pub struct EventArgs {
    /// Warning or Normal.
    #[arg(long = "type", value_name = "Warning|Normal", default_value = "Warning")]
    pub type_: String,
    /// The reason, CamelCase.
    #[arg(long, value_name = "REASON")]
    pub reason: String,
    /// The action, CamelCase.
    #[arg(long, value_name = "ACTION", default_value = "Test")]
    pub action: String,
    /// Whether to write them (env TRAINLET_EVENTS; default on).
    #[arg(long, value_name = "on|off")]
    pub events: Option<String>,
    /// The notes, one event each, in order (repeat a note to repeat the event).
    #[arg(value_name = "NOTE", required = true)]
    pub notes: Vec<String>,
}

/// `trainlet init`.
#[derive(Debug, Args)]
pub struct InitArgs {
    /// `dataset` (into /workspace/dataset) or `model` (into /workspace/model).
    #[arg(value_enum)]
    pub kind: InitKind,
    /// Source, overriding env STORAGE_URI: hf://ORG/NAME[@REV], s3://BUCKET/PREFIX, http(s)://..., file:///PATH.
    #[arg(long = "storage-uri", value_name = "URI")]
    pub storage_uri: Option<String>,
    /// Output directory (default /workspace/dataset or /workspace/model).
    #[arg(long, value_name = "DIR")]
    pub output: Option<PathBuf>,
    /// Hub revision (branch, tag or commit), instead of the URI's @REV.
    #[arg(long, env = "TRAINLET_INIT_REVISION", value_name = "REV")]
    pub revision: Option<String>,
    /// Ranged reads in flight at once, over all files.
    #[arg(long, env = "TRAINLET_INIT_CONCURRENCY", default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..=1024), value_name = "N")]
    pub concurrency: u16,
    /// Size of each ranged read of a large file, in MiB (smaller files are one read).
    #[arg(long = "chunk-size", env = "TRAINLET_INIT_CHUNK_MIB", default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=4096), value_name = "MIB")]
    pub chunk_mib: u32,
    /// Retries of one read after transient failures (progress resets the count).
    #[arg(long, env = "TRAINLET_INIT_RETRIES", default_value_t = 5, value_name = "N")]
    pub retries: u32,
    /// A read that receives nothing for this long is dropped and retried.
    #[arg(long = "stall-timeout", env = "TRAINLET_INIT_STALL_TIMEOUT", default_value = "60", value_parser = seconds, value_name = "SECS")]
    pub stall: std::time::Duration,
    /// How often the progress line is logged.
    #[arg(long = "progress-interval", env = "TRAINLET_INIT_PROGRESS_INTERVAL", default_value = "10", value_parser = seconds, value_name = "SECS")]
    pub progress_every: std::time::Duration,
    /// `full`: check each file's content hash where the source publishes one
    /// (SHA-256, git SHA-1, MD5); `size`: sizes and version tags only (MD5
    /// costs about a core-second per GiB).
    #[arg(long, env = "TRAINLET_INIT_VERIFY", value_enum, default_value_t = InitVerify::Full)]
    pub verify: InitVerify,
    /// Serve the progress as Prometheus metrics at http://ADDR/metrics.
    #[arg(long = "metrics-addr", env = "TRAINLET_METRICS_ADDR", value_name = "ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
}

/// What `trainlet init` checks each file against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum InitVerify {
    /// The content hash the source publishes, where it publishes one.
    Full,
    /// Sizes and version tags only.
    Size,
}

/// `trainlet init` kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum InitKind {
    /// Trainer's dataset-initializer.
    Dataset,
    /// Trainer's model-initializer.
    Model,
}

/// A duration in seconds (`30`, `2.5`).
pub fn seconds(v: &str) -> Result<std::time::Duration, String> {
    v.trim()
        .trim_end_matches('s')
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s >= 0.0)
        .map(std::time::Duration::from_secs_f64)
        .ok_or_else(|| format!("{v:?} is not a number of seconds >= 0"))
}

/// `trainlet sshd`.
#[derive(Debug, Args)]
pub struct SshdArgs {
    /// Address to listen on (default: all interfaces, on TRAINLET_SSH_PORT or 2222).
    #[arg(long, value_name = "ADDR:PORT")]
    pub listen: Option<std::net::SocketAddr>,
    /// Port when --listen is not given.
    #[arg(long, env = crate::env::TRAINLET_SSH_PORT, default_value_t = 2222)]
    pub port: u16,
    /// Key directory: the runtime's sshAuthMountPath (default $HOME/.ssh, else /root/.ssh).
    #[arg(long, env = crate::env::TRAINLET_SSH_DIR, value_name = "DIR")]
    pub ssh_dir: Option<PathBuf>,
    /// Host key (default: <ssh-dir>/ssh_host_key, else the job key <ssh-dir>/id_*).
    #[arg(long, env = crate::env::TRAINLET_SSH_HOST_KEY, value_name = "FILE")]
    pub host_key: Option<PathBuf>,
    /// authorized_keys file (default <ssh-dir>/authorized_keys).
    #[arg(long, value_name = "FILE")]
    pub authorized_keys: Option<PathBuf>,
    /// User names a root server accepts besides `root` (a non-root server accepts any name: it can only run commands as itself).
    #[arg(long = "allow-user", value_name = "NAME")]
    pub allow_users: Vec<String>,
    /// Seconds between SIGTERM and SIGKILL for a dropped session's processes.
    #[arg(long, value_parser = seconds, default_value = "3")]
    pub kill_timeout: std::time::Duration,
    /// Write our pid here once listening (sshd's PidFile); removed on exit.
    #[arg(long, value_name = "FILE")]
    pub pid_file: Option<PathBuf>,
    /// Close connections not authenticated after this long (OpenSSH's LoginGraceTime: `120`, `2m`; 0 = never).
    #[arg(long, value_parser = sshd_time, default_value = "120")]
    pub login_grace_time: std::time::Duration,
    /// Drop new connections while this many are unauthenticated (OpenSSH's MaxStartups `start:rate:full`).
    #[arg(long, value_name = "START:RATE:FULL", default_value = "10:30:100")]
    pub max_startups: crate::ssh::server::MaxStartups,
}

/// sshd's time format for clap.
fn sshd_time(v: &str) -> Result<std::time::Duration, String> {
    crate::ssh::sshd_config::sshd_time(v).ok_or_else(|| format!("{v:?} is not a time such as 120, 2m or 1h30m"))
}

/// When `trainlet mpi` tells the workers' servers to exit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StopWorkers {
    /// Only after mpirun succeeded (a failed launcher may be retried by its Job and needs the workers).
    Success,
    /// Whenever mpirun ends.
    Always,
    /// Never (the JobSet deletes them).
    Never,
}

/// `trainlet mpi`.
#[derive(Debug, Args)]
pub struct MpiArgs {
    /// Hostfile (default: mpirun's own --hostfile, else OMPI_MCA_orte_default_hostfile, else /etc/mpi/hostfile, else one written from --hosts).
    #[arg(long, value_name = "FILE")]
    pub hostfile: Option<PathBuf>,
    /// Hosts when there is no hostfile: `h1,h2:4` (also TRAINLET_MPI_HOSTS).
    #[arg(long, env = crate::env::TRAINLET_MPI_HOSTS, value_name = "LIST")]
    pub hosts: Option<String>,
    /// Slots per host written into a generated hostfile (default OMPI_MCA_orte_set_default_slots, else 1).
    #[arg(long, env = crate::env::OMPI_MCA_ORTE_SET_DEFAULT_SLOTS)]
    pub slots: Option<u32>,
    /// The workers' SSH port.
    #[arg(long, env = crate::env::TRAINLET_SSH_PORT, default_value_t = 2222)]
    pub port: u16,
    /// Key directory (default $HOME/.ssh, else /root/.ssh).
    #[arg(long, env = crate::env::TRAINLET_SSH_DIR, value_name = "DIR")]
    pub ssh_dir: Option<PathBuf>,
    /// Seconds to wait for every host to answer the SSH handshake.
    #[arg(long, value_parser = seconds, default_value = "300")]
    pub wait_timeout: std::time::Duration,
    /// Let Open MPI / Intel MPI daemons launch each other (every worker then needs the client key).
    #[arg(long)]
    pub tree_spawn: bool,
    /// When to tell the workers' `trainlet sshd` to exit.
    #[arg(long, value_enum, default_value_t = StopWorkers::Success)]
    pub stop_workers: StopWorkers,
    /// Seconds mpirun gets after SIGTERM before SIGKILL.
    #[arg(long, value_parser = seconds, default_value = "25")]
    pub grace: std::time::Duration,
    /// The MPI launch command, e.g. `mpirun -np 8 python3 train.py`.
    #[arg(last = true, required = true, value_name = "MPIRUN")]
    pub command: Vec<String>,
}

/// `trainlet keygen`.
#[derive(Debug, Args)]
pub struct KeygenArgs {
    /// Secret name (Trainer's own is `<trainjob>-mpi-ssh-auth`).
    #[arg(long, default_value = "trainlet-mpi-ssh")]
    pub name: String,
    /// Namespace written into the manifest.
    #[arg(long)]
    pub namespace: Option<String>,
    /// Key type.
    #[arg(long = "type", value_enum, default_value_t = crate::ssh::keys::KeyType::Ed25519)]
    pub kind: crate::ssh::keys::KeyType,
    /// Separate launcher (client) and node (host) keys in two Secrets.
    #[arg(long)]
    pub split: bool,
    /// Also write the files (as they will be mounted) under this directory.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
}

/// `trainlet store`.
#[derive(Debug, Args)]
pub struct StoreArgs {
    /// Port to listen on (0 = any free port, printed on start).
    #[arg(long, default_value_t = 29500)]
    pub port: u16,
    /// Address to bind (default: all interfaces, dual stack).
    #[arg(long)]
    pub host: Option<std::net::IpAddr>,
    /// Most memory clients can make the store hold, e.g. `512M` (default: a quarter of the container's memory limit; env TRAINLET_STORE_MEMORY).
    #[arg(long = "store-memory", value_name = "BYTES")]
    pub store_memory: Option<String>,
}

/// When invoked as `torchrun`: the run options at the top level.
#[derive(Debug, Parser)]
#[command(
    name = "torchrun",
    version,
    about = "trainlet, answering to torchrun",
    override_usage = "torchrun [OPTIONS] SCRIPT [ARGS]...\n       torchrun [OPTIONS] --no-python PROGRAM [ARGS]..."
)]
pub struct TorchrunCli {
    /// The options of `trainlet run`.
    #[command(flatten)]
    pub run: RunArgs,
}

/// torchrun's options, with torchrun's names (dash and underscore spellings).
#[derive(Debug, Args, Default, Clone)]
#[command(next_help_heading = "torchrun options")]
pub struct RunArgs {
    /// Number of nodes, `N` or `MIN:MAX` (env PET_NNODES; default 1).
    #[arg(long, alias = "nnodes", value_name = "N|MIN:MAX")]
    pub nnodes: Option<String>,
    /// Workers per node: an integer, `auto`, `cpu` or `gpu` (env PET_NPROC_PER_NODE; default 1).
    #[arg(long = "nproc-per-node", alias = "nproc_per_node", value_name = "N|auto|cpu|gpu")]
    pub nproc_per_node: Option<String>,
    /// This node's rank (env PET_NODE_RANK, then JOB_COMPLETION_INDEX; default 0).
    #[arg(long = "node-rank", alias = "node_rank")]
    pub node_rank: Option<String>,
    /// Address of node rank 0 (env PET_MASTER_ADDR; default 127.0.0.1).
    #[arg(long = "master-addr", alias = "master_addr")]
    pub master_addr: Option<String>,
    /// Port of node rank 0's store (env PET_MASTER_PORT; default 29500).
    #[arg(long = "master-port", alias = "master_port")]
    pub master_port: Option<String>,
    /// Store endpoint `host[:port]`, overrides master addr/port (env PET_RDZV_ENDPOINT).
    #[arg(long = "rdzv-endpoint", alias = "rdzv_endpoint")]
    pub rdzv_endpoint: Option<String>,
    /// Run id shared by all nodes of the job (env PET_RDZV_ID; default `none`).
    #[arg(long = "rdzv-id", alias = "rdzv_id")]
    pub rdzv_id: Option<String>,
    /// `static` or `c10d`: both use trainlet's own store (env PET_RDZV_BACKEND).
    #[arg(long = "rdzv-backend", alias = "rdzv_backend")]
    pub rdzv_backend: Option<String>,
    /// Extra rendezvous settings `k=v,k=v`: join_timeout, timeout, read_timeout, is_host.
    #[arg(long = "rdzv-conf", alias = "rdzv_conf")]
    pub rdzv_conf: Option<String>,
    /// Single-node job with a private store on a free local port.
    #[arg(long)]
    pub standalone: bool,
    /// Job-wide restarts after a worker failure (env PET_MAX_RESTARTS; default 0).
    #[arg(long = "max-restarts", alias = "max_restarts")]
    pub max_restarts: Option<String>,
    /// Accepted for compatibility; trainlet is event driven and never polls.
    #[arg(long = "monitor-interval", alias = "monitor_interval")]
    pub monitor_interval: Option<String>,
    /// Run the script as a module: `python -u -m SCRIPT`.
    #[arg(short = 'm', long)]
    pub module: bool,
    /// Execute SCRIPT directly instead of through python.
    #[arg(long = "no-python", alias = "no_python")]
    pub no_python: bool,
    /// Run SCRIPT through `runpy.run_path`.
    #[arg(long = "run-path", alias = "run_path")]
    pub run_path: bool,
    /// Directory for per-attempt, per-rank logs and error files.
    #[arg(long = "log-dir", alias = "log_dir")]
    pub log_dir: Option<PathBuf>,
    /// Send worker output to files only: 0 none, 1 stdout, 2 stderr, 3 both, or `lr:v,...`.
    #[arg(short = 'r', long)]
    pub redirects: Option<String>,
    /// Send worker output to files and the console: same values as --redirects.
    #[arg(short = 't', long)]
    pub tee: Option<String>,
    /// Local ranks whose output reaches the console, e.g. `0,3`.
    #[arg(long = "local-ranks-filter", alias = "local_ranks_filter")]
    pub local_ranks_filter: Option<String>,
    /// Prefix template for worker lines: ${role_name} ${local_rank} ${rank} ${hostname}.
    #[arg(long = "log-line-prefix-template", alias = "log_line_prefix_template")]
    pub log_line_prefix_template: Option<String>,
    /// Worker role name (ROLE_NAME; default `default`).
    #[arg(long)]
    pub role: Option<String>,
    /// This node's address as peers and reports should name it.
    #[arg(long = "local-addr", alias = "local_addr")]
    pub local_addr: Option<String>,
    /// `spawn`, `fork` or `forkserver`; only meaningful to torchrun for function entrypoints.
    #[arg(long = "start-method", alias = "start_method")]
    pub start_method: Option<String>,
    /// Seconds between forwarding a stop signal and SIGKILL (default 25, so that it and --kill-timeout fit in a pod's default 30 s termination grace).
    #[arg(long = "shutdown-timeout", alias = "shutdown_timeout", visible_alias = "grace-period")]
    pub shutdown_timeout: Option<String>,
    /// Signals forwarded to workers as a stop request (default SIGTERM,SIGINT,SIGHUP,SIGQUIT).
    #[arg(long = "signals-to-handle", alias = "signals_to_handle")]
    pub signals_to_handle: Option<String>,
    /// Seconds to wait for the store and every peer pod (default 600).
    #[arg(long = "join-timeout", alias = "join_timeout")]
    pub join_timeout: Option<String>,
    /// Most memory clients can make the stores this pod serves hold, e.g. `512M` (default: a quarter of the container's memory limit; env TRAINLET_STORE_MEMORY).
    #[arg(long = "store-memory", value_name = "BYTES")]
    pub store_memory: Option<String>,
    /// Failure policy file (TOML `[[rule]]` entries; env TRAINLET_POLICY).
    #[arg(long, value_name = "FILE", help_heading = "failure policy and preemption")]
    pub policy: Option<PathBuf>,
    /// A failure rule `CODES=ACTION` (restart, fail, ignore), e.g. `3=fail`, `137,SIGSEGV=restart`; repeatable, checked before the file.
    #[arg(long = "on-exit", value_name = "CODES=ACTION", help_heading = "failure policy and preemption")]
    pub on_exit: Vec<String>,
    /// Signal sent to workers first on a planned stop (preemption, regroup), e.g. SIGUSR1 (env TRAINLET_CHECKPOINT_SIGNAL).
    #[arg(long = "checkpoint-signal", value_name = "SIGNAL", help_heading = "failure policy and preemption")]
    pub checkpoint_signal: Option<String>,
    /// Seconds workers get to checkpoint before SIGTERM; within the grace period (default 15, env TRAINLET_CHECKPOINT_TIMEOUT).
    #[arg(long = "checkpoint-timeout", value_name = "SECS", help_heading = "failure policy and preemption")]
    pub checkpoint_timeout: Option<String>,
    /// Directory the workers checkpoint to: before every round the pod checks it can write there, and leaves with 207 when it cannot (env TRAINLET_CHECKPOINT_DIR).
    #[arg(long = "checkpoint-dir", value_name = "DIR", help_heading = "failure policy and preemption")]
    pub checkpoint_dir: Option<String>,
    /// Least size of /dev/shm (e.g. 8G): before every round the pod checks it, and leaves with 207 when it is smaller (env TRAINLET_MIN_SHM).
    #[arg(long = "min-shm", value_name = "SIZE", help_heading = "failure policy and preemption")]
    pub min_shm: Option<String>,
    /// Name the ranks the others wait for while the job runs, from the workers' stacks sampled at a low rate (at most 1% of a core per pod): on (default) or off (env TRAINLET_STRAGGLERS).
    #[arg(long, value_name = "on|off", help_heading = "failure policy and preemption")]
    pub stragglers: Option<String>,
    /// With spares: a pod whose rank has been named a straggler this many seconds leaves the job with 207, and a spare takes its rank (default off, env TRAINLET_EVICT_STRAGGLERS).
    #[arg(long = "evict-stragglers", value_name = "SECS", help_heading = "failure policy and preemption")]
    pub evict_stragglers: Option<String>,
    /// Seconds to wait after SIGKILL before abandoning a worker as unkillable (default 3, env TRAINLET_KILL_TIMEOUT).
    #[arg(long = "kill-timeout", value_name = "SECS", help_heading = "failure policy and preemption")]
    pub kill_timeout: Option<String>,
    /// Fail the job when a worker stays in uninterruptible sleep this long (env TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT; default off).
    #[arg(long = "hung-timeout", value_name = "SECS", help_heading = "failure policy and preemption")]
    pub hung_timeout: Option<String>,
    /// Base of the exponential backoff between restarts, in seconds (default 0, env TRAINLET_RESTART_BACKOFF).
    #[arg(long = "restart-backoff", value_name = "SECS", help_heading = "failure policy and preemption")]
    pub restart_backoff: Option<String>,
    /// Treat the job as hung when a worker that reported progress (to trainlet's status endpoint, or by touching TRAINLET_HEARTBEAT_FILE) reports nothing for this many seconds (default off; env TRAINLET_PROGRESS_TIMEOUT, rdzv-conf progress_timeout).
    #[arg(long = "progress-timeout", value_name = "SECS", help_heading = "failure policy and preemption")]
    pub progress_timeout: Option<String>,
    /// Of the job's pods, K wait warm as spares (joined, preloaded, health-checked) and take a lost pod's node rank in the next round (default 0, env TRAINLET_SPARES).
    #[arg(long, value_name = "K", help_heading = "elastic rendezvous")]
    pub spares: Option<String>,
    /// A pod whose heartbeat is silent this long is dead (default 10, env TRAINLET_HEARTBEAT_TIMEOUT).
    #[arg(long = "heartbeat-timeout", value_name = "SECS", help_heading = "elastic rendezvous")]
    pub heartbeat_timeout: Option<String>,
    /// A pod whose store connection closed without a goodbye (its agent died: SIGKILL, the OOM killer) and did not come back within this many seconds is dead, long before its heartbeat timeout (default 0.5, at most the heartbeat timeout; env TRAINLET_LOST_GRACE).
    #[arg(long = "lost-grace", value_name = "SECS", help_heading = "elastic rendezvous")]
    pub lost_grace: Option<String>,
    /// Seconds to wait for more pods once MIN are in (default 30, env TRAINLET_LAST_CALL_TIMEOUT).
    #[arg(long = "last-call-timeout", value_name = "SECS", help_heading = "elastic rendezvous")]
    pub last_call_timeout: Option<String>,
    /// Split the pods into G TorchFT replica groups of consecutive node ranks: each group its own world, rendezvous and restart budget, TorchFT's Lighthouse on node rank 0 (env TRAINLET_REPLICA_GROUPS; TORCHFT_LIGHTHOUSE: use your own Lighthouse).
    #[arg(long = "replica-groups", value_name = "G", help_heading = "fault tolerance")]
    pub replica_groups: Option<String>,
    /// Be this pod's JobSet in-place restart agent (KEP-467): write the pod's attempt, wait at the JobSet's barrier before the rendezvous, exit IN_PLACE_RESTART_EXIT_CODE when the JobSet restarts the pods in place (env TRAINLET_IN_PLACE_RESTART; needs JOBSET_NAME and POD_NAME).
    #[arg(long = "in-place-restart", help_heading = "Kubernetes")]
    pub in_place_restart: bool,
    /// Write the job's verdicts (a failure, a hang, a restart, a spare taking a rank, an unhealthy pod leaving, a straggler) as Kubernetes Events on the pod: on (default) or off (env TRAINLET_EVENTS; needs `create` and `patch` on `events` in `events.k8s.io`, else one warning and off).
    #[arg(long, value_name = "on|off", help_heading = "Kubernetes")]
    pub events: Option<String>,
    /// Keep the pods up between runs: wait for runs submitted to the control API on the store host (env TRAINLET_SERVE); the script is then optional.
    #[arg(long, help_heading = "serve mode")]
    pub serve: bool,
    /// Port of the control API on the store host (default 29400, env TRAINLET_CONTROL_PORT).
    #[arg(long = "control-port", value_name = "PORT", help_heading = "serve mode")]
    pub control_port: Option<String>,
    /// Where the control API listens: loopback, any, pod (the address in POD_IP) or an IP address (default: loopback when standalone, else any; env TRAINLET_CONTROL_BIND).
    #[arg(long = "control-bind", value_name = "loopback|any|pod|IP", help_heading = "serve mode")]
    pub control_bind: Option<String>,
    /// File holding the control API's bearer token, e.g. a mounted Secret (default: a random token written to <serve dir>/control-token; env TRAINLET_CONTROL_TOKEN_FILE).
    #[arg(long = "control-token-file", value_name = "PATH", help_heading = "serve mode")]
    pub control_token_file: Option<String>,
    /// Exit 0 after this many seconds without a run or a request (default off, env TRAINLET_SERVE_IDLE_TIMEOUT).
    #[arg(long = "serve-idle-timeout", value_name = "SECS", help_heading = "serve mode")]
    pub serve_idle_timeout: Option<String>,
    /// Directory for runs' files and the file cache (default $TMPDIR/trainlet-serve, env TRAINLET_SERVE_DIR).
    #[arg(long = "serve-dir", value_name = "DIR", help_heading = "serve mode")]
    pub serve_dir: Option<String>,
    /// Python modules to import once in a zygote that python workers are forked from, e.g. torch,numpy (env TRAINLET_PRELOAD).
    #[arg(long, value_name = "MODULES", help_heading = "serve mode")]
    pub preload: Option<String>,
    /// What the workers are: torch (torchrun's env), jax (JAX_* env, a coordinator port per round) or xgboost (DMLC_* env, a tracker on the first pod); default: detected from Trainer's env (env TRAINLET_FRAMEWORK).
    #[arg(long, value_name = "torch|jax|xgboost")]
    pub framework: Option<String>,
    /// Python interpreter for workers (env TRAINLET_PYTHON, then PYTHON_EXEC; default python, else python3).
    #[arg(long)]
    pub python: Option<String>,
    /// Not supported yet.
    #[arg(long = "event-log-handler", alias = "event_log_handler", hide = true)]
    pub event_log_handler: Option<String>,
    /// Not supported yet.
    #[arg(long = "logs-specs", alias = "logs_specs", hide = true)]
    pub logs_specs: Option<String>,
    /// torchrun's spelling of --pin: `node` = `--pin numa`, `exclusive` = `--pin cpu`.
    #[arg(long = "numa-binding", alias = "numa_binding", value_name = "node|exclusive", help_heading = "GPU and NUMA")]
    pub numa_binding: Option<String>,
    /// Not supported yet.
    #[arg(long = "duplicate-stdout-filters", alias = "duplicate_stdout_filters", hide = true)]
    pub duplicate_stdout_filters: Option<String>,
    /// Not supported yet.
    #[arg(long = "duplicate-stderr-filters", alias = "duplicate_stderr_filters", hide = true)]
    pub duplicate_stderr_filters: Option<String>,
    /// Not supported: torchrun's shell completion script (torch 2.15, through
    /// the `shtab` package).
    #[arg(long = "print-completion", alias = "print_completion", hide = true)]
    pub print_completion: Option<String>,
    /// torchrun's spelling of `--gpu-visibility single`.
    #[arg(long = "virtual-local-rank", alias = "virtual_local_rank", help_heading = "GPU and NUMA")]
    pub virtual_local_rank: bool,
    /// GPU and CPU/NUMA binding of each local rank: none, gpu, cpu, numa or auto (default auto; env TRAINLET_PIN).
    #[arg(long, value_name = "MODE", help_heading = "GPU and NUMA")]
    pub pin: Option<String>,
    /// `all`: every worker sees all GPUs and uses LOCAL_RANK (default, torchrun's); `single`: CUDA_VISIBLE_DEVICES is the worker's own GPU and LOCAL_RANK 0 (env TRAINLET_GPU_VISIBILITY).
    #[arg(long = "gpu-visibility", value_name = "all|single", help_heading = "GPU and NUMA")]
    pub gpu_visibility: Option<String>,
    /// Pre-flight GPU checks before any worker starts: all (default), none, or a list of count,ecc,remap,mig,lost (env TRAINLET_PREFLIGHT).
    #[arg(long, value_name = "LIST", help_heading = "GPU and NUMA")]
    pub preflight: Option<String>,
    /// GPUs this pod was given (its nvidia.com/gpu request); the count check fails on any other number (env TRAINLET_EXPECT_GPUS).
    #[arg(long = "expect-gpus", value_name = "N", help_heading = "GPU and NUMA")]
    pub expect_gpus: Option<String>,
    /// MIG mode the job needs on every GPU, `on` or `off` (default: either; env TRAINLET_MIG).
    #[arg(long, value_name = "on|off", help_heading = "GPU and NUMA")]
    pub mig: Option<String>,
    /// Seconds the NVML probe may take before it is killed and sysfs alone is used (default 10, env TRAINLET_NVML_TIMEOUT).
    #[arg(long = "nvml-timeout", value_name = "SECS", help_heading = "GPU and NUMA")]
    pub nvml_timeout: Option<String>,
    /// Point NCCL at the NICs on each rank's GPU NUMA node (NCCL_IB_HCA, NCCL_SOCKET_IFNAME) unless set (env TRAINLET_NIC_HINT=1).
    #[arg(long = "nic-hint", help_heading = "GPU and NUMA")]
    pub nic_hint: bool,
    /// Serve Prometheus metrics at this address, e.g. `0.0.0.0:9400` (default off; env TRAINLET_METRICS_ADDR).
    #[arg(long = "metrics-addr", value_name = "ADDR", help_heading = "GPU and NUMA")]
    pub metrics_addr: Option<String>,
    /// The training script (or program with --no-python) and its arguments.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, value_name = "SCRIPT [ARGS]...")]
    pub command: Vec<String>,
}

impl RunArgs {
    /// The first unsupported torchrun option given, by its flag name.
    pub fn unsupported(&self) -> Option<&'static str> {
        [
            (self.event_log_handler.is_some(), "--event-log-handler"),
            (self.logs_specs.is_some(), "--logs-specs"),
            (self.duplicate_stdout_filters.is_some(), "--duplicate-stdout-filters"),
            (self.duplicate_stderr_filters.is_some(), "--duplicate-stderr-filters"),
            (self.print_completion.is_some(), "--print-completion"),
        ]
        .into_iter()
        .find_map(|(given, name)| given.then_some(name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    fn run(args: &[&str]) -> RunArgs {
        TorchrunCli::try_parse_from(std::iter::once("torchrun").chain(args.iter().copied())).expect("parse").run
    }

    #[test_case(&["--nproc-per-node", "4", "t.py"]; "dash")]
    #[test_case(&["--nproc_per_node", "4", "t.py"]; "underscore")]
    #[test_case(&["--nproc-per-node=4", "t.py"]; "equals")]
    fn both_spellings(args: &[&str]) {
        assert_eq!(run(args).nproc_per_node.as_deref(), Some("4"));
    }

    #[test]
    fn script_args_are_not_parsed_as_options() {
        let a = run(&["--nnodes", "2", "train.py", "--nnodes", "7", "-m", "x"]);
        assert_eq!(a.nnodes.as_deref(), Some("2"));
        assert!(!a.module);
        assert_eq!(a.command, ["train.py", "--nnodes", "7", "-m", "x"]);
    }

    #[test]
    fn short_flags() {
        let a = run(&["-m", "-r", "3", "-t", "1", "pkg.mod"]);
        assert!(a.module);
        assert_eq!((a.redirects.as_deref(), a.tee.as_deref()), (Some("3"), Some("1")));
    }

    #[test]
    fn unsupported_options_are_named() {
        assert_eq!(run(&["--logs-specs", "x", "t.py"]).unsupported(), Some("--logs-specs"));
        assert_eq!(run(&["--print-completion", "bash"]).unsupported(), Some("--print-completion"));
        assert_eq!(run(&["--numa-binding", "node", "t.py"]).unsupported(), None);
        assert_eq!(run(&["t.py"]).unsupported(), None);
    }
}
