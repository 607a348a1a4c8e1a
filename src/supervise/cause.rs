//! Which failure caused the others: the root cause is the first failure in
//! cause, not only in time.
//!
//! When one rank dies, its peers' collectives break: their connections
//! close, their timeouts fire, their watchdogs abort, and some of them exit
//! before the rank that started it (it may still be unwinding, flushing or
//! finalizing). "First by time" then names a bystander. So each failure is
//! judged from what it shows (pure: its record in, a [`Cause`] out), and
//! the root cause is the earliest of the most primary kind:
//! 1. [`Cause::Own`]: it failed on its own: an exception of its own (a
//!    Python exception that is not a broken collective), a signal that is
//!    not a consequence (SIGSEGV, SIGBUS, an OOM kill, SIGKILL), a fail
//!    rule, a worker that never started, one stuck in the kernel;
//! 2. [`Cause::Unknown`]: nothing says: an exit code without an error
//!    (no error file, no exception in its last lines);
//! 3. [`Cause::Consequence`]: it failed because another did: its error is
//!    a collective's or store's broken connection, a peer's death, a
//!    timeout or a watchdog (the texts of torch over gloo and NCCL, the
//!    TCPStore, XGBoost's collective, JAX's coordination service, MPI).
//!
//! The text judged is the worker's error file (torch's `@record`), else
//! the exception lines of its last stderr lines ([`super::output::Tail`]):
//! a chained exception counts as its own when any exception of the chain
//! is its own (a `ValueError` raised in a step, then an XGBoost collective
//! error while its context closes, is the `ValueError`'s rank's own
//! failure).

pub use super::report::Cause;
use super::report::Failure;
use crate::config::rules::RuleAction;

/// Texts of an error that another rank's failure caused, lowercased: a
/// broken connection of a collective or the store, a peer gone, a timeout
/// or a watchdog. Each is one a real peer printed (torch 2.x over gloo and
/// NCCL, its TCPStore, XGBoost 2-3's collective, jaxlib's coordination
/// service and gloo, MPI).
const CONSEQUENCES: &[&str] = &[
    // Sockets: gloo's pair.cc, TCPStore, XGBoost's comm, MPI's TCP.
    "connection closed by peer",
    "connection reset by peer",
    "connection refused",
    "broken pipe",
    "socket closed",
    "peer closed",
    "end of file",
    "failed to recv",
    "failed to send",
    "recv failed",
    "send failed",
    "read error",
    "write error",
    "other end is likely closed",
    "encountered eof",
    // torch.distributed's own errors of a broken group or store.
    "distbackenderror",
    "diststoreerror",
    "distnetworkerror",
    "remote process exited",
    "ncclremoteerror",
    "communicator was aborted",
    "watchdog",
    // XGBoost's collective.
    "allreduce",
    "allgather",
    "broadcast failed",
    // JAX's coordination service and XLA's status codes for a peer gone.
    "coordination service",
    "heartbeat",
    "unavailable:",
    "deadline_exceeded",
    "cancelled:",
    "aborted:",
    // A wait that timed out waiting for someone.
    "timed out",
    "timeout",
    // MPI: a peer's abort or death.
    "mpi_abort was invoked",
    "a process or daemon was unable",
    "process manager",
];

/// Signals that are a consequence: a peer closed the pipe.
const CONSEQUENCE_SIGNALS: &[i32] = &[libc::SIGPIPE];

/// Most exception lines judged of one failure (its text is bounded too).
const MOST_ERRORS: usize = 16;

/// What `f` was, and the line that says so (an exception, a signal, a rule).
pub fn judge(f: &Failure) -> (Cause, Option<String>) {
    if f.not_started.is_some() {
        return (Cause::Own, Some("it never started".into()));
    }
    if f.action == RuleAction::Fail {
        return (Cause::Own, Some("it matched a fail rule".into()));
    }
    if f.hung {
        return (Cause::Own, Some("it hung in the kernel".into()));
    }
    let errors = errors_of(f);
    let own = errors.iter().find(|e| !is_consequence(e));
    let sig = f.signal;
    // A signal of its own, unless its text says a watchdog or a broken
    // collective aborted it (NCCL's watchdog raises SIGABRT).
    if let Some(s) = sig {
        if CONSEQUENCE_SIGNALS.contains(&s) {
            return (Cause::Consequence, Some(format!("killed by {}", crate::sys::signal_name(s))));
        }
        if s != libc::SIGABRT || errors.is_empty() || own.is_some() {
            let what = own.cloned().unwrap_or_else(|| format!("killed by {}", crate::sys::signal_name(s)));
            return (Cause::Own, Some(what));
        }
    }
    match (own, errors.first()) {
        (Some(e), _) => (Cause::Own, Some(e.clone())),
        (None, Some(e)) => (Cause::Consequence, Some(e.clone())),
        (None, None) if f.no_progress => (Cause::Unknown, None),
        (None, None) => (Cause::Unknown, None),
    }
}

impl Failure {
    /// Judge what this failure was ([`judge`]) and keep the verdict; a
    /// worker that left no error file gets the exception line that judged
    /// it (else its last one) as its message.
    pub fn judge(&mut self) {
        let (cause, line) = judge(self);
        self.cause = cause;
        if self.message.is_none()
            && let Some(tail) = &self.log_tail
        {
            let errors = exception_lines(tail);
            self.message = line.as_ref().filter(|l| errors.contains(l)).cloned().or_else(|| errors.last().cloned());
        }
        self.cause_line = line;
    }
}

/// Whether an error line is another rank's doing.
fn is_consequence(error: &str) -> bool {
    let low = error.to_lowercase();
    CONSEQUENCES.iter().any(|p| low.contains(p))
}

/// The error lines of `f`: its error file's message, else the exception
/// lines of its last stderr lines.
fn errors_of(f: &Failure) -> Vec<String> {
    if f.error_file.is_some()
        && let Some(m) = f.message.as_deref().filter(|m| !m.trim().is_empty())
    {
        let mut out = vec![first_line(m)];
        if let Some(tb) = &f.traceback {
            out.extend(exception_lines(tb));
        }
        out.truncate(MOST_ERRORS);
        return out;
    }
    f.log_tail.as_deref().map(exception_lines).unwrap_or_default()
}

fn first_line(text: &str) -> String {
    text.lines().find(|l| !l.trim().is_empty()).unwrap_or_default().trim().to_string()
}

/// The lines of `text` that state an exception ([`exceptions`]).
pub fn exception_lines(text: &str) -> Vec<String> {
    let lines: Vec<(u64, &str)> = text.lines().map(|l| (0, l)).collect();
    exceptions(&lines).into_iter().map(|(_, e)| e).collect()
}

/// The exceptions stated in `lines` (each with when it was printed), in
/// order: a Python exception's last line (`pkg.TypeError: message`, or a
/// bare `KeyboardInterrupt`), C++'s `terminate called ...` and its
/// `what():`, CPython's `Fatal Python error:`. An exception whose message
/// goes on over more lines (XGBoost's: a blank line, then `- ` lines)
/// takes the next lines while they are indented or bulleted.
pub fn exceptions(lines: &[(u64, &str)]) -> Vec<(u64, String)> {
    let goes_on = |l: &str| {
        (l.starts_with("  ") || l.starts_with("- ") || l.starts_with('\t')) && !l.trim_start().starts_with("File \"")
    };
    let lines: Vec<(u64, &str)> = lines.iter().map(|(at, l)| (*at, unprefixed(l))).collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() && out.len() < MOST_ERRORS {
        let (at, line) = (lines[i].0, lines[i].1.trim_end());
        i += 1;
        if !is_exception(line) {
            continue;
        }
        let mut whole = line.trim().to_string();
        loop {
            // Blank lines inside a message that goes on after them.
            let mut j = i;
            while lines.get(j).is_some_and(|(_, l)| l.trim().is_empty()) {
                j += 1;
            }
            match lines.get(j).map(|(_, l)| l.trim_end()) {
                Some(next) if goes_on(next) && whole.len() < 1024 => {
                    whole.push(' ');
                    whole.push_str(next.trim());
                    i = j + 1;
                }
                _ => break,
            }
        }
        out.push((at, whole));
    }
    out
}

/// Whether an exception line is the worker's own (not another rank's
/// failure showing through a collective).
pub fn is_own(error: &str) -> bool {
    !is_consequence(error)
}

/// The exception of its own a worker stopped by trainlet had raised: the
/// last exception its last lines state before `until` (when trainlet began
/// to stop it), when that one is its own and was printed at or after
/// `from`; with when it was printed. An exception caught, logged and
/// survived long before is not one (it is older than `from`, or another
/// exception came after it).
pub fn raised(lines: &[(u64, String)], from: u64, until: u64) -> Option<(u64, String)> {
    let before: Vec<(u64, &str)> =
        lines.iter().filter(|(at, _)| *at < until).map(|(at, l)| (*at, l.as_str())).collect();
    let (at, last) = exceptions(&before).pop()?;
    (at >= from && is_own(&last)).then_some((at, last))
}

/// `line` without torch's `[rankN]: ` (torch.distributed prefixes a
/// rank's uncaught exception with it).
fn unprefixed(line: &str) -> &str {
    if let Some(rest) = line.strip_prefix("[rank")
        && let Some((n, after)) = rest.split_once("]:")
        && !n.is_empty()
        && n.bytes().all(|b| b.is_ascii_digit())
    {
        return after.strip_prefix(' ').unwrap_or(after);
    }
    line
}

fn is_exception(line: &str) -> bool {
    if line.starts_with("terminate called") || line.trim_start().starts_with("what():") {
        return true;
    }
    if line.starts_with("Fatal Python error:") {
        return true;
    }
    // `a.b.SomeError: text` or `SomeError` alone, at the line's start.
    let name_end = line.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.')).unwrap_or(line.len());
    let name = &line[..name_end];
    let rest = &line[name_end..];
    let class = name.rsplit('.').next().unwrap_or(name);
    let named = ["Error", "Exception", "Exit", "Interrupt", "Failure", "Abort", "Aborted"]
        .iter()
        .any(|s| class.ends_with(s) && class.len() > s.len() || class == "KeyboardInterrupt")
        && class.chars().next().is_some_and(|c| c.is_ascii_uppercase());
    named && (rest.is_empty() || rest.starts_with(": ") || rest == ":")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::supervise::report::tests::failure;

    fn with_tail(rank: u32, at_us: u64, tail: &str) -> Failure {
        let mut f = failure(rank, at_us);
        f.exit_code = Some(1);
        f.log_tail = Some(tail.into());
        f
    }

    /// What real peers printed (the tests/it runs of the SDK's failure
    /// commands, torch's gloo and NCCL errors as their sources word them).
    #[test_case::test_case(
        "Traceback (most recent call last):\n  File \"sdk_train.py\", line 40, in after_iteration\n    raise ValueError(\"rank 3 failing on purpose\")\nValueError: rank 3 failing on purpose",
        Cause::Own ; "a user's exception")]
    #[test_case::test_case(
        "Traceback (most recent call last):\n  File \"x.py\", line 3, in <module>\nxgboost.core.XGBoostError: [10:01:02] /workspace/src/collective/result.cc:78: \n- [allreduce.cc:40] Ring allreduce small failed.\n- [comm.cc:212] Failed to recv: Connection reset by peer",
        Cause::Consequence ; "xgboost's broken ring")]
    #[test_case::test_case(
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.2]:40123",
        Cause::Consequence ; "gloo's closed pair")]
    #[test_case::test_case(
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error, NCCL version 2.21.5",
        Cause::Consequence ; "nccl's remote error")]
    #[test_case::test_case(
        "jaxlib.xla_extension.XlaRuntimeError: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats)",
        Cause::Consequence ; "jax's coordination service")]
    #[test_case::test_case(
        "ValueError: boom\n\nDuring handling of the above exception, another exception occurred:\n\nTraceback (most recent call last):\nxgboost.core.XGBoostError: Failed to recv: Connection reset by peer",
        Cause::Own ; "a chain with an own exception")]
    #[test_case::test_case("epoch 3 loss 0.2\nsaving\n", Cause::Unknown ; "no exception")]
    #[test_case::test_case("KeyboardInterrupt", Cause::Own ; "a bare exception name")]
    #[test_case::test_case(
        "[rank3]: Traceback (most recent call last):\n[rank3]:   File \"/tmp/sdk_train.py\", line 13, in train_torch_failing\n[rank3]: ValueError: rank 3 failing on purpose",
        Cause::Own ; "torch's rank prefix")]
    #[test_case::test_case("MyAppError: the data is bad", Cause::Own ; "a user's own class")]
    #[test_case::test_case("warnings.py:12: UserWarning: deprecated\nerror: something", Cause::Unknown ; "warnings are not exceptions")]
    fn judges_a_failure_from_its_last_lines(tail: &str, want: Cause) {
        assert_eq!(judge(&with_tail(3, 1, tail)).0, want, "{tail}");
    }

    #[test]
    fn signals_and_rules() {
        let mut f = failure(1, 1);
        f.exit_code = None;
        f.signal = Some(libc::SIGSEGV);
        assert_eq!(judge(&f).0, Cause::Own);
        f.signal = Some(libc::SIGPIPE);
        assert_eq!(judge(&f).0, Cause::Consequence);
        // NCCL's watchdog aborts a rank whose peer died.
        f.signal = Some(libc::SIGABRT);
        f.log_tail = Some("terminate called after throwing an instance of 'c10::DistBackendError'\n  what():  [PG ID 0] Process group watchdog thread terminated with exception: NCCL error".into());
        assert_eq!(judge(&f).0, Cause::Consequence);
        f.log_tail = None;
        assert_eq!(judge(&f).0, Cause::Own, "an abort without a word is its own");
        let mut g = with_tail(2, 1, "RuntimeError: Connection closed by peer");
        g.action = RuleAction::Fail;
        assert_eq!(judge(&g).0, Cause::Own, "a fail rule's match is the cause the policy names");
        let mut n = failure(0, 1);
        n.not_started = Some(127);
        assert_eq!(judge(&n).0, Cause::Own);
    }

    #[test]
    fn an_error_file_is_judged_before_the_tail() {
        let mut f = with_tail(1, 1, "ValueError: not this");
        f.error_file = Some("/tmp/e.json".into());
        f.message = Some("torch.distributed.DistBackendError: Connection reset by peer".into());
        assert_eq!(judge(&f).0, Cause::Consequence);
    }

    #[test]
    fn an_exception_raised_just_before_the_stop_is_found_an_old_or_later_one_is_not() {
        let l = |at: u64, s: &str| (at, s.to_string());
        let lines = vec![
            l(10, "Traceback (most recent call last):"),
            l(11, "ValueError: rank 3 failing on purpose"),
            l(30, "KeyboardInterrupt"),
        ];
        assert_eq!(raised(&lines, 5, 20), Some((11, "ValueError: rank 3 failing on purpose".into())));
        assert_eq!(raised(&lines, 12, 20), None, "printed before the window");
        assert_eq!(raised(&lines, 5, 11), None, "printed after the stop began");
        let collateral = vec![l(10, "RuntimeError: Connection closed by peer")];
        assert_eq!(raised(&collateral, 0, 20), None, "not its own");
        let survived = vec![l(10, "ValueError: caught and logged"), l(12, "RuntimeError: Connection reset by peer")];
        assert_eq!(raised(&survived, 0, 20), None, "the last exception before the stop is not its own");
    }

    #[test]
    fn exception_lines_join_a_message_that_goes_on() {
        let got = exception_lines(
            "xgboost.core.XGBoostError: [x] result.cc:78:\n- [a] Ring allreduce small failed\n- [b] Failed to recv\nnext line",
        );
        assert_eq!(
            got,
            ["xgboost.core.XGBoostError: [x] result.cc:78: - [a] Ring allreduce small failed - [b] Failed to recv"]
        );
        // XGBoost 3's, as printed: a blank line before the bullets.
        let xgb = "xgboost.core.XGBoostError: [18:56:54] /__w/xgboost/xgboost/src/collective/result.cc:83: [histogram.h:197|18:56:54]:\n\n- [allreduce.cc:135|18:56:54]: Ring Allreduce failed.\n- [loop.cc:102|18:56:54]: Encountered EOF. The other end is likely closed.\nStack trace:\n  [bt] (0) /x/libxgboost.so(+0x2c1a8c) [0x7f7931ec1a8c]";
        let got = exception_lines(xgb);
        assert_eq!(got.len(), 1);
        assert!(got[0].ends_with("The other end is likely closed."), "{got:?}");
        assert!(!is_own(&got[0]));
        let many = "E: x\n".repeat(100);
        assert!(exception_lines(&many).is_empty(), "one letter is no exception class");
        let flood = "ValueError: x\n".repeat(100);
        assert_eq!(exception_lines(&flood).len(), MOST_ERRORS);
    }
}
