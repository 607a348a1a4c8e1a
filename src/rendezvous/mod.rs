//! Rendezvous of trainlet agents over the agents' store: rounds, ranks,
//! heartbeats, and how every round ends.
//!
//! Static (`--nnodes N`) and elastic (`--nnodes MIN:MAX`) jobs run the same
//! protocol; static is MIN = MAX with node ranks taken from each pod's env.
//! A round closes at once when MAX pods joined, or at the end of a last-call
//! window that opens when MIN pods are in. Pods beyond MAX wait as spares;
//! a pod that arrives while a smaller round runs asks it to regroup
//! (torchrun's `num_nodes_waiting`). With `--spares K`, MIN and MAX count
//! the pods that train, members keep their ranks from round to round, and
//! a spare takes the rank a lost pod left ([`member`]). Liveness is one heartbeat key per agent
//! (O(pods) traffic), judged by the store host's clock ([`host`]).
//!
//! Keys, under `trainlet/<run_id>/j<jobset restart attempt>/` (torch's
//! clients prefix their keys with `/`, so they never collide):
//!
//! | key | written by | meaning |
//! |---|---|---|
//! | `../attempt` | every agent, raised to the max | the newest JobSet restart attempt seen |
//! | `round` | raised to the max | the open (or running) round R |
//! | `restarts` | raised to the max | restarts used, job-wide |
//! | `hb/<uid>` | each agent, every interval | heartbeat counter, `bye` on exit |
//! | `claim/<place>` | each agent, first COMPARE_SET wins | the uid of the live agent that holds a node rank (elastic: `<node rank>@<host>`); taken over only from one that said `bye` or stopped heartbeating ([`claim`]) |
//! | `leaving/<uid>` | an agent that got a stop signal | its signal: a pod that comes for its place waits for it to go instead of being refused |
//! | `rR/lead` | the store host's agent | its `--spares`, once it joined: in jobs with spares the others join after it, so it is always a member |
//! | `rR/join` | ADD per pod | arrival slots |
//! | `rR/m/<slot>` | each pod | its [`Member`] record |
//! | `rR/quorum` | the pod that made MIN | the last call has started |
//! | `rR/closed` | first COMPARE_SET wins | `N:<slot>`: the first N slots are members, slot assigns ranks |
//! | `rR/rank/<slot>`, `rR/members` | the assigning pod | each slot's [`Assignment`]; members by group rank |
//! | `rR/port` | the store host | `PORT,AUX`: the round's fresh worker store, and a free port for the coordinator or tracker |
//! | `rR/service` | the store host's agent | `ready` or `failed: <why>`: XGBoost's tracker for the round |
//! | `status/<node rank>` | each pod's progress relay | its workers' newest `trainerStatus` (`crate::status::relay`) |
//! | `rR/end` | first COMPARE_SET wins | a [`crate::supervise::round_end::RoundEnd`]: `success`, `failure`, `fatal` (with `:hang` at a hang), `waiting:<uid>`, `abort:<uid>:<sig>`, `dead:<uid>`, `stop:<run>` (serve mode) |
//! | `rR/done`, `rR/stopped`, `rR/all_stopped` | ADD per pod, then the last | workers done / gone everywhere |
//! | `rR/failures/<group rank>` | each pod | JSON list of its failures |
//! | `rR/stacks/<group rank>`, `rR/dumped/<group rank>` | each pod, at a hang | its workers' stacks (JSON, with their Flight Recorder dumps once `dumped` is set) |
//! | `rR/dead` | the store host | uids that stopped heartbeating |
//! | `rR/verdict` | first COMPARE_SET wins | what every pod does next (`policy::Verdict`) |
//! | `rR/next` | whoever moves the job on | the next round number |
//! | `rR/left`, `rR/all_left` | ADD per pod, then the last | the store host may close the store |
//! | `rR/spare_left` | ADD per spare that read the last verdict | the store host closes the store (at most 3 s later) |
//! | `takeovers` | ADD per spare that got in | takeovers so far (the TrainJob's status) |
//!
//! Every wait is bounded by the join deadline or the heartbeat timeout,
//! except a spare's wait for room (it waits while the job runs). Rounds
//! never share keys or worker stores. When round R forms, the store host
//! deletes the keys of every round before R - 1 ([`host`]): R's members
//! have left them, and R - 1's stay for the spares and the pods an
//! elastic round left behind, so the store holds two rounds' keys
//! whatever the number of rounds. Everything job-wide (`round`,
//! `restarts`, `attempt`) is raised to the maximum any agent knows when it
//! joins, so a store host that restarts with an empty store is rebuilt by
//! the agents that reconnect.

mod claim;
mod end;
pub mod host;
mod join;
mod member;
mod service;
mod session;
mod spares;

pub use end::JOB_ENDED;

/// Extra time, beyond the grace period and the kill timeout, for the other
/// pods to report their workers stopped.
pub const STOP_SYNC_MARGIN: std::time::Duration = std::time::Duration::from_secs(10);
pub use member::{Assignment, Member, assign};
pub use session::{Joined, Known, Round, Session, Stopped, Timing, job_base};

use std::time::Duration;

use crate::exit;
use crate::store::{ClientError, Endpoint};

/// Errors of the rendezvous.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Could not reach the store before the deadline.
    #[error("rendezvous store not reachable")]
    Unreachable(#[source] ClientError),
    /// The store connection broke.
    #[error("lost the connection to the rendezvous store at {endpoint}")]
    Lost {
        /// The store.
        endpoint: Endpoint,
        /// What failed.
        #[source]
        source: ClientError,
    },
    /// Not enough pods joined before the deadline.
    #[error("timed out after {waited:?} in round {round} at {endpoint}: {detail}")]
    Timeout {
        /// How long we waited.
        waited: Duration,
        /// The round.
        round: u64,
        /// Who or what is missing.
        detail: String,
        /// The store.
        endpoint: Endpoint,
    },
    /// Pods disagree on the job.
    #[error("pods disagree on the job: {0}")]
    Mismatch(String),
    /// Two live pods claim the same node rank (in an elastic job: the same
    /// host and node rank).
    #[error(
        "node rank {node_rank} is already held by {holder}, which is alive; this pod ({ours}) claims it too: \
         each pod needs its own node rank"
    )]
    Duplicate {
        /// The contested rank.
        node_rank: u32,
        /// Who holds it.
        holder: String,
        /// This agent: host and pid.
        ours: String,
    },
    /// This pod belongs to an older JobSet restart attempt than the job.
    #[error(
        "this pod belongs to JobSet restart attempt {ours}, but the job is at attempt {current}; \
         a pod of a previous attempt must not join (it is being replaced)"
    )]
    Stale {
        /// This pod's attempt.
        ours: u64,
        /// The job's newest attempt.
        current: u64,
    },
}

impl Error {
    /// Its exit code ([`crate::exit`]): a deadline is 201, a disagreement
    /// 200, a lost peer 203, a stale pod 204.
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::Unreachable(_) | Error::Timeout { .. } => exit::RENDEZVOUS_TIMEOUT,
            Error::Mismatch(_) | Error::Duplicate { .. } => exit::CONFIG,
            Error::Lost { .. } => exit::PEER_LOST,
            Error::Stale { .. } => exit::STALE_ATTEMPT,
        }
    }
}
