//! Who holds a place in the job (`claim/<place>`: a static job's node
//! rank, an elastic job's host and node rank): one live agent. The agent's
//! `rendezvous::claim` claims its place when it connects and before every
//! round, by COMPARE_SET from empty; a place held by another agent is
//! decided by [`on_holder`] once that agent's heartbeat was watched.

use crate::mutant::{Mutant, on};

/// What a claimant does about another agent that holds its place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// The holder is gone (it said `bye`, or its heartbeat stood still for
    /// two periods): take the place over (COMPARE_SET from its uid).
    TakeOver,
    /// The holder lives but is leaving (it got a stop signal and wrote
    /// `leaving/<uid>`: a pod deleted while its replacement starts): wait
    /// for it to go.
    Outwait,
    /// The holder lives: this claimant is a second live agent in one place
    /// (a stale pod back, two pods given one rank) and is refused before
    /// it takes a slot in any round (exit 200); the job never sees it.
    Refuse,
}

/// `gone`: the holder's heartbeat says it is gone; `leaving`: it said it
/// is leaving.
pub fn on_holder(gone: bool, leaving: bool) -> Claim {
    if gone || on(Mutant::StalePodTakesOver) {
        Claim::TakeOver
    } else if leaving {
        Claim::Outwait
    } else {
        Claim::Refuse
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_holder_keeps_its_place() {
        assert_eq!(on_holder(true, false), Claim::TakeOver);
        assert_eq!(on_holder(true, true), Claim::TakeOver);
        assert_eq!(on_holder(false, true), Claim::Outwait);
        assert_eq!(on_holder(false, false), Claim::Refuse);
    }
}
