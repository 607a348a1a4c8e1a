//! `trainlet run`: store, rendezvous, attempts, exit code.
//!
//! Owns the flow of one pod's agent: serve the store (and the per-round
//! worker stores and liveness monitor) if this pod hosts it, join the
//! rendezvous, then per round: spawn and supervise workers, stop them when
//! the round ends anywhere, agree with the other pods on a verdict, and
//! regroup, restart or exit. A lost store is waited for (its host restarts)
//! up to the join deadline. Must not parse flags or env (that
//! is `config`) nor decide policy (that is `supervise::policy`).
//!
//! [`run`] owns the JobSet in-place restart agent, when there is one; the
//! job itself is `job` (its phases); the features that plug into its
//! rounds implement `feature::Feature` and are listed in `feature_list`.

use tokio::sync::mpsc::UnboundedReceiver;
use tokio_util::sync::CancellationToken;

use crate::config::Plan;
use crate::process::signals::SysEvent;

pub(crate) mod error_file;
mod evict;
mod feature;
mod feature_list;
mod finish;
mod health;
mod hosting;
mod inplace;
mod job;
mod pmi;
mod progress;
mod replicas;
mod round;
mod start;
mod stragglers;
mod tracker;
mod wait;

/// Why `trainlet run` could not run the job to an outcome of its own
/// (`crate::cmd` maps each to its exit code).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Bad flags or env.
    #[error(transparent)]
    Config(#[from] crate::config::Error),
    /// The store could not be served.
    #[error(transparent)]
    Store(#[from] crate::store::ServerError),
    /// The rendezvous failed.
    #[error(transparent)]
    Rendezvous(#[from] crate::rendezvous::Error),
    /// An OS call trainlet depends on failed.
    #[error("operating system call failed")]
    Os(#[source] std::io::Error),
    /// The in-place restart agent could not start or was refused.
    #[error(transparent)]
    InPlace(#[from] crate::inplace::Error),
}

/// Result of the launch flow.
pub type Result<T> = std::result::Result<T, Error>;

/// Run the job described by `plan`; returns trainlet's exit code. With
/// `--in-place-restart`, the pod's JobSet in-place restart agent runs
/// beside the job: its stop joins the job's events, and its code may
/// replace the job's (`inplace::finish`).
pub async fn run(plan: Plan, events: UnboundedReceiver<SysEvent>, cancel: CancellationToken) -> Result<u8> {
    // The pod's Kubernetes Events: every verdict below emits through the global handle.
    let config = crate::events::Config::new(plan.events, &crate::env::Env::from_process());
    crate::events::install(crate::events::Events::start(&config, &cancel));
    let out = run_job(plan, events, cancel).await;
    // What was emitted just before the end is written before the pod exits.
    crate::events::global().finish(crate::events::FLUSH_BOUND).await;
    out
}

async fn run_job(plan: Plan, events: UnboundedReceiver<SysEvent>, cancel: CancellationToken) -> Result<u8> {
    let (evictor, events) = evict::start(&plan, events);
    let (mut agent, events) = match plan.in_place.clone() {
        Some(cfg) => {
            let (agent, merged) = inplace::start(&cfg, events, &cancel).await?;
            (Some(agent), merged)
        }
        None => (None, events),
    };
    let kept = evictor.as_ref().map(|_| plan.clone());
    let out = job::run(plan, events, (agent.as_mut(), evictor.clone()), cancel).await;
    let out = match agent.as_mut() {
        Some(agent) => inplace::finish(agent, out),
        None => out,
    };
    match &kept {
        Some(plan) => evict::finish(plan, evictor.as_ref(), out),
        None => out,
    }
}
