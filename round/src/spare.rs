//! A spare's wait: what it does with each thing it hears while a round
//! runs without it (the members' leaving, the job moving on, a verdict,
//! the store closing, its health check's time).
//!
//! [`SpareWait`] is the whole wait as operations, carried out by the
//! agent's `rendezvous::join::wait_as_spare` and by the simulation: it
//! waits on all of them at once, and when two are ready together (the
//! members leave and the store closes right after), it acts on the first
//! in [`PRIORITY`]'s order.

use crate::mutant::{Mutant, on};

/// What a spare heard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Heard {
    /// The members left the job (`rR/all_left`), watched only in serve mode
    /// ([`watches_left`]).
    MembersLeft,
    /// The job moved on to another round (`rR/next`).
    Next,
    /// The round's verdict (`rR/verdict`).
    Verdict(VerdictRead),
    /// The store closed (every WAIT ended with an error).
    StoreLost,
    /// Time for its health check.
    Recheck,
}

/// A verdict as a spare reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VerdictRead {
    /// The job ended (success or failure).
    Final {
        /// It succeeded.
        success: bool,
    },
    /// A restart or regroup (or an unreadable value): the job moves on.
    MovesOn,
}

/// What the spare does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Leave the job with its outcome; `say_read`: first `ADD rR/spare_left`
    /// (the store host waits for it before it closes the store).
    Leave {
        /// The job succeeded.
        success: bool,
        /// Tell the store host the verdict was read.
        say_read: bool,
    },
    /// Wait (bounded) for `rR/next`, then check health and join it; move
    /// the job on when nobody did.
    AwaitNext,
    /// The job moved on: check health, then join the next round after the
    /// last round's live members.
    MovedOn,
    /// Reconnect and weigh what the store host announced as it left
    /// ([`crate::host_left`]).
    Reconnect,
    /// Check health, then wait again.
    Recheck,
}

/// The order in which a spare takes what it heard together.
pub const PRIORITY: [fn(&Heard) -> bool; 5] = [
    |h| *h == Heard::MembersLeft,
    |h| *h == Heard::Next,
    |h| matches!(h, Heard::Verdict(_)),
    |h| *h == Heard::StoreLost,
    |h| *h == Heard::Recheck,
];

/// Whether a spare watches the members' leaving: in serve mode only, where
/// the idle timeout's shutdown ends the job with no verdict for it.
/// Elsewhere every end has a verdict, and `all_left` may be an old store's
/// (a pod restarted in place meets its previous containers' store).
pub fn watches_left(serving: bool) -> bool {
    serving || on(Mutant::SpareTakesAllLeft)
}

/// Of what is ready together, what the spare takes first ([`PRIORITY`]).
pub fn first(ready: &[Heard]) -> Option<Heard> {
    if on(Mutant::SpareHearsCloseFirst) && ready.contains(&Heard::StoreLost) {
        return Some(Heard::StoreLost);
    }
    PRIORITY.iter().find_map(|is| ready.iter().copied().find(is))
}

/// What a spare does with `heard` (`serving`: a served job's pod).
pub fn step(heard: Heard, serving: bool) -> Step {
    match heard {
        Heard::MembersLeft => Step::Leave { success: true, say_read: false },
        Heard::Next => Step::MovedOn,
        // In serve mode a verdict ends a run; the pods go on serving.
        Heard::Verdict(VerdictRead::Final { success }) if !serving => Step::Leave { success, say_read: true },
        Heard::Verdict(_) => Step::AwaitNext,
        Heard::StoreLost => Step::Reconnect,
        Heard::Recheck => Step::Recheck,
    }
}

/// A key a spare's wait reads or writes: round R's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum K {
    /// `rR/all_left`: the members left the job.
    AllLeft,
    /// `rR/next`.
    Next,
    /// `rR/verdict`.
    Verdict,
    /// `rR/spare_left`: the spares that read a final verdict.
    SpareLeft,
}

/// The next store operation of a spare's wait.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// WAIT until any of these keys is set (listed in [`PRIORITY`]'s
    /// order), the store closes, or the time `until`: [`Got::Ready`] or
    /// [`Got::TimedOut`].
    WaitAny(Vec<K>, u64),
    /// GET `rR/verdict` and read it: [`Got::Verdict`].
    ReadVerdict,
    /// ADD 1 to `rR/spare_left` (best effort: the store may be closing):
    /// [`Got::Done`].
    SayRead,
    /// Move the job from R to R + 1 (raise `round`, COMPARE_SET
    /// `rR/next`): [`Got::Done`].
    Advance,
    /// Nothing more: the wait's end.
    Done(SpareEnd),
}

/// What an operation of a spare's wait got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Got {
    /// These keys were set, and whether the store closed too (every WAIT
    /// ended with an error), all seen at one wake-up.
    Ready(Vec<K>, bool),
    /// The wait's time came first.
    TimedOut,
    /// The verdict, read.
    Verdict(VerdictRead),
    /// Done.
    Done,
}

/// How a spare's wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpareEnd {
    /// Leave the job with its outcome.
    Leave {
        /// The job succeeded.
        success: bool,
    },
    /// The job moved on: check health, then join the next round after the
    /// last round's live members.
    MovedOn,
    /// Check health, then wait again.
    Recheck,
    /// The store closed: reconnect, and weigh what its host announced
    /// ([`crate::host_left`]); `in_hand`: the members' leaving was heard
    /// with it (the job's end in hand).
    Reconnect {
        /// The job's end was in hand.
        in_hand: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum At {
    Wait,
    ReadVerdict,
    SayRead { success: bool },
    AwaitNext { until: u64 },
    Advance,
    Done(SpareEnd),
}

/// A spare's wait beside round R, as operations ([`Op`] out, [`Got`] in,
/// with the time now in the caller's unit): what it hears, in
/// [`PRIORITY`]'s order, and [`step`]'s answer, carried out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpareWait {
    serving: bool,
    /// When it rechecks its health.
    recheck_at: u64,
    /// How long it waits for `rR/next` after a verdict that moves the job on.
    next_wait: u64,
    at: At,
}

impl SpareWait {
    /// A spare's wait (`serving`: a served job's pod) that rechecks its
    /// health at `recheck_at` and waits `next_wait` for the next round after
    /// a verdict that moves the job on.
    pub fn new(serving: bool, recheck_at: u64, next_wait: u64) -> SpareWait {
        SpareWait { serving, recheck_at, next_wait, at: At::Wait }
    }

    /// The next operation (the same until it is answered).
    pub fn next(&self) -> Op {
        match self.at {
            At::Wait => {
                let mut keys = Vec::new();
                if watches_left(self.serving) {
                    keys.push(K::AllLeft);
                }
                keys.extend([K::Next, K::Verdict]);
                Op::WaitAny(keys, self.recheck_at)
            }
            At::ReadVerdict => Op::ReadVerdict,
            At::SayRead { .. } => Op::SayRead,
            At::AwaitNext { until } => Op::WaitAny(vec![K::Next], until),
            At::Advance => Op::Advance,
            At::Done(end) => Op::Done(end),
        }
    }

    /// The answer to [`SpareWait::next`]'s operation, got at time `now`;
    /// then the next operation.
    pub fn answer(&mut self, got: Got, now: u64) -> Op {
        self.at = match (self.at, got) {
            (At::Wait, got) => {
                let (keys, lost) = match got {
                    Got::Ready(keys, lost) => (keys, lost),
                    _ => (Vec::new(), false),
                };
                let mut ready: Vec<Heard> = keys
                    .iter()
                    .filter_map(|k| match k {
                        K::AllLeft => Some(Heard::MembersLeft),
                        K::Next => Some(Heard::Next),
                        K::Verdict => Some(Heard::Verdict(VerdictRead::MovesOn)),
                        K::SpareLeft => None,
                    })
                    .collect();
                if lost {
                    ready.push(Heard::StoreLost);
                }
                if ready.is_empty() {
                    ready.push(Heard::Recheck);
                }
                match first(&ready) {
                    // The value is read after the wake-up.
                    Some(Heard::Verdict(_)) => At::ReadVerdict,
                    Some(heard) => self.after(heard, ready.contains(&Heard::MembersLeft), now),
                    None => At::Wait,
                }
            }
            (At::ReadVerdict, Got::Verdict(v)) => self.after(Heard::Verdict(v), false, now),
            (At::ReadVerdict, _) => self.after(Heard::Verdict(VerdictRead::MovesOn), false, now),
            (At::SayRead { success }, _) => At::Done(SpareEnd::Leave { success }),
            (At::AwaitNext { .. }, Got::Ready(keys, _)) if keys.contains(&K::Next) => At::Done(SpareEnd::MovedOn),
            // Members move the job on right after a verdict that does; when
            // none did within the bound, the spare does.
            (At::AwaitNext { .. }, _) => At::Advance,
            (At::Advance, _) => At::Done(SpareEnd::MovedOn),
            (At::Done(end), _) => At::Done(end),
        };
        self.next()
    }

    fn after(&self, heard: Heard, in_hand: bool, now: u64) -> At {
        match step(heard, self.serving) {
            Step::Leave { success, say_read: true } => At::SayRead { success },
            Step::Leave { success, say_read: false } => At::Done(SpareEnd::Leave { success }),
            Step::AwaitNext => At::AwaitNext { until: now + self.next_wait },
            Step::MovedOn => At::Done(SpareEnd::MovedOn),
            Step::Recheck => At::Done(SpareEnd::Recheck),
            Step::Reconnect => At::Done(SpareEnd::Reconnect { in_hand }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spare_leaves_moves_on_or_waits_for_what_it_heard() {
        let fin = |success| Heard::Verdict(VerdictRead::Final { success });
        let table = [
            (Heard::MembersLeft, true, Step::Leave { success: true, say_read: false }),
            (fin(true), false, Step::Leave { success: true, say_read: true }),
            (fin(false), false, Step::Leave { success: false, say_read: true }),
            (fin(true), true, Step::AwaitNext),
            (Heard::Verdict(VerdictRead::MovesOn), false, Step::AwaitNext),
            (Heard::Next, false, Step::MovedOn),
            (Heard::StoreLost, true, Step::Reconnect),
            (Heard::Recheck, false, Step::Recheck),
        ];
        for (heard, serving, want) in table {
            assert_eq!(step(heard, serving), want, "{heard:?} serving={serving}");
        }
        assert!(watches_left(true));
        assert!(!watches_left(false));
    }

    #[test]
    fn a_spare_waits_reads_the_verdict_says_it_read_it_and_leaves() {
        let mut w = SpareWait::new(false, 100, 20);
        assert_eq!(w.next(), Op::WaitAny(vec![K::Next, K::Verdict], 100));
        assert_eq!(w.answer(Got::Ready(vec![K::Verdict], false), 5), Op::ReadVerdict);
        assert_eq!(w.answer(Got::Verdict(VerdictRead::Final { success: false }), 6), Op::SayRead);
        assert_eq!(w.answer(Got::Done, 7), Op::Done(SpareEnd::Leave { success: false }));

        let mut moves_on = SpareWait::new(false, 100, 20);
        moves_on.answer(Got::Ready(vec![K::Verdict], false), 5);
        assert_eq!(moves_on.answer(Got::Verdict(VerdictRead::MovesOn), 6), Op::WaitAny(vec![K::Next], 26));
        assert_eq!(moves_on.answer(Got::TimedOut, 26), Op::Advance, "nobody moved the job on");
        assert_eq!(moves_on.answer(Got::Done, 27), Op::Done(SpareEnd::MovedOn));

        let mut served = SpareWait::new(true, 100, 20);
        assert_eq!(served.next(), Op::WaitAny(vec![K::AllLeft, K::Next, K::Verdict], 100));
        let left = served.answer(Got::Ready(vec![K::AllLeft], true), 5);
        assert_eq!(left, Op::Done(SpareEnd::Leave { success: true }), "the leaving before the store's close");

        let mut lost = SpareWait::new(false, 100, 20);
        assert_eq!(lost.answer(Got::Ready(vec![], true), 5), Op::Done(SpareEnd::Reconnect { in_hand: false }));
        let mut recheck = SpareWait::new(false, 100, 20);
        assert_eq!(recheck.answer(Got::TimedOut, 100), Op::Done(SpareEnd::Recheck));
    }

    #[test]
    fn the_members_leaving_comes_before_the_store_closing() {
        assert_eq!(first(&[Heard::StoreLost, Heard::MembersLeft]), Some(Heard::MembersLeft));
        assert_eq!(first(&[Heard::Recheck, Heard::StoreLost]), Some(Heard::StoreLost));
        let v = Heard::Verdict(VerdictRead::MovesOn);
        assert_eq!(first(&[Heard::Recheck, v, Heard::Next]), Some(Heard::Next));
        assert_eq!(first(&[]), None);
    }
}
