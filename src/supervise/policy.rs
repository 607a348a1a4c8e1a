//! The pure core of the supervisor: events in, actions out, no I/O.
//!
//! One [`Attempt`] tracks one pod's workers through one rendezvous round:
//!
//! ```text
//!  Running ──all exit 0 (or ignored)──▶ LocalDone ──job success──▶ Finished(Succeeded)
//!     │                                    │ job failure/regroup/lost, stop signal
//!     │ worker fails or hangs, stop        ▼
//!     │ signal, job end ──────────▶ Stopping(reason) ──last worker gone──▶ Finished(reason)
//!
//!  Stopping: [checkpoint signal ─checkpoint timer─▶] SIGTERM ─grace timer─▶ SIGKILL
//!            ─kill timer─▶ Finished, the survivors abandoned as unkillable
//! ```
//!
//! A planned stop (this agent was asked to stop, a peer left cleanly, pods
//! are waiting to join) sends the checkpoint signal first when one is
//! configured; a failure stops with SIGTERM at once. The grace timer runs
//! from the start of the stop, so checkpoint + SIGTERM fit inside it. Only
//! exits seen while Running count as failures: workers that die after we
//! asked them to stop are casualties, not causes.
//!
//! In survivors mode ([`Attempt::set_survivors`], an actor's
//! `restart="survivors"`), a worker's own death, or a failure or a
//! membership change elsewhere, ends the round here at once with no
//! signal: the live workers are kept ([`Attempt::kept`]) to rejoin the
//! next round. A `fail` rule, a hung or silent worker, a stop signal and a
//! lost store stop every worker as above.
//!
//! What to do once a round is over on every pod ([`verdict`]) is decided
//! here too, from facts every pod reads from the store, so all pods agree.

use std::collections::BTreeSet;

use crate::config::rules::{RuleAction, Rules};
use crate::sys::Exit;

/// How the job's current round ended, as published in the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobEnd {
    /// Every worker on every pod is done.
    Success,
    /// A worker failed somewhere.
    Failure,
    /// The membership changes: a peer left cleanly or pods wait to join
    /// (`planned`), or a peer died (not planned).
    Regroup {
        /// Whether workers get the checkpoint signal first.
        planned: bool,
    },
    /// The store became unreachable.
    Lost,
}

/// Timers the event loop arms on the core's request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Timer {
    /// Time the workers get to checkpoint before SIGTERM.
    Checkpoint,
    /// From the start of a stop to SIGKILL.
    Grace,
    /// From SIGKILL to giving up on workers that do not die.
    Kill,
}

/// Inputs of the core.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A worker (by local rank) ended; `at_us` is wall-clock microseconds.
    WorkerExited {
        /// Its local rank.
        local_rank: u32,
        /// How it ended.
        exit: Exit,
        /// When, in wall-clock microseconds.
        at_us: u64,
    },
    /// An MPI rank ended the job, however it exited: it called abort
    /// (`exit` is the code it asked for; it is exiting by itself), was
    /// stopped for breaking the PMI protocol, or exited after PMI init
    /// without finalize. A failure whatever the rules say of the exit
    /// (they may still make it fatal).
    Fault {
        /// Its local rank.
        local_rank: u32,
        /// How it ended (or asked to).
        exit: Exit,
        /// When, in wall-clock microseconds.
        at_us: u64,
    },
    /// A worker has been in uninterruptible sleep longer than allowed.
    Hung {
        /// Its local rank.
        local_rank: u32,
        /// When this was noticed.
        at_us: u64,
    },
    /// A worker that reported progress has reported none for
    /// `--progress-timeout`: the job is hung (a stuck collective).
    Silent {
        /// The silent workers' local ranks.
        local_ranks: Vec<u32>,
        /// When this was noticed.
        at_us: u64,
    },
    /// A signal that asks the agent to stop.
    StopSignal(i32),
    /// trainlet asks itself to stop as by this signal (the in-place
    /// restart agent): like `StopSignal`, but a stop under way is not hurried.
    StopAsked(i32),
    /// A signal passed through to the workers (SIGUSR1/2).
    ForwardSignal(i32),
    /// The store says how the round ended.
    Job(JobEnd),
    /// A timer armed by [`Action::Arm`] fired.
    Timer(Timer),
}

/// A worker that failed on its own while the round ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalFailure {
    /// Local rank of the worker.
    pub local_rank: u32,
    /// How it ended; None for a worker stuck in uninterruptible sleep.
    pub exit: Option<Exit>,
    /// When, in wall-clock microseconds.
    pub at_us: u64,
    /// What the failure policy says about it.
    pub action: RuleAction,
    /// It stopped reporting progress (alive, not stuck in D state).
    pub silent: bool,
}

/// Why a round ended on this pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// All workers everywhere succeeded.
    Succeeded,
    /// A worker failed (here or on another pod).
    Failed,
    /// This agent was asked to stop by this signal.
    Stopped(i32),
    /// The membership changes (a peer left or died, pods wait to join).
    Regroup,
    /// The store went away.
    Lost,
}

/// Outputs of the core.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Send this signal to every live worker's process group.
    Signal(i32),
    /// SIGKILL every live worker's process group.
    KillAll,
    /// Start a timer.
    Arm(Timer),
    /// Tell the other pods this round failed (`fatal`: by a `fail` rule).
    PublishFailure {
        /// A `fail` rule matched, or a worker hung.
        fatal: bool,
    },
    /// Tell the other pods this pod is leaving (stopped by a signal).
    PublishAbort(i32),
    /// Tell the other pods every worker here is done.
    PublishLocalDone,
    /// The round is over on this pod; no worker is left (or the rest are
    /// abandoned, see [`Attempt::abandoned`]).
    Finish(Outcome),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Running,
    LocalDone,
    Stopping(Outcome),
    Finished,
}

/// One pod's view of one round.
#[derive(Debug)]
pub struct Attempt {
    alive: BTreeSet<u32>,
    phase: Phase,
    failures: Vec<LocalFailure>,
    rules: Rules,
    checkpoint: Option<i32>,
    /// Signal to send when the checkpoint timer fires.
    term: Option<i32>,
    killed: bool,
    abandoned: Vec<u32>,
    /// The round's end said success while workers here still ran (only
    /// a writer other than trainlet can make it so): the end is written
    /// once and its watch is over, so the round ends as soon as the last
    /// worker here exits 0, instead of waiting for an end that came.
    early_success: bool,
    /// Keep the live workers when the round fails or regroups.
    survivors: bool,
    /// The workers kept alive at the round's end (survivors mode).
    kept: Vec<u32>,
}

impl Attempt {
    /// A round whose workers `0..nproc` are all running.
    pub fn new(nproc: u32, rules: Rules, checkpoint: Option<i32>) -> Self {
        Self {
            alive: (0..nproc).collect(),
            phase: Phase::Running,
            failures: Vec::new(),
            rules,
            checkpoint,
            term: None,
            killed: false,
            abandoned: Vec::new(),
            early_success: false,
            survivors: false,
            kept: Vec::new(),
        }
    }

    /// A round whose workers are `running` (local ranks; the others are
    /// kept from the last round and join as they are).
    pub fn set_survivors(&mut self, on: bool) {
        self.survivors = on;
    }

    /// Local ranks left running at the round's end for the next round
    /// (survivors mode): neither signalled nor waited for.
    pub fn kept(&self) -> &[u32] {
        &self.kept
    }

    /// Survivors mode: end the round here at once, keeping the live workers.
    fn keep_rest(&mut self, why: Outcome, out: &mut Vec<Action>) {
        self.kept = std::mem::take(&mut self.alive).into_iter().collect();
        self.phase = Phase::Finished;
        out.push(Action::Finish(why));
    }

    /// Local ranks still running.
    pub fn alive(&self) -> impl Iterator<Item = u32> + '_ {
        self.alive.iter().copied()
    }

    /// Failures observed while running, in order.
    pub fn failures(&self) -> &[LocalFailure] {
        &self.failures
    }

    /// Local ranks that outlived SIGKILL by the kill timer.
    pub fn abandoned(&self) -> &[u32] {
        &self.abandoned
    }

    /// Is the round over?
    pub fn finished(&self) -> bool {
        self.phase == Phase::Finished
    }

    fn stop(&mut self, why: Outcome, planned: bool, sig: i32, out: &mut Vec<Action>) {
        self.phase = Phase::Stopping(why);
        match self.checkpoint.filter(|_| planned) {
            Some(ckpt) => {
                self.term = Some(sig);
                out.push(Action::Signal(ckpt));
                out.push(Action::Arm(Timer::Checkpoint));
            }
            None => out.push(Action::Signal(sig)),
        }
        out.push(Action::Arm(Timer::Grace));
    }

    fn kill(&mut self, out: &mut Vec<Action>) {
        if !self.killed {
            self.killed = true;
            self.term = None;
            out.push(Action::KillAll);
            out.push(Action::Arm(Timer::Kill));
        }
    }

    fn finish_if_empty(&mut self, out: &mut Vec<Action>) {
        if let Phase::Stopping(why) = self.phase
            && self.alive.is_empty()
        {
            self.phase = Phase::Finished;
            out.push(Action::Finish(why));
        }
    }

    fn job_outcome(end: JobEnd) -> Outcome {
        match end {
            JobEnd::Success => Outcome::Succeeded,
            JobEnd::Failure => Outcome::Failed,
            JobEnd::Regroup { .. } => Outcome::Regroup,
            JobEnd::Lost => Outcome::Lost,
        }
    }

    fn fail(&mut self, f: LocalFailure, out: &mut Vec<Action>) {
        let fatal = f.action == RuleAction::Fail || (f.exit.is_none() && !f.silent);
        let keep = self.survivors && !fatal && !f.silent;
        self.failures.push(f);
        out.push(Action::PublishFailure { fatal });
        if keep {
            self.keep_rest(Outcome::Failed, out);
        } else {
            self.stop(Outcome::Failed, false, libc::SIGTERM, out);
        }
    }

    /// Worker `local_rank` ended with `exit` (`forced`: a failure even if
    /// the rules would take the exit for success).
    fn exited(&mut self, local_rank: u32, exit: Exit, at_us: u64, forced: bool, out: &mut Vec<Action>) {
        if !self.alive.remove(&local_rank) {
            return;
        }
        if self.phase == Phase::Running {
            match (self.rules.action(exit), forced) {
                (RuleAction::Ignore, false) => {
                    if self.alive.is_empty() {
                        self.phase = Phase::LocalDone;
                        out.push(Action::PublishLocalDone);
                        if self.early_success {
                            self.phase = Phase::Finished;
                            out.push(Action::Finish(Outcome::Succeeded));
                        }
                    }
                }
                (action, _) => {
                    let action = if action == RuleAction::Ignore { RuleAction::Restart } else { action };
                    self.fail(LocalFailure { local_rank, exit: Some(exit), at_us, action, silent: false }, out);
                }
            }
        }
        self.finish_if_empty(out);
    }

    /// Feed one event; returns what to do, in order.
    pub fn handle(&mut self, event: Event) -> Vec<Action> {
        let mut out = Vec::new();
        match (self.phase, event) {
            (Phase::Finished, _) => {}
            (_, Event::WorkerExited { local_rank, exit, at_us }) => {
                self.exited(local_rank, exit, at_us, false, &mut out)
            }
            (_, Event::Fault { local_rank, exit, at_us }) => self.exited(local_rank, exit, at_us, true, &mut out),
            (Phase::Running, Event::Hung { local_rank, at_us }) => {
                if self.alive.contains(&local_rank) {
                    let f = LocalFailure { local_rank, exit: None, at_us, action: RuleAction::Fail, silent: false };
                    self.fail(f, &mut out);
                }
            }
            (_, Event::Hung { .. }) => {}
            (Phase::Running, Event::Silent { local_ranks, at_us }) => {
                // Every silent worker is a failure of the round (the report
                // names them all); the round fails once.
                let action = self.rules.no_progress_action();
                if action == RuleAction::Ignore {
                    return out;
                }
                let silent: Vec<u32> = local_ranks.into_iter().filter(|lr| self.alive.contains(lr)).collect();
                if let Some((&last, rest)) = silent.split_last() {
                    for &local_rank in rest {
                        self.failures.push(LocalFailure { local_rank, exit: None, at_us, action, silent: true });
                    }
                    self.fail(LocalFailure { local_rank: last, exit: None, at_us, action, silent: true }, &mut out);
                }
            }
            (_, Event::Silent { .. }) => {}
            (Phase::Running, Event::StopSignal(sig)) => {
                out.push(Action::PublishAbort(sig));
                self.stop(Outcome::Stopped(sig), true, sig, &mut out);
                self.finish_if_empty(&mut out);
            }
            (Phase::LocalDone, Event::StopSignal(sig)) => {
                out.push(Action::PublishAbort(sig));
                self.phase = Phase::Finished;
                out.push(Action::Finish(Outcome::Stopped(sig)));
            }
            (Phase::Running | Phase::LocalDone, Event::StopAsked(sig)) => return self.handle(Event::StopSignal(sig)),
            (Phase::Stopping(why), Event::StopAsked(sig)) => {
                // The round ends stopped (the pod leaves), within the grace already running.
                if !matches!(why, Outcome::Stopped(_)) {
                    out.push(Action::PublishAbort(sig));
                    self.phase = Phase::Stopping(Outcome::Stopped(sig));
                }
            }
            (Phase::Stopping(why), Event::StopSignal(sig)) => {
                // A second stop request skips the rest of the grace period.
                if !matches!(why, Outcome::Stopped(_)) {
                    out.push(Action::PublishAbort(sig));
                    self.phase = Phase::Stopping(Outcome::Stopped(sig));
                }
                self.kill(&mut out);
            }
            (Phase::Running | Phase::Stopping(_), Event::ForwardSignal(sig)) => out.push(Action::Signal(sig)),
            (Phase::LocalDone, Event::ForwardSignal(_)) => {}
            // Not trainlet's (it writes success once every member is done):
            // the workers here go on, and their own end decides.
            (Phase::Running, Event::Job(JobEnd::Success)) => self.early_success = true,
            (Phase::Running, Event::Job(end @ (JobEnd::Failure | JobEnd::Regroup { .. }))) if self.survivors => {
                self.keep_rest(Self::job_outcome(end), &mut out);
            }
            (Phase::Running, Event::Job(end)) => {
                let planned = matches!(end, JobEnd::Regroup { planned: true });
                self.stop(Self::job_outcome(end), planned, libc::SIGTERM, &mut out);
                self.finish_if_empty(&mut out);
            }
            (Phase::LocalDone, Event::Job(end)) => {
                self.phase = Phase::Finished;
                out.push(Action::Finish(Self::job_outcome(end)));
            }
            (Phase::Stopping(Outcome::Failed | Outcome::Regroup), Event::Job(JobEnd::Lost)) => {
                self.phase = Phase::Stopping(Outcome::Lost);
            }
            (Phase::Stopping(_), Event::Job(_)) => {}
            (Phase::Stopping(_), Event::Timer(Timer::Checkpoint)) => {
                if let Some(sig) = self.term.take() {
                    out.push(Action::Signal(sig));
                }
            }
            (Phase::Stopping(_), Event::Timer(Timer::Grace)) => self.kill(&mut out),
            (Phase::Stopping(why), Event::Timer(Timer::Kill)) => {
                self.abandoned = self.alive.iter().copied().collect();
                self.alive.clear();
                self.phase = Phase::Finished;
                out.push(Action::Finish(why));
            }
            (Phase::Running | Phase::LocalDone, Event::Timer(_)) => {}
        }
        out
    }
}

/// How a round ended, as every pod reads it back from the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoundFacts {
    /// The round's published end.
    pub end: Option<JobEnd>,
    /// The liveness monitor declared a member dead.
    pub dead: bool,
    /// Every member reported its workers gone.
    pub all_stopped: bool,
    /// A reported failure matched a `fail` rule.
    pub fatal: bool,
    /// A worker hung or survived SIGKILL.
    pub unkillable: bool,
    /// Job-wide restarts used so far.
    pub restarts: u32,
    /// The job-wide budget.
    pub max_restarts: u32,
}

/// Why the job gives up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailKind {
    /// A worker exit matched a `fail` rule.
    Policy,
    /// A worker hung in uninterruptible sleep or survived SIGKILL.
    Unkillable,
    /// Worker failures used up the job-wide restart budget.
    Budget,
    /// A member neither stopped nor died within the bound.
    Stuck,
}

/// What every pod does once a round is over everywhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The job is done.
    Success,
    /// Form a new round; membership changes cost no restart.
    Regroup,
    /// Restart after a worker failure; this many restarts used in total.
    Restart(u32),
    /// Give up.
    Fail(FailKind),
}

/// The decision after a round, from facts all pods share.
pub fn verdict(f: &RoundFacts) -> Verdict {
    if f.unkillable {
        return Verdict::Fail(FailKind::Unkillable);
    }
    if f.fatal {
        return Verdict::Fail(FailKind::Policy);
    }
    if f.dead {
        return Verdict::Regroup;
    }
    match f.end {
        Some(JobEnd::Success) if f.all_stopped => Verdict::Success,
        Some(JobEnd::Regroup { .. }) if f.all_stopped => Verdict::Regroup,
        Some(JobEnd::Failure) if f.all_stopped => {
            if f.restarts < f.max_restarts {
                Verdict::Restart(f.restarts + 1)
            } else {
                Verdict::Fail(FailKind::Budget)
            }
        }
        _ => Verdict::Fail(FailKind::Stuck),
    }
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Verdict::Success => f.write_str("success"),
            Verdict::Regroup => f.write_str("regroup"),
            Verdict::Restart(n) => write!(f, "restart:{n}"),
            Verdict::Fail(FailKind::Policy) => f.write_str("fail:policy"),
            Verdict::Fail(FailKind::Unkillable) => f.write_str("fail:unkillable"),
            Verdict::Fail(FailKind::Budget) => f.write_str("fail:budget"),
            Verdict::Fail(FailKind::Stuck) => f.write_str("fail:stuck"),
        }
    }
}

impl std::str::FromStr for Verdict {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        Ok(match s {
            "success" => Verdict::Success,
            "regroup" => Verdict::Regroup,
            "fail:policy" => Verdict::Fail(FailKind::Policy),
            "fail:unkillable" => Verdict::Fail(FailKind::Unkillable),
            "fail:budget" => Verdict::Fail(FailKind::Budget),
            "fail:stuck" => Verdict::Fail(FailKind::Stuck),
            _ => Verdict::Restart(s.strip_prefix("restart:").and_then(|n| n.parse().ok()).ok_or(())?),
        })
    }
}

/// Exponential backoff before restart number `n` (1-based): `base * 2^(n-1)`,
/// at most `cap`; zero when `base` is zero.
pub fn backoff(base: std::time::Duration, n: u32, cap: std::time::Duration) -> std::time::Duration {
    if base.is_zero() || n == 0 {
        return std::time::Duration::ZERO;
    }
    base.saturating_mul(1u32 << (n - 1).min(20)).min(cap)
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    const TERM: i32 = libc::SIGTERM;
    const USR1: i32 = libc::SIGUSR1;
    const PLANNED: JobEnd = JobEnd::Regroup { planned: true };
    const DIED: JobEnd = JobEnd::Regroup { planned: false };

    fn exited(local_rank: u32, code: i32) -> Event {
        Event::WorkerExited { local_rank, exit: Exit::Code(code), at_us: u64::from(local_rank) }
    }

    fn fired(t: Timer) -> Event {
        Event::Timer(t)
    }

    fn feed_with(nproc: u32, rules: &[&str], ckpt: Option<i32>, events: &[Event]) -> (Attempt, Vec<Action>) {
        let rules = Rules::new(rules.iter().map(|r| Rules::parse_flag(r).expect("rule")).collect(), Vec::new());
        let mut a = Attempt::new(nproc, rules, ckpt);
        let mut all = Vec::new();
        for e in events {
            all.extend(a.handle(e.clone()));
        }
        (a, all)
    }

    fn feed(nproc: u32, events: &[Event]) -> (Attempt, Vec<Action>) {
        feed_with(nproc, &[], None, events)
    }

    use Action::{Arm, Finish, KillAll, PublishAbort, PublishLocalDone, Signal};
    const FAIL: Action = Action::PublishFailure { fatal: false };
    const FATAL: Action = Action::PublishFailure { fatal: true };

    #[test_case(&[exited(0, 0), exited(1, 0)], &[PublishLocalDone]; "all succeed locally")]
    #[test_case(&[exited(0, 0), exited(1, 0), Event::Job(JobEnd::Success)],
        &[PublishLocalDone, Finish(Outcome::Succeeded)]; "job success")]
    #[test_case(&[Event::Job(JobEnd::Success), exited(0, 0), exited(1, 0)],
        &[PublishLocalDone, Finish(Outcome::Succeeded)]; "a success end while running is not lost")]
    #[test_case(&[exited(1, 3)], &[FAIL, Signal(TERM), Arm(Timer::Grace)]; "local failure stops the rest")]
    #[test_case(&[exited(1, 3), exited(0, -1)],
        &[FAIL, Signal(TERM), Arm(Timer::Grace), Finish(Outcome::Failed)]; "casualty is not a failure")]
    #[test_case(&[exited(1, 3), fired(Timer::Grace), fired(Timer::Grace)],
        &[FAIL, Signal(TERM), Arm(Timer::Grace), KillAll, Arm(Timer::Kill)]; "grace kills once")]
    #[test_case(&[exited(1, 3), fired(Timer::Grace), fired(Timer::Kill)],
        &[FAIL, Signal(TERM), Arm(Timer::Grace), KillAll, Arm(Timer::Kill), Finish(Outcome::Failed)];
        "kill timer abandons the unkillable")]
    #[test_case(&[Event::StopSignal(TERM)], &[PublishAbort(TERM), Signal(TERM), Arm(Timer::Grace)]; "stop signal forwarded")]
    #[test_case(&[Event::StopSignal(TERM), Event::StopSignal(TERM)],
        &[PublishAbort(TERM), Signal(TERM), Arm(Timer::Grace), KillAll, Arm(Timer::Kill)]; "second signal skips grace")]
    #[test_case(&[Event::StopAsked(TERM)], &[PublishAbort(TERM), Signal(TERM), Arm(Timer::Grace)]; "asked stop")]
    #[test_case(&[Event::Job(JobEnd::Failure), Event::StopAsked(TERM), fired(Timer::Grace)],
        &[Signal(TERM), Arm(Timer::Grace), PublishAbort(TERM), KillAll, Arm(Timer::Kill)]; "asked stop keeps the grace")]
    #[test_case(&[Event::ForwardSignal(USR1)], &[Signal(USR1)]; "usr1 passes through")]
    #[test_case(&[Event::Job(JobEnd::Failure)], &[Signal(TERM), Arm(Timer::Grace)]; "remote failure stops us")]
    #[test_case(&[exited(0, 0), exited(1, 0), Event::Job(JobEnd::Failure)],
        &[PublishLocalDone, Finish(Outcome::Failed)]; "remote failure after local success")]
    #[test_case(&[exited(0, 0), exited(1, 0), Event::StopSignal(TERM)],
        &[PublishLocalDone, PublishAbort(TERM), Finish(Outcome::Stopped(TERM))]; "signal after local success")]
    #[test_case(&[Event::Job(PLANNED), exited(0, -1), exited(1, -1)],
        &[Signal(TERM), Arm(Timer::Grace), Finish(Outcome::Regroup)]; "peer left")]
    #[test_case(&[Event::Job(DIED), exited(0, 1), exited(1, 1)],
        &[Signal(TERM), Arm(Timer::Grace), Finish(Outcome::Regroup)]; "peer died; gloo errors are casualties")]
    #[test_case(&[exited(1, 3), Event::StopSignal(TERM), exited(0, 0)],
        &[FAIL, Signal(TERM), Arm(Timer::Grace), PublishAbort(TERM), KillAll, Arm(Timer::Kill),
          Finish(Outcome::Stopped(TERM))]; "signal during failure stop wins")]
    #[test_case(&[exited(1, 3), Event::Job(JobEnd::Lost), exited(0, 1)],
        &[FAIL, Signal(TERM), Arm(Timer::Grace), Finish(Outcome::Lost)]; "store lost while stopping")]
    #[test_case(&[exited(0, 0), exited(0, 1)], &[]; "duplicate exit ignored")]
    #[test_case(&[Event::Hung { local_rank: 1, at_us: 9 }], &[FATAL, Signal(TERM), Arm(Timer::Grace)]; "hung worker is fatal")]
    #[test_case(&[exited(1, 3), Event::Hung { local_rank: 0, at_us: 9 }],
        &[FAIL, Signal(TERM), Arm(Timer::Grace)]; "hang while stopping is bounded by the timers")]
    #[test_case(&[fired(Timer::Grace), fired(Timer::Kill), fired(Timer::Checkpoint)], &[]; "stray timers while running")]
    #[test_case(&[Event::Fault { local_rank: 1, exit: Exit::Code(0), at_us: 9 }],
        &[FAIL, Signal(TERM), Arm(Timer::Grace)]; "an mpi rank gone without finalize fails with exit 0")]
    #[test_case(&[Event::Fault { local_rank: 1, exit: Exit::Code(3), at_us: 9 }, exited(1, 3), exited(0, -1)],
        &[FAIL, Signal(TERM), Arm(Timer::Grace), Finish(Outcome::Failed)]; "an abort then the aborting rank's own exit")]
    #[test_case(&[exited(0, 0), Event::Fault { local_rank: 0, exit: Exit::Code(0), at_us: 9 }], &[];
        "a fault after the rank's exit is not a second one")]
    fn transitions(events: &[Event], want: &[Action]) {
        let (_, got) = feed(2, events);
        assert_eq!(got, want);
    }

    #[test_case(&[Event::StopSignal(TERM), fired(Timer::Checkpoint), fired(Timer::Grace)],
        &[PublishAbort(TERM), Signal(USR1), Arm(Timer::Checkpoint), Arm(Timer::Grace), Signal(TERM), KillAll,
          Arm(Timer::Kill)]; "stop signal checkpoints first")]
    #[test_case(&[Event::StopSignal(TERM), exited(0, 0), exited(1, 0), fired(Timer::Checkpoint)],
        &[PublishAbort(TERM), Signal(USR1), Arm(Timer::Checkpoint), Arm(Timer::Grace),
          Finish(Outcome::Stopped(TERM))]; "workers that checkpoint and exit need no sigterm")]
    #[test_case(&[Event::Job(PLANNED), fired(Timer::Checkpoint)],
        &[Signal(USR1), Arm(Timer::Checkpoint), Arm(Timer::Grace), Signal(TERM)]; "planned regroup checkpoints")]
    #[test_case(&[Event::Job(DIED)], &[Signal(TERM), Arm(Timer::Grace)]; "a dead peer does not wait for a checkpoint")]
    #[test_case(&[exited(0, 1)], &[FAIL, Signal(TERM), Arm(Timer::Grace)]; "failures never wait for a checkpoint")]
    #[test_case(&[Event::StopSignal(TERM), fired(Timer::Grace), fired(Timer::Checkpoint)],
        &[PublishAbort(TERM), Signal(USR1), Arm(Timer::Checkpoint), Arm(Timer::Grace), KillAll, Arm(Timer::Kill)];
        "no sigterm after sigkill")]
    fn checkpoint_stops(events: &[Event], want: &[Action]) {
        let (_, got) = feed_with(2, &[], Some(USR1), events);
        assert_eq!(got, want);
    }

    #[test_case(&["3=fail"], &[exited(0, 3)], &[FATAL, Signal(TERM), Arm(Timer::Grace)]; "fail rule is fatal")]
    #[test_case(&["3=ignore"], &[exited(0, 3), exited(1, 0)], &[PublishLocalDone]; "ignored exit counts as done")]
    #[test_case(&["0=restart"], &[exited(0, 0)], &[FAIL, Signal(TERM), Arm(Timer::Grace)]; "exit 0 made a failure")]
    #[test_case(&["SIGSEGV=restart"], &[Event::WorkerExited { local_rank: 0, exit: Exit::Signal(11), at_us: 0 }],
        &[FAIL, Signal(TERM), Arm(Timer::Grace)]; "signal rule")]
    #[test_case(&["137=fail"], &[Event::WorkerExited { local_rank: 0, exit: Exit::Signal(9), at_us: 0 }],
        &[FATAL, Signal(TERM), Arm(Timer::Grace)]; "oom kill by code")]
    #[test_case(&["3=fail"], &[Event::Fault { local_rank: 0, exit: Exit::Code(3), at_us: 0 }],
        &[FATAL, Signal(TERM), Arm(Timer::Grace)]; "a rule makes an abort's code fatal")]
    #[test_case(&["0=ignore"], &[Event::Fault { local_rank: 0, exit: Exit::Code(0), at_us: 0 }],
        &[FAIL, Signal(TERM), Arm(Timer::Grace)]; "a fault is never ignored")]
    fn rules_decide(rules: &[&str], events: &[Event], want: &[Action]) {
        let (_, got) = feed_with(2, rules, None, events);
        assert_eq!(got, want);
    }

    /// Silent workers fail the round once and are all recorded; the
    /// failure policy's `no-progress` rule decides restart or fail (or,
    /// ignored, only the later real exit of rank 1 counts).
    #[test_case(&[], FAIL, &[(0, RuleAction::Restart, true), (2, RuleAction::Restart, true)]; "restart by default")]
    #[test_case(&["no-progress=fail"], FATAL, &[(0, RuleAction::Fail, true), (2, RuleAction::Fail, true)]; "a rule makes it fatal")]
    #[test_case(&["137=fail"], FAIL, &[(0, RuleAction::Restart, true), (2, RuleAction::Restart, true)]; "exit rules do not match silence")]
    #[test_case(&["no-progress=ignore"], FAIL, &[(1, RuleAction::Restart, false)]; "ignored")]
    fn silent_workers_fail_the_round(rules: &[&str], publish: Action, want: &[(u32, RuleAction, bool)]) {
        let silent = Event::Silent { local_ranks: vec![0, 2, 9], at_us: 5 };
        let (a, got) = feed_with(3, rules, Some(USR1), &[silent.clone(), silent, exited(1, 3)]);
        assert_eq!(got, [publish, Signal(TERM), Arm(Timer::Grace)], "no checkpoint signal: the workers are stuck");
        let recorded: Vec<(u32, RuleAction, bool)> =
            a.failures().iter().map(|f| (f.local_rank, f.action, f.silent)).collect();
        assert_eq!(recorded, want, "alive silent ranks, once each");
    }

    /// Survivors mode: a death here, or a failure or regroup elsewhere,
    /// ends the round at once and keeps the live workers; what is fatal,
    /// silent, a stop or a lost store stops them all as before.
    #[test_case(&[], &[exited(1, 3)], &[FAIL, Finish(Outcome::Failed)], &[0, 2]; "a death keeps the rest")]
    #[test_case(&[], &[Event::Job(JobEnd::Failure)], &[Finish(Outcome::Failed)], &[0, 1, 2]; "a failure elsewhere")]
    #[test_case(&[], &[Event::Job(DIED)], &[Finish(Outcome::Regroup)], &[0, 1, 2]; "a lost pod")]
    #[test_case(&[], &[exited(0, 0), Event::Job(PLANNED)], &[Finish(Outcome::Regroup)], &[1, 2];
        "a pod joins; a finished worker is not kept")]
    #[test_case(&["3=fail"], &[exited(1, 3)], &[FATAL, Signal(TERM), Arm(Timer::Grace)], &[]; "a fail rule stops all")]
    #[test_case(&[], &[Event::Hung { local_rank: 1, at_us: 9 }], &[FATAL, Signal(TERM), Arm(Timer::Grace)], &[];
        "a hung worker stops all")]
    #[test_case(&[], &[Event::Silent { local_ranks: vec![1], at_us: 9 }], &[FAIL, Signal(TERM), Arm(Timer::Grace)], &[];
        "a silent worker stops all")]
    #[test_case(&[], &[Event::StopSignal(TERM)], &[PublishAbort(TERM), Signal(TERM), Arm(Timer::Grace)], &[];
        "a stop signal stops all")]
    #[test_case(&[], &[Event::Job(JobEnd::Lost)], &[Signal(TERM), Arm(Timer::Grace)], &[]; "a lost store stops all")]
    fn survivors_are_kept(rules: &[&str], events: &[Event], want: &[Action], kept: &[u32]) {
        let rules = Rules::new(rules.iter().map(|r| Rules::parse_flag(r).expect("rule")).collect(), Vec::new());
        let mut a = Attempt::new(3, rules, None);
        a.set_survivors(true);
        let got: Vec<Action> = events.iter().flat_map(|e| a.handle(e.clone())).collect();
        assert_eq!(got, want);
        assert_eq!(a.kept(), kept);
        assert_eq!(a.finished(), want.iter().any(|x| matches!(x, Finish(_))));
        assert!(!a.finished() || a.alive().count() == 0, "a finished round has no live worker of its own");
    }

    #[test]
    fn failures_keep_order_and_ignore_casualties() {
        let (a, _) = feed(3, &[exited(2, 7), exited(0, 1), exited(1, 0)]);
        assert_eq!(
            a.failures(),
            [LocalFailure {
                local_rank: 2,
                exit: Some(Exit::Code(7)),
                at_us: 2,
                action: RuleAction::Restart,
                silent: false
            }]
        );
        assert!(a.finished());
        assert_eq!(a.alive().count(), 0);
        assert!(a.abandoned().is_empty());
    }

    #[test]
    fn unkillable_workers_are_abandoned_and_named() {
        let (a, _) = feed(3, &[exited(2, 7), exited(0, -1), fired(Timer::Grace), fired(Timer::Kill)]);
        assert!(a.finished());
        assert_eq!(a.abandoned(), [1]);
    }

    #[test]
    fn nothing_happens_after_finish() {
        let (mut a, _) = feed(1, &[exited(0, 5)]);
        assert!(a.finished());
        assert!(a.handle(Event::StopSignal(TERM)).is_empty());
        assert!(a.handle(fired(Timer::Grace)).is_empty());
    }

    fn facts(end: Option<JobEnd>) -> RoundFacts {
        RoundFacts {
            end,
            dead: false,
            all_stopped: true,
            fatal: false,
            unkillable: false,
            restarts: 0,
            max_restarts: 1,
        }
    }

    #[test_case(facts(Some(JobEnd::Success)), Verdict::Success; "success")]
    #[test_case(facts(Some(JobEnd::Failure)), Verdict::Restart(1); "budget left")]
    #[test_case(RoundFacts { restarts: 1, ..facts(Some(JobEnd::Failure)) }, Verdict::Fail(FailKind::Budget); "budget spent")]
    #[test_case(RoundFacts { max_restarts: 0, ..facts(Some(JobEnd::Failure)) }, Verdict::Fail(FailKind::Budget); "no restarts")]
    #[test_case(RoundFacts { fatal: true, ..facts(Some(JobEnd::Failure)) }, Verdict::Fail(FailKind::Policy); "fail rule beats budget")]
    #[test_case(RoundFacts { unkillable: true, dead: true, ..facts(Some(JobEnd::Failure)) },
        Verdict::Fail(FailKind::Unkillable); "unkillable beats everything")]
    #[test_case(RoundFacts { dead: true, all_stopped: false, ..facts(Some(JobEnd::Failure)) }, Verdict::Regroup;
        "a dead peer makes failures free")]
    #[test_case(facts(Some(PLANNED)), Verdict::Regroup; "waiting pods or a clean departure")]
    #[test_case(RoundFacts { all_stopped: false, ..facts(Some(JobEnd::Failure)) }, Verdict::Fail(FailKind::Stuck);
        "a live pod that never stops")]
    #[test_case(facts(None), Verdict::Fail(FailKind::Stuck); "no end at all")]
    fn verdicts(f: RoundFacts, want: Verdict) {
        assert_eq!(verdict(&f), want);
    }

    #[test_case(Verdict::Success; "success")]
    #[test_case(Verdict::Regroup; "regroup")]
    #[test_case(Verdict::Restart(7); "restart")]
    #[test_case(Verdict::Fail(FailKind::Policy); "policy")]
    #[test_case(Verdict::Fail(FailKind::Unkillable); "unkillable")]
    #[test_case(Verdict::Fail(FailKind::Budget); "budget")]
    #[test_case(Verdict::Fail(FailKind::Stuck); "stuck")]
    fn verdicts_round_trip_through_the_store(v: Verdict) {
        assert_eq!(v.to_string().parse::<Verdict>(), Ok(v));
    }

    #[test_case(0, 1, 0; "off")]
    #[test_case(1, 1, 1; "first")]
    #[test_case(1, 3, 4; "doubles")]
    #[test_case(1, 30, 60; "capped")]
    fn backoff_doubles_up_to_the_cap(base: u64, n: u32, want: u64) {
        let s = std::time::Duration::from_secs;
        assert_eq!(backoff(s(base), n, s(60)), s(want));
    }
}
