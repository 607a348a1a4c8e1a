//! A served run's stop (`trainlet-client stop`, an actor's close), as the
//! control API carries it out: read the current round, mark the run ended,
//! and, only when this stop marked it first, end the round it read with
//! `stop:N`. [`StopRun`] says which operation comes next; the API
//! (`serve::api`) and the simulation do it and tell it what they got.
//!
//! Why in this order: a run that is over already (an earlier stop, or its
//! own end) has left the round, which may run the next run, so only the
//! first marker may end a round; and the pods move the job on only after
//! each has marked the run over itself, so while this stop's marker is
//! the first, the round read before it is still the run's. Read after it,
//! the round may already be the next run's.

use crate::mutant::{Mutant, on};

/// The next store operation of a stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// GET the job's `round`; then [`StopRun::read`].
    ReadRound,
    /// Mark the run ended (`serve::Link::set_ended`); then [`StopRun::marked`].
    Mark,
    /// COMPARE_SET `rR/end` from empty to `stop:N`; then [`StopRun::ended`].
    EndRound(u64),
    /// Nothing more.
    Done,
}

/// One stop of a served run, from its request to its `stop:N`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StopRun {
    round: Option<u64>,
    marked_first: Option<bool>,
    ended: bool,
}

impl StopRun {
    /// A stop that has done nothing yet.
    pub fn new() -> StopRun {
        StopRun::default()
    }

    /// What to do next.
    pub fn next(&self) -> Op {
        let late = on(Mutant::StopReadsRoundLate);
        match (self.round, self.marked_first) {
            (None, None) if late => Op::Mark,
            (None, None) => Op::ReadRound,
            (Some(_), None) => Op::Mark,
            (_, Some(first)) if !ends_round(first) => Op::Done,
            (None, Some(_)) => Op::ReadRound,
            (Some(r), Some(_)) if !self.ended => Op::EndRound(r),
            (Some(_), Some(_)) => Op::Done,
        }
    }

    /// The job's current round, read.
    pub fn read(&mut self, round: u64) {
        self.round = Some(round);
    }

    /// The run is marked; `first`: by this stop's marker.
    pub fn marked(&mut self, first: bool) {
        self.marked_first = Some(first);
    }

    /// The round's end was written (or another end was there).
    pub fn ended(&mut self) {
        self.ended = true;
    }
}

/// A valid marker of the run was there before this stop wrote one: the run
/// is over already. (A second stop's marker is the same bytes as the
/// first's, so the COMPARE_SET alone cannot tell.)
pub fn over_already(found_valid_marker: bool) -> bool {
    found_valid_marker && !on(Mutant::SecondStopSameMarker)
}

/// Whether this stop writes `stop:N` into a round: only when it marked the
/// run ended first.
fn ends_round(marked_first: bool) -> bool {
    marked_first || on(Mutant::StopOfOverRun)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_reads_the_round_then_marks_then_ends_it_when_first() {
        let mut s = StopRun::new();
        assert_eq!(s.next(), Op::ReadRound);
        s.read(7);
        assert_eq!(s.next(), Op::Mark);
        s.marked(true);
        assert_eq!(s.next(), Op::EndRound(7));
        s.ended();
        assert_eq!(s.next(), Op::Done);

        let mut late = StopRun::new();
        late.read(7);
        late.marked(false);
        assert_eq!(late.next(), Op::Done, "a run over already ends no round");
    }

    #[test]
    fn only_a_marker_found_before_means_over() {
        assert!(over_already(true));
        assert!(!over_already(false));
    }
}
