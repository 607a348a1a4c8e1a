//! The store host's monitor of the job's rounds (`rendezvous::host`): it
//! follows the job from round to round, forgets old rounds' keys, declares
//! silent members dead, and acts for a round whose members are all gone.
//!
//! A member is dead when its heartbeat stood still for the heartbeat
//! timeout (a machine that vanished), or at once after a short grace when
//! the store says its connection was closed without a `bye` (the agent's
//! process died: its kernel closed its sockets) and it did not beat again
//! ([`dead`]).

use crate::mutant::{Mutant, on};

/// The monitor follows the job from a round to the next; `formed`: the
/// round formed (its members were read). Whether it deletes the keys of
/// the rounds before the previous one now: a round that formed did so as
/// it formed; one that never formed (given up, or left before it closed)
/// does it as the job moves on, or rounds given up one after another (a
/// loaded machine's) would pile up their keys (found by the simulation).
pub fn forgets_on_moving_on(formed: bool) -> bool {
    !formed && !on(Mutant::GivenUpRoundsPileUp)
}

/// A member's heartbeat as the monitor reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Beat {
    /// It left the job (`bye`).
    Bye,
    /// Its connection was closed by its end without a `bye`, and it has not
    /// beaten since (the store's `lost`).
    Lost,
    /// A counter (or nothing yet).
    Beating,
}

/// Whether a member whose heartbeat reads `beat`, unchanged for `still`,
/// is dead, with the heartbeat `timeout` and the reconnection `grace` (in
/// any one unit). A lost connection is given the grace to come back (a
/// heartbeat connection that blipped reconnects and beats again at once);
/// one that does not is dead then, not after the whole timeout.
pub fn dead(beat: Beat, still: u64, timeout: u64, grace: u64) -> bool {
    match beat {
        Beat::Bye => false,
        Beat::Lost => still >= grace.min(timeout),
        Beat::Beating => still >= timeout,
    }
}

/// A round's verdict as the monitor reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VerdictSeen {
    /// None yet.
    None,
    /// A restart or a regroup: the job goes on.
    MovesOn,
    /// Success or failure: the job is over.
    Final,
}

/// What the monitor does for a formed round whose members may all be gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Orphaned {
    /// Nothing: a member is left, or the job is over (its spares read the
    /// final verdict and leave with it).
    Nothing,
    /// Every member is dead or gone and the job is not over: nobody is
    /// left to move it on, so the monitor opens the next round.
    MoveOn,
    /// The round succeeded and every member is gone before any of them
    /// decided: its verdict is a success (`rR/verdict`), which its spares
    /// (and a member's restarted container) read and leave with.
    Succeed,
}

/// `all_gone`: every member said `bye`, was declared dead or (after a
/// success) fell silent; `any_dead`: one of them died rather than left;
/// `succeeded`: the round's end is a success; `verdict`: the round's.
///
/// Found by the simulation, each a spare's wait that never ended or a job
/// that ended twice: a round that succeeded and lost every member before
/// its verdict had none; a round whose members all left with no verdict
/// (stopped) was moved on only when one had died; and a round whose job
/// had failed was moved on when a member had died, so its spares ran on
/// and left with success while the members had left with the failure.
pub fn orphaned(all_gone: bool, any_dead: bool, succeeded: bool, verdict: VerdictSeen) -> Orphaned {
    if !all_gone {
        return Orphaned::Nothing;
    }
    match (verdict, succeeded) {
        (VerdictSeen::Final, _) if any_dead && on(Mutant::FailedJobMovedOn) => Orphaned::MoveOn,
        (VerdictSeen::Final, _) => Orphaned::Nothing,
        (VerdictSeen::None, true) if on(Mutant::SucceededRoundOrphaned) => Orphaned::Nothing,
        (VerdictSeen::None, true) => Orphaned::Succeed,
        _ if !any_dead && on(Mutant::StoppedRoundOrphaned) => Orphaned::Nothing,
        _ => Orphaned::MoveOn,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_connection_is_dead_after_the_grace_a_silent_one_after_the_timeout() {
        // (beat, still, timeout, grace) -> dead
        let table = [
            (Beat::Beating, 9, 10, 1, false),
            (Beat::Beating, 10, 10, 1, true),
            (Beat::Lost, 0, 10, 1, false),
            (Beat::Lost, 1, 10, 1, true),
            // A grace longer than the timeout is the timeout.
            (Beat::Lost, 5, 5, 8, true),
            (Beat::Bye, 100, 10, 1, false),
        ];
        for (beat, still, timeout, grace, want) in table {
            assert_eq!(dead(beat, still, timeout, grace), want, "{beat:?} still {still}");
        }
    }

    #[test]
    fn a_round_whose_members_are_all_gone_moves_on_or_succeeds() {
        use VerdictSeen::{Final, MovesOn, None};
        // (all gone, any dead, succeeded, verdict) -> what to do
        let table = [
            (false, true, false, None, Orphaned::Nothing),
            // Every member left (bye) with no verdict: stopped; the spares go on.
            (true, false, false, None, Orphaned::MoveOn),
            // ... after a regroup or restart verdict, or dead: the job goes on.
            (true, false, false, MovesOn, Orphaned::MoveOn),
            (true, true, false, None, Orphaned::MoveOn),
            (true, true, false, MovesOn, Orphaned::MoveOn),
            // The job is over: the spares read its verdict.
            (true, false, false, Final, Orphaned::Nothing),
            (true, true, false, Final, Orphaned::Nothing),
            (true, true, true, Final, Orphaned::Nothing),
            // A success nobody lived to decide.
            (true, true, true, None, Orphaned::Succeed),
            (true, false, true, None, Orphaned::Succeed),
        ];
        for (all_gone, any_dead, succeeded, verdict, want) in table {
            assert_eq!(
                orphaned(all_gone, any_dead, succeeded, verdict),
                want,
                "{all_gone} {any_dead} {succeeded} {verdict:?}"
            );
        }
        assert!(forgets_on_moving_on(false));
        assert!(!forgets_on_moving_on(true));
    }
}
