//! This pod's workers in one attempt ([`Crew`]): how each is started
//! (or a kept one given its rank) with its environment, placement and
//! output, and the failure record of each that failed. The attempt's
//! event loop (`super::attempt`) drives them.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio_util::task::TaskTracker;

use crate::config::Env;
use crate::config::rules::RuleAction;
use crate::exit;
use crate::process::signals::now_us;
use crate::process::spawn::{Spawner, WorkerSpec};
use crate::supervise::carry::{Carry, Kept};
use crate::supervise::mpi::Ranks;
use crate::supervise::output::{self, Sink};
use crate::supervise::policy::Event;
use crate::supervise::report::Failure;
use crate::supervise::worker::{WorldView, framework_env, substitute, worker_env};
use crate::sys::Exit;

/// One local rank's worker in the attempt.
pub(super) struct Worker {
    /// Its pid and process group; None when it never started.
    pub(super) pid: Option<i32>,
    /// The tasks reading its output.
    pub(super) drains: TaskTracker,
    /// The last lines it printed on stderr.
    pub(super) tail: output::Tail,
    /// The file it touches to show progress (with --progress-timeout).
    pub(super) heartbeat: Option<PathBuf>,
    pub(super) rank: u32,
    pub(super) error_file: PathBuf,
    /// The code for a worker that never ran (126, 127, 210).
    pub(super) not_started: Option<u8>,
    /// Why it never ran.
    pub(super) why: Option<String>,
}

/// This pod's workers in one attempt, as the shell sees them.
pub(super) struct Crew {
    /// Each local rank's worker.
    pub(super) workers: HashMap<u32, Worker>,
    /// The local rank of each live worker's pid.
    pub(super) by_pid: HashMap<i32, u32>,
    /// What the round's PMI service says of the ranks (`--framework mpi`).
    pub(super) mpi: Ranks,
    /// Exits of workers that never started, for the core first.
    pub(super) early: Vec<Event>,
    /// Workers told silent past --progress-timeout, and for how long.
    pub(super) silent_for: HashMap<u32, Duration>,
    /// How each worker that exited ended, and when (wall-clock µs).
    pub(super) exits: HashMap<u32, (Exit, u64)>,
    /// When the first signal went to the workers (the stop), if one did.
    pub(super) signalled_us: Option<u64>,
    /// Workers killed because they raised and hung in their exit
    /// (`super::exiting`): when their exception was printed, and it.
    pub(super) exiting: HashMap<u32, (u64, String)>,
    /// When this attempt began, before any of its workers started or
    /// rejoined: a Flight Recorder dump older than that is an earlier
    /// round's.
    pub(super) started: std::time::SystemTime,
}

/// Start every local rank's worker (or give a kept one its rank).
pub(super) async fn spawn_all(
    world: &WorldView<'_>,
    (dir, files_ok): (&Path, bool),
    (spawner, carry): (&Spawner, &mut Carry),
    env: &Env,
) -> Crew {
    let plan = world.plan;
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
    let mut crew = Crew {
        workers: HashMap::new(),
        by_pid: HashMap::new(),
        mpi: Ranks::new(world.pmi.and_then(crate::mpi::pmi::round::Link::take_notes)),
        early: Vec::new(),
        silent_for: HashMap::new(),
        exits: HashMap::new(),
        signalled_us: None,
        exiting: HashMap::new(),
        started: std::time::SystemTime::now(),
    };
    let (placed, _) = crate::gpu::prepare::placements(&plan.gpu, plan.nproc);
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
            let order = (plan.gpu.user_order, plan.gpu.narrowed);
            wenv.extend(crate::gpu::plan::rank_env(p, &plan.gpu.gpus, plan.gpu.visibility, order));
            wenv.extend(crate::gpu::plan::nic_env(p, &plan.gpu.gpus, &nics, |v| env.get(v).is_some()));
        } else {
            wenv.extend(crate::gpu::plan::narrowed_env(&plan.gpu.gpus, plan.gpu.visibility, plan.gpu.narrowed));
        }
        let w = Worker {
            pid: None,
            drains: TaskTracker::new(),
            tail: output::Tail::default(),
            heartbeat,
            rank,
            error_file,
            not_started: None,
            why: None,
        };
        // A kept worker takes its rank as it is: it gets the round's variables.
        if let (Some(r), Some(i)) = (world.survivors, kept.iter().position(|k| k.local_rank == local_rank)) {
            let k = kept.swap_remove(i);
            tracing::info!(local_rank, rank, pid = k.pid, was_rank = k.rank, "a kept worker rejoins");
            r.rejoin(k.pid, k.start, rank, wenv);
            crew.by_pid.insert(k.pid, local_rank);
            crew.workers.insert(local_rank, Worker { pid: Some(k.pid), drains: k.drains, tail: k.tail, ..w });
            continue;
        }
        let mut spec = WorkerSpec::piped(plan.entry.program.clone(), substitute(&plan.entry.args, local_rank), wenv);
        spec.unset = unset;
        spec.cwd.clone_from(&plan.entry.cwd);
        spec.cpus = place.and_then(|p| p.cpus.clone());
        spec.mem_node = place.and_then(|p| p.mem_node);
        spec.oom_score_adj = oom_adj;
        spec.pass_fd = world.pmi.and_then(|l| l.take_fd(local_rank));
        spawn_one(world, (local_rank, &rank_dir, files_ok), (spawner, spec), w, &mut crew).await;
    }
    // Kept workers left over (the world shrank below their local rank).
    for k in kept {
        tracing::info!(local_rank = k.local_rank, pid = k.pid, "a kept worker has no rank in this round; stopping it");
        k.kill();
    }
    crew
}

/// Start local rank `local_rank`'s worker from `spec` (forked from the
/// zygote when it can run it, else exec'd) and drain its output; one that
/// cannot start exits at once with the code a shell would give.
async fn spawn_one(
    world: &WorldView<'_>,
    (local_rank, rank_dir, files_ok): (u32, &Path, bool),
    (spawner, spec): (&Spawner, WorkerSpec),
    mut w: Worker,
    crew: &mut Crew,
) {
    let plan = world.plan;
    // Not started: the code a shell would give, and why.
    let spawned: Result<_, (u8, String)> = match world.unstartable {
        Some(why) => Err((exit::WORKER_NOT_EXECUTABLE, why.to_string())),
        None => {
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
            let prefix =
                output::prefix(&plan.output.prefix_template, &plan.output.role, local_rank, w.rank, &plan.output.host);
            let shown = plan.output.console_ranks.as_ref().is_none_or(|r| r.contains(&local_rank));
            // Without files, a redirected stream stays on the console.
            let (red_out, red_err) = plan.output.redirects.for_rank(local_rank);
            let (red_out, red_err) = (red_out && files_ok, red_err && files_ok);
            let (tee_out, tee_err) = plan.output.tee.for_rank(local_rank);
            let files = plan.output.log_dir.is_some();
            for (fd, is_err, redirected, teed, name) in
                [(sp.stdout, false, red_out, tee_out, "stdout.log"), (sp.stderr, true, red_err, tee_err, "stderr.log")]
            {
                let Some(fd) = fd else { continue };
                let sink = Sink {
                    prefix: prefix.clone(),
                    console: shown && (teed || !redirected),
                    file: (files_ok && (files || redirected || teed)).then(|| rank_dir.join(name)),
                    is_err,
                    tap: world.tap.clone(),
                    tail: is_err.then(|| w.tail.clone()),
                };
                w.drains.spawn(output::drain(fd, sink));
            }
            w.drains.close();
            crate::metrics::global().workers_started.inc();
            crew.by_pid.insert(sp.pid, local_rank);
            w.pid = Some(sp.pid);
            crew.workers.insert(local_rank, w);
        }
        Err((code, why)) => {
            tracing::error!(local_rank, code, error = %why, "cannot start worker");
            w.drains.close(); // no output to wait for
            w.heartbeat = None;
            w.not_started = Some(code);
            w.why = Some(why);
            crew.workers.insert(local_rank, w);
            crate::metrics::global().worker_exited(Exit::Code(i32::from(code)));
            crew.early.push(Event::WorkerExited { local_rank, exit: Exit::Code(i32::from(code)), at_us: now_us() });
        }
    }
}

/// How long before the stop an exception a stopped worker raised may have
/// been printed and still count as why it was failing: a rank that raised
/// is stopped within seconds (its peers' collectives break, or its own
/// exit ends the round); an exception older than this was caught and
/// survived.
const RAISED_WITHIN: Duration = Duration::from_secs(60);

/// The workers trainlet stopped after the round failed that had raised an
/// exception of their own before it did (printed, not exited yet: an
/// interpreter flushing, finalizing a collective, or waiting in its exit
/// for a peer): each is a failure of the round, judged by its exception,
/// whatever signal ended it. `recorded`: the local ranks already failures.
pub(super) fn raised(world: &WorldView<'_>, crew: &Crew, round: u64, recorded: &[u32]) -> Vec<Failure> {
    let Some(stop) = crew.signalled_us else { return Vec::new() };
    let from = stop.saturating_sub(u64::try_from(RAISED_WITHIN.as_micros()).unwrap_or(u64::MAX));
    let mut out = Vec::new();
    let mut ranks: Vec<&u32> = crew.workers.keys().filter(|lr| !recorded.contains(lr)).collect();
    ranks.sort_unstable();
    for &local_rank in ranks {
        let w = &crew.workers[&local_rank];
        let Some(&(exit, at_us)) = crew.exits.get(&local_rank) else { continue };
        if exit == Exit::Code(0) {
            continue;
        }
        let Some((printed, line)) = crate::supervise::cause::raised(&w.tail.lines(), from, stop) else { continue };
        tracing::info!(local_rank, rank = w.rank, error = %line, "a worker stopped after the round failed had raised an exception of its own before; it is a failure of the round");
        let mut rec = record(
            world,
            crew,
            round,
            Recorded { local_rank, exit: Some(exit), at_us, action: RuleAction::Restart, hung: false, silent: false },
        );
        rec.raised = true;
        rec.judge();
        rec.error_at_us = Some(printed);
        out.push(rec);
    }
    out
}

/// One failure as the core recorded it.
pub(super) struct Recorded {
    pub(super) local_rank: u32,
    pub(super) exit: Option<Exit>,
    pub(super) at_us: u64,
    pub(super) action: RuleAction,
    /// Stuck in D state, or survived SIGKILL.
    pub(super) hung: bool,
    /// Silent past --progress-timeout.
    pub(super) silent: bool,
}

/// The failure record of `f`, with what the worker wrote in its error
/// file, or else why it failed as trainlet saw it.
pub(super) fn record(world: &WorldView<'_>, crew: &Crew, round: u64, f: Recorded) -> Failure {
    let w = &crew.workers[&f.local_rank];
    let (exit_code, signal) = match f.exit {
        Some(Exit::Code(c)) => (Some(c), None),
        Some(Exit::Signal(s)) => (None, Some(s)),
        None => (None, None),
    };
    let mut rec = Failure {
        attempt: u32::try_from(round).unwrap_or(u32::MAX),
        rank: w.rank,
        local_rank: f.local_rank,
        node_rank: world.group_rank,
        host: world.plan.output.host.clone(),
        // The report's schema (torchrun's) has a pid: 0 for one that never ran.
        pid: w.pid.unwrap_or(0),
        exit_code,
        signal,
        at_us: f.at_us,
        error_file: None,
        message: None,
        traceback: None,
        action: f.action,
        hung: f.hung,
        no_progress: f.silent,
        not_started: w.not_started,
        stall: None,
        log_tail: w.tail.text(),
        cause: Default::default(),
        cause_line: None,
        error_at_us: None,
        raised: false,
    };
    rec.read_error_file(&w.error_file);
    if rec.message.is_none() {
        rec.message = w.why.clone().or_else(|| crew.mpi.why(f.local_rank).map(str::to_string));
    }
    if f.silent && rec.message.is_none() {
        let quiet = crew.silent_for.get(&f.local_rank).map_or(0.0, Duration::as_secs_f64);
        rec.message =
            Some(format!("reported no progress for {quiet:.0} s (--progress-timeout): stuck, e.g. in a collective"));
    }
    if f.hung && rec.message.is_none() {
        rec.message = Some(if f.exit.is_none() {
            "stuck in uninterruptible sleep (D state) past --hung-timeout".into()
        } else {
            "survived SIGKILL past --kill-timeout (uninterruptible sleep)".into()
        });
    }
    if let Some((at, _)) = crew.exiting.get(&f.local_rank) {
        // Killed by trainlet for hanging in its exit: its failure is its exception.
        rec.raised = true;
        rec.error_at_us = Some(*at);
    }
    rec.judge();
    if rec.error_file.is_none() && !rec.raised {
        // When the exception that judged it was printed.
        let lines = w.tail.lines();
        let refs: Vec<(u64, &str)> = lines.iter().map(|(at, l)| (*at, l.as_str())).collect();
        rec.error_at_us = crate::supervise::cause::exceptions(&refs)
            .into_iter()
            .find(|(_, e)| rec.cause_line.as_ref() == Some(e))
            .map(|(at, _)| at);
    }
    rec
}
