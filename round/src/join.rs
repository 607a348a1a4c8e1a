//! Joining a round: what a pod does with the arrival slot it took, when
//! the last call ends, where it stands once the round closed, and what a
//! pod that finds the round already running asks for.
//!
//! The agent's `rendezvous::join` does the store's operations in this
//! order: `ADD rR/join` (its slot is the count minus one), `GET round`
//! ([`forgotten`]), `SET rR/m/<slot>`, then what [`on_slot`] says; it waits
//! for `rR/closed` (or `rR/next`, or the end of a last call,
//! [`at_last_call`]) and takes its [`place`].

use crate::mutant::{Mutant, on};

/// What `rR/closed` holds: the first `size` arrival slots are the round's
/// members, and `slot` assigns their ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Closed {
    /// Members.
    pub size: u64,
    /// The slot of the pod that assigns ranks.
    pub slot: u64,
}

impl Closed {
    /// The value written (`N:<slot>`).
    pub fn value(&self) -> String {
        format!("{}:{}", self.size, self.slot)
    }

    /// The value read; None when it is not one ([`Closed::value`]).
    pub fn read(value: &[u8]) -> Option<Closed> {
        let (size, slot) = std::str::from_utf8(value).ok()?.split_once(':')?;
        Some(Closed { size: size.parse().ok()?, slot: slot.parse().ok()? })
    }
}

/// A pod took a slot in round `r`, or is about to decide `r`'s verdict,
/// and read the job's round, `current`: Some(current) when `r` is past
/// keeping (the store host deletes a round's keys once the round after
/// next forms). Nothing in a forgotten round closes, moves on or agrees
/// any more: the pod joins `current` instead (after a round it settled:
/// as a regroup). Found by the simulation: a pod that stalled between
/// reading the round and taking its slot while two rounds formed waited
/// out its join deadline there; an elastic round's member that stalled
/// before its verdict while two rounds formed without it decided a
/// verdict of its own from the deleted keys.
pub fn forgotten(r: u64, current: u64) -> Option<u64> {
    (current > r + 1 && !on(Mutant::ForgottenRound)).then_some(current)
}

/// What `rR/members` holds when the round was given up before its ranks
/// were assigned.
pub const ABANDONED: &[u8] = b"abandoned";

/// The pod that closed the round COMPARE_SETs the members into
/// `rR/members` (and only then writes the ranks); a pod that waited for
/// its rank past the bound COMPARE_SETs [`ABANDONED`] there. The first
/// writer decides for every pod, so a round either forms with all of its
/// members or none of them forms it. `members` is the value the closer's
/// COMPARE_SET left: whether it writes the ranks. A closer that stalled
/// past the bound would otherwise form the round alone, while the others
/// had moved on without it (found by the simulation).
pub fn closer_forms(members: &[u8]) -> bool {
    members != ABANDONED || on(Mutant::LateCloserForms)
}

/// `members` is the value a pod's COMPARE_SET of [`ABANDONED`] left:
/// whether the round was given up (else the closer formed it meanwhile,
/// and the pod's rank is there or on its way).
pub fn given_up(members: &[u8]) -> bool {
    members == ABANDONED
}

/// A spare found its round closed and waited the bound for the members
/// (`rR/members`), then COMPARE_SET [`ABANDONED`] there; `members` is the
/// value left: whether the round never formed (its closer, or its members,
/// went before it did), so the spare gives it up as a member would and
/// the job moves on. Else it would wait beside it forever (found by the
/// simulation).
pub fn spare_gives_up(members: &[u8]) -> bool {
    given_up(members) && !on(Mutant::SpareBesideUnformedRound)
}

/// What a pod does once it took arrival slot `joined - 1` of a round of
/// MIN..=MAX pods.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnSlot {
    /// The round is full: close it (COMPARE_SET `rR/closed` from empty; the
    /// first writer wins).
    Close(Closed),
    /// MIN pods are in (an elastic round): open the last call (`rR/quorum`).
    LastCall,
    /// Wait for others.
    Wait,
}

/// What the pod that made `joined` arrivals does ([`OnSlot`]).
pub fn on_slot(joined: u64, min: u64, max: u64) -> OnSlot {
    if joined == max {
        OnSlot::Close(Closed { size: max, slot: joined.saturating_sub(1) })
    } else if joined == min && min < max {
        OnSlot::LastCall
    } else {
        OnSlot::Wait
    }
}

/// The last call ended with `joined` arrivals: the round closes with them,
/// MAX at most, and the pod in `slot` (whose last call it was) assigns.
pub fn at_last_call(joined: u64, slot: u64, max: u64) -> Closed {
    Closed { size: joined.min(max), slot }
}

/// Where the pod in `slot` stands once the round closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// A member of a round of `size`; `assigns`: it closed the round, so
    /// it assigns the ranks.
    Member {
        /// The round's members.
        size: u64,
        /// It reads every member and publishes the ranks.
        assigns: bool,
    },
    /// Past the round's size (or the value is unreadable): a spare beside
    /// a round of `size` members.
    Spare {
        /// The running round's members.
        size: u64,
    },
}

/// The place of the pod in `slot` given `closed`'s value.
pub fn place(closed: &[u8], slot: u64) -> Place {
    let Closed { size, slot: closer } = Closed::read(closed).unwrap_or(Closed { size: 0, slot: u64::MAX });
    if slot >= size { Place::Spare { size } } else { Place::Member { size, assigns: closer == slot } }
}

/// The first member (by slot) whose place an earlier slot holds too: a pod
/// that left the open round and came back. The live pods then meet again
/// in a new round rather than assign a place twice.
pub fn first_repeat<T: PartialEq>(places: &[T]) -> Option<usize> {
    (0..places.len()).find(|&i| places[..i].contains(&places[i]))
}

/// What a pod that finds a round closed without it asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// Its own place is held by its previous incarnation (a restart in
    /// place, or a replacement): declare that one dead and end the round
    /// (`Dead`), so the pods meet again with this one.
    TakeOver,
    /// A smaller round than MAX is running: ask it to regroup (`Waiting`)
    /// and admit this pod.
    Regroup,
    /// The round is full: wait as a spare.
    Wait,
}

/// A pod finds the round running with `size` of at most `max` members;
/// `replaces_itself`: one of them holds its place under another uid.
pub fn arrival(replaces_itself: bool, size: u64, max: u64) -> Arrival {
    if replaces_itself {
        Arrival::TakeOver
    } else if size < max {
        Arrival::Regroup
    } else {
        Arrival::Wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_closes_the_round_opens_the_last_call_or_waits() {
        // (joined, min, max) -> step
        let table = [
            (4, 4, 4, OnSlot::Close(Closed { size: 4, slot: 3 })),
            (3, 4, 4, OnSlot::Wait),
            (2, 2, 4, OnSlot::LastCall),
            (3, 2, 4, OnSlot::Wait),
            (4, 2, 4, OnSlot::Close(Closed { size: 4, slot: 3 })),
            // Past MAX: a spare's slot does nothing.
            (5, 2, 4, OnSlot::Wait),
            (1, 1, 1, OnSlot::Close(Closed { size: 1, slot: 0 })),
        ];
        for (joined, min, max, want) in table {
            assert_eq!(on_slot(joined, min, max), want, "{joined} {min} {max}");
        }
        assert_eq!(at_last_call(7, 2, 4), Closed { size: 4, slot: 2 });
        assert_eq!(at_last_call(3, 1, 4), Closed { size: 3, slot: 1 });
    }

    #[test]
    fn the_first_to_write_the_members_decides_whether_the_round_formed() {
        assert!(closer_forms(b"[{\"uid\":\"a\"}]"));
        assert!(!closer_forms(ABANDONED));
        assert!(given_up(ABANDONED));
        assert!(!given_up(b"[]"));
    }

    #[test]
    fn a_slot_in_a_forgotten_round_is_left_for_the_current_one() {
        assert_eq!(forgotten(3, 3), None);
        assert_eq!(forgotten(3, 4), None, "round 3's keys stay while round 4 is open");
        assert_eq!(forgotten(3, 5), Some(5));
    }

    #[test]
    fn a_closed_round_places_each_slot() {
        assert_eq!(place(b"3:2", 2), Place::Member { size: 3, assigns: true });
        assert_eq!(place(b"3:2", 0), Place::Member { size: 3, assigns: false });
        assert_eq!(place(b"3:2", 3), Place::Spare { size: 3 });
        assert_eq!(place(b"junk", 0), Place::Spare { size: 0 });
        assert_eq!(Closed::read(Closed { size: 9, slot: 4 }.value().as_bytes()), Some(Closed { size: 9, slot: 4 }));
        assert_eq!(Closed::read(b"9"), None);
    }

    #[test]
    fn a_place_taken_twice_is_found_at_its_second_slot() {
        assert_eq!(first_repeat(&["a", "b", "c"]), None);
        assert_eq!(first_repeat(&["a", "b", "a", "b"]), Some(2));
        assert_eq!(first_repeat::<u8>(&[]), None);
    }

    #[test]
    fn a_late_pod_takes_over_regroups_or_waits() {
        assert_eq!(arrival(true, 4, 4), Arrival::TakeOver);
        assert_eq!(arrival(false, 3, 4), Arrival::Regroup);
        assert_eq!(arrival(false, 4, 4), Arrival::Wait);
    }
}
