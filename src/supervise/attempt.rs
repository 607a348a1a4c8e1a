//! One attempt of this pod's workers, the shell around the pure core
//! ([`super::policy::Attempt`]): spawn the workers, take the next event
//! (a worker exit, a signal, the round's end, a timer, a hung worker),
//! carry out the actions the core returns, and build the failure records.
//! What the rest of the job must learn, and how this pod hears that the
//! round ended, go through [`Job`]: the rendezvous session in production
//! (wired in `crate::launch`), a fake in tests.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::Instant;

use crate::config::rules::RuleAction;
use crate::config::{Env, Plan};
use crate::process::signals::{Heard, SysEvent, now_us};
use crate::process::spawn::Spawner;
use crate::process::sweep;
use crate::supervise::carry::{Carry, Kept};
use crate::supervise::crew::{Crew, Recorded, Worker, record, spawn_all};
use crate::supervise::hang_read;
use crate::supervise::policy::{Action, Attempt, Event, JobEnd, Outcome, Timer};
use crate::supervise::report::Failure;
use crate::supervise::round_end::RoundEnd;
use crate::supervise::worker::{Rejoin, WorldView};
use crate::sys;

/// How long output drains may lag behind the last worker exit.
const DRAIN_WAIT: Duration = Duration::from_secs(2);
/// Bound on killing leftover processes at the end of a round.
const SWEEP_LIMIT: Duration = Duration::from_secs(5);
/// How often workers are checked for uninterruptible sleep (with --hung-timeout).
const HUNG_CHECK: Duration = Duration::from_secs(1);

/// The job-wide side of one attempt.
pub trait Pods {
    /// Why the rest of the job could not be told (the store is gone).
    type Error: std::fmt::Display;
    /// The round this attempt runs in.
    fn round(&self) -> u64;
    /// Resolves when the round ends anywhere: how (None: the store was lost).
    fn watch_end(&self) -> impl std::future::Future<Output = Option<RoundEnd>> + Send + 'static;
    /// Why the store host said it left, if it did.
    fn host_left(&self) -> Option<String>;
    /// A worker failed here: end the round as failed (`fatal`: by a `fail`
    /// rule; `hang`: a worker hung or stopped making progress, so every pod
    /// reads its workers' stacks before it stops them).
    fn publish_failure(
        &mut self,
        fatal: bool,
        hang: bool,
    ) -> impl std::future::Future<Output = Result<(), Self::Error>>;
    /// This pod's workers' stacks at a hang (JSON, bounded), for the job's
    /// view; `dumped`: with their Flight Recorder's dumps.
    fn publish_stacks(
        &mut self,
        json: Vec<u8>,
        dumped: bool,
    ) -> impl std::future::Future<Output = Result<(), Self::Error>>;
    /// Wait (at most `limit`) until every pod's stacks of this round's hang
    /// are in the store (`dumped`: with their Flight Recorder's dumps);
    /// false when the limit came first.
    fn wait_stacks(
        &mut self,
        dumped: bool,
        limit: Duration,
    ) -> impl std::future::Future<Output = Result<bool, Self::Error>>;
    /// This pod was stopped by `signal`: end the round so the others stop too.
    fn publish_abort(&mut self, signal: i32) -> impl std::future::Future<Output = Result<(), Self::Error>>;
    /// Every worker here succeeded.
    fn publish_local_done(&mut self) -> impl std::future::Future<Output = Result<(), Self::Error>>;
}

/// Spawn this pod's workers for one round and supervise them to the end.
/// In survivors mode (`world.survivors`), the workers `carry` holds from
/// the last round take their ranks instead of new ones, and the workers
/// kept at this round's end are left in it.
pub async fn run_attempt(
    world: &WorldView<'_>,
    (dir, files_ok): (&Path, bool),
    (spawner, carry): (&Spawner, &mut Carry),
    env: &Env,
    events: &mut UnboundedReceiver<SysEvent>,
    job: &mut impl Pods,
) -> (Outcome, Vec<Failure>) {
    let plan = world.plan;
    let mut core = Attempt::new(plan.nproc, plan.rules.clone(), plan.checkpoint_signal);
    core.set_survivors(world.survivors.is_some());
    let mut crew = spawn_all(world, (dir, files_ok), (spawner, &mut *carry), env).await;
    hang_read::register(world, &crew);
    let outcome = supervise(world, &mut core, &mut crew, events, job).await;
    hang_read::unregister();
    let failures = wrap_up(world, &core, &crew, carry, job.round()).await;
    (outcome, failures)
}

/// The attempt's event loop: feed the core each event (a worker exit, a
/// signal, the round's end, a timer, a silent or hung worker) and carry
/// out its actions, until it is finished; the outcome.
async fn supervise(
    world: &WorldView<'_>,
    core: &mut Attempt,
    crew: &mut Crew,
    events: &mut UnboundedReceiver<SysEvent>,
    job: &mut impl Pods,
) -> Outcome {
    let plan = world.plan;
    let round = job.round();
    let watch = job.watch_end();
    tokio::pin!(watch);
    let mut watching = true;
    let mut timers: HashMap<Timer, Instant> = HashMap::new();
    let mut outcome = Outcome::Lost;
    let mut pending: std::collections::VecDeque<Event> = std::mem::take(&mut crew.early).into();
    let mut hung_check = tokio::time::interval(HUNG_CHECK);
    hung_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut d_since: HashMap<u32, Instant> = HashMap::new();
    let mut exit_check = tokio::time::interval(super::exiting::CHECK_EVERY);
    let mut progress_check = tokio::time::interval(HUNG_CHECK);
    progress_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // This pod's stacks were read at a hang (once per attempt).
    let mut captured = false;
    let mut heard_hang = false;
    if let Some(link) = world.status {
        link.board.new_attempt();
    }
    while !core.finished() {
        let next_timer = timers.iter().min_by_key(|(_, at)| **at).map(|(t, at)| (*t, *at));
        let event = if let Some(e) = pending.pop_front() {
            e
        } else {
            tokio::select! {
                ev = events.recv() => match heard(plan, crew, Heard::of(ev, &plan.stop_signals), &mut pending) {
                    Some(e) => e,
                    None => continue,
                },
                note = crew.mpi.next() => {
                    let a = crew.mpi.apply(note, plan.nproc, now_us());
                    kill_ranks(&crew.workers, &a.stop);
                    match a.event {
                        Some(e) => e,
                        None => continue,
                    }
                }
                ended = &mut watch, if watching => {
                    watching = false;
                    match ended {
                        None => {
                            match job.host_left() {
                                Some(why) => tracing::warn!(store_host = %why, "the store host left the job; stopping workers"),
                                None => tracing::error!("lost the rendezvous store; stopping workers"),
                            }
                            Event::Job(JobEnd::Lost)
                        }
                        Some(ended) => {
                            if ended.is_stop() {
                                // The run is stopped (closed, replaced): nobody is kept.
                                core.set_survivors(false);
                            }
                            heard_hang = ended.is_hang();
                            if ended != RoundEnd::Success {
                                tracing::warn!(round, end = %ended, "the round ended; stopping workers");
                            }
                            Event::Job(ended.job_end())
                        }
                    }
                }
                () = crate::waiting::sleep_until(next_timer.map(|(_, at)| at)) => {
                    let Some((t, _)) = next_timer else { continue };
                    timers.remove(&t);
                    match t {
                        Timer::Checkpoint => tracing::warn!("checkpoint time over; sending SIGTERM"),
                        Timer::Grace => tracing::warn!(grace_s = plan.grace.as_secs_f64(), "grace period over; killing workers"),
                        Timer::Kill => tracing::error!(kill_timeout_s = plan.kill_timeout.as_secs_f64(), "workers survived SIGKILL; abandoning them"),
                    }
                    Event::Timer(t)
                }
                _ = progress_check.tick(), if plan.progress.timeout.is_some() => match silence(world, core, crew) {
                    Some(e) => e,
                    None => continue,
                },
                _ = exit_check.tick() => {
                    super::exiting::stop_stuck(core, crew).await;
                    continue;
                }
                _ = hung_check.tick(), if plan.hung_timeout.is_some() => {
                    match hung_worker(core, &crew.workers, &mut d_since, plan.hung_timeout) {
                        Some(local_rank) => Event::Hung { local_rank, at_us: now_us() },
                        None => continue,
                    }
                }
            }
        };
        if let Event::WorkerExited { local_rank, exit, at_us } | Event::Fault { local_rank, exit, at_us } = &event {
            crew.exits.insert(*local_rank, (*exit, *at_us));
            let action = match (plan.rules.action(*exit), &event) {
                (RuleAction::Ignore, Event::Fault { .. }) => RuleAction::Restart,
                (a, _) => a,
            };
            tracing::info!(local_rank, %exit, %action, fault = crew.mpi.why(*local_rank), "worker exited");
        }
        let hang_verdict = matches!(event, Event::Silent { .. } | Event::Hung { .. });
        let mut actions = core.handle(event);
        let fails = actions.iter().any(|a| matches!(a, Action::PublishFailure { .. }));
        let hang = hang_verdict && fails;
        if (hang || std::mem::take(&mut heard_hang)) && !captured && core.alive().next().is_some() {
            // Read the stacks while the workers still stand where they hung.
            captured = true;
            read_at_hang(world, (core, crew), job, (&mut actions, hang)).await;
        }
        for action in actions {
            let published = match action {
                Action::Signal(sig) => {
                    crew.signalled_us.get_or_insert_with(now_us);
                    signal_alive(core, &crew.workers, sig);
                    Ok(())
                }
                Action::KillAll => {
                    crew.signalled_us.get_or_insert_with(now_us);
                    signal_alive(core, &crew.workers, libc::SIGKILL);
                    Ok(())
                }
                Action::Arm(t) => {
                    let after = match t {
                        Timer::Checkpoint => plan.checkpoint_timeout,
                        Timer::Grace => plan.grace,
                        Timer::Kill => plan.kill_timeout,
                    };
                    timers.insert(t, Instant::now() + after);
                    Ok(())
                }
                Action::PublishFailure { fatal } => job.publish_failure(fatal, hang).await,
                Action::PublishAbort(sig) => job.publish_abort(sig).await,
                Action::PublishLocalDone => job.publish_local_done().await,
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
    outcome
}

/// Longest wait for every pod's stacks before the Flight Recorder's dumps
/// are asked for (a pod hearing the hang reads its own within 2.3 s).
const STACKS_IN_WAIT: Duration = Duration::from_secs(5);
/// Longest wait for every pod's dumps before this pod stops its workers,
/// past its own (every pod asks at once, once all stacks are in). With
/// the other waits, the hang's stop starts at most 30 s after the verdict.
const DUMPED_WAIT: Duration = Duration::from_secs(10);

/// At a hang, before the first stop signal: this pod's workers' stacks go
/// into the store; when some run NCCL, their Flight Recorder dumps are
/// then asked for and added. A dump ends an NCCL worker and a stopped
/// worker can end its peers' collectives, so the round's failure goes out
/// first (from `actions`, which keep what is left to do), the dumps are
/// asked for once every pod's stacks are in, and the workers are stopped
/// once every pod's dumps are (each wait bounded, and said).
async fn read_at_hang<J: Pods>(
    world: &WorldView<'_>,
    (core, crew): (&Attempt, &Crew),
    job: &mut J,
    (actions, hang): (&mut Vec<Action>, bool),
) {
    let mut read = hang_read::capture(world, core, crew).await;
    let targets = super::flight::targets(&mut read).await;
    // A pod with no dump to ask for says so at once (dumped): no pod waits for it.
    if let Err(e) = job.publish_stacks(hang_read::encode(read.clone()), targets.is_empty()).await {
        tracing::warn!(error = %e, "cannot put this pod's stacks in the store");
    }
    if targets.is_empty() {
        return;
    }
    if let Some(i) = actions.iter().position(|a| matches!(a, Action::PublishFailure { .. })) {
        let failure = actions.remove(i);
        if let Action::PublishFailure { fatal } = failure
            && job.publish_failure(fatal, hang).await.is_err()
        {
            // The loop publishes it again and says what went wrong.
            actions.insert(0, failure);
        }
    }
    every_pod(job, false, STACKS_IN_WAIT).await;
    super::flight::gather(world, &mut read, targets, crew.started).await;
    if let Err(e) = job.publish_stacks(hang_read::encode(read), true).await {
        tracing::warn!(error = %e, "cannot put this pod's Flight Recorder dumps in the store");
    }
    every_pod(job, true, DUMPED_WAIT).await;
}

/// Wait until every pod's stacks (`dumped`: and dumps) are in the store,
/// at most `limit` in all (a store that stops answering included).
async fn every_pod<J: Pods>(job: &mut J, dumped: bool, limit: Duration) {
    let what = if dumped {
        "Flight Recorder dumps, before stopping the workers"
    } else {
        "stacks, before asking for the Flight Recorder's dumps"
    };
    tracing::info!(wait_s = limit.as_secs_f64(), "waiting for every pod's {what}");
    // Bounded in all (reaching the store included); a lost store ends the
    // wait: no pod can be waited for.
    if let Ok(Ok(false)) | Err(_) = tokio::time::timeout(limit, job.wait_stacks(dumped, limit)).await {
        tracing::warn!("not every pod's {what} came within {:.0} s; going on", limit.as_secs_f64());
    }
}

/// The core's event for what the events channel said, if any: a worker's
/// exit (as its PMI service reads it), a stop, a signal to forward. Notes
/// the PMI service sent before an exit are applied first (a rank's
/// finalize is noted before its reply, so before it exits).
fn heard(plan: &Plan, crew: &mut Crew, heard: Heard, pending: &mut std::collections::VecDeque<Event>) -> Option<Event> {
    Some(match heard {
        Heard::Exited { pid, exit, at_us } => match crew.by_pid.remove(&pid) {
            Some(local_rank) => {
                crate::metrics::global().worker_exited(exit);
                for a in crew.mpi.drain(plan.nproc, at_us) {
                    kill_ranks(&crew.workers, &a.stop);
                    pending.extend(a.event);
                }
                crew.mpi.exit_event(local_rank, exit, at_us)
            }
            None => {
                tracing::debug!(pid, %exit, "reaped orphan");
                return None;
            }
        },
        Heard::Stop { signal, asked: false } => {
            tracing::warn!(signal = %sys::signal_name(signal), checkpoint = plan.checkpoint_signal.map(sys::signal_name), "stop signal; stopping workers");
            Event::StopSignal(signal)
        }
        Heard::Stop { signal, asked: true } => {
            tracing::warn!(signal = %sys::signal_name(signal), checkpoint = plan.checkpoint_signal.map(sys::signal_name), "asked to stop (an in-place restart); stopping workers");
            Event::StopAsked(signal)
        }
        Heard::Other(s) if s == libc::SIGUSR1 || s == libc::SIGUSR2 => Event::ForwardSignal(s),
        Heard::Other(_) => return None,
    })
}

/// The workers newly silent past --progress-timeout, as the core's event
/// (each silence is told once; it is logged only, with a
/// `no-progress=ignore` rule).
fn silence(world: &WorldView<'_>, core: &Attempt, crew: &mut Crew) -> Option<Event> {
    let plan = world.plan;
    let mut silent = silent_workers(core, &crew.workers, world.status, plan.progress.timeout);
    silent.retain(|(lr, _)| !crew.silent_for.contains_key(lr));
    if silent.is_empty() {
        return None;
    }
    let ranks: Vec<u32> = silent.iter().filter_map(|(lr, _)| crew.workers.get(lr).map(|w| w.rank)).collect();
    tracing::error!(?ranks, local_ranks = ?silent.iter().map(|(lr, _)| *lr).collect::<Vec<_>>(), progress_timeout_s = plan.progress.timeout.map(|t| t.as_secs_f64()), "workers reported no progress past --progress-timeout; the job is hung");
    crew.silent_for.extend(silent.iter().copied());
    Some(Event::Silent { local_ranks: silent.into_iter().map(|(lr, _)| lr).collect(), at_us: now_us() })
}

/// The attempt is over: keep the survivors (survivors mode), kill what the
/// others left behind, wait for their output, and build the failure
/// records.
async fn wrap_up(world: &WorldView<'_>, core: &Attempt, crew: &Crew, carry: &mut Carry, round: u64) -> Vec<Failure> {
    let workers = &crew.workers;
    // Survivors mode: the live workers the bridge saw ready stay for the
    // next round, spared by the sweep below.
    let keep = keepers(core, workers, world.survivors);
    if let Some(r) = world.survivors {
        let held = keep.iter().filter_map(|&local_rank| {
            let w = workers.get(&local_rank)?;
            let pid = w.pid?;
            let start = sys::proc_start(pid)?;
            Some(Kept { local_rank, rank: w.rank, pid, start, drains: w.drains.clone(), tail: w.tail.clone() })
        });
        carry.hold(r.seq(), held.collect());
        if !carry.is_empty() {
            tracing::info!(round, pids = ?carry.pids(), "survivors mode: the live workers are kept for the next round");
        }
    }
    // Processes a worker left in its group (grandchildren) go too, and so
    // does every other descendant of the agent (those that called setsid()
    // or were re-parented to us), before the next round starts.
    let gone = || workers.iter().filter(|(lr, _)| !keep.contains(lr)).map(|(_, w)| w);
    for w in gone() {
        if let Some(pid) = w.pid {
            sys::signal_group(pid, libc::SIGKILL);
        }
    }
    let swept = tokio::task::block_in_place(|| sweep::kill_all(SWEEP_LIMIT));
    sweep::log(&swept, "end of round");
    let until = Instant::now() + DRAIN_WAIT;
    for w in gone() {
        if tokio::time::timeout_at(until, w.drains.wait()).await.is_err() {
            tracing::warn!("worker output still open after the workers exited; no longer reading it");
            break;
        }
    }
    let record = |f: Recorded| record(world, crew, round, f);
    let mut failures: Vec<Failure> = core
        .failures()
        .iter()
        .map(|f| {
            let hung = f.exit.is_none() && !f.silent;
            record(Recorded {
                local_rank: f.local_rank,
                exit: f.exit,
                at_us: f.at_us,
                action: f.action,
                hung,
                silent: f.silent,
            })
        })
        .collect();
    for &local_rank in core.abandoned() {
        let at_us = now_us();
        failures.push(record(Recorded {
            local_rank,
            exit: None,
            at_us,
            action: RuleAction::Fail,
            hung: true,
            silent: false,
        }));
    }
    let recorded: Vec<u32> = failures.iter().map(|f| f.local_rank).collect();
    failures.extend(super::crew::raised(world, crew, round, &recorded));
    failures
}

/// Kill local ranks `stop` (MPI ranks waiting for PMI replies that will
/// not come); their exits end the round.
fn kill_ranks(workers: &HashMap<u32, Worker>, stop: &[u32]) {
    for pid in stop.iter().filter_map(|lr| workers.get(lr)?.pid) {
        sys::signal_group(pid, libc::SIGKILL);
    }
}

/// The workers to keep for the next round: those the core kept that the
/// bridge saw ready (survivors mode only).
fn keepers(core: &Attempt, workers: &HashMap<u32, Worker>, survivors: Option<&dyn Rejoin>) -> Vec<u32> {
    let Some(r) = survivors else { return Vec::new() };
    let ready = |lr: &u32| workers.get(lr).and_then(|w| w.pid).is_some_and(|pid| r.ready(pid));
    let (keep, not_ready): (Vec<u32>, Vec<u32>) = core.kept().iter().copied().partition(ready);
    if !not_ready.is_empty() {
        tracing::info!(local_ranks = ?not_ready, "survivors mode: workers not ready (in __init__ or rejoining) are not kept");
    }
    keep
}

/// The first live worker in D state for longer than `limit`.
fn hung_worker(
    core: &Attempt,
    workers: &HashMap<u32, Worker>,
    since: &mut HashMap<u32, Instant>,
    limit: Option<Duration>,
) -> Option<u32> {
    let limit = limit?;
    let now = Instant::now();
    let mut found = None;
    for lr in core.alive() {
        let Some(w) = workers.get(&lr) else { continue };
        if w.pid.and_then(sys::proc_state) == Some('D') {
            let t = *since.entry(lr).or_insert(now);
            if found.is_none() && now.duration_since(t) >= limit {
                tracing::error!(local_rank = lr, "worker stuck in uninterruptible sleep (D state) past --hung-timeout");
                found = Some(lr);
            }
        } else {
            since.remove(&lr);
        }
    }
    found
}

/// The live workers that reported progress in this attempt (to the
/// status endpoint, or by touching their heartbeat file) and have been
/// silent longer than `limit` since; with how long.
fn silent_workers(
    core: &Attempt,
    workers: &HashMap<u32, Worker>,
    status: Option<&crate::supervise::worker::StatusLink>,
    limit: Option<Duration>,
) -> Vec<(u32, Duration)> {
    let Some(limit) = limit else { return Vec::new() };
    core.alive()
        .filter_map(|lr| {
            let w = workers.get(&lr)?;
            let posted = status.and_then(|s| s.board.last_report(lr)).map(|t| t.elapsed());
            let touched = w
                .heartbeat
                .as_ref()
                .and_then(|hb| std::fs::metadata(hb).and_then(|m| m.modified()).ok())
                .map(|t| t.elapsed().unwrap_or_default());
            let quiet = match (posted, touched) {
                (Some(a), Some(b)) => a.min(b),
                (a, b) => a.or(b)?,
            };
            (quiet > limit).then_some((lr, quiet))
        })
        .collect()
}

/// Signal every live worker. Stop signals (TERM, INT, HUP, QUIT, KILL) go
/// to the worker's whole process group, as torchrun's killpg; any other
/// signal (the checkpoint signal, forwarded SIGUSR1/SIGUSR2) goes to the
/// rank's main process only: DataLoader workers of the `spawn` context die
/// of an unhandled SIGUSR1, and with `fork` the handler would run in each.
fn signal_alive(core: &Attempt, workers: &HashMap<u32, Worker>, sig: i32) {
    let group = is_group_signal(sig);
    for lr in core.alive() {
        if let Some(pid) = workers.get(&lr).and_then(|w| w.pid) {
            if group {
                sys::signal_group(pid, sig);
            } else {
                sys::signal_process(pid, sig);
            }
        }
    }
}

/// Does `sig` go to a worker's process group (else to its main process)?
fn is_group_signal(sig: i32) -> bool {
    matches!(sig, libc::SIGTERM | libc::SIGINT | libc::SIGHUP | libc::SIGQUIT | libc::SIGKILL)
}
