//! `trainlet run`: store, rendezvous, attempts, exit code.
//!
//! Owns the flow of one pod's agent: serve the store if this pod hosts it,
//! join the rendezvous, then per attempt: a fresh worker store (store host),
//! agree on the world, spawn and supervise workers, learn how the attempt
//! ended everywhere, and restart or exit. Must not parse flags or env (that
//! is `config`) nor decide policy (that is `supervise::policy`).

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{Env, Plan};
use crate::exit;
use crate::rendezvous::{self, NodeInfo, Session};
use crate::store::{Endpoint, StoreLoop};
use crate::supervise::output::{self, Sink};
use crate::supervise::policy::{Action, Attempt, Event, JobEnd, Next, Outcome, next_step};
use crate::supervise::report::{Failure, Report, root_cause};
use crate::supervise::signals::{SysEvent, now_us};
use crate::supervise::spawn::{Spawner, WorkerSpec, WorldView, substitute, worker_env};
use crate::sys::{self, Exit};
use crate::{Error, Result};

/// How long output drains may lag behind the last worker exit.
const DRAIN_WAIT: Duration = Duration::from_secs(2);
/// Bound on a last store write made while exiting.
const PUBLISH_WAIT: Duration = Duration::from_secs(2);
/// How long the store host waits for the other pods to read the outcome.
const LEAVE_WAIT: Duration = Duration::from_secs(10);
/// Extra time, beyond the grace period, for other pods to report stopped.
const STOP_SYNC_MARGIN: Duration = Duration::from_secs(30);

/// Run the job described by `plan`; returns trainlet's exit code.
pub async fn run(plan: Plan, mut events: UnboundedReceiver<SysEvent>, cancel: CancellationToken) -> Result<u8> {
    let spawner = Spawner::start().map_err(Error::Os)?;
    let env = Env::from_process();
    let log_root = log_root(&plan);

    // The agents' store, when this pod hosts it.
    let bind_ip: Option<IpAddr> = plan.standalone.then_some(IpAddr::from([127, 0, 0, 1]));
    let store_loop = if plan.serve_store { Some(StoreLoop::start().map_err(Error::Os)?) } else { None };
    let control = if let Some(lp) = &store_loop {
        let server = lp.serve(bind_ip, plan.endpoint.port, cancel.child_token())?;
        tracing::info!(addr = %server.local_addr(), "serving the rendezvous store");
        Some(server)
    } else {
        None
    };
    // The store host dials its own store on loopback: its own DNS record may
    // not be published yet (headless services publish late). Workers get the
    // address every pod can reach.
    let endpoint = match &control {
        Some(s) => Endpoint { host: "127.0.0.1".into(), port: s.local_addr().port() },
        None => plan.endpoint.clone(),
    };
    let master_addr = if plan.standalone { endpoint.host.clone() } else { plan.endpoint.host.clone() };

    let me = NodeInfo {
        node_rank: plan.node_rank,
        nnodes: plan.nnodes,
        nproc: plan.nproc,
        max_restarts: plan.max_restarts,
        host: plan.host.clone(),
        pid: std::process::id(),
    };
    let deadline = Instant::now() + plan.join_timeout;
    let joined = until_stop(&mut events, &plan, Session::join(&endpoint, &plan.run_id, me, deadline, &cancel)).await;
    let mut session = match joined {
        Ok(s) => s?,
        Err(sig) => return Ok(exit::for_signal(sig)),
    };
    tracing::info!(%endpoint, node_rank = plan.node_rank, nnodes = plan.nnodes, "joined the rendezvous");

    let mut history: Vec<Failure> = Vec::new();
    let mut attempt = 0u32;
    loop {
        let worker_store = match &store_loop {
            Some(lp) => Some(lp.serve(bind_ip, 0, cancel.child_token())?),
            None => None,
        };
        let deadline = Instant::now() + plan.join_timeout;
        let port = worker_store.as_ref().map(|s| s.local_addr().port());
        let master_port = match until_stop(&mut events, &plan, session.attempt(attempt, port, deadline)).await {
            Ok(Ok(p)) => p,
            Ok(Err(e @ rendezvous::Error::Mismatch(_))) => {
                // Every pod sees the same announcements and fails the same
                // way; the store host keeps the store up until all have read them.
                let _ = session.leave(attempt, plan.serve_store, LEAVE_WAIT).await;
                return Err(e.into());
            }
            Ok(Err(e)) => return Err(e.into()),
            Err(sig) => {
                // Tell the pods we were meeting with, so they do not wait for us.
                let _ = tokio::time::timeout(PUBLISH_WAIT, session.publish_abort(attempt, sig)).await;
                return Ok(exit::for_signal(sig));
            }
        };
        tracing::info!(attempt, master_addr = %master_addr, master_port, world_size = plan.world_size(), "starting workers");
        let world = WorldView { plan: &plan, master_addr: &master_addr, master_port, attempt };
        let attempt_dir = log_root.join(format!("attempt_{attempt}"));
        let (outcome, failures) = run_attempt(&world, &attempt_dir, &spawner, &env, &mut events, &mut session).await;
        tracing::info!(attempt, ?outcome, local_failures = failures.len(), "attempt over on this pod");

        // Everyone reports; the store host keeps both stores up until all
        // pods' workers are gone.
        let reported = session.report_stopped(attempt, &failures).await;
        let limit = match outcome {
            Outcome::Stopped(_) if plan.serve_store => Duration::from_secs(3),
            Outcome::Stopped(_) => Duration::ZERO,
            _ => plan.grace + STOP_SYNC_MARGIN,
        };
        let all_stopped = match reported {
            Ok(()) if !limit.is_zero() => session.wait_all_stopped(attempt, limit).await.unwrap_or(false),
            _ => false,
        };
        let attempt_failures =
            if all_stopped { session.failures(attempt).await.unwrap_or(failures.clone()) } else { failures };
        history.extend(attempt_failures.iter().cloned());
        if let Some(ws) = worker_store {
            ws.shutdown().await;
        }

        let next = if outcome == Outcome::Failed && !all_stopped {
            Next::Exit
        } else {
            next_step(outcome, attempt, plan.max_restarts)
        };
        match next {
            Next::Restart(n) => {
                let root = root_cause(&attempt_failures);
                tracing::warn!(
                    attempt = n,
                    restarts_left = plan.max_restarts - n,
                    failed_rank = root.map(|f| f.rank),
                    "restarting every pod's workers"
                );
                attempt = n;
            }
            Next::Exit => {
                let (code, reason) = exit_code(outcome, all_stopped, &attempt_failures);
                if code != exit::SUCCESS {
                    report(&plan, &log_root, code, reason, &attempt_failures, &history);
                }
                if all_stopped {
                    let _ = session.leave(attempt, plan.serve_store, LEAVE_WAIT).await;
                }
                if let Some(s) = control {
                    s.shutdown().await;
                }
                return Ok(code);
            }
        }
    }
}

fn exit_code(outcome: Outcome, all_stopped: bool, failures: &[Failure]) -> (u8, String) {
    match outcome {
        Outcome::Succeeded => (exit::SUCCESS, "success".into()),
        Outcome::Stopped(sig) => (exit::for_signal(sig), format!("trainlet received {}", sys::signal_name(sig))),
        Outcome::Failed => match root_cause(failures) {
            Some(f) => (exit::for_worker(f.exit()), format!("worker rank {} failed with {}", f.rank, f.exit())),
            None if !all_stopped => (exit::PEER_LOST, "a worker failed and not every pod reported back".into()),
            None => (exit::PEER_LOST, "the job failed on a pod that reported no failure".into()),
        },
        Outcome::PeerLost => (exit::PEER_LOST, "a peer pod left or the store became unreachable".into()),
    }
}

fn report(plan: &Plan, log_root: &Path, code: u8, reason: String, last: &[Failure], history: &[Failure]) {
    let report = Report {
        run_id: plan.run_id.clone(),
        script: plan.entry.script.clone(),
        node_rank: plan.node_rank,
        exit_code: code,
        reason,
        root_cause: root_cause(last).or_else(|| root_cause(history)).cloned(),
        failures: history.to_vec(),
    };
    let path = log_root.join("failure_report.json");
    match report.write(&path) {
        Ok(()) => eprintln!("trainlet: failure report written to {}", path.display()),
        Err(e) => tracing::error!(path = %path.display(), error = %e, "cannot write the failure report"),
    }
    eprint!("{}", report.summary());
}

/// `<log_dir>/<run_id>_<pid>`, torchrun's layout; a temp dir when no --log-dir.
fn log_root(plan: &Plan) -> PathBuf {
    let base = plan.log_dir.clone().unwrap_or_else(|| std::env::temp_dir().join("trainlet"));
    base.join(format!("{}_{}", plan.run_id, std::process::id()))
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
                Some(SysEvent::Exited { pid, exit, .. }) => tracing::debug!(pid, %exit, "reaped orphan"),
                Some(SysEvent::Signal(_)) => {}
                None => return Err(libc::SIGTERM),
            },
        }
    }
}

struct Worker {
    pid: i32,
    rank: u32,
    error_file: PathBuf,
}

/// Spawn this pod's workers for one attempt and supervise them to the end.
async fn run_attempt(
    world: &WorldView<'_>,
    dir: &Path,
    spawner: &Spawner,
    env: &Env,
    events: &mut UnboundedReceiver<SysEvent>,
    session: &mut Session,
) -> (Outcome, Vec<Failure>) {
    let plan = world.plan;
    let attempt = world.attempt;
    let mut core = Attempt::new(plan.nproc);
    let mut workers: HashMap<u32, Worker> = HashMap::new();
    let mut by_pid: HashMap<i32, u32> = HashMap::new();
    let drains = TaskTracker::new();
    let mut early: Vec<Event> = Vec::new();

    for local_rank in 0..plan.nproc {
        let rank = plan.node_rank * plan.nproc + local_rank;
        let rank_dir = dir.join(local_rank.to_string());
        if let Err(e) = std::fs::create_dir_all(&rank_dir) {
            tracing::warn!(dir = %rank_dir.display(), error = %e, "cannot create the worker log directory");
        }
        let error_file = rank_dir.join("error.json");
        let spec = WorkerSpec {
            program: plan.entry.program.clone(),
            args: substitute(&plan.entry.args, local_rank),
            env: worker_env(world, local_rank, &error_file.display().to_string(), env),
        };
        match spawner.spawn(spec).await {
            Ok(sp) => {
                let prefix = output::prefix(&plan.prefix_template, &plan.role, local_rank, rank, &plan.host);
                let shown = plan.console_ranks.as_ref().is_none_or(|r| r.contains(&local_rank));
                let (red_out, red_err) = plan.redirects.for_rank(local_rank);
                let (tee_out, tee_err) = plan.tee.for_rank(local_rank);
                let files = plan.log_dir.is_some();
                for (fd, is_err, redirected, teed, name) in [
                    (sp.stdout, false, red_out, tee_out, "stdout.log"),
                    (sp.stderr, true, red_err, tee_err, "stderr.log"),
                ] {
                    let sink = Sink {
                        prefix: prefix.clone(),
                        console: shown && (teed || !redirected),
                        file: (files || redirected || teed).then(|| rank_dir.join(name)),
                        is_err,
                    };
                    drains.spawn(output::drain(fd, sink));
                }
                by_pid.insert(sp.pid, local_rank);
                workers.insert(local_rank, Worker { pid: sp.pid, rank, error_file });
            }
            Err(e) => {
                let code = match &e {
                    crate::supervise::spawn::SpawnError::Exec { source, .. }
                        if source.kind() == std::io::ErrorKind::PermissionDenied =>
                    {
                        exit::WORKER_NOT_EXECUTABLE
                    }
                    _ => exit::WORKER_NOT_FOUND,
                };
                tracing::error!(local_rank, error = %crate::store::error_chain(&e), "cannot start worker");
                workers.insert(local_rank, Worker { pid: 0, rank, error_file });
                early.push(Event::WorkerExited { local_rank, exit: Exit::Code(i32::from(code)), at_us: now_us() });
            }
        }
    }
    drains.close();

    let watch = session.watch_end(attempt);
    tokio::pin!(watch);
    let mut watching = true;
    let mut grace: Option<Instant> = None;
    let mut outcome = Outcome::PeerLost;
    let mut pending: std::collections::VecDeque<Event> = early.into();

    while !core.finished() {
        let event = if let Some(e) = pending.pop_front() {
            e
        } else {
            tokio::select! {
                ev = events.recv() => match ev {
                    Some(SysEvent::Exited { pid, exit, at_us }) => match by_pid.remove(&pid) {
                        Some(local_rank) => Event::WorkerExited { local_rank, exit, at_us },
                        None => {
                            tracing::debug!(pid, %exit, "reaped orphan");
                            continue;
                        }
                    },
                    Some(SysEvent::Signal(s)) if plan.stop_signals.contains(&s) => {
                        tracing::warn!(signal = %sys::signal_name(s), "stop signal; stopping workers");
                        Event::StopSignal(s)
                    }
                    Some(SysEvent::Signal(s)) if s == libc::SIGUSR1 || s == libc::SIGUSR2 => Event::ForwardSignal(s),
                    Some(SysEvent::Signal(_)) => continue,
                    None => Event::StopSignal(libc::SIGTERM),
                },
                end = &mut watch, if watching => {
                    watching = false;
                    if end == JobEnd::Lost {
                        tracing::error!("lost the rendezvous store; stopping workers");
                    }
                    Event::Job(end)
                }
                () = sleep_until_opt(grace), if grace.is_some() => {
                    grace = None;
                    tracing::warn!("grace period over; killing workers");
                    Event::GraceExpired
                }
            }
        };
        if let Event::WorkerExited { local_rank, exit, .. } = &event {
            tracing::info!(local_rank, %exit, "worker exited");
        }
        for action in core.handle(event) {
            let published = match action {
                Action::Signal(sig) => {
                    signal_alive(&core, &workers, sig);
                    Ok(())
                }
                Action::KillAll => {
                    signal_alive(&core, &workers, libc::SIGKILL);
                    Ok(())
                }
                Action::ArmGrace => {
                    grace = Some(Instant::now() + plan.grace);
                    Ok(())
                }
                Action::PublishFailure => session.publish_failure(attempt).await,
                Action::PublishAbort(sig) => session.publish_abort(attempt, sig).await,
                Action::PublishLocalDone => session.publish_local_done(attempt).await,
                Action::Finish(o) => {
                    outcome = o;
                    Ok(())
                }
            };
            if let Err(e) = published {
                tracing::error!(error = %e, "cannot reach the rendezvous store");
                pending.push_back(Event::Job(JobEnd::Lost));
            }
        }
    }

    // Processes a worker left in its group (daemons, grandchildren) go too.
    for w in workers.values() {
        sys::signal_group(w.pid, libc::SIGKILL);
    }
    if tokio::time::timeout(DRAIN_WAIT, drains.wait()).await.is_err() {
        tracing::warn!("worker output still open after the workers exited; no longer reading it");
    }

    let failures = core
        .failures()
        .iter()
        .map(|f| {
            let w = &workers[&f.local_rank];
            let (exit_code, signal) = match f.exit {
                Exit::Code(c) => (Some(c), None),
                Exit::Signal(s) => (None, Some(s)),
            };
            let mut rec = Failure {
                attempt,
                rank: w.rank,
                local_rank: f.local_rank,
                node_rank: plan.node_rank,
                host: plan.host.clone(),
                pid: w.pid,
                exit_code,
                signal,
                at_us: f.at_us,
                error_file: None,
                message: None,
                traceback: None,
            };
            rec.read_error_file(&w.error_file);
            rec
        })
        .collect();
    (outcome, failures)
}

fn signal_alive(core: &Attempt, workers: &HashMap<u32, Worker>, sig: i32) {
    for lr in core.alive() {
        if let Some(w) = workers.get(&lr) {
            sys::signal_group(w.pid, sig);
        }
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}
