//! A spare's wait: what it does with each thing it hears while a round
//! runs without it (the members' leaving, the job moving on, a verdict,
//! the store closing, its health check's time).
//!
//! The agent's `rendezvous::join::wait_as_spare` waits on all of them at
//! once, biased in [`PRIORITY`]'s order: when two are ready together (the
//! members leave and the store closes right after), the first one listed
//! is the one it acts on.

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
    fn the_members_leaving_comes_before_the_store_closing() {
        assert_eq!(first(&[Heard::StoreLost, Heard::MembersLeft]), Some(Heard::MembersLeft));
        assert_eq!(first(&[Heard::Recheck, Heard::StoreLost]), Some(Heard::StoreLost));
        let v = Heard::Verdict(VerdictRead::MovesOn);
        assert_eq!(first(&[Heard::Recheck, v, Heard::Next]), Some(Heard::Next));
        assert_eq!(first(&[]), None);
    }
}
