//! The pure core of the supervisor: events in, actions out, no I/O.
//!
//! One [`Attempt`] tracks one pod's workers through one restart attempt:
//!
//! ```text
//!  Running ──all exit 0──▶ LocalDone ──job success──▶ Finished(Succeeded)
//!     │                       │ job failure/abort/lost, stop signal
//!     │ worker fails, stop     ▼
//!     │ signal, job end ─▶ Stopping(reason) ──last worker gone──▶ Finished(reason)
//!     │                    grace expired: SIGKILL; second stop signal: SIGKILL now
//! ```
//!
//! Only exits seen while Running count as failures: workers that die after
//! we asked them to stop are casualties, not causes. What to do after an
//! attempt ([`next_step`]) is also decided here, from the attempt number and
//! the job-wide restart budget, so every pod takes the same decision.

use std::collections::BTreeSet;

use crate::sys::Exit;

/// How the job's current attempt ended, as published in the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobEnd {
    /// Every worker on every pod exited 0.
    Success,
    /// A worker failed somewhere.
    Failure,
    /// A pod was stopped by a signal and left.
    Abort,
    /// The store became unreachable.
    Lost,
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
    /// A signal that asks the agent to stop.
    StopSignal(i32),
    /// A signal passed through to the workers (SIGUSR1/2).
    ForwardSignal(i32),
    /// The store says how the attempt ended.
    Job(JobEnd),
    /// The grace period after the stop request ran out.
    GraceExpired,
}

/// A worker that failed on its own while the attempt ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalFailure {
    /// Local rank of the worker.
    pub local_rank: u32,
    /// How it ended.
    pub exit: Exit,
    /// When, in wall-clock microseconds.
    pub at_us: u64,
}

/// Why an attempt ended on this pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// All workers everywhere succeeded.
    Succeeded,
    /// A worker failed (here or on another pod).
    Failed,
    /// This agent was asked to stop by this signal.
    Stopped(i32),
    /// Another pod left (signal) or the store went away.
    PeerLost,
}

/// Outputs of the core.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Send this signal to every live worker's process group.
    Signal(i32),
    /// SIGKILL every live worker's process group.
    KillAll,
    /// Start the grace timer.
    ArmGrace,
    /// Tell the other pods this attempt failed.
    PublishFailure,
    /// Tell the other pods this pod is leaving (stopped by a signal).
    PublishAbort(i32),
    /// Tell the other pods every worker here exited 0.
    PublishLocalDone,
    /// The attempt is over on this pod; no worker is left.
    Finish(Outcome),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Running,
    LocalDone,
    Stopping(Outcome),
    Finished,
}

/// One pod's view of one attempt.
#[derive(Debug)]
pub struct Attempt {
    alive: BTreeSet<u32>,
    phase: Phase,
    failures: Vec<LocalFailure>,
    killed: bool,
}

impl Attempt {
    /// An attempt whose workers `0..nproc` are all running.
    pub fn new(nproc: u32) -> Self {
        Self { alive: (0..nproc).collect(), phase: Phase::Running, failures: Vec::new(), killed: false }
    }

    /// Local ranks still running.
    pub fn alive(&self) -> impl Iterator<Item = u32> + '_ {
        self.alive.iter().copied()
    }

    /// Failures observed while running, in order.
    pub fn failures(&self) -> &[LocalFailure] {
        &self.failures
    }

    /// Is the attempt over?
    pub fn finished(&self) -> bool {
        self.phase == Phase::Finished
    }

    fn stop(&mut self, why: Outcome, sig: i32, out: &mut Vec<Action>) {
        self.phase = Phase::Stopping(why);
        out.push(Action::Signal(sig));
        out.push(Action::ArmGrace);
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
            JobEnd::Abort | JobEnd::Lost => Outcome::PeerLost,
        }
    }

    /// Feed one event; returns what to do, in order.
    pub fn handle(&mut self, event: Event) -> Vec<Action> {
        let mut out = Vec::new();
        match (self.phase, event) {
            (Phase::Finished, _) => {}
            (_, Event::WorkerExited { local_rank, exit, at_us }) => {
                if !self.alive.remove(&local_rank) {
                    return out;
                }
                if self.phase == Phase::Running {
                    if exit.success() {
                        if self.alive.is_empty() {
                            self.phase = Phase::LocalDone;
                            out.push(Action::PublishLocalDone);
                        }
                    } else {
                        self.failures.push(LocalFailure { local_rank, exit, at_us });
                        out.push(Action::PublishFailure);
                        self.stop(Outcome::Failed, libc::SIGTERM, &mut out);
                    }
                }
                self.finish_if_empty(&mut out);
            }
            (Phase::Running, Event::StopSignal(sig)) => {
                out.push(Action::PublishAbort(sig));
                self.stop(Outcome::Stopped(sig), sig, &mut out);
                self.finish_if_empty(&mut out);
            }
            (Phase::LocalDone, Event::StopSignal(sig)) => {
                out.push(Action::PublishAbort(sig));
                self.phase = Phase::Finished;
                out.push(Action::Finish(Outcome::Stopped(sig)));
            }
            (Phase::Stopping(why), Event::StopSignal(sig)) => {
                // A second stop request skips the rest of the grace period.
                if !matches!(why, Outcome::Stopped(_)) {
                    out.push(Action::PublishAbort(sig));
                    self.phase = Phase::Stopping(Outcome::Stopped(sig));
                }
                if !self.killed {
                    self.killed = true;
                    out.push(Action::KillAll);
                }
            }
            (Phase::Running | Phase::Stopping(_), Event::ForwardSignal(sig)) => out.push(Action::Signal(sig)),
            (Phase::LocalDone, Event::ForwardSignal(_)) => {}
            (Phase::Running, Event::Job(JobEnd::Success)) => {} // impossible while we run; ignore
            (Phase::Running, Event::Job(end)) => {
                self.stop(Self::job_outcome(end), libc::SIGTERM, &mut out);
                self.finish_if_empty(&mut out);
            }
            (Phase::LocalDone, Event::Job(end)) => {
                self.phase = Phase::Finished;
                out.push(Action::Finish(Self::job_outcome(end)));
            }
            (Phase::Stopping(Outcome::Failed), Event::Job(JobEnd::Abort | JobEnd::Lost)) => {
                self.phase = Phase::Stopping(Outcome::PeerLost);
            }
            (Phase::Stopping(_), Event::Job(_)) => {}
            (Phase::Stopping(_), Event::GraceExpired) => {
                if !self.killed {
                    self.killed = true;
                    out.push(Action::KillAll);
                }
            }
            (Phase::Running | Phase::LocalDone, Event::GraceExpired) => {}
        }
        out
    }
}

/// What the agent does once an attempt is over on every pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Start attempt `n`.
    Restart(u32),
    /// Exit; the code comes from the outcome and the root-cause failure.
    Exit,
}

/// Restart after a failure while the job-wide budget allows; otherwise exit.
pub fn next_step(outcome: Outcome, attempt: u32, max_restarts: u32) -> Next {
    match outcome {
        Outcome::Failed if attempt < max_restarts => Next::Restart(attempt + 1),
        _ => Next::Exit,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    const TERM: i32 = libc::SIGTERM;
    const USR1: i32 = libc::SIGUSR1;

    fn exited(local_rank: u32, code: i32) -> Event {
        Event::WorkerExited { local_rank, exit: Exit::Code(code), at_us: u64::from(local_rank) }
    }

    fn feed(nproc: u32, events: &[Event]) -> (Attempt, Vec<Action>) {
        let mut a = Attempt::new(nproc);
        let mut all = Vec::new();
        for e in events {
            all.extend(a.handle(e.clone()));
        }
        (a, all)
    }

    #[test_case(&[exited(0, 0), exited(1, 0)], &[Action::PublishLocalDone]; "all succeed locally")]
    #[test_case(&[exited(0, 0), exited(1, 0), Event::Job(JobEnd::Success)],
        &[Action::PublishLocalDone, Action::Finish(Outcome::Succeeded)]; "job success")]
    #[test_case(&[exited(1, 3)],
        &[Action::PublishFailure, Action::Signal(TERM), Action::ArmGrace]; "local failure stops the rest")]
    #[test_case(&[exited(1, 3), exited(0, -1)],
        &[Action::PublishFailure, Action::Signal(TERM), Action::ArmGrace, Action::Finish(Outcome::Failed)]; "casualty is not a failure")]
    #[test_case(&[exited(1, 3), Event::GraceExpired, Event::GraceExpired],
        &[Action::PublishFailure, Action::Signal(TERM), Action::ArmGrace, Action::KillAll]; "grace kills once")]
    #[test_case(&[Event::StopSignal(TERM)],
        &[Action::PublishAbort(TERM), Action::Signal(TERM), Action::ArmGrace]; "stop signal forwarded")]
    #[test_case(&[Event::StopSignal(TERM), Event::StopSignal(TERM)],
        &[Action::PublishAbort(TERM), Action::Signal(TERM), Action::ArmGrace, Action::KillAll]; "second signal skips grace")]
    #[test_case(&[Event::ForwardSignal(USR1)], &[Action::Signal(USR1)]; "usr1 passes through")]
    #[test_case(&[Event::Job(JobEnd::Failure)], &[Action::Signal(TERM), Action::ArmGrace]; "remote failure stops us")]
    #[test_case(&[exited(0, 0), exited(1, 0), Event::Job(JobEnd::Failure)],
        &[Action::PublishLocalDone, Action::Finish(Outcome::Failed)]; "remote failure after local success")]
    #[test_case(&[exited(0, 0), exited(1, 0), Event::StopSignal(TERM)],
        &[Action::PublishLocalDone, Action::PublishAbort(TERM), Action::Finish(Outcome::Stopped(TERM))]; "signal after local success")]
    #[test_case(&[Event::Job(JobEnd::Abort), exited(0, -1), exited(1, -1)],
        &[Action::Signal(TERM), Action::ArmGrace, Action::Finish(Outcome::PeerLost)]; "peer left")]
    #[test_case(&[exited(1, 3), Event::StopSignal(TERM), exited(0, 0)],
        &[Action::PublishFailure, Action::Signal(TERM), Action::ArmGrace, Action::PublishAbort(TERM), Action::KillAll,
          Action::Finish(Outcome::Stopped(TERM))]; "signal during failure stop wins")]
    #[test_case(&[exited(0, 0), exited(0, 1)], &[]; "duplicate exit ignored")]
    fn transitions(events: &[Event], want: &[Action]) {
        let (_, got) = feed(2, events);
        assert_eq!(got, want);
    }

    #[test]
    fn failures_keep_order_and_ignore_casualties() {
        let (a, _) = feed(3, &[exited(2, 7), exited(0, 1), exited(1, 0)]);
        assert_eq!(a.failures(), [LocalFailure { local_rank: 2, exit: Exit::Code(7), at_us: 2 }]);
        assert!(a.finished());
        assert_eq!(a.alive().count(), 0);
    }

    #[test]
    fn nothing_happens_after_finish() {
        let (mut a, _) = feed(1, &[exited(0, 5)]);
        assert!(a.finished());
        assert!(a.handle(Event::StopSignal(TERM)).is_empty());
        assert!(a.handle(Event::GraceExpired).is_empty());
    }

    #[test_case(Outcome::Failed, 0, 1, Next::Restart(1); "budget left")]
    #[test_case(Outcome::Failed, 1, 1, Next::Exit; "budget spent")]
    #[test_case(Outcome::Failed, 0, 0, Next::Exit; "no restarts")]
    #[test_case(Outcome::Succeeded, 0, 3, Next::Exit; "success exits")]
    #[test_case(Outcome::Stopped(TERM), 0, 3, Next::Exit; "signal never restarts")]
    #[test_case(Outcome::PeerLost, 0, 3, Next::Exit; "peer lost exits in static mode")]
    fn restart_budget(outcome: Outcome, attempt: u32, max: u32, want: Next) {
        assert_eq!(next_step(outcome, attempt, max), want);
    }
}
