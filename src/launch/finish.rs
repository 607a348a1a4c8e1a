//! The end of a run, and the files it leaves: where the run's logs live,
//! the exit code, reason and root cause of a failed job, the failure
//! report, and removing a successful run's temporary directory.

use std::path::{Path, PathBuf};

use crate::config::Plan;
use crate::exit;
use crate::rendezvous::Round;
use crate::stacks::stall::{RankStacks, Stall};
use crate::supervise::policy::FailKind;
use crate::supervise::report::{Failure, Report, RoundRecord, fatal_root, root_cause};

/// What the job's report tells of it so far on this pod: every failure of
/// every round, the rounds, and the last stall the stacks explained.
#[derive(Debug, Default)]
pub(super) struct Story {
    pub failures: Vec<Failure>,
    pub rounds: Vec<RoundRecord>,
    pub stalled: Option<Stalled>,
}

/// A round that ended hung, as every rank's stacks show it.
#[derive(Debug, Clone)]
pub(super) struct Stalled {
    /// The round.
    pub round: u64,
    /// Who the others waited for.
    pub stall: Stall,
    /// Every rank's stacks the pods read.
    pub stacks: Vec<RankStacks>,
}

/// A successful run that was not asked to keep files (no `--log-dir`,
/// `--redirects` or `--tee`) removes its directory under the temporary
/// directory, which would otherwise grow by one per run. Failed and
/// stopped runs keep theirs: the failure report and error files are there.
pub(super) fn forget_logs(plan: &Plan, log_root: &Path, code: u8) {
    let none = crate::config::Streams::default();
    if code != exit::SUCCESS
        || plan.output.log_dir.is_some()
        || plan.output.redirects != none
        || plan.output.tee != none
    {
        return;
    }
    if let Err(e) = std::fs::remove_dir_all(log_root)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::debug!(dir = %log_root.display(), error = %e, "cannot remove the run's temporary directory");
    }
}

pub(super) fn record(round: &Round, end: &str, verdict: &str) -> RoundRecord {
    RoundRecord {
        round: round.number,
        nnodes: round.nnodes,
        group_rank: round.group_rank,
        restarts: round.restarts,
        end: end.to_string(),
        verdict: verdict.to_string(),
    }
}

/// The exit code, the reason and the root cause of a failed job, defined
/// once: the root cause is a failure of the final round, and its code is
/// the exit code (earlier rounds' failures are history).
pub(super) fn fail_code(kind: FailKind, last: &[Failure]) -> (u8, String, Option<Failure>) {
    match kind {
        FailKind::Policy => {
            let f = fatal_root(last);
            let what = f.map_or_else(|| "a worker".to_string(), |f| format!("worker rank {} ({})", f.rank, f.exit()));
            (exit::FAILED_BY_POLICY, format!("{what} matched a fail rule of the failure policy"), f.cloned())
        }
        FailKind::Unkillable => {
            let f = last.iter().find(|f| f.hung);
            let what = f.map_or_else(|| "a worker".to_string(), |f| format!("worker rank {} on {}", f.rank, f.host));
            (exit::WORKER_UNKILLABLE, format!("{what} hung in uninterruptible sleep or survived SIGKILL"), f.cloned())
        }
        FailKind::Budget => match root_cause(last) {
            Some(f) if f.no_progress => (
                f.code(),
                "workers reported no progress for --progress-timeout (the job hung); no restarts left".into(),
                Some(f.clone()),
            ),
            Some(f) => {
                let how = if f.raised {
                    "raised an exception (stopped before it exited)".to_string()
                } else {
                    format!("failed with {}", f.exit())
                };
                (
                    f.code(),
                    format!("worker rank {} {how}; no restarts left{}", f.rank, consequences(f, last)),
                    Some(f.clone()),
                )
            }
            None => (exit::PEER_LOST, "the job failed on a pod that reported no failure".into(), None),
        },
        FailKind::Stuck => {
            (exit::PEER_LOST, "a pod neither stopped its workers nor died within the bound".into(), None)
        }
    }
}

/// The ranks of `last` whose failures `root`'s caused, in words (empty
/// when none): the root cause's own failure came first in cause, theirs
/// may have come first in time.
fn consequences(root: &Failure, last: &[Failure]) -> String {
    use crate::supervise::cause::Cause;
    let mut ranks: Vec<u32> = last
        .iter()
        .filter(|f| f.attempt == root.attempt && f.rank != root.rank && f.cause == Cause::Consequence)
        .map(|f| f.rank)
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    match ranks.as_slice() {
        [] => String::new(),
        [r] => format!(" (rank {r} failed because it did)"),
        many => {
            let shown: Vec<String> = many.iter().take(8).map(u32::to_string).collect();
            let more = if many.len() > 8 { format!(" and {} more", many.len() - 8) } else { String::new() };
            format!(" (ranks {}{more} failed because it did)", shown.join(", "))
        }
    }
}

pub(super) fn report(
    plan: &Plan,
    log_root: &Path,
    (code, reason, root): (u8, String, Option<Failure>),
    story: &Story,
) -> Report {
    let stalled = story.stalled.as_ref();
    let report = Report {
        run_id: plan.run_id.clone(),
        script: plan.entry.script.clone(),
        node_rank: plan.node_rank,
        exit_code: code,
        reason,
        root_cause: root,
        failures: story.failures.clone(),
        rounds: story.rounds.clone(),
        stall: stalled.map(|s| s.stall.summary.clone()),
        stall_round: stalled.map(|s| s.round),
        stalled_ranks: stalled.map(|s| s.stall.stalled_ranks.clone()).unwrap_or_default(),
        stacks: stalled.map(|s| s.stacks.clone()).unwrap_or_default(),
    };
    let path = log_root.join("failure_report.json");
    match report.write(&path) {
        Ok(()) => eprintln!("trainlet: failure report written to {}", path.display()),
        Err(e) => tracing::error!(path = %path.display(), error = %e, "cannot write the failure report"),
    }
    eprint!("{}", report.summary());
    let cause = report.root_cause.as_ref().and_then(|f| f.message.as_deref()).and_then(|m| m.lines().next());
    let line = match (&report.root_cause, cause) {
        // The stall's line says more than "no progress": who, and where.
        (Some(Failure { stall: Some(why), .. }), _) => format!("{} (exit {}): {why}", report.reason, report.exit_code),
        (Some(f), Some(m)) => format!("{} (exit {}): {}: {m}", report.reason, report.exit_code, f.host),
        _ => format!("{} (exit {})", report.reason, report.exit_code),
    };
    // A served run's failure ends the run, not the pod.
    if plan.serve.is_none() {
        // One Event for the job's failure: on the root cause's pod (the
        // store host's when no failure is known).
        let here = report.root_cause.as_ref().map_or(plan.serve_store, |f| f.host == plan.output.host);
        if here {
            crate::events::global().emit(crate::events::Event {
                type_: crate::events::Type::Warning,
                reason: "JobFailed",
                action: "Fail",
                note: line.clone(),
            });
        }
        termination_message(plan, &line);
        if let Some(path) = &plan.output.error_file {
            let now_s = crate::clock::now_us() / 1_000_000;
            let record = super::error_file::for_job(report.root_cause.as_ref(), plan.node_rank, &line, now_s);
            super::error_file::write(path, &record);
        }
    }
    report
}

/// The Event of a restart of the workers after `root` failed (the store
/// host's). No counter in the note: repeats fold into one Event whose
/// count is the restarts so far, of `--max-restarts`.
pub(super) fn restarted(plan: &Plan, what: &str, root: Option<&Failure>) {
    if !plan.serve_store {
        return;
    }
    let why = root.map_or_else(String::new, |f| {
        let line = f.cause_line.as_deref().or(f.message.as_deref()).and_then(|l| l.lines().next());
        match line.map(str::trim).filter(|l| !l.is_empty()) {
            Some(line) => format!(" after rank {} failed ({line})", f.rank),
            None => format!(" after rank {} failed", f.rank),
        }
    });
    crate::events::global().emit(crate::events::Event {
        type_: crate::events::Type::Normal,
        reason: "Restarted",
        action: "Restart",
        note: format!("{what}{why}; --max-restarts {}", plan.max_restarts),
    });
}

/// The Event of a pod that leaves the job because it is not healthy.
pub(super) fn left_unhealthy(text: &str) {
    crate::events::global().emit(crate::events::Event {
        type_: crate::events::Type::Warning,
        reason: "LeftUnhealthy",
        action: "Leave",
        note: format!("{text}; it leaves the job (a spare or a new pod takes its place)"),
    });
}

/// The Event and termination message of a pod evicted as a straggler's.
pub(super) fn evicted(plan: &Plan, text: &str) {
    crate::events::global().emit(crate::events::Event {
        type_: crate::events::Type::Warning,
        reason: "StragglerEvicted",
        action: "Leave",
        note: format!("{text}; a spare takes its rank"),
    });
    termination_message(plan, text);
}

/// Most bytes of a termination message Kubernetes keeps.
const TERMINATION_MAX: usize = 4096;

/// Write why this pod's job failed where Kubernetes reads it when the
/// container ends (`terminationMessagePath`: `kubectl get pod`, `describe`
/// and the Job's and JobSet's failure messages show it): `TRAINLET_TERMINATION_LOG`,
/// else `/dev/termination-log` when it exists (every pod has it; nothing
/// is made outside Kubernetes). At most 4 KiB, cut at a character.
pub(super) fn termination_message(plan: &Plan, text: &str) {
    let default = Path::new("/dev/termination-log");
    let Some(path) = plan.output.termination_log.as_deref().or_else(|| default.exists().then_some(default)) else {
        return;
    };
    let mut end = text.len().min(TERMINATION_MAX);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    if let Err(e) = std::fs::write(path, &text.as_bytes()[..end]) {
        tracing::warn!(path = %path.display(), error = %e, "cannot write the termination message");
    }
}

/// Create `dir` and prove a file can be written in it.
pub(super) fn check_writable(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let probe = dir.join(".trainlet-write-check");
    std::fs::write(&probe, b"ok")?;
    std::fs::remove_file(&probe)
}

/// `<log_dir>/<run_id>_<pid>`, torchrun's layout; a temp dir when no --log-dir.
pub(super) fn log_root(plan: &Plan) -> PathBuf {
    let base = plan.output.log_dir.clone().unwrap_or_else(|| std::env::temp_dir().join("trainlet"));
    base.join(format!("{}_{}", plan.run_id, std::process::id()))
}
