//! Settling a round once it ended, as operations: the verdict every pod
//! follows ([`Decide`]) and, after a verdict that moves the job on, the
//! move to the next round ([`Finish`]). The agent (`trainlet::rendezvous::
//! end`) and the simulation carry out the same operations in the same
//! order.
//!
//! Deciding: raise the job's `round` to R (reading it): a round the job
//! has moved two rounds past is forgotten ([`forgotten`]: its keys are
//! deleted, nobody agrees there any more) and the pod regroups into the
//! current one; else COMPARE_SET `rR/verdict` from empty to the proposal
//! (the first writer decides for every pod), and after a restart verdict
//! raise the job-wide `restarts` to its count. Finishing: raise `round` to
//! R + 1, then COMPARE_SET `rR/next` to the round now, unless R is
//! forgotten (its `next` would be a key of a deleted round).

use crate::join::forgotten;

/// The next operation of a round's settling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Raise the job's `round` to at least this: [`Got::Num`], the round now.
    RaiseRound(u64),
    /// COMPARE_SET `rR/verdict` from empty to the pod's proposal:
    /// [`Got::Agreed`], the verdict there afterwards, as read.
    Propose,
    /// Raise the job's `restarts` to at least this: [`Got::Num`].
    RaiseRestarts(u32),
    /// COMPARE_SET `rR/next` from empty to this round: [`Got::Done`].
    PointNext(u64),
    /// Nothing more.
    Done(Settled),
}

/// What an operation got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Got {
    /// A number.
    Num(u64),
    /// The agreed verdict: `Some(n)` when it restarts the job (its n-th restart).
    Agreed {
        /// The restart it is, if it is one.
        restart: Option<u32>,
    },
    /// Done.
    Done,
}

/// How the settling ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// The agreed verdict stands (the caller read it).
    Agreed,
    /// The round was forgotten: regroup into the current one.
    Forgotten,
    /// The job moved past the round (or it was forgotten already).
    Moved,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum At {
    Raise,
    Propose,
    Restarts(u32),
    Done(Settled),
}

/// Deciding round R's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decide {
    r: u64,
    at: At,
}

impl Decide {
    /// A pod about to decide round `r`'s verdict.
    pub fn new(r: u64) -> Decide {
        Decide { r, at: At::Raise }
    }

    /// The next operation.
    pub fn next(&self) -> Op {
        match self.at {
            At::Raise => Op::RaiseRound(self.r),
            At::Propose => Op::Propose,
            At::Restarts(n) => Op::RaiseRestarts(n),
            At::Done(s) => Op::Done(s),
        }
    }

    /// The answer to [`Decide::next`]'s operation; then the next one.
    pub fn answer(&mut self, got: Got) -> Op {
        self.at = match (self.at, got) {
            (At::Raise, Got::Num(current)) if forgotten(self.r, current).is_some() => At::Done(Settled::Forgotten),
            (At::Raise, _) => At::Propose,
            (At::Propose, Got::Agreed { restart: Some(n) }) => At::Restarts(n),
            (At::Propose | At::Restarts(_), _) => At::Done(Settled::Agreed),
            (At::Done(s), _) => At::Done(s),
        };
        self.next()
    }
}

/// Moving the job past round R after a verdict that moves it on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finish {
    r: u64,
    /// The round the job is at, once raised.
    current: Option<u64>,
    done: bool,
}

impl Finish {
    /// A pod about to move the job past round `r`.
    pub fn new(r: u64) -> Finish {
        Finish { r, current: None, done: false }
    }

    /// The next operation.
    pub fn next(&self) -> Op {
        match self.current {
            None => Op::RaiseRound(self.r + 1),
            Some(current) if !self.done && forgotten(self.r, current).is_none() => Op::PointNext(current),
            Some(_) => Op::Done(Settled::Moved),
        }
    }

    /// The answer to [`Finish::next`]'s operation; then the next one.
    pub fn answer(&mut self, got: Got) -> Op {
        match (self.current, got) {
            (None, Got::Num(current)) => self.current = Some(current),
            (None, _) => self.current = Some(self.r + 1),
            (Some(_), _) => self.done = true,
        }
        self.next()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_proposes_follows_the_agreed_verdict_and_counts_a_restart() {
        let mut d = Decide::new(4);
        assert_eq!(d.next(), Op::RaiseRound(4));
        assert_eq!(d.answer(Got::Num(4)), Op::Propose);
        assert_eq!(d.answer(Got::Agreed { restart: Some(2) }), Op::RaiseRestarts(2));
        assert_eq!(d.answer(Got::Num(2)), Op::Done(Settled::Agreed));

        let mut ok = Decide::new(4);
        ok.answer(Got::Num(5));
        assert_eq!(ok.answer(Got::Agreed { restart: None }), Op::Done(Settled::Agreed));

        let mut late = Decide::new(4);
        assert_eq!(late.answer(Got::Num(6)), Op::Done(Settled::Forgotten), "two rounds on: forgotten");
    }

    #[test]
    fn moving_on_points_next_unless_the_round_is_forgotten() {
        let mut f = Finish::new(4);
        assert_eq!(f.next(), Op::RaiseRound(5));
        assert_eq!(f.answer(Got::Num(5)), Op::PointNext(5));
        assert_eq!(f.answer(Got::Done), Op::Done(Settled::Moved));

        let mut late = Finish::new(4);
        assert_eq!(late.answer(Got::Num(7)), Op::Done(Settled::Moved), "no next in a forgotten round");
    }
}
