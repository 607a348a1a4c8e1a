//! `--in-place-restart`: the launch flow beside its pod's JobSet in-place
//! restart agent (`crate::inplace`). The agent's stop joins the signals in
//! one stream of events, the barrier comes before the rendezvous, and a
//! restart asked by the JobSet ends with the agent's exit code.

use tokio::sync::mpsc::UnboundedReceiver;
use tokio_util::sync::CancellationToken;

use std::time::Duration;

use super::Result;
use super::round::rejoin;
use super::wait::until_stop;
use crate::config::{InPlace, Plan};
use crate::exit;
use crate::inplace::InPlaceAgent;
use crate::process::signals::SysEvent;
use crate::rendezvous::Session;
use crate::supervise::policy::Verdict;

/// Start the pod's in-place restart agent: its stop joins the signals in
/// the one stream of events the job reads (returned).
pub(super) async fn start(
    cfg: &InPlace,
    events: UnboundedReceiver<SysEvent>,
    cancel: &CancellationToken,
) -> Result<(InPlaceAgent, UnboundedReceiver<SysEvent>)> {
    let (tx, merged) = merge(events);
    let agent = crate::inplace::start(cfg, tx, cancel).await?;
    Ok((agent, merged))
}

/// `events` in a stream that a sender of trainlet's own (returned) joins:
/// an in-place restart's or an eviction's stop.
pub(super) fn merge(
    events: UnboundedReceiver<SysEvent>,
) -> (tokio::sync::mpsc::UnboundedSender<SysEvent>, UnboundedReceiver<SysEvent>) {
    let (tx, merged) = tokio::sync::mpsc::unbounded_channel();
    let forward = tx.clone();
    tokio::spawn(async move {
        let mut events = events;
        while let Some(ev) = events.recv().await {
            if forward.send(ev).is_err() {
                return;
            }
        }
    });
    (tx, merged)
}

/// The job's outcome `out` as the pod's exit: the agent's code replaces a
/// stop or a lost peer, never an outcome of the job's own (success, or a
/// failure the runtime routes to FailJob).
pub(super) fn finish(agent: &mut InPlaceAgent, out: Result<u8>) -> Result<u8> {
    match (agent.finish(), out) {
        (Some(code), Ok(c))
            if ![exit::SUCCESS, exit::CONFIG, exit::FAILED_BY_POLICY, exit::GPU_MISMATCH].contains(&c) =>
        {
            Ok(code)
        }
        (_, out) => out,
    }
}

/// Wait at the JobSet's barrier, if there is an agent; `Some(code)` when a
/// stop signal came first.
pub(super) async fn barrier(
    agent: Option<&mut InPlaceAgent>,
    events: &mut UnboundedReceiver<SysEvent>,
    plan: &Plan,
) -> Result<Option<u8>> {
    let Some(agent) = agent else { return Ok(None) };
    let wait = tokio::time::timeout(plan.join_timeout, agent.barrier());
    match until_stop(events, plan, wait).await {
        Ok(Err(_)) => {
            tracing::error!(
                join_timeout_s = plan.join_timeout.as_secs_f64(),
                "in-place restarts: the JobSet's barrier did not lift within the join timeout"
            );
            Ok(Some(exit::RENDEZVOUS_TIMEOUT))
        }
        Ok(Ok(Ok(lifted))) => {
            tracing::info!(?lifted, "in-place restarts: past the JobSet's barrier; joining the rendezvous");
            Ok(None)
        }
        Ok(Ok(Err(e))) => Err(e.into()),
        Err(sig) => Ok(Some(exit::for_signal(sig))),
    }
}

/// A pod of an in-place job that has run no round yet found the job over
/// on the store: that store is the previous containers' (their host
/// lingers until the pods read the outcome), reached because the pods
/// restarted without the barrier (the JobSet's disable annotation). Joining
/// it would end this container at once and spend the JobSet's `maxRestarts`
/// in a crash loop, so wait for that store to close and rejoin the store
/// its host's new container serves. Err(exit code) when it does not close
/// or come back within the join timeout, or a stop signal came.
pub(super) async fn outwait_stale_store(
    session: &mut Session,
    plan: &Plan,
    ended: Verdict,
    events: &mut UnboundedReceiver<SysEvent>,
    cancel: &CancellationToken,
) -> std::result::Result<(), u8> {
    tracing::warn!(
        verdict = %ended,
        limit_s = plan.join_timeout.as_secs_f64(),
        "in-place restarts: the store still holds the job this pod's previous containers ran, and it is over; \
         waiting for its host to restart with a fresh store"
    );
    let dial = session.dial();
    // A key nobody sets: the WAIT ends only when the store closes.
    let closed = async {
        let key = crate::keys::JobKeys::never_set(&plan.run_id);
        match dial.connect().await {
            Ok(mut c) => c.wait(std::slice::from_ref(&key)).await.is_err(),
            Err(_) => true,
        }
    };
    match until_stop(events, plan, tokio::time::timeout(plan.join_timeout, closed)).await {
        Ok(Ok(true)) => {}
        Ok(_) => {
            tracing::error!(
                limit_s = plan.join_timeout.as_secs_f64(),
                "in-place restarts: the previous containers' store did not close within the join timeout"
            );
            return Err(exit::PEER_LOST);
        }
        Err(sig) => return Err(exit::for_signal(sig)),
    }
    // Its host's container restarts: a moment before the new store listens.
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Its host announced the job's end as it left (`JOB_ENDED`): that is
    // the previous containers' job, already read, not the end of this one.
    tracing::info!("in-place restarts: the previous containers' store closed; joining its host's new store");
    rejoin(session, plan, events, cancel).await
}
