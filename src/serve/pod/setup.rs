//! Serve mode's setup steps on this pod (`crate::serve::setup`): applied in
//! order, from the first one this pod's agent has not applied (all of them,
//! in fresh directories, when a run changed what they left), before its
//! next run or actor starts; each step's lines go to the console and to that run's
//! log, as `[setup]` lines. A failed step stops there: the run cannot
//! start on this pod, and says which step failed where.

use tokio::sync::mpsc::UnboundedReceiver;

use crate::config::Plan;
use crate::process::signals::{Heard, SysEvent};
use crate::process::spawn::{Spawner, WorkerSpec};
use crate::serve::setup::{Applied, Dirs, Step, chain, first_to_apply};
use crate::supervise::output::{self, LineTap, Sink};
use crate::sys::{self, Exit};

/// Longest wait for a step's last lines after it exited.
const DRAIN_LIMIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Why the steps were not all applied.
#[derive(Debug)]
pub(super) enum Stop {
    /// A step failed (what, where, how).
    Failed(String),
    /// A stop signal came.
    Signal(i32),
    /// The round ended meanwhile (the run was stopped, a pod left or joined).
    Ended(String),
}

/// The end of the round the steps are applied in.
pub(super) type EndWatch = std::pin::Pin<Box<dyn std::future::Future<Output = String> + Send>>;

/// What applying a step needs of the pod.
pub(super) struct Pod<'a> {
    pub plan: &'a Plan,
    pub spawner: &'a Spawner,
    pub tap: Option<LineTap>,
}

/// Apply `steps` from the first this pod has not applied (`applied`, kept
/// by the agent), in fresh directories when what the steps left there
/// changed since (a run wrote there) or this agent has not applied any.
pub(super) async fn apply(
    steps: &[Step],
    (dirs, applied): (&Dirs, &mut Applied),
    pod: &Pod<'_>,
    round: (&mut UnboundedReceiver<SysEvent>, &mut EndWatch),
) -> Result<(), Stop> {
    let host = &pod.plan.output.host;
    // Off the runtime's threads: the walk is bounded, but a run decides
    // how slow each entry is to read.
    let (d, was) = (dirs.clone(), applied.left.clone());
    let now = tokio::task::spawn_blocking(move || d.manifest(was.as_ref()))
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
    let changed = match (&applied.left, now) {
        (None, _) => {
            tracing::info!(dir = %dirs.root.display(), "the setup steps' directories start fresh with this agent (its predecessor's runs could write there)");
            true
        }
        (Some(_), Ok((_, named))) if named.is_empty() => false,
        (Some(_), Ok((_, named))) => {
            tracing::warn!(dir = %dirs.root.display(), changes = %named.join(", "), "the setup steps' directories changed since the steps wrote them (a run wrote there): applying every step again in fresh ones");
            true
        }
        (Some(_), Err(e)) => {
            tracing::warn!(dir = %dirs.root.display(), error = %e, "cannot check the setup steps' directories: applying every step again in fresh ones");
            true
        }
    };
    if changed {
        let d = dirs.clone();
        let wiped = tokio::task::spawn_blocking(move || d.wipe())
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
        wiped.map_err(|e| {
            Stop::Failed(format!(
                "cannot clear the setup steps' directories under {} on pod {host}: {e}",
                dirs.root.display()
            ))
        })?;
        applied.chain.clear();
    }
    let out = apply_from(steps, (dirs, &mut applied.chain), pod, round).await;
    // What the steps left, to be found unchanged before the next run.
    let d = dirs.clone();
    let left = tokio::task::spawn_blocking(move || d.manifest(None))
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
    applied.left = match left {
        Ok((m, _)) => Some(m),
        Err(e) => {
            tracing::warn!(dir = %dirs.root.display(), error = %e, "cannot take the manifest of what the setup steps left: every step is applied again before the next run");
            None
        }
    };
    out
}

/// Apply `steps` from the first not in `applied`, recording each there.
async fn apply_from(
    steps: &[Step],
    (dirs, applied): (&Dirs, &mut Vec<String>),
    pod: &Pod<'_>,
    (events, end): (&mut UnboundedReceiver<SysEvent>, &mut EndWatch),
) -> Result<(), Stop> {
    let from = first_to_apply(steps, applied);
    if from == steps.len() {
        return Ok(());
    }
    let host = &pod.plan.output.host;
    for d in [dirs.site(), dirs.work()] {
        std::fs::create_dir_all(&d)
            .map_err(|e| Stop::Failed(format!("cannot make {} for the setup steps on pod {host}: {e}", d.display())))?;
    }
    let digests = chain(steps);
    let python = pod.plan.entry.python.clone().unwrap_or_else(|| "python3".into());
    let path = std::env::var("PATH").unwrap_or_default();
    let pythonpath = std::env::var("PYTHONPATH").unwrap_or_default();
    for (i, step) in steps.iter().enumerate().skip(from) {
        let what = step.describe();
        tracing::info!(step = i + 1, of = steps.len(), what = %what, "applying a setup step");
        let started = std::time::Instant::now();
        let (program, args) = match step {
            Step::Env(_) => (None, Vec::new()),
            Step::Pip(a) => {
                let mut args: Vec<String> =
                    ["-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--upgrade", "--target"]
                        .iter()
                        .map(|s| (*s).to_string())
                        .collect();
                args.push(dirs.site().display().to_string());
                args.extend(a.iter().cloned());
                (Some(python.clone()), args)
            }
            // A file, not an argument: an argument holds at most 128 KiB
            // (MAX_ARG_STRLEN), a step up to `serve::setup::MAX_STEP`.
            Step::Bash(s) => {
                let file = dirs.script();
                // Replacing whatever a run left at that name (a link, a FIFO).
                crate::serve::files::write_new(&file, s.as_bytes()).map_err(|e| {
                    Stop::Failed(format!("cannot write setup step {} to {} on pod {host}: {e}", i + 1, file.display()))
                })?;
                (Some("bash".to_string()), vec![file.display().to_string()])
            }
        };
        if let Some(program) = program {
            let mut spec = WorkerSpec::piped(program, args, dirs.env(&steps[..i], &path, &pythonpath));
            spec.cwd = Some(dirs.work());
            let exit = run(spec, pod, events, end).await.map_err(|e| match e {
                Stop::Failed(why) => {
                    Stop::Failed(format!("setup step {} of {} ({what}) on pod {host}: {why}", i + 1, steps.len()))
                }
                s => s,
            })?;
            if exit != Exit::Code(0) {
                return Err(Stop::Failed(format!(
                    "setup step {} of {} ({what}) failed on pod {host}: {exit} (its lines are in the log, as [setup])",
                    i + 1,
                    steps.len()
                )));
            }
        }
        *applied = digests[..=i].to_vec();
        tracing::info!(step = i + 1, took_s = started.elapsed().as_secs_f64(), "setup step applied");
    }
    compile_site(dirs, &python, (&path, &pythonpath, steps), pod, (events, end)).await
}

/// Compile what the steps left in the site directory (pip compiles what it
/// installs; a module a bash step wrote is not), so that a run's imports
/// find it compiled and write nothing there: Python's own `__pycache__`
/// would else count as a run's change and make every pod apply every step
/// again before the next run (issue 53). Python still checks each file
/// against its source at import. A failure (no such interpreter, a file
/// that does not compile) is logged: imports then compile as they go.
async fn compile_site(
    dirs: &Dirs,
    python: &str,
    (path, pythonpath, steps): (&str, &str, &[Step]),
    pod: &Pod<'_>,
    (events, end): (&mut UnboundedReceiver<SysEvent>, &mut EndWatch),
) -> Result<(), Stop> {
    let site = dirs.site().display().to_string();
    let args = ["-m", "compileall", "-q", "-j", "0", site.as_str()].map(str::to_string).to_vec();
    let mut spec = WorkerSpec::piped(python.to_string(), args, dirs.env(steps, path, pythonpath));
    spec.cwd = Some(dirs.work());
    tracing::info!(dir = %site, "compiling what the setup steps left in the site directory");
    match run(spec, pod, events, end).await {
        Ok(Exit::Code(0)) => Ok(()),
        Ok(exit) => {
            tracing::warn!(dir = %site, %exit, "cannot compile every module the setup steps left (its lines are in the log, as [setup]); runs compile them as they import them, and the pods apply the steps again before the next run");
            Ok(())
        }
        Err(Stop::Failed(why)) => {
            tracing::warn!(dir = %site, error = %why, "cannot compile the modules the setup steps left; runs compile them as they import them");
            Ok(())
        }
        Err(stop) => Err(stop),
    }
}

/// Run one step's process to its end, its lines to the console and the tap.
async fn run(
    spec: WorkerSpec,
    pod: &Pod<'_>,
    events: &mut UnboundedReceiver<SysEvent>,
    end: &mut EndWatch,
) -> Result<Exit, Stop> {
    let program = spec.program.clone();
    let sp = pod
        .spawner
        .spawn(spec)
        .await
        .map_err(|e| Stop::Failed(format!("cannot start {program}: {}", crate::error::error_chain(&e))))?;
    crate::process::sweep::keep(sp.pid);
    let sink = |is_err| Sink {
        prefix: "[setup]: ".into(),
        console: true,
        file: None,
        is_err,
        tap: pod.tap.clone(),
        tail: None,
    };
    let mut drains = Vec::new();
    if let Some(fd) = sp.stdout {
        drains.push(tokio::spawn(output::drain(fd, sink(false))));
    }
    if let Some(fd) = sp.stderr {
        drains.push(tokio::spawn(output::drain(fd, sink(true))));
    }
    let mut stopped = None;
    let mut ended = None;
    let exit = loop {
        let ev = tokio::select! {
            ev = events.recv() => ev,
            why = &mut *end, if ended.is_none() => {
                tracing::warn!(end = %why, "the round ended during a setup step; ending it (it runs again with the next run)");
                sys::signal_group(sp.pid, libc::SIGKILL);
                ended = Some(why);
                continue;
            }
        };
        // The events gone (the agent is ending): no exit will come to wait for.
        let closed = ev.is_none();
        match Heard::of(ev, &pod.plan.stop_signals) {
            Heard::Exited { pid, exit, .. } if pid == sp.pid => break exit,
            Heard::Exited { pid, exit, .. } => tracing::debug!(pid, %exit, "reaped orphan"),
            Heard::Stop { signal, .. } => {
                tracing::warn!(signal = %sys::signal_name(signal), "stop signal during a setup step; ending it");
                sys::signal_group(sp.pid, libc::SIGKILL);
                stopped = Some(signal);
                if closed {
                    break Exit::Signal(libc::SIGKILL);
                }
            }
            Heard::Other(_) => {}
        }
    };
    // What the step left running in its group goes with it.
    sys::signal_group(sp.pid, libc::SIGKILL);
    crate::process::sweep::release(sp.pid);
    for d in drains {
        let _ = tokio::time::timeout(DRAIN_LIMIT, d).await;
    }
    match (stopped, ended) {
        (Some(s), _) => Err(Stop::Signal(s)),
        (None, Some(why)) => Err(Stop::Ended(why)),
        (None, None) => Ok(exit),
    }
}
