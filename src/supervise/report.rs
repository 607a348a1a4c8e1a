//! Failure records and the failure report.
//!
//! Each pod records the workers that failed on their own (not those it
//! stopped) and publishes them in the store; every pod then picks the same
//! root cause: the first failure in cause ([`super::cause`]: one of its own
//! before one nothing explains before one another rank's failure caused),
//! then in wall-clock time, across pods. A worker that used torch's
//! `@record` wrote TORCHELASTIC_ERROR_FILE; its message and traceback are
//! read into the record; every record keeps the worker's last stderr
//! lines, and a worker without an error file gets its last exception line
//! as its message. The report is printed as a torchrun-style summary and
//! written as JSON.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::rules::RuleAction;
use crate::sys::Exit;

/// One worker failure, as shared between pods.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    /// Restart attempt it happened in.
    pub attempt: u32,
    /// Global rank.
    pub rank: u32,
    /// Local rank on its pod.
    pub local_rank: u32,
    /// Its pod's node rank.
    pub node_rank: u32,
    /// Its pod's name.
    pub host: String,
    /// Its pid.
    pub pid: i32,
    /// Exit code, if it exited.
    pub exit_code: Option<i32>,
    /// Signal number, if it was killed.
    pub signal: Option<i32>,
    /// When it was reaped, wall-clock microseconds.
    pub at_us: u64,
    /// The worker's TORCHELASTIC_ERROR_FILE, if it wrote one.
    pub error_file: Option<String>,
    /// The error message from that file.
    pub message: Option<String>,
    /// The Python traceback from that file.
    pub traceback: Option<String>,
    /// What the failure policy said: `restart`, `fail` or `ignore`.
    #[serde(default = "default_action")]
    pub action: RuleAction,
    /// The worker was stuck in uninterruptible sleep, or survived SIGKILL.
    #[serde(default)]
    pub hung: bool,
    /// The worker stopped reporting progress for `--progress-timeout`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_progress: bool,
    /// The worker never ran: the code trainlet gives for that (126, 127
    /// from exec's errno; 210 when fork failed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_started: Option<u8>,
    /// For a worker that hung or made no progress: who the job waited
    /// for, from every rank's stacks (`crate::stacks::stall`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stall: Option<String>,
    /// The last lines it printed on stderr (at most
    /// `output::TAIL_LINES` lines, `output::TAIL_BYTES` bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_tail: Option<String>,
    /// What it was: its own failure, one another rank's caused, or
    /// unknown ([`super::cause::judge`]).
    #[serde(default)]
    pub cause: Cause,
    /// The line that says so (an exception, a signal, a rule).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cause_line: Option<String>,
    /// When that exception was printed, wall-clock microseconds: the
    /// failure's time in cause (a rank that raised may exit after the
    /// peers it broke).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_at_us: Option<u64>,
    /// It raised an exception of its own and trainlet stopped it (the
    /// round had failed) before it exited.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub raised: bool,
}

/// What a failure was, as its record shows it. Ordered: the root cause is
/// the earliest failure of the smallest kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// It failed on its own.
    Own,
    /// Nothing says.
    #[default]
    Unknown,
    /// It failed because another rank did.
    Consequence,
}

impl Cause {
    /// In words, for the report.
    pub fn text(self) -> &'static str {
        match self {
            Cause::Own => "its own",
            Cause::Unknown => "unknown (an exit code, no error)",
            Cause::Consequence => "a consequence of another rank's failure",
        }
    }
}

fn default_action() -> RuleAction {
    RuleAction::Restart
}

/// One rendezvous round of the job, as this pod saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RoundRecord {
    /// Round number.
    pub round: u64,
    /// Pods in it.
    pub nnodes: u32,
    /// This pod's group rank.
    pub group_rank: u32,
    /// Job-wide restarts used before it.
    pub restarts: u32,
    /// How it ended (`rR/end`).
    pub end: String,
    /// What the pods decided.
    pub verdict: String,
}

impl Failure {
    /// How it ended.
    pub fn exit(&self) -> Exit {
        match (self.exit_code, self.signal) {
            (_, Some(s)) => Exit::Signal(s),
            (Some(c), None) => Exit::Code(c),
            (None, None) => Exit::Code(1),
        }
    }

    /// trainlet's exit code for this failure (exit.rs): the spawner's code
    /// for a worker that never ran, else the worker's own, mapped; a
    /// failure that exited 0 (an MPI rank gone without finalize, a
    /// `0=restart` rule) gives 1, never success.
    pub fn code(&self) -> u8 {
        if self.no_progress {
            return crate::exit::WORKER_HUNG;
        }
        if self.raised {
            // What CPython exits with for an exception nobody caught.
            return 1;
        }
        match self.not_started.unwrap_or_else(|| crate::exit::for_worker(self.exit())) {
            crate::exit::SUCCESS => 1,
            c => c,
        }
    }

    /// Fill message/traceback from the worker's error file, if it exists.
    pub fn read_error_file(&mut self, path: &Path) {
        let text = match read_error_file(path) {
            None => return,
            Some(Ok(text)) => text,
            Some(Err(TooLarge)) => {
                self.error_file = Some(path.display().to_string());
                self.message = Some(format!("(the worker's error file is over {ERROR_FILE_MAX} bytes; not read)"));
                return;
            }
        };
        let Ok(json) = serde_json::from_slice::<serde_json::Value>(&text) else { return };
        let msg = &json["message"];
        self.error_file = Some(path.display().to_string());
        self.message = msg["message"].as_str().map(str::to_string).or_else(|| msg.as_str().map(str::to_string));
        self.traceback = msg["extraInfo"]["py_callstack"].as_str().map(str::to_string);
    }
}

/// Most bytes of a worker's error file read: the worker writes it, and
/// torch's are kilobytes, so a worker cannot make PID 1 read without end.
pub(crate) const ERROR_FILE_MAX: u64 = 1 << 20;

/// A worker's error file over [`ERROR_FILE_MAX`] bytes.
#[derive(Debug)]
pub(crate) struct TooLarge;

/// A worker's error file, read at most [`ERROR_FILE_MAX`] bytes: None when
/// it cannot be opened or read.
pub(crate) fn read_error_file(path: &Path) -> Option<Result<Vec<u8>, TooLarge>> {
    use std::io::Read as _;
    let file = std::fs::File::open(path).ok()?;
    let mut text = Vec::new();
    file.take(ERROR_FILE_MAX + 1).read_to_end(&mut text).ok()?;
    Some(if text.len() as u64 > ERROR_FILE_MAX { Err(TooLarge) } else { Ok(text) })
}

/// The first failure in cause, then in time: of the earliest attempt that
/// failed, a failure of its own before one nothing explains before one
/// another rank's caused ([`Cause`]), the earliest of that kind (by when
/// its error was printed, else when it exited); ties broken by rank so
/// every pod agrees.
pub fn root_cause(failures: &[Failure]) -> Option<&Failure> {
    failures.iter().min_by_key(|f| (f.attempt, f.cause, f.error_at_us.unwrap_or(f.at_us), f.rank))
}

/// The earliest failure that matched a `fail` rule: the job's cause when
/// the policy ended it.
pub fn fatal_root(failures: &[Failure]) -> Option<&Failure> {
    failures.iter().filter(|f| f.action == RuleAction::Fail).min_by_key(|f| (f.attempt, f.at_us, f.rank))
}

/// Ranks whose stacks the summary shows (the JSON has them all).
const STACKS_SHOWN: usize = 16;
/// Innermost frames of each shown.
const FRAMES_SHOWN: usize = 3;

/// The whole-job report written at a failed exit.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// TORCHELASTIC_RUN_ID.
    pub run_id: String,
    /// The user's script or program.
    pub script: String,
    /// This pod's node rank.
    pub node_rank: u32,
    /// trainlet's exit code.
    pub exit_code: u8,
    /// Why trainlet exits, in words.
    pub reason: String,
    /// The first failure across all pods and attempts.
    pub root_cause: Option<Failure>,
    /// Every failure of every attempt, all pods.
    pub failures: Vec<Failure>,
    /// Every round this pod took part in, in order.
    pub rounds: Vec<RoundRecord>,
    /// Who the others waited for in the last round that hung, in words
    /// (from every rank's stacks).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stall: Option<String>,
    /// That round.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stall_round: Option<u64>,
    /// The ranks the others waited for in that round.
    pub stalled_ranks: Vec<u32>,
    /// Every rank's stacks in that round, read before its workers stopped.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stacks: Vec<crate::stacks::stall::RankStacks>,
}

impl Report {
    /// Human summary in torchrun's layout: the root cause once, headed by
    /// the exit code it gives, then every other failure of every round.
    pub fn summary(&self) -> String {
        let line = "-".repeat(60);
        let mut s = format!("{} FAILED (exit code {})\n{line}\n{}\n", self.script, self.exit_code, self.reason);
        let entry = |s: &mut String, i: usize, f: &Failure| {
            let exit = match f.exit() {
                _ if f.exit_code.is_none() && f.signal.is_none() => format!("none, still running (pid: {})", f.pid),
                Exit::Code(c) => format!("{c} (pid: {})", f.pid),
                Exit::Signal(sig) => format!("-{sig} (pid: {})  ({})", f.pid, crate::sys::signal_name(sig)),
            };
            let _ = write!(
                s,
                "[{i}]:\n  time      : {}\n  host      : {} (node rank {})\n  rank      : {} (local_rank: {})\n  attempt   : {}\n  exitcode  : {exit}\n  error_file: {}\n",
                crate::clock::format_time(f.at_us),
                f.host,
                f.node_rank,
                f.rank,
                f.local_rank,
                f.attempt,
                f.error_file.as_deref().unwrap_or("<N/A>"),
            );
            let tb = f.traceback.as_deref().or(f.message.as_deref());
            let _ = writeln!(
                s,
                "  outcome   : {}{}",
                self.outcome(f),
                if f.hung {
                    " (hung)"
                } else if f.no_progress {
                    " (no progress)"
                } else {
                    ""
                }
            );
            let _ = writeln!(s, "  traceback : {}", tb.unwrap_or("<N/A>").trim_end().replace('\n', "\n    "));
            if let Some(why) = &f.stall {
                let _ = writeln!(s, "  stall     : {why}");
            }
            let then = if f.raised { "; it raised it, and was stopped before it exited" } else { "" };
            match &f.cause_line {
                Some(line) => {
                    let _ = writeln!(s, "  cause     : {} ({line}){then}", f.cause.text());
                }
                None => {
                    let _ = writeln!(s, "  cause     : {}{then}", f.cause.text());
                }
            }
        };
        if !self.rounds.is_empty() {
            s.push_str("Rounds:\n");
            for r in &self.rounds {
                let _ = writeln!(
                    s,
                    "  round {}: {} pods, group rank {}, {} restarts used, end {}, verdict {}",
                    r.round, r.nnodes, r.group_rank, r.restarts, r.end, r.verdict
                );
            }
            s.push_str(&line);
            s.push('\n');
        }
        if let (Some(why), Some(round)) = (&self.stall, self.stall_round) {
            let _ = writeln!(s, "Stall (round {round}): {why}");
            for r in self.stacks.iter().take(STACKS_SHOWN) {
                let top =
                    r.stacks.threads.first().map(|t| &t.python[..t.python.len().min(FRAMES_SHOWN)]).unwrap_or(&[]);
                let at: Vec<String> = top.iter().map(ToString::to_string).collect();
                let what = if at.is_empty() { r.stacks.note.clone().unwrap_or_default() } else { at.join(" < ") };
                let _ = writeln!(s, "  rank {} ({}, pid {}): {what}", r.rank, r.host, r.stacks.pid);
            }
            s.push_str(&line);
            s.push('\n');
        }
        if let Some(root) = &self.root_cause {
            let _ = writeln!(s, "Root Cause (exit code {}):", self.exit_code);
            entry(&mut s, 0, root);
            s.push_str(&line);
            s.push('\n');
        }
        let others: Vec<&Failure> = self.failures.iter().filter(|f| Some(*f) != self.root_cause.as_ref()).collect();
        if !others.is_empty() {
            s.push_str(if self.root_cause.is_some() { "Other failures:\n" } else { "Failures:\n" });
            for (i, f) in others.into_iter().enumerate() {
                entry(&mut s, i + 1, f);
            }
            s.push_str(&line);
            s.push('\n');
        }
        s
    }

    /// What became of a failure: the verdict of its round, in words (the
    /// rule's action alone says what the policy asked, not what happened).
    pub fn outcome(&self, f: &Failure) -> String {
        use super::policy::{FailKind, Verdict};
        let Some(text) = self.rounds.iter().find(|r| r.round == u64::from(f.attempt)).map(|r| r.verdict.as_str())
        else {
            return format!("rule: {}", f.action);
        };
        match text.parse::<Verdict>() {
            Ok(Verdict::Restart(n)) => format!("the job restarted (restart {n})"),
            Ok(Verdict::Fail(FailKind::Budget)) => "no restarts left: the job failed".into(),
            Ok(Verdict::Fail(FailKind::Policy)) if f.action == RuleAction::Fail => {
                "matched a fail rule: the job failed".into()
            }
            Ok(Verdict::Fail(FailKind::Policy)) => "the job failed (another failure matched a fail rule)".into(),
            Ok(Verdict::Fail(FailKind::Unkillable)) => "the job failed (a worker could not be killed)".into(),
            Ok(Verdict::Fail(FailKind::Stuck)) => "the job failed (a pod neither stopped nor died in time)".into(),
            Ok(Verdict::Regroup) => "the pods regrouped".into(),
            Ok(Verdict::Success) => "the job succeeded".into(),
            // `launch` records "exit" for a round ended by a stop signal.
            Err(()) if text == "exit" => "trainlet was stopped by a signal".into(),
            Err(()) => format!("round verdict {text}"),
        }
    }

    /// Write the JSON report to `path`.
    pub fn write(&self, path: &PathBuf) -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(path, serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A failure of `rank` at `at_us` (exit 3), for this module's and
    /// `launch::error_file`'s tests.
    pub(crate) fn failure(rank: u32, at_us: u64) -> Failure {
        Failure {
            attempt: 0,
            rank,
            local_rank: rank % 2,
            node_rank: rank / 2,
            host: "h".into(),
            pid: 10,
            exit_code: Some(3),
            signal: None,
            at_us,
            error_file: None,
            message: None,
            traceback: None,
            action: RuleAction::Restart,
            hung: false,
            no_progress: false,
            not_started: None,
            stall: None,
            log_tail: None,
            cause: Cause::Unknown,
            cause_line: None,
            error_at_us: None,
            raised: false,
        }
    }

    #[test]
    fn root_cause_is_the_earliest_across_pods() {
        let all = [failure(4, 300), failure(1, 100), failure(0, 100), failure(2, 200)];
        assert_eq!(root_cause(&all).map(|f| f.rank), Some(0));
        assert_eq!(root_cause(&[]), None);
    }

    /// The SDK's XGBoost failure on 2 pods x 2: rank 3 raised, rank 2's
    /// broken ring exited first; rank 3 is the root cause, in the attempt
    /// that failed first.
    #[test]
    fn the_root_cause_is_first_in_cause_then_in_time() {
        let mut collateral = failure(2, 100);
        collateral.log_tail = Some("xgboost.core.XGBoostError: [x] Ring allreduce small failed".into());
        collateral.judge();
        let mut raised = failure(3, 250);
        raised.log_tail = Some("Traceback (most recent call last):\nValueError: rank 3 failing on purpose".into());
        raised.judge();
        assert_eq!(raised.message.as_deref(), Some("ValueError: rank 3 failing on purpose"));
        assert_eq!(collateral.cause, Cause::Consequence);
        let mut unknown = failure(1, 200);
        unknown.judge();
        assert_eq!(unknown.cause, Cause::Unknown);
        let all = [collateral.clone(), unknown.clone(), raised.clone()];
        assert_eq!(root_cause(&all).map(|f| f.rank), Some(3));
        assert_eq!(root_cause(&all[..2]).map(|f| f.rank), Some(1), "nothing said before a consequence");
        assert_eq!(root_cause(&all[..1]).map(|f| f.rank), Some(2), "a consequence alone is still the root");
        // An earlier attempt's failure stays first, whatever it was.
        let mut earlier = collateral;
        earlier.attempt = 0;
        raised.attempt = 1;
        assert_eq!(root_cause(&[raised, earlier]).map(|f| f.rank), Some(2));
    }

    #[test]
    fn a_fail_rule_failure_is_the_cause_even_when_later() {
        let mut fatal = failure(3, 500);
        fatal.action = RuleAction::Fail;
        let all = [failure(1, 100), fatal];
        assert_eq!(fatal_root(&all).map(|f| f.rank), Some(3));
        assert_eq!(fatal_root(&all[..1]), None);
    }

    #[test]
    fn a_failure_that_exited_0_never_gives_success() {
        let mut f = failure(1, 1);
        assert_eq!(f.code(), 3);
        f.exit_code = Some(0);
        assert_eq!(f.code(), 1);
        f.exit_code = None;
        f.signal = Some(9);
        assert_eq!(f.code(), 137);
    }

    #[test]
    fn reads_torch_error_files() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("error.json");
        std::fs::write(
            &path,
            r#"{"message": {"message": "ValueError: boom", "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1"}}}"#,
        )
        .expect("write");
        let mut f = failure(1, 1);
        f.read_error_file(&path);
        assert_eq!(f.message.as_deref(), Some("ValueError: boom"));
        assert_eq!(f.traceback.as_deref(), Some("Traceback ..."));
        let mut g = failure(1, 1);
        g.read_error_file(&dir.path().join("missing.json"));
        assert_eq!(g.error_file, None);
    }

    #[test]
    fn summary_names_rank_and_code() {
        let r = Report {
            run_id: "r".into(),
            script: "fail.py".into(),
            node_rank: 0,
            exit_code: 3,
            reason: "worker failed".into(),
            root_cause: Some(failure(5, 1)),
            failures: vec![failure(5, 1)],
            rounds: vec![RoundRecord {
                round: 0,
                nnodes: 2,
                group_rank: 0,
                restarts: 0,
                end: "failure".into(),
                verdict: "fail:budget".into(),
            }],
            stall: None,
            stall_round: None,
            stalled_ranks: Vec::new(),
            stacks: Vec::new(),
        };
        let s = r.summary();
        assert!(s.contains("fail.py FAILED"));
        assert!(s.contains("rank      : 5 (local_rank: 1)"));
        assert!(s.contains("exitcode  : 3 (pid: 10)"));
        assert!(s.contains("round 0: 2 pods, group rank 0, 0 restarts used, end failure, verdict fail:budget"), "{s}");
    }
}
