//! `trainlet run`: store, rendezvous, attempts, exit code.
//!
//! Owns the flow of one pod's agent: serve the store (and the per-round
//! worker stores and liveness monitor) if this pod hosts it, join the
//! rendezvous, then per round: spawn and supervise workers, stop them when
//! the round ends anywhere, agree with the other pods on a verdict, and
//! regroup, restart or exit. A lost store is waited for (its host restarts)
//! up to the join deadline. Must not parse flags or env (that
//! is `config`) nor decide policy (that is `supervise::policy`).

use std::time::Duration;

use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::{Env, Framework, Plan};
use crate::exit;
use crate::process::signals::SysEvent;
use crate::process::spawn::Spawner;
use crate::rendezvous::{self, Joined, Known, Member, Session, Timing};
use crate::serve::board::State as RunState;
use crate::supervise::attempt::run_attempt;
use crate::supervise::carry::Carry;
use crate::supervise::policy::{Outcome, Verdict, backoff, verdict};
use crate::supervise::report::{Failure, RoundRecord, root_cause};
use crate::supervise::worker::WorldView;
use crate::sys;
use finish::{check_writable, fail_code, forget_logs, log_root, record, report};
use round::{RoundJob, reconnect, stop_sync};

mod finish;
mod hosting;
mod inplace;
mod pmi;
mod progress;
mod replicas;
mod round;
mod serve;
mod setup;
mod tracker;

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

/// Bound on a last store write made while exiting.
const PUBLISH_WAIT: Duration = Duration::from_secs(2);
/// How long the store host waits for the other pods to read the outcome.
const LEAVE_WAIT: Duration = Duration::from_secs(10);
/// Longest the loss of the store waits for the watch of the store host's
/// "leaving" announcement to settle (it ends as the connection does).
const HOST_LEFT_SETTLE: Duration = Duration::from_secs(1);
/// Extra time, beyond grace and kill timeout, for other pods to report stopped.
const STOP_SYNC_MARGIN: Duration = Duration::from_secs(10);
/// Most time between two restarts, whatever --restart-backoff says.
const BACKOFF_CAP: Duration = Duration::from_secs(300);
/// How often the GPUs are sampled for metrics.
const METRICS_EVERY: Duration = Duration::from_secs(5);

/// Run the job described by `plan`; returns trainlet's exit code.
pub async fn run(plan: Plan, events: UnboundedReceiver<SysEvent>, cancel: CancellationToken) -> Result<u8> {
    match plan.in_place.clone() {
        Some(cfg) => inplace::run(cfg, plan, events, cancel).await,
        None => run_job(plan, events, None, cancel).await,
    }
}

async fn run_job(
    mut plan: Plan,
    mut events: UnboundedReceiver<SysEvent>,
    in_place: Option<&mut crate::inplace::InPlaceAgent>,
    cancel: CancellationToken,
) -> Result<u8> {
    let spawner = Spawner::start().map_err(Error::Os)?;
    let env = Env::from_process();
    if let Some(addr) = plan.gpu.metrics_addr {
        crate::metrics::serve(addr, cancel.child_token())
            .await
            .map_err(|e| Error::Config(crate::config::Error::Usage(crate::error::error_chain(&e))))?;
    }
    if let Some(code) = preflight(&mut plan, &spawner).await {
        return Ok(code);
    }
    // The imports overlap the rendezvous: started before the pod joins.
    let zygote = match &plan.preload {
        Some(p) => Some(crate::supervise::zygote::Zygote::start(&spawner, &p.python, &p.modules).await),
        None => None,
    };
    // Stopped (its NVML child killed) when `run` returns.
    let _sampler = (plan.gpu.metrics_addr.is_some() && !plan.gpu.gpus.is_empty()).then(|| {
        crate::metrics::sample_gpus(spawner.clone(), plan.gpu.gpus.clone(), METRICS_EVERY, plan.gpu.nvml_timeout)
    });
    crate::process::oom::warn_if_group_kill(&plan.gpu.root);
    let log_root = log_root(&plan);
    // Checked before anything starts: with --log-dir, an unwritable
    // directory is a configuration error; without it, worker files are off
    // and every stream goes to the console (one warning, no line lost).
    let files_ok = match check_writable(&log_root) {
        Ok(()) => true,
        Err(e) => {
            if let Some(dir) = &plan.output.log_dir {
                return Err(Error::Config(crate::config::Error::Usage(format!(
                    "--log-dir {}: cannot write worker logs under {} ({e}); give a writable directory (an emptyDir volume) or drop --log-dir",
                    dir.display(),
                    log_root.display()
                ))));
            }
            tracing::warn!(
                dir = %log_root.display(),
                error = %e,
                "cannot write worker logs, error files or the failure report under the temporary directory; worker output goes to the console only"
            );
            false
        }
    };
    let timing =
        Timing { last_call: plan.last_call, heartbeat: plan.heartbeat, heartbeat_timeout: plan.heartbeat_timeout };

    // JobSet's barrier: every pod wrote the same in-place restart attempt.
    if let Some(code) = inplace::barrier(in_place, &mut events, &plan).await? {
        return Ok(code);
    }
    // Serve mode's agents' store asks every connection for the control token.
    let token_file = serve::token_file(&plan)?;
    let guard = token_file.as_deref().map(crate::store::Guard::new);
    // The agents' store (and the rounds' worker stores), when this pod hosts it.
    let (control, endpoint) = hosting::host_store(&plan, guard.as_ref(), timing, &cancel)?;
    // The store host's own dial of its store (loopback).
    let host_dial = control.as_ref().map(|_| crate::store::Dial {
        addr: std::net::SocketAddr::from(([127, 0, 0, 1], endpoint.port)),
        guard: guard.clone(),
    });
    let lighthouse = host_dial.clone().and_then(|d| replicas::start(&plan, &spawner, d, &cancel));
    let master_addr = if plan.standalone { endpoint.host.clone() } else { plan.endpoint.host.clone() };

    let me = Member {
        uid: String::new(),
        host: plan.output.host.clone(),
        pid: std::process::id(),
        node_rank: plan.node_rank,
        nproc: plan.nproc,
        min_nodes: plan.min_nodes,
        max_nodes: plan.nnodes,
        max_restarts: plan.max_restarts,
    };
    let deadline = Instant::now() + plan.join_timeout;
    let rdzv_id = plan.rdzv_id();
    let connect = Session::connect((&endpoint, guard), &rdzv_id, plan.jobset_attempt, me, timing, deadline, &cancel);
    let mut session = match until_stop(&mut events, &plan, connect).await {
        Ok(Ok(s)) => s,
        Ok(Err(e @ rendezvous::Error::Stale { .. })) => {
            tracing::error!(error = %e, "rejected: pod of an older JobSet restart attempt");
            replicas::stop(lighthouse).await;
            return Err(e.into());
        }
        Ok(Err(e)) => {
            replicas::stop(lighthouse).await;
            return Err(e.into());
        }
        Err(sig) => {
            replicas::stop(lighthouse).await;
            return Ok(exit::for_signal(sig));
        }
    };
    tracing::info!(
        %endpoint,
        node_rank = plan.node_rank,
        nnodes = %plan.nnodes_spec(),
        replica_group = ?plan.groups.as_ref().map(|g| g.group),
        job_node_rank = ?plan.groups.as_ref().map(|g| g.job_node_rank),
        uid = %session.me().uid,
        "joined the rendezvous"
    );

    let mut lighthouse_url =
        match replicas::address(&plan, (&session.dial(), &endpoint), plan.join_timeout, &mut events).await {
            Ok(url) => url,
            Err(Ok(e)) => {
                session.bye().await;
                replicas::stop(lighthouse).await;
                return Err(e.into());
            }
            Err(Err(sig)) => {
                session.bye().await;
                replicas::stop(lighthouse).await;
                return Ok(exit::for_signal(sig));
            }
        };
    let progress = progress::Progress::start(&plan, &log_root, session.dial(), &cancel).await;
    let mut served = serve::Served::start(&plan, (session.dial(), &spawner), token_file, &cancel).await?;
    let mut known = Known::default();
    let mut history: Vec<Failure> = Vec::new();
    let mut rounds: Vec<RoundRecord> = Vec::new();
    // An actor's workers kept from one round to the next (survivors mode).
    let mut carry = Carry::default();
    // What ended the job on this pod, when not a code of its own: a stop
    // signal (the pod is going away) or an error of the rendezvous.
    let mut stop_sig: Option<i32> = None;
    let mut failed: Option<Error> = None;
    let code = loop {
        let deadline = Instant::now() + plan.join_timeout;
        let waited = Instant::now();
        let next = serve::kept_until(session.next_round(&mut known, deadline), &mut carry, served.as_mut(), plan.grace);
        let round = match until_stop(&mut events, &plan, next).await {
            Ok(Ok(Joined::Round(r))) => {
                crate::metrics::global().rendezvous.observe(waited.elapsed().as_secs_f64());
                r
            }
            Ok(Ok(Joined::JobEnded(v)))
                if plan.in_place.is_some() && known.round.is_none() && v != Verdict::Success =>
            {
                match inplace::outwait_stale_store(&mut session, &plan, v, &mut events, &cancel).await {
                    Ok(()) => continue,
                    Err(code) => break code,
                }
            }
            Ok(Ok(Joined::JobEnded(v))) => {
                tracing::info!(verdict = %v, "the job ended while this pod waited as a spare");
                break if v == Verdict::Success { exit::SUCCESS } else { exit::PEER_LOST };
            }
            Ok(Err(rendezvous::Error::Lost { source, .. })) => {
                match reconnect(&mut session, &plan, &mut events, &cancel, &crate::error::error_chain(&source)).await {
                    Ok(()) => continue,
                    Err(code) => break code,
                }
            }
            Ok(Err(e @ rendezvous::Error::Mismatch(_))) => {
                // Every member reads the same assignment; the store host
                // lingers a moment so that all of them can.
                if plan.serve_store {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                let code = e.exit_code();
                failed = Some(e.into());
                break code;
            }
            Ok(Err(e)) => {
                session.bye().await;
                let code = e.exit_code();
                failed = Some(e.into());
                break code;
            }
            Err(sig) => {
                if plan.serve_store {
                    let why = format!("stopped by {}", sys::signal_name(sig));
                    session.announce_leaving(&why).await;
                    replicas::announce_leaving(&plan, &session.dial(), &why).await;
                }
                session.withdraw().await;
                session.bye().await;
                stop_sig = Some(sig);
                break exit::for_signal(sig);
            }
        };
        // Serve mode: this round runs the current run (its plan), or waits idle.
        let (run_plan, idle) = match served.as_mut() {
            Some(sv) => match sv.work((&session, &round), &mut events, &mut carry, &plan).await {
                serve::Work::Run => (Some(sv.plan_for(&plan)), None),
                serve::Work::Idle(o) => (Some(sv.idle_plan(&plan)), Some(o)),
                serve::Work::Shutdown => {
                    let _ = session.leave(&round, plan.serve_store, LEAVE_WAIT).await;
                    session.bye().await;
                    break exit::SUCCESS;
                }
            },
            None => (None, None),
        };
        let plan = run_plan.as_ref().unwrap_or(&plan);
        let base_restarts = served.as_ref().map_or(0, serve::Served::base_restarts);
        let restarts = round.restarts.saturating_sub(base_restarts);
        let (outcome, failures) = if let Some(o) = idle {
            carry.kill("the pods are idle");
            crate::process::sweep::between_rounds("the pods are idle");
            (o, Vec::new())
        } else {
            replicas::register(plan, &session.dial(), &session.heartbeat_key()).await;
            replicas::refresh(plan, &session.dial(), &mut lighthouse_url).await;
            tracing::info!(
                round = round.number,
                group_rank = round.group_rank,
                nnodes = round.nnodes,
                world_size = round.nnodes * plan.nproc,
                restarts_used = restarts,
                restarts_left = plan.max_restarts.saturating_sub(restarts),
                master_addr = %master_addr,
                master_port = round.worker_port,
                "starting workers"
            );
            let pmi = (plan.framework == Framework::Mpi).then(|| pmi::start(&session, &round, plan));
            let world = WorldView {
                plan,
                master_addr: &master_addr,
                master_port: round.worker_port,
                aux_port: round.aux_port,
                restarts,
                status: progress.link(),
                tap: served.as_ref().and_then(serve::Served::tap),
                unstartable: served
                    .as_ref()
                    .and_then(serve::Served::unstartable)
                    .or_else(|| pmi.as_ref().and_then(|p| p.as_ref().err()).map(String::as_str)),
                zygote: zygote.as_ref(),
                survivors: served.as_ref().and_then(serve::Served::survivors),
                lighthouse: lighthouse_url.as_deref(),
                pmi: pmi.as_ref().and_then(|p| p.as_ref().ok()),
                group_rank: round.group_rank,
                nnodes: round.nnodes,
            };
            let mut xgb_tracker = None;
            if plan.framework == Framework::Xgboost {
                match until_stop(&mut events, plan, tracker::prepare(&mut session, &round, plan, &spawner)).await {
                    Ok(t) => xgb_tracker = t,
                    Err(sig) => {
                        let _ = tokio::time::timeout(PUBLISH_WAIT, session.publish_abort(round.number, sig)).await;
                        session.bye().await;
                        stop_sig = Some(sig);
                        break exit::for_signal(sig);
                    }
                }
            }
            progress.round(&round, plan.nproc);
            if let Some(sv) = &served {
                sv.started(&round, restarts, plan.nproc);
            }
            let attempt_dir = log_root.join(format!("attempt_{}", round.number));
            let ended = run_attempt(
                &world,
                (&attempt_dir, files_ok),
                (&spawner, &mut carry),
                &env,
                &mut events,
                &mut RoundJob { session: &mut session, round: &round },
            )
            .await;
            if let Some(t) = xgb_tracker {
                t.stop(ended.0 == Outcome::Succeeded).await;
            }
            ended
        };
        progress.flush().await;
        if let Some(sv) = &served {
            sv.flush().await;
        }
        tracing::info!(round = round.number, ?outcome, local_failures = failures.len(), "round over on this pod");

        if let Outcome::Stopped(sig) = outcome {
            stop_sig = Some(sig);
            if plan.serve_store {
                let why = format!("stopped by {}", sys::signal_name(sig));
                session.announce_leaving(&why).await;
                replicas::announce_leaving(plan, &session.dial(), &why).await;
            }
            // Tell the others our workers are gone, so they regroup at once;
            // the store host keeps the store up a moment for them.
            let _ = tokio::time::timeout(PUBLISH_WAIT, session.report_stopped(&round, &failures)).await;
            if plan.serve_store {
                let _ = session.wait_stopped(&round, Duration::from_secs(3)).await;
            }
            history.extend(failures.iter().cloned());
            rounds.push(record(&round, "stopped by signal", "exit"));
            session.bye().await;
            let code = exit::for_signal(sig);
            if !history.is_empty() {
                report(
                    plan,
                    &log_root,
                    (code, format!("trainlet received {}", sys::signal_name(sig)), None),
                    &history,
                    &rounds,
                );
            }
            break code;
        }
        let synced = if outcome == Outcome::Lost {
            Err(None)
        } else {
            stop_sync(&mut session, &round, (plan, restarts), &failures).await.map_err(Some)
        };
        let (facts, all_failures, end) = match synced {
            Ok(x) => x,
            Err(e) => {
                let cause = e.map_or_else(
                    || "the store connection broke while the workers ran".into(),
                    |e| crate::error::error_chain(&e),
                );
                if let Some(sv) = &served {
                    sv.round_over(round.number, &failures, &cause);
                }
                rounds.push(record(&round, "store lost", "regroup"));
                history.extend(failures.iter().cloned());
                match reconnect(&mut session, plan, &mut events, &cancel, &cause).await {
                    Ok(()) => continue,
                    Err(code) => break code,
                }
            }
        };
        history.extend(all_failures.iter().cloned());
        if let Some(sv) = &served {
            sv.round_over(round.number, &all_failures, &end);
        }
        let proposal = verdict(&facts);
        let agreed = match session.decide(round.number, proposal).await {
            Ok(v) => v,
            Err(e) => match reconnect(&mut session, plan, &mut events, &cancel, &crate::error::error_chain(&e)).await {
                Ok(()) => continue,
                Err(code) => break code,
            },
        };
        // Kept workers go on only into a restart or regroup of their run.
        if !matches!(agreed, Verdict::Restart(_) | Verdict::Regroup) || end.starts_with("stop:") {
            carry.stop(plan.grace).await;
            if served.is_some() {
                crate::process::sweep::between_rounds("after the run's kept workers stopped");
            }
        }
        rounds.push(record(&round, &end, &agreed.to_string()));
        let root = root_cause(&all_failures);
        progress.failed(root);
        tracing::info!(
            round = round.number,
            end = %end,
            verdict = %agreed,
            dead = facts.dead,
            all_stopped = facts.all_stopped,
            failed_rank = root.map(|f| f.rank),
            restarts_used = facts.restarts,
            restarts_left = plan.max_restarts.saturating_sub(facts.restarts),
            "round decided"
        );
        match agreed {
            // A serving pod outlives every run's verdict, whatever phase it
            // was in when the round ended (a setup step cut short, idle):
            // only the control API or the idle timeout ends it.
            Verdict::Success if served.is_some() => {
                let world = round.nnodes * plan.nproc;
                if let Some(sv) = served.as_mut() {
                    sv.run_over(RunState::Succeeded, world, &all_failures, None).await;
                }
                (history, rounds) = (Vec::new(), Vec::new());
                let _ = session.finish_round(round.number).await;
            }
            Verdict::Success => {
                let _ = session.leave(&round, plan.serve_store, LEAVE_WAIT).await;
                session.bye().await;
                break exit::SUCCESS;
            }
            Verdict::Regroup => {
                if end.starts_with("stop:")
                    && let Some(sv) = served.as_mut()
                {
                    sv.run_over(RunState::Stopped, round.nnodes * plan.nproc, &all_failures, None).await;
                    (history, rounds) = (Vec::new(), Vec::new());
                }
                if session.finish_round(round.number).await.is_err() {
                    tracing::warn!("lost the store while moving to the next round");
                }
            }
            Verdict::Restart(n) => {
                known.restarts = n + base_restarts;
                crate::metrics::global().restarts.inc();
                let wait = backoff(plan.restart_backoff, n, BACKOFF_CAP);
                let (left, failed_rank) = (plan.max_restarts.saturating_sub(n), root.map(|f| f.rank));
                match plan.groups.as_ref().filter(|g| g.count > 1) {
                    Some(g) => tracing::warn!(
                        restart = n,
                        restarts_left = left,
                        backoff_s = wait.as_secs_f64(),
                        failed_rank,
                        replica_group = g.group,
                        "restarting this replica group's workers; the other groups go on"
                    ),
                    None => tracing::warn!(
                        restart = n,
                        restarts_left = left,
                        backoff_s = wait.as_secs_f64(),
                        failed_rank,
                        "restarting every pod's workers"
                    ),
                }
                let _ = session.finish_round(round.number).await;
                if !wait.is_zero()
                    && let Err(sig) = until_stop(&mut events, plan, tokio::time::sleep(wait)).await
                {
                    session.bye().await;
                    stop_sig = Some(sig);
                    break exit::for_signal(sig);
                }
            }
            Verdict::Fail(kind) => {
                let failed = fail_code(kind, &all_failures);
                let code = failed.0;
                let written = report(plan, &log_root, failed, &history, &rounds);
                if let Some(sv) = served.as_mut() {
                    sv.run_over(RunState::Failed, round.nnodes * plan.nproc, &all_failures, Some(&written)).await;
                    (history, rounds) = (Vec::new(), Vec::new());
                    let _ = session.finish_round(round.number).await;
                    continue;
                }
                let _ = session.leave(&round, plan.serve_store, LEAVE_WAIT).await;
                session.bye().await;
                break code;
            }
        }
    };
    carry.stop(plan.grace).await;
    progress.finish().await;
    // The store host of replica groups outlasts the other groups' pods,
    // unless it is being stopped.
    let code = match &host_dial {
        Some(d) if stop_sig.is_none() => match replicas::outlast_other_groups(&plan, d, &mut events).await {
            Ok(()) => code,
            Err(sig) => exit::for_signal(sig),
        },
        _ => code,
    };
    replicas::stop(lighthouse).await;
    if let Some(s) = control {
        s.shutdown().await;
    }
    forget_logs(&plan, &log_root, code);
    match failed {
        Some(e) => Err(e),
        None => Ok(code),
    }
}

/// Drive `fut` while honouring stop signals; Err(signal) if one came first.
async fn until_stop<F: std::future::Future>(
    events: &mut UnboundedReceiver<SysEvent>,
    plan: &Plan,
    fut: F,
) -> std::result::Result<F::Output, i32> {
    tokio::pin!(fut);
    loop {
        tokio::select! {
            out = &mut fut => return Ok(out),
            ev = events.recv() => match ev {
                Some(SysEvent::Signal(s)) if plan.stop_signals.contains(&s) => {
                    tracing::warn!(signal = %sys::signal_name(s), "stop signal before workers started; exiting");
                    return Err(s);
                }
                Some(SysEvent::StopAsked(s)) => return Err(s),
                Some(SysEvent::Exited { pid, exit, .. }) => tracing::debug!(pid, %exit, "reaped orphan"),
                Some(SysEvent::Signal(_)) => {}
                None => return Err(libc::SIGTERM),
            },
        }
    }
}

/// Pre-flight GPU checks; the exit code of the first failure, if any.
/// The NVML report, when there is one, fills what sysfs left out.
async fn preflight(plan: &mut Plan, spawner: &Spawner) -> Option<u8> {
    if plan.gpu.checks.is_empty() {
        return None;
    }
    let (g, sp) = (plan.gpu.clone(), spawner.clone());
    let verdicts = match tokio::task::spawn_blocking(move || crate::gpu::setup::preflight(&g, &sp)).await {
        Ok((v, report)) => {
            if let Ok(r) = &report {
                crate::gpu::setup::enrich(&mut plan.gpu.gpus, r);
            }
            v
        }
        Err(e) => {
            tracing::error!(error = %e, "pre-flight checks panicked");
            return Some(exit::INTERNAL);
        }
    };
    for v in &verdicts {
        tracing::debug!(check = %v.check, status = ?v.status, "pre-flight");
    }
    let (code, msg) = crate::gpu::preflight::first_failure(&verdicts)?;
    tracing::error!(code, "{msg}");
    Some(code)
}
