//! Configuration: raw CLI + environment -> one immutable [`Plan`].
//!
//! Precedence is CLI > env > default, applied in [`Plan::resolve`] and
//! nowhere else; every value remembers where it came from so that
//! `trainlet doctor` can say. What resolution needs of the machine (GPUs,
//! CPUs, host name) is discovered once ([`machine::Machine`]) and passed in; beyond
//! that it reads only the failure policy file and PATH, never the network.
//! One file per concern: nodes, rendezvous, timeouts, output, entry, gpu, groups,
//! over one lookup helper (`setting.rs`).

mod defaults;
mod entry;
mod events;
mod framework;
mod gpu;
mod groups;
mod health;
mod inplace;
pub mod machine;
mod nodes;
mod output;
mod progress;
mod rendezvous;
mod resolve;
pub mod rules;
mod serve;
mod setting;
mod timeouts;

use std::fmt;
use std::time::Duration;

pub use crate::env::Env;

pub use framework::Framework;
pub use groups::{Groups, Lighthouse, RunLighthouse, replica_env};
pub use health::Health;
pub use inplace::InPlace;
pub use output::{Output, Streams};
pub use progress::{Progress, Upstream};
pub use serve::{LANE_FD, Lane, Preload, Serve, slots_gpus};
pub use setting::{parse_port, store_memory};

use crate::store::Endpoint;

/// A bad flag or variable: names it, its value, and what was expected.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A value that does not parse or is out of range.
    #[error("invalid {origin} value {value:?}: expected {expected}")]
    Invalid {
        /// `--flag` or `ENV_VAR`.
        origin: String,
        /// What was given.
        value: String,
        /// What would have been accepted.
        expected: String,
    },
    /// The failure policy file or a rule flag is bad.
    #[error(transparent)]
    Policy(#[from] crate::config::rules::RuleError),
    /// A torchrun option or setting trainlet does not implement yet.
    #[error("{what} is not supported by trainlet yet: {hint}")]
    Unsupported {
        /// The option or setting.
        what: String,
        /// What to do instead.
        hint: String,
    },
    /// Options that cannot be combined, or a missing one.
    #[error("{0}")]
    Usage(String),
    /// The GPU inventory (sysfs/procfs) could not be read.
    #[error("cannot list this pod's GPUs")]
    Gpu(#[from] crate::gpu::GpuError),
}

/// Where a resolved value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A command-line flag.
    Flag(&'static str),
    /// An environment variable.
    Env(&'static str),
    /// torchrun's default.
    Default,
    /// Computed from other values (e.g. `auto` -> GPU count).
    Derived(String),
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Flag(n) => write!(f, "flag {n}"),
            Source::Env(n) => write!(f, "env {n}"),
            Source::Default => f.write_str("default"),
            Source::Derived(how) => write!(f, "derived: {how}"),
        }
    }
}

/// What each worker executes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entrypoint {
    /// Program to exec (an interpreter, or the script with --no-python).
    pub program: String,
    /// Its arguments; `${local_rank}` is substituted per worker.
    pub args: Vec<String>,
    /// The user's script or module, for reports.
    pub script: String,
    /// The python interpreter: the program, or with `--no-python` the one
    /// XGBoost's tracker runs in (None when nothing needs one).
    pub python: Option<String>,
    /// Its working directory (serve mode: the run's directory).
    pub cwd: Option<std::path::PathBuf>,
    /// Variables set on top of the agent's (serve mode: the run's `env`).
    pub env: Vec<(String, String)>,
}

/// The rendezvous run id of replica group `group` of job `run_id`.
pub fn group_rdzv_id(run_id: &str, group: u32) -> String {
    format!("{run_id}/g{group}")
}

/// The rendezvous id of serve mode's lane for run `seq`: its agents meet
/// on keys of their own (`crate::serve::lane`).
pub fn lane_rdzv_id(run_id: &str, seq: u64) -> String {
    format!("{run_id}/lane{seq}")
}

/// Everything a launch needs, resolved and validated.
#[derive(Debug, Clone)]
pub struct Plan {
    /// What the workers are: their environment, and what runs beside them.
    pub framework: Framework,
    /// Number of pods (agents): MAX of `--nnodes MIN:MAX`.
    pub nnodes: u32,
    /// MIN of `--nnodes MIN:MAX` (equal to `nnodes` in a static job).
    pub min_nodes: u32,
    /// Of the pods, those that wait warm as spares (`--spares`).
    pub spares: u32,
    /// Workers per pod.
    pub nproc: u32,
    /// This pod's rank.
    pub node_rank: u32,
    /// Single-pod job with a private store on a free loopback port.
    pub standalone: bool,
    /// The agents' store (port 0 in standalone mode: picked at bind).
    pub endpoint: Endpoint,
    /// Whether this pod serves the store.
    pub serve_store: bool,
    /// Job id shared by all pods (TORCHELASTIC_RUN_ID).
    pub run_id: String,
    /// Job-wide restart budget.
    pub max_restarts: u32,
    /// Deadline for reaching the store and every peer.
    pub join_timeout: Duration,
    /// Grace between a stop signal and SIGKILL.
    pub grace: Duration,
    /// Signals that stop the job gracefully (always includes SIGTERM and SIGINT).
    pub stop_signals: Vec<i32>,
    /// What workers run (in serve mode: the current run's command).
    pub entry: Entrypoint,
    /// Serve mode: pods stay up between runs submitted to the control API.
    pub serve: Option<Serve>,
    /// The Python zygote python workers are forked from.
    pub preload: Option<Preload>,
    /// Write Kubernetes Events (`--events`, default on).
    pub events: bool,
    /// JobSet in-place restarts: this pod's agent (`--in-place-restart`).
    pub in_place: Option<InPlace>,
    /// TorchFT replica groups (`--replica-groups`): `nnodes`, `min_nodes`
    /// and `node_rank` are then this pod's group's, these the job's.
    pub groups: Option<Groups>,
    /// JobSet restart attempt (0 when not exposed).
    pub jobset_attempt: u64,
    /// Elastic last-call window.
    pub last_call: Duration,
    /// Heartbeat period.
    pub heartbeat: Duration,
    /// Silence after which a pod is dead.
    pub heartbeat_timeout: Duration,
    /// How long a pod's store connection, closed without a goodbye, may
    /// stay closed before the pod is dead (at most `heartbeat_timeout`).
    pub lost_grace: Duration,
    /// Base of the exponential backoff between restarts.
    pub restart_backoff: Duration,
    /// Sent to workers first on a planned stop.
    pub checkpoint_signal: Option<i32>,
    /// Time between the checkpoint signal and SIGTERM.
    pub checkpoint_timeout: Duration,
    /// Time between SIGKILL and abandoning a worker.
    pub kill_timeout: Duration,
    /// D-state time after which a worker is hung.
    pub hung_timeout: Option<Duration>,
    /// Memory budget of the stores this pod serves, in bytes.
    pub store_memory: u64,
    /// The failure policy.
    pub rules: crate::config::rules::Rules,
    /// Names and output of the workers, and this pod's name in reports.
    pub output: Output,
    /// `OMP_NUM_THREADS` to give workers when it is unset (1 if nproc > 1).
    pub omp_default: Option<String>,
    /// GPUs, binding and pre-flight checks.
    pub gpu: crate::gpu::GpuPlan,
    /// Where progress goes, and how long workers may go without any.
    pub progress: Progress,
    /// What the pod checks of itself before every round.
    pub health: Health,
    /// (setting, value, source) for `trainlet doctor`.
    pub provenance: Vec<(&'static str, String, Source)>,
}

impl Plan {
    /// The rendezvous's run id: the job's, or with replica groups this
    /// pod's group's (each group meets on its own keys).
    pub fn rdzv_id(&self) -> String {
        match (&self.groups, self.serve.as_ref().and_then(|s| s.lane.as_ref())) {
            (Some(g), _) => group_rdzv_id(&self.run_id, g.group),
            (None, Some(lane)) => lane_rdzv_id(&self.run_id, lane.seq),
            (None, None) => self.run_id.clone(),
        }
    }

    /// Global world size of a full round.
    pub fn world_size(&self) -> u32 {
        self.world_nodes().1 * self.nproc
    }

    /// The least and most pods of a round: `--nnodes` without the spares.
    pub fn world_nodes(&self) -> (u32, u32) {
        let max = self.nnodes.saturating_sub(self.spares).max(1);
        (self.min_nodes.min(max), max)
    }

    /// `N` or `MIN:MAX`.
    pub fn nnodes_spec(&self) -> String {
        if self.min_nodes == self.nnodes {
            self.nnodes.to_string()
        } else {
            format!("{}:{}", self.min_nodes, self.nnodes)
        }
    }

    /// The human-readable plan printed by `trainlet doctor`.
    pub fn describe(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let _ = writeln!(s, "trainlet plan");
        for (name, value, source) in &self.provenance {
            let _ = writeln!(s, "  {name:<16} {value:<28} ({source})");
        }
        let _ = writeln!(s, "  {:<16} {}", "world size", self.world_size());
        let _ = writeln!(
            s,
            "  {:<16} {}",
            "store",
            if self.standalone {
                "served by this pod on a free loopback port".to_string()
            } else if self.serve_store && self.endpoint.port == 0 {
                "served by this pod on a free port".to_string()
            } else if self.serve_store {
                format!("served by this pod on port {}, peers dial {}", self.endpoint.port, self.endpoint)
            } else {
                format!("dial {}", self.endpoint)
            }
        );
        let _ = writeln!(s, "  {:<16} {} {}", "worker command", self.entry.program, self.entry.args.join(" "));
        s
    }
}
