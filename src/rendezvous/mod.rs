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
//! Its keys, and what each holds: [`crate::keys`].
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
mod hang;
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
pub use crate::keys::{heartbeat_tie, job_base};
pub use member::{Member, Roster, assign};
pub(crate) use session::read_members;
pub use session::{Joined, Known, Roles, Round, Session, Stopped, Timing};

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
