//! An MPI attempt's ranks as its PMI service sees them ([`Ranks`]): which
//! started (PMI init) and finalized, and which ended the job and why.
//! The attempt feeds it the service's notes and asks it how to read each
//! exit: a rank that started and exits without finalize, or that called
//! abort, or that was stopped for breaking the protocol, is a failure of
//! the job whatever its exit code (mpiexec's rule: the other ranks would
//! wait for it forever).

use std::collections::{HashMap, HashSet};

use tokio::sync::mpsc::UnboundedReceiver;

use crate::mpi::pmi::server::Note;
use crate::supervise::policy::Event;
use crate::sys::Exit;

/// What a note asks of the attempt.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Applied {
    /// An event for the core.
    pub event: Option<Event>,
    /// Local ranks to kill (they wait for replies that will not come).
    pub stop: Vec<u32>,
}

/// One attempt's MPI ranks on this pod.
#[derive(Debug, Default)]
pub(super) struct Ranks {
    notes: Option<UnboundedReceiver<Note>>,
    started: HashSet<u32>,
    /// How many of them speak PMI-2.
    v2: u32,
    finalized: HashSet<u32>,
    /// Ranks stopped by trainlet: their exit is a fault.
    stopped: HashSet<u32>,
    /// Why a rank ended the job (its report's message).
    why: HashMap<u32, String>,
}

impl Ranks {
    /// The ranks of an attempt whose service sends `notes` (None: not MPI).
    pub fn new(notes: Option<UnboundedReceiver<Note>>) -> Ranks {
        Ranks { notes, ..Ranks::default() }
    }

    /// The next note; never resolves when there is none to come.
    pub async fn next(&mut self) -> Note {
        match &mut self.notes {
            Some(rx) => match rx.recv().await {
                Some(n) => n,
                None => {
                    self.notes = None;
                    std::future::pending().await
                }
            },
            None => std::future::pending().await,
        }
    }

    /// The notes already sent, applied in order (before an exit is read:
    /// a rank's finalize is noted before its reply, so before it exits).
    pub fn drain(&mut self, nproc: u32, at_us: u64) -> Vec<Applied> {
        let mut out = Vec::new();
        while let Some(n) = self.notes.as_mut().and_then(|rx| rx.try_recv().ok()) {
            out.push(self.apply(n, nproc, at_us));
        }
        out
    }

    /// Take `note` in; what the attempt must do about it.
    pub fn apply(&mut self, note: Note, nproc: u32, at_us: u64) -> Applied {
        let lr = |l: usize| u32::try_from(l).unwrap_or(u32::MAX);
        match note {
            Note::Started { local, v2 } => {
                self.started.insert(lr(local));
                self.v2 += u32::from(v2);
                if self.started.len() == nproc as usize {
                    tracing::info!(
                        ranks = nproc,
                        pmi_1 = nproc - self.v2,
                        pmi_2 = self.v2,
                        "every local MPI rank is in PMI; the ranks' fences wait for every pod's"
                    );
                }
                Applied::default()
            }
            Note::Finalized(l) => {
                self.finalized.insert(lr(l));
                Applied::default()
            }
            Note::Aborted { local, code, why } => {
                let local_rank = lr(local);
                // The code as exit() would give it (MPI_Abort takes any int).
                let code = code.rem_euclid(256);
                tracing::error!(local_rank, exit_code = code, message = %why.escape_debug(), "an MPI rank called abort; stopping the job's ranks");
                let said = if why.is_empty() { String::new() } else { format!(": {}", why.escape_debug()) };
                self.why.entry(local_rank).or_insert(format!("called MPI_Abort (PMI abort, exit code {code}){said}"));
                // A PMI-1 client waits to be killed after its abort (Intel
                // MPI's); a PMI-2 one exits by itself (Slurm's library).
                Applied {
                    event: Some(Event::Fault { local_rank, exit: Exit::Code(code), at_us }),
                    stop: vec![local_rank],
                }
            }
            Note::Refused { local, why } => {
                let local_rank = lr(local);
                tracing::error!(local_rank, reason = %why.escape_debug(), "an MPI rank broke the PMI protocol or asked for what trainlet does not serve; stopping it and the job's ranks");
                self.why.entry(local_rank).or_insert(format!("stopped by trainlet: {why}"));
                self.stopped.insert(local_rank);
                Applied { event: None, stop: vec![local_rank] }
            }
            Note::Fence(why) => {
                tracing::error!(reason = %why, "the job-wide PMI fence failed; stopping this pod's ranks");
                for l in 0..nproc {
                    self.why.entry(l).or_insert(format!("stopped by trainlet: the job-wide PMI fence failed: {why}"));
                    self.stopped.insert(l);
                }
                Applied { event: None, stop: (0..nproc).collect() }
            }
        }
    }

    /// How the core reads local rank `local_rank`'s `exit`.
    pub fn exit_event(&mut self, local_rank: u32, exit: Exit, at_us: u64) -> Event {
        let left = self.started.contains(&local_rank) && !self.finalized.contains(&local_rank);
        if self.stopped.contains(&local_rank) || (left && exit == Exit::Code(0)) {
            if left {
                self.why.entry(local_rank).or_insert_with(|| {
                    "exited after PMI init without MPI_Finalize: the other ranks would wait for it forever".into()
                });
            }
            return Event::Fault { local_rank, exit, at_us };
        }
        Event::WorkerExited { local_rank, exit, at_us }
    }

    /// Why local rank `local_rank` ended the job, if it did.
    pub fn why(&self, local_rank: u32) -> Option<&str> {
        self.why.get(&local_rank).map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exit(code: i32) -> Exit {
        Exit::Code(code)
    }

    #[test]
    fn exits_are_read_by_what_the_rank_did_with_pmi() {
        let mut r = Ranks::new(None);
        for n in [
            Note::Started { local: 0, v2: false },
            Note::Started { local: 1, v2: false },
            Note::Finalized(1),
            Note::Started { local: 2, v2: false },
        ] {
            assert_eq!(r.apply(n, 4, 1), Applied::default());
        }
        // Never used PMI, or finalized: the exit speaks for itself.
        assert_eq!(r.exit_event(3, exit(0), 5), Event::WorkerExited { local_rank: 3, exit: exit(0), at_us: 5 });
        assert_eq!(r.exit_event(1, exit(0), 5), Event::WorkerExited { local_rank: 1, exit: exit(0), at_us: 5 });
        // Started, not finalized: exit 0 is a fault, a failing exit stays one.
        assert_eq!(r.exit_event(0, exit(0), 5), Event::Fault { local_rank: 0, exit: exit(0), at_us: 5 });
        assert!(r.why(0).is_some_and(|w| w.contains("without MPI_Finalize")));
        assert_eq!(r.exit_event(2, exit(4), 5), Event::WorkerExited { local_rank: 2, exit: exit(4), at_us: 5 });
    }

    #[test]
    fn abort_refusal_and_a_failed_fence_end_the_job() {
        let mut r = Ranks::new(None);
        let a = r.apply(Note::Aborted { local: 1, code: 3, why: "bad".into() }, 2, 7);
        assert_eq!(a, Applied { event: Some(Event::Fault { local_rank: 1, exit: exit(3), at_us: 7 }), stop: vec![1] });
        assert!(r.why(1).is_some_and(|w| w.contains("MPI_Abort") && w.contains("bad")));
        let a = r.apply(Note::Refused { local: 0, why: "spawn".into() }, 2, 7);
        assert_eq!(a, Applied { event: None, stop: vec![0] });
        assert_eq!(
            r.exit_event(0, Exit::Signal(9), 8),
            Event::Fault { local_rank: 0, exit: Exit::Signal(9), at_us: 8 }
        );
        let mut r = Ranks::new(None);
        assert_eq!(r.apply(Note::Fence("store gone".into()), 2, 7).stop, vec![0, 1]);
        assert!(r.why(1).is_some_and(|w| w.contains("store gone")));
    }

    #[tokio::test]
    async fn drain_applies_what_was_sent_in_order() {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut r = Ranks::new(Some(rx));
        tx.send(Note::Started { local: 0, v2: false }).expect("send");
        tx.send(Note::Finalized(0)).expect("send");
        assert_eq!(r.drain(1, 0).len(), 2);
        assert_eq!(r.exit_event(0, exit(0), 1), Event::WorkerExited { local_rank: 0, exit: exit(0), at_us: 1 });
        drop(tx);
        assert!(tokio::time::timeout(std::time::Duration::from_millis(50), r.next()).await.is_err());
    }
}
