//! One attempt of this pod's workers, the shell around the pure core
//! ([`super::policy::Attempt`]): spawn the workers, take the next event
//! (a worker exit, a signal, the round's end, a timer, a hung worker),
//! carry out the actions the core returns, and build the failure records.
//! What the rest of the job must learn, and how this pod hears that the
//! round ended, go through [`Job`]: the rendezvous session in production
//! (wired in `crate::launch`), a fake in tests.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use crate::config::Env;
use crate::config::rules::RuleAction;
use crate::exit;
use crate::process::signals::{SysEvent, now_us};
use crate::process::spawn::{Spawner, WorkerSpec};
use crate::process::sweep;
use crate::supervise::carry::{Carry, Kept};
use crate::supervise::mpi::Ranks;
use crate::supervise::output::{self, Sink};
use crate::supervise::policy::{Action, Attempt, Event, JobEnd, Outcome, Timer};
use crate::supervise::report::Failure;
use crate::supervise::worker::{Rejoin, WorldView, framework_env, substitute, worker_env};
use crate::sys::{self, Exit};

/// How long output drains may lag behind the last worker exit.
const DRAIN_WAIT: Duration = Duration::from_secs(2);
/// Bound on killing leftover processes at the end of a round.
const SWEEP_LIMIT: Duration = Duration::from_secs(5);
/// How often workers are checked for uninterruptible sleep (with --hung-timeout).
const HUNG_CHECK: Duration = Duration::from_secs(1);

/// The job-wide side of one attempt.
pub trait Job {
    /// Why the rest of the job could not be told (the store is gone).
    type Error: std::fmt::Display;
    /// The round this attempt runs in.
    fn round(&self) -> u64;
    /// Resolves when the round ends anywhere: how, and the end's text.
    fn watch_end(&self) -> impl std::future::Future<Output = (JobEnd, String)> + Send + 'static;
    /// Why the store host said it left, if it did.
    fn host_left(&self) -> Option<String>;
    /// A worker failed here: end the round as failed (`fatal`: by a `fail` rule).
    fn publish_failure(&mut self, fatal: bool) -> impl std::future::Future<Output = Result<(), Self::Error>>;
    /// This pod was stopped by `signal`: end the round so the others stop too.
    fn publish_abort(&mut self, signal: i32) -> impl std::future::Future<Output = Result<(), Self::Error>>;
    /// Every worker here succeeded.
    fn publish_local_done(&mut self) -> impl std::future::Future<Output = Result<(), Self::Error>>;
}

struct Worker {
    /// Its pid and process group; None when it never started.
    pid: Option<i32>,
    /// The tasks reading its output.
    drains: TaskTracker,
    /// The file it touches to show progress (with --progress-timeout).
    heartbeat: Option<PathBuf>,
    rank: u32,
    error_file: PathBuf,
    /// The code for a worker that never ran (126, 127, 210).
    not_started: Option<u8>,
    /// Why it never ran.
    why: Option<String>,
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
    job: &mut impl Job,
) -> (Outcome, Vec<Failure>) {
    let round = job.round();
    let plan = world.plan;
    let mut core = Attempt::new(plan.nproc, plan.rules.clone(), plan.checkpoint_signal);
    core.set_survivors(world.survivors.is_some());
    let mut kept = match world.survivors {
        Some(r) => {
            // One whose connection closed since the last round ended (it
            // died with it, a moment after) could never rejoin: its rank
            // starts afresh now, not in a failure of this round.
            let (live, gone): (Vec<Kept>, Vec<Kept>) = carry.take(r.seq()).into_iter().partition(|k| r.ready(k.pid));
            for k in gone {
                tracing::warn!(
                    local_rank = k.local_rank,
                    pid = k.pid,
                    "a kept worker's connection closed between two rounds; its rank starts afresh"
                );
                k.kill();
            }
            live
        }
        None => {
            carry.kill("the next run is not theirs");
            Vec::new()
        }
    };
    let mut workers: HashMap<u32, Worker> = HashMap::new();
    let mut mpi = Ranks::new(world.pmi.and_then(crate::pmi::round::Link::take_notes));
    let mut by_pid: HashMap<i32, u32> = HashMap::new();
    let mut early: Vec<Event> = Vec::new();
    let (placed, _) = crate::gpu::setup::placements(&plan.gpu, plan.nproc);
    let nics = if plan.gpu.nic_hint { crate::gpu::sysfs::Sysfs::new(&plan.gpu.root).nics() } else { Vec::new() };
    let oom_adj = crate::process::oom::worker_adj(Path::new("/"));

    for local_rank in 0..plan.nproc {
        let rank = world.group_rank * plan.nproc + local_rank;
        let rank_dir = dir.join(local_rank.to_string());
        if files_ok && let Err(e) = std::fs::create_dir_all(&rank_dir) {
            tracing::warn!(dir = %rank_dir.display(), error = %e, "cannot create the worker log directory");
        }
        let error_file = rank_dir.join("error.json");
        // A stale error file from an earlier run must not be read as this one's.
        let _ = std::fs::remove_file(&error_file);
        // A served run's variables first: trainlet's own win over them.
        let mut wenv = plan.entry.env.clone();
        wenv.extend(worker_env(world, local_rank, &error_file.display().to_string(), env));
        let mut unset = Vec::new();
        if let Some(link) = world.status {
            wenv.extend(link.env(local_rank));
            unset.push(crate::env::KUBEFLOW_TRAINER_SERVER_CA_CERT.to_string());
        }
        let heartbeat = (plan.progress.timeout.is_some() && files_ok).then(|| rank_dir.join("heartbeat"));
        if let Some(hb) = &heartbeat {
            // Only touches by this attempt's worker count.
            let _ = std::fs::remove_file(hb);
            wenv.push((crate::env::TRAINLET_HEARTBEAT_FILE.to_string(), hb.display().to_string()));
        }
        let place = placed.get(local_rank as usize);
        wenv.extend(framework_env(world, local_rank, place.and_then(|p| p.gpu)));
        if let Some(p) = place {
            // Later entries win: LOCAL_RANK 0 with --gpu-visibility single.
            wenv.extend(crate::gpu::plan::rank_env(p, &plan.gpu.gpus, plan.gpu.visibility, plan.gpu.user_order));
            wenv.extend(crate::gpu::plan::nic_env(p, &plan.gpu.gpus, &nics, |v| env.get(v).is_some()));
        }
        // A kept worker takes its rank as it is: it gets the round's variables.
        if let (Some(r), Some(i)) = (world.survivors, kept.iter().position(|k| k.local_rank == local_rank)) {
            let k = kept.swap_remove(i);
            tracing::info!(local_rank, rank, pid = k.pid, was_rank = k.rank, "a kept worker rejoins");
            r.rejoin(k.pid, k.start, rank, wenv);
            by_pid.insert(k.pid, local_rank);
            let w = Worker {
                pid: Some(k.pid),
                drains: k.drains,
                heartbeat,
                rank,
                error_file,
                not_started: None,
                why: None,
            };
            workers.insert(local_rank, w);
            continue;
        }
        let mut spec = WorkerSpec::piped(plan.entry.program.clone(), substitute(&plan.entry.args, local_rank), wenv);
        spec.unset = unset;
        spec.cwd.clone_from(&plan.entry.cwd);
        spec.cpus = place.and_then(|p| p.cpus.clone());
        spec.mem_node = place.and_then(|p| p.mem_node);
        spec.oom_score_adj = oom_adj;
        spec.pass_fd = world.pmi.and_then(|l| l.take_fd(local_rank));
        // Not started: the code a shell would give, and why.
        let spawned: Result<_, (u8, String)> = match world.unstartable {
            Some(why) => Err((exit::WORKER_NOT_EXECUTABLE, why.to_string())),
            None => {
                // Forked from the zygote when it can run the worker, else exec'd.
                let forked = match world.zygote {
                    Some(z) => z.fork(&spec).await.and_then(Result::ok),
                    None => None,
                };
                match forked {
                    Some(sp) => Ok(sp),
                    None => spawner.spawn_retrying(spec, plan.grace).await,
                }
                .map_err(|e| (e.exec_code().unwrap_or(exit::FORK_FAILED), crate::error::error_chain(&e)))
            }
        };
        match spawned {
            Ok(sp) => {
                let prefix = output::prefix(
                    &plan.output.prefix_template,
                    &plan.output.role,
                    local_rank,
                    rank,
                    &plan.output.host,
                );
                let shown = plan.output.console_ranks.as_ref().is_none_or(|r| r.contains(&local_rank));
                // Without files, a redirected stream stays on the console.
                let (red_out, red_err) = plan.output.redirects.for_rank(local_rank);
                let (red_out, red_err) = (red_out && files_ok, red_err && files_ok);
                let (tee_out, tee_err) = plan.output.tee.for_rank(local_rank);
                let files = plan.output.log_dir.is_some();
                let drains = TaskTracker::new();
                for (fd, is_err, redirected, teed, name) in [
                    (sp.stdout, false, red_out, tee_out, "stdout.log"),
                    (sp.stderr, true, red_err, tee_err, "stderr.log"),
                ] {
                    let Some(fd) = fd else { continue };
                    let sink = Sink {
                        prefix: prefix.clone(),
                        console: shown && (teed || !redirected),
                        file: (files_ok && (files || redirected || teed)).then(|| rank_dir.join(name)),
                        is_err,
                        tap: world.tap.clone(),
                    };
                    drains.spawn(output::drain(fd, sink));
                }
                drains.close();
                crate::metrics::global().workers_started.inc();
                by_pid.insert(sp.pid, local_rank);
                workers.insert(
                    local_rank,
                    Worker { pid: Some(sp.pid), drains, heartbeat, rank, error_file, not_started: None, why: None },
                );
            }
            Err((code, why)) => {
                tracing::error!(local_rank, code, error = %why, "cannot start worker");
                let drains = TaskTracker::new();
                drains.close(); // no output to wait for
                let w = Worker {
                    pid: None,
                    drains,
                    heartbeat: None,
                    rank,
                    error_file,
                    not_started: Some(code),
                    why: Some(why),
                };
                workers.insert(local_rank, w);
                crate::metrics::global().worker_exited(Exit::Code(i32::from(code)));
                early.push(Event::WorkerExited { local_rank, exit: Exit::Code(i32::from(code)), at_us: now_us() });
            }
        }
    }
    // Kept workers left over (the world shrank below their local rank).
    for k in kept {
        tracing::info!(local_rank = k.local_rank, pid = k.pid, "a kept worker has no rank in this round; stopping it");
        k.kill();
    }

    let watch = job.watch_end();
    tokio::pin!(watch);
    let mut watching = true;
    let mut timers: HashMap<Timer, Instant> = HashMap::new();
    let mut outcome = Outcome::Lost;
    let mut pending: std::collections::VecDeque<Event> = early.into();
    let mut hung_check = tokio::time::interval(HUNG_CHECK);
    hung_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut d_since: HashMap<u32, Instant> = HashMap::new();
    let mut progress_check = tokio::time::interval(HUNG_CHECK);
    progress_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    if let Some(link) = world.status {
        link.board.new_attempt();
    }
    let mut silent_for: HashMap<u32, Duration> = HashMap::new();

    while !core.finished() {
        let next_timer = timers.iter().min_by_key(|(_, at)| **at).map(|(t, at)| (*t, *at));
        let event = if let Some(e) = pending.pop_front() {
            e
        } else {
            tokio::select! {
                ev = events.recv() => match ev {
                    Some(SysEvent::Exited { pid, exit, at_us, .. }) => match by_pid.remove(&pid) {
                        Some(local_rank) => {
                            crate::metrics::global().worker_exited(exit);
                            for a in mpi.drain(plan.nproc, at_us) {
                                kill_ranks(&workers, &a.stop);
                                pending.extend(a.event);
                            }
                            mpi.exit_event(local_rank, exit, at_us)
                        }
                        None => {
                            tracing::debug!(pid, %exit, "reaped orphan");
                            continue;
                        }
                    },
                    Some(SysEvent::Signal(s)) if plan.stop_signals.contains(&s) => {
                        tracing::warn!(signal = %sys::signal_name(s), checkpoint = plan.checkpoint_signal.map(sys::signal_name), "stop signal; stopping workers");
                        Event::StopSignal(s)
                    }
                    Some(SysEvent::StopAsked(s)) => {
                        tracing::warn!(signal = %sys::signal_name(s), checkpoint = plan.checkpoint_signal.map(sys::signal_name), "asked to stop (an in-place restart); stopping workers");
                        Event::StopAsked(s)
                    }
                    Some(SysEvent::Signal(s)) if s == libc::SIGUSR1 || s == libc::SIGUSR2 => Event::ForwardSignal(s),
                    Some(SysEvent::Signal(_)) => continue,
                    None => Event::StopSignal(libc::SIGTERM),
                },
                note = mpi.next() => {
                    let a = mpi.apply(note, plan.nproc, now_us());
                    kill_ranks(&workers, &a.stop);
                    match a.event {
                        Some(e) => e,
                        None => continue,
                    }
                }
                (end, text) = &mut watch, if watching => {
                    watching = false;
                    if text.starts_with("stop:") {
                        // The run is stopped (closed, replaced): nobody is kept.
                        core.set_survivors(false);
                    }
                    match end {
                        JobEnd::Lost => match job.host_left() {
                            Some(why) => tracing::warn!(store_host = %why, "the store host left the job; stopping workers"),
                            None => tracing::error!("lost the rendezvous store; stopping workers"),
                        },
                        JobEnd::Success => {}
                        _ => tracing::warn!(round, end = %text, "the round ended; stopping workers"),
                    }
                    Event::Job(end)
                }
                () = crate::progress::sleep_until(next_timer.map(|(_, at)| at)) => {
                    let Some((t, _)) = next_timer else { continue };
                    timers.remove(&t);
                    match t {
                        Timer::Checkpoint => tracing::warn!("checkpoint time over; sending SIGTERM"),
                        Timer::Grace => tracing::warn!(grace_s = plan.grace.as_secs_f64(), "grace period over; killing workers"),
                        Timer::Kill => tracing::error!(kill_timeout_s = plan.kill_timeout.as_secs_f64(), "workers survived SIGKILL; abandoning them"),
                    }
                    Event::Timer(t)
                }
                _ = progress_check.tick(), if plan.progress.timeout.is_some() => {
                    let mut silent = silent_workers(&core, &workers, world.status, plan.progress.timeout);
                    // Each silence is told once (it is logged only, with a `no-progress=ignore` rule).
                    silent.retain(|(lr, _)| !silent_for.contains_key(lr));
                    if silent.is_empty() {
                        continue;
                    }
                    let ranks: Vec<u32> = silent.iter().filter_map(|(lr, _)| workers.get(lr).map(|w| w.rank)).collect();
                    tracing::error!(?ranks, local_ranks = ?silent.iter().map(|(lr, _)| *lr).collect::<Vec<_>>(), progress_timeout_s = plan.progress.timeout.map(|t| t.as_secs_f64()), "workers reported no progress past --progress-timeout; the job is hung");
                    silent_for.extend(silent.iter().copied());
                    Event::Silent { local_ranks: silent.into_iter().map(|(lr, _)| lr).collect(), at_us: now_us() }
                }
                _ = hung_check.tick(), if plan.hung_timeout.is_some() => {
                    match hung_worker(&core, &workers, &mut d_since, plan.hung_timeout) {
                        Some(local_rank) => {
                            tracing::error!(local_rank, "worker stuck in uninterruptible sleep (D state) past --hung-timeout");
                            Event::Hung { local_rank, at_us: now_us() }
                        }
                        None => continue,
                    }
                }
            }
        };
        if let Event::WorkerExited { local_rank, exit, .. } | Event::Fault { local_rank, exit, .. } = &event {
            let action = match (plan.rules.action(*exit), &event) {
                (RuleAction::Ignore, Event::Fault { .. }) => RuleAction::Restart,
                (a, _) => a,
            };
            tracing::info!(local_rank, %exit, %action, fault = mpi.why(*local_rank), "worker exited");
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
                Action::Arm(t) => {
                    let after = match t {
                        Timer::Checkpoint => plan.checkpoint_timeout,
                        Timer::Grace => plan.grace,
                        Timer::Kill => plan.kill_timeout,
                    };
                    timers.insert(t, Instant::now() + after);
                    Ok(())
                }
                Action::PublishFailure { fatal } => job.publish_failure(fatal).await,
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

    // Survivors mode: the live workers the bridge saw ready stay for the
    // next round, spared by the sweep below.
    let keep = keepers(&core, &workers, world.survivors);
    if let Some(r) = world.survivors {
        let held = keep.iter().filter_map(|&local_rank| {
            let w = workers.get(&local_rank)?;
            let pid = w.pid?;
            let start = sys::proc_start(pid)?;
            Some(Kept { local_rank, rank: w.rank, pid, start, drains: w.drains.clone() })
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

    let record = |local_rank: u32, exit: Option<Exit>, at_us: u64, action: RuleAction, hung: bool, silent: bool| {
        let w = &workers[&local_rank];
        let (exit_code, signal) = match exit {
            Some(Exit::Code(c)) => (Some(c), None),
            Some(Exit::Signal(s)) => (None, Some(s)),
            None => (None, None),
        };
        let mut rec = Failure {
            attempt: u32::try_from(round).unwrap_or(u32::MAX),
            rank: w.rank,
            local_rank,
            node_rank: world.group_rank,
            host: plan.output.host.clone(),
            // The report's schema (torchrun's) has a pid: 0 for one that never ran.
            pid: w.pid.unwrap_or(0),
            exit_code,
            signal,
            at_us,
            error_file: None,
            message: None,
            traceback: None,
            action,
            hung,
            no_progress: silent,
            not_started: w.not_started,
        };
        rec.read_error_file(&w.error_file);
        if rec.message.is_none() {
            rec.message = w.why.clone().or_else(|| mpi.why(local_rank).map(str::to_string));
        }
        if silent && rec.message.is_none() {
            let quiet = silent_for.get(&local_rank).map_or(0.0, Duration::as_secs_f64);
            rec.message = Some(format!(
                "reported no progress for {quiet:.0} s (--progress-timeout): stuck, e.g. in a collective"
            ));
        }
        if hung && rec.message.is_none() {
            rec.message = Some(if exit.is_none() {
                "stuck in uninterruptible sleep (D state) past --hung-timeout".into()
            } else {
                "survived SIGKILL past --kill-timeout (uninterruptible sleep)".into()
            });
        }
        rec
    };
    let mut failures: Vec<Failure> = core
        .failures()
        .iter()
        .map(|f| record(f.local_rank, f.exit, f.at_us, f.action, f.exit.is_none() && !f.silent, f.silent))
        .collect();
    for &lr in core.abandoned() {
        failures.push(record(lr, None, now_us(), RuleAction::Fail, true, false));
    }
    (outcome, failures)
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
