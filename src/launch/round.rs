//! One round as the job side of an attempt ([`RoundPods`]), how the pods
//! agree on what happened once its workers are gone ([`stop_sync`]), and
//! the wait for a lost store to come back ([`reconnect`]).

use round::host_left::{AfterLoss, Announced, Rejoin, after_loss};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::finish::Stalled;
use super::wait::until_stop;
use crate::config::Plan;
use crate::config::rules::RuleAction;
use crate::exit;
use crate::process::signals::SysEvent;
use crate::rendezvous::{self, Round, STOP_SYNC_MARGIN, Session};
use crate::stacks::stall::judge;
use crate::supervise::attempt::Pods;
use crate::supervise::policy::{RoundFacts, Verdict};
use crate::supervise::report::Failure;
use crate::supervise::round_end::RoundEnd;

/// Longest the loss of the store waits for the watch of the store host's
/// "leaving" announcement to settle (it ends as the connection does).
const HOST_LEFT_SETTLE: std::time::Duration = std::time::Duration::from_secs(1);

/// Report our workers gone, wait for the others (or a death verdict), and
/// gather what every pod needs to decide the same way; for a round that
/// hung, who the others waited for, from every pod's stacks.
pub(super) async fn stop_sync(
    session: &mut Session,
    round: &Round,
    (plan, restarts): (&Plan, u32),
    failures: &[Failure],
) -> std::result::Result<(RoundFacts, Vec<Failure>, Option<RoundEnd>, Option<Stalled>), rendezvous::Error> {
    session.report_stopped(round, failures).await?;
    let limit = plan.grace + plan.kill_timeout + STOP_SYNC_MARGIN;
    let stopped = session.wait_stopped(round, limit).await?;
    let all = if stopped.all_stopped || stopped.dead { session.failures(round).await? } else { failures.to_vec() };
    let end = session.round_end(round.number).await?;
    let facts = RoundFacts {
        end: end.as_ref().map(RoundEnd::job_end),
        dead: stopped.dead,
        all_stopped: stopped.all_stopped,
        fatal: all.iter().any(|f| f.action == RuleAction::Fail),
        unkillable: all.iter().any(|f| f.hung),
        restarts,
        max_restarts: plan.max_restarts,
    };
    let stalled = if end.as_ref().is_some_and(RoundEnd::is_hang) { Some(stalled(session, round).await?) } else { None };
    if let Some(s) = stalled.as_ref().filter(|_| plan.serve_store) {
        crate::events::global().emit(crate::events::Event {
            type_: crate::events::Type::Warning,
            reason: "JobHung",
            action: "StopWorkers",
            note: format!("the job hung in round {}: {}", round.number, s.stall.summary),
        });
    }
    let mut all = all;
    if let Some(s) = &stalled {
        // Every consumer of the failure (the termination message, the
        // TrainJob's status, a served run's record) says who, and where.
        for f in all.iter_mut().filter(|f| f.no_progress || f.hung) {
            f.stall = Some(s.stall.summary.clone());
        }
    }
    Ok((facts, all, end, stalled))
}

/// Most ranks whose innermost frame is logged at a stall.
const RANKS_LOGGED: usize = 64;

/// Every pod's stacks of a round that hung, judged and logged.
async fn stalled(session: &mut Session, round: &Round) -> std::result::Result<Stalled, rendezvous::Error> {
    let mut stacks = session.stacks(round).await?;
    stacks.sort_by_key(|r| r.rank);
    let stall = judge(&stacks);
    tracing::error!(round = round.number, stalled_ranks = ?stall.stalled_ranks, "the job hung: {}", stall.summary);
    for r in stacks.iter().take(RANKS_LOGGED) {
        let main = r.stacks.threads.first();
        let at = main.and_then(|t| t.python.first()).map(ToString::to_string);
        let native = main.and_then(|t| t.native.first()).and_then(|n| n.function.clone());
        tracing::info!(
            rank = r.rank,
            host = %r.host,
            pid = r.stacks.pid,
            at = at.as_deref().or(r.stacks.note.as_deref()).unwrap_or("?"),
            native = native.as_deref(),
            kernel = main.map(|t| t.kernel.as_str()),
            "stack at the hang"
        );
    }
    Ok(Stalled { round: round.number, stall, stacks })
}

/// The rendezvous session as the job side of one attempt.
pub(super) struct RoundPods<'a> {
    pub session: &'a mut Session,
    pub round: &'a Round,
}

impl Pods for RoundPods<'_> {
    type Error = rendezvous::Error;

    fn round(&self) -> u64 {
        self.round.number
    }

    fn watch_end(&self) -> impl std::future::Future<Output = Option<RoundEnd>> + Send + 'static {
        self.session.watch_end(self.round.number)
    }

    fn host_left(&self) -> Option<String> {
        self.session.host_left()
    }

    async fn publish_failure(&mut self, fatal: bool, hang: bool) -> std::result::Result<(), rendezvous::Error> {
        self.session.publish_failure(self.round.number, fatal, hang).await
    }

    async fn publish_stacks(&mut self, json: Vec<u8>, dumped: bool) -> std::result::Result<(), rendezvous::Error> {
        self.session.publish_stacks(self.round, &json, dumped).await
    }

    async fn wait_stacks(
        &mut self,
        dumped: bool,
        limit: std::time::Duration,
    ) -> std::result::Result<bool, rendezvous::Error> {
        self.session.wait_stacks(self.round, dumped, limit).await
    }

    async fn publish_abort(&mut self, signal: i32) -> std::result::Result<(), rendezvous::Error> {
        self.session.publish_abort(self.round.number, signal).await
    }

    async fn publish_local_done(&mut self) -> std::result::Result<(), rendezvous::Error> {
        self.session.publish_local_done(self.round).await
    }
}

/// The store went away: reconnect until the join deadline (the store host
/// restarting). Err(exit code) when it does not come back or we are stopped.
/// `before_any_round`: this pod of an in-place job has run no round since
/// its container started, so a failed job's end its host announced is the
/// previous containers' (their store, reached before it closed), not this
/// pod's: it rejoins.
pub(super) async fn reconnect(
    session: &mut Session,
    plan: &Plan,
    events: &mut UnboundedReceiver<SysEvent>,
    cancel: &CancellationToken,
    (cause, before_any_round): (&str, bool),
) -> std::result::Result<(), u8> {
    let timeout_s = plan.join_timeout.as_secs_f64();
    let why = session.host_left_settled(HOST_LEFT_SETTLE).await;
    // The job's end its host announced, and whether it succeeded.
    let ended = why
        .as_deref()
        .and_then(|w| w.strip_prefix(rendezvous::JOB_ENDED))
        .map(|verdict| verdict.is_empty() || verdict.parse::<Verdict>().is_ok_and(|v| v == Verdict::Success));
    let announced = match (&why, ended) {
        (_, Some(success)) => Announced::JobEnded { success },
        (Some(_), None) => Announced::LeftCleanly,
        (None, None) => Announced::Nothing,
    };
    let said = why.as_deref().unwrap_or_default();
    match after_loss(announced, before_any_round) {
        AfterLoss::Rejoin(Rejoin::PreviousContainers) => tracing::info!(
            store_host = %said,
            timeout_s,
            "in-place restarts: the store that closed held the previous containers' job; joining its host's new store"
        ),
        // The job is over (a spare waiting between rounds hears it here).
        AfterLoss::Leave { success } => {
            tracing::info!(
                verdict = said.trim_start_matches(rendezvous::JOB_ENDED),
                "the job ended while this pod waited; leaving"
            );
            return Err(if success { exit::SUCCESS } else { exit::PEER_LOST });
        }
        AfterLoss::Rejoin(Rejoin::HostLeftCleanly) => tracing::warn!(
            store_host = %said,
            timeout_s,
            "the store host left the job cleanly; waiting for it (or its replacement) to come back"
        ),
        AfterLoss::Rejoin(Rejoin::Lost) => tracing::error!(
            error = %cause,
            timeout_s,
            "lost the rendezvous store; waiting for the store host to come back"
        ),
    }
    rejoin(session, plan, events, cancel).await
}

/// Reconnect to the rendezvous store until the join deadline, whatever its
/// host announced as it left (the caller weighed that). Err(exit code)
/// when it does not come back or we are stopped.
pub(super) async fn rejoin(
    session: &mut Session,
    plan: &Plan,
    events: &mut UnboundedReceiver<SysEvent>,
    cancel: &CancellationToken,
) -> std::result::Result<(), u8> {
    let deadline = Instant::now() + plan.join_timeout;
    match until_stop(events, plan, session.reconnect(deadline, cancel)).await {
        Ok(Ok(())) => {
            tracing::info!("reconnected to the rendezvous store; rejoining");
            Ok(())
        }
        Ok(Err(e)) => {
            tracing::error!(error = %crate::error::error_chain(&e), "the store host did not come back before the join deadline");
            Err(e.exit_code().max(exit::PEER_LOST))
        }
        Err(sig) => Err(exit::for_signal(sig)),
    }
}
