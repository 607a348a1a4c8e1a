//! The round's historic ordering bugs, each re-introducible in the
//! simulation (`--mutant NAME`), so that a default run shows it finds
//! them. Without the `sim` feature [`on`] is `false` and the compiler
//! drops every mutant branch: the agent never carries them.

/// One historic bug of the round, by the commit that fixed it (or `sim`:
/// found by the simulation, fixed with it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutant {
    /// 1aa7555: a spare that lost the store between rounds did not read
    /// the job's end its host announced, and waited for a host that had
    /// ended.
    SpareMissesHostsEnd,
    /// 3ea3954: a spare outside serve mode took the members' leaving
    /// (`all_left`, an old store's after an in-place restart) as the end
    /// and left with success.
    SpareTakesAllLeft,
    /// d12b181: a pod restarted in place, before any round, took the failed
    /// job's end its previous containers' host announced for its own.
    RestartTakesOldEnd,
    /// cbadb28: a served job's spare heard the store close before the
    /// members' leaving, and left with success only by chance.
    SpareHearsCloseFirst,
    /// d2ab89f: a stop of a run that was already over wrote `stop:N` into
    /// the current round, and stopped the next run.
    StopOfOverRun,
    /// 6e3520a: a second stop's marker, the same bytes as the first's, was
    /// taken for its own, and its `stop:N` ended the next run's round.
    SecondStopSameMarker,
    /// Found by the simulation (schedule seed 143 of its first run): a stop
    /// read the round after it marked the run, and when the run ended on
    /// its own meanwhile, its `stop:N` ended the next run's round.
    StopReadsRoundLate,
    /// Found by the simulation (seed 56973 of a 100,000-schedule run, and
    /// seed 1793 of the default run once pauses came in bursts): a pod that
    /// stalled while two rounds formed took a slot in (or decided the
    /// verdict of) a round whose keys were deleted: it waited there until
    /// its join deadline (or followed a verdict of its own).
    ForgottenRound,
    /// Found by the simulation (seed 220349 of a 300,000-schedule run): the
    /// pod that closed a round stalled past the others' wait for their
    /// ranks; they moved on to the next round, and it assigned the ranks
    /// anyway and formed the round alone.
    LateCloserForms,
    /// Found by the simulation (seed 8684 of the default run, with the
    /// fix of [`Mutant::LateCloserForms`]): the store host forgot old
    /// rounds only when a round formed, so rounds given up one after
    /// another on a loaded machine piled up their keys.
    GivenUpRoundsPileUp,
    /// Found by the simulation (seed 3075938 of a million-schedule run):
    /// the members of a round that succeeded died before any decided its
    /// verdict, and its spare (or a member's restarted container) waited
    /// for one forever: the monitor watched no heartbeat after a success.
    SucceededRoundOrphaned,
    /// Found by the simulation (seed 5048549 of a million-schedule run):
    /// every member of a round left with no verdict (stopped by SIGTERM),
    /// none had died, and the monitor moved the job on only for the dead:
    /// the round's spare waited forever.
    StoppedRoundOrphaned,
    /// Found by the simulation (seed 13428 of the default run, with the
    /// fix of [`Mutant::StoppedRoundOrphaned`]): a member died and the
    /// others left after the round's verdict failed the job; the monitor
    /// moved the job on all the same, and its spare ran on and left with
    /// success while the members had left with the failure.
    FailedJobMovedOn,
    /// Found by the simulation (seed 9266228 of a two-million-schedule run):
    /// the pod that closed a round and the round's other member went
    /// before it formed, and the spare that arrived past its size waited
    /// beside it forever.
    SpareBesideUnformedRound,
    /// Found by the simulation (seed 2416 of the default run, once the
    /// agent and the simulation carried out one formation, `round::form`):
    /// the closer formed a round (`rR/members`) and stalled before it wrote
    /// the ranks; a member that waited out the bound twice moved the job
    /// on past the formed round, whose members then ran beside the next.
    MemberLeavesFormedRound,
    /// Not a bug the round had: the store host's pod closes its store once
    /// its own replica group is done, while other groups still train on
    /// it (`trainlet::launch::replicas` outlasts them).
    HostLeavesGroups,
    /// Not a bug the round had: a claimant that takes a live holder's
    /// place (a stale pod back), which the claim refuses; the simulation
    /// must see two live agents in one place.
    StalePodTakesOver,
}

impl Mutant {
    /// Every mutant, in the order of the commits that fixed them.
    pub const ALL: [Mutant; 17] = [
        Mutant::SpareMissesHostsEnd,
        Mutant::SpareTakesAllLeft,
        Mutant::RestartTakesOldEnd,
        Mutant::SpareHearsCloseFirst,
        Mutant::StopOfOverRun,
        Mutant::SecondStopSameMarker,
        Mutant::StopReadsRoundLate,
        Mutant::ForgottenRound,
        Mutant::LateCloserForms,
        Mutant::GivenUpRoundsPileUp,
        Mutant::SucceededRoundOrphaned,
        Mutant::StoppedRoundOrphaned,
        Mutant::FailedJobMovedOn,
        Mutant::SpareBesideUnformedRound,
        Mutant::MemberLeavesFormedRound,
        Mutant::HostLeavesGroups,
        Mutant::StalePodTakesOver,
    ];

    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Mutant::SpareMissesHostsEnd => "spare-misses-hosts-end",
            Mutant::SpareTakesAllLeft => "spare-takes-all-left",
            Mutant::RestartTakesOldEnd => "restart-takes-old-end",
            Mutant::SpareHearsCloseFirst => "spare-hears-close-first",
            Mutant::StopOfOverRun => "stop-of-over-run",
            Mutant::SecondStopSameMarker => "second-stop-same-marker",
            Mutant::StopReadsRoundLate => "stop-reads-round-late",
            Mutant::ForgottenRound => "forgotten-round",
            Mutant::LateCloserForms => "late-closer-forms",
            Mutant::GivenUpRoundsPileUp => "given-up-rounds-pile-up",
            Mutant::SucceededRoundOrphaned => "succeeded-round-orphaned",
            Mutant::StoppedRoundOrphaned => "stopped-round-orphaned",
            Mutant::FailedJobMovedOn => "failed-job-moved-on",
            Mutant::SpareBesideUnformedRound => "spare-beside-unformed-round",
            Mutant::MemberLeavesFormedRound => "member-leaves-formed-round",
            Mutant::HostLeavesGroups => "host-leaves-groups",
            Mutant::StalePodTakesOver => "stale-pod-takes-over",
        }
    }

    /// The commit that fixed it.
    pub fn commit(self) -> &'static str {
        match self {
            Mutant::SpareMissesHostsEnd => "1aa7555",
            Mutant::SpareTakesAllLeft => "3ea3954",
            Mutant::RestartTakesOldEnd => "d12b181",
            Mutant::SpareHearsCloseFirst => "cbadb28",
            Mutant::StopOfOverRun => "d2ab89f",
            Mutant::SecondStopSameMarker => "6e3520a",
            Mutant::StopReadsRoundLate
            | Mutant::ForgottenRound
            | Mutant::LateCloserForms
            | Mutant::GivenUpRoundsPileUp
            | Mutant::SucceededRoundOrphaned
            | Mutant::StoppedRoundOrphaned
            | Mutant::FailedJobMovedOn
            | Mutant::SpareBesideUnformedRound
            | Mutant::MemberLeavesFormedRound => "sim",
            Mutant::HostLeavesGroups => "groups",
            Mutant::StalePodTakesOver => "claim",
        }
    }

    /// What the bug did, in one line.
    pub fn what(self) -> &'static str {
        match self {
            Mutant::SpareMissesHostsEnd => {
                "a spare that lost the store between rounds ignores the job's end its host announced"
            }
            Mutant::SpareTakesAllLeft => {
                "a spare outside serve mode takes the members' leaving (all_left) as a success"
            }
            Mutant::RestartTakesOldEnd => {
                "a pod restarted in place takes its previous containers' failed end for its own"
            }
            Mutant::SpareHearsCloseFirst => "a served job's spare hears the store close before the members' leaving",
            Mutant::StopOfOverRun => "a stop of a run already over writes stop:N into the current round",
            Mutant::SecondStopSameMarker => "a second stop takes the first stop's marker (the same bytes) for its own",
            Mutant::StopReadsRoundLate => "a stop reads the round after it marked the run ended",
            Mutant::ForgottenRound => "a pod in (or settling) a round whose keys were deleted stays with it",
            Mutant::LateCloserForms => "a closer that stalled past the others' wait forms the round alone",
            Mutant::GivenUpRoundsPileUp => "the store host forgets old rounds only when a round forms",
            Mutant::SucceededRoundOrphaned => {
                "a round that succeeded and lost every member before its verdict has none"
            }
            Mutant::StoppedRoundOrphaned => "a round whose members all left with no verdict strands its spares",
            Mutant::FailedJobMovedOn => "the store host moves a job on after its failure when a member died",
            Mutant::SpareBesideUnformedRound => "a spare waits forever beside a round that never formed",
            Mutant::MemberLeavesFormedRound => "a member without its rank moves the job past a round its closer formed",
            Mutant::HostLeavesGroups => "the store host closes its store while other replica groups train on it",
            Mutant::StalePodTakesOver => "a second live agent in a place takes it over instead of being refused",
        }
    }

    /// The mutant called `name`.
    pub fn parse(name: &str) -> Option<Mutant> {
        Mutant::ALL.into_iter().find(|m| m.name() == name)
    }
}

#[cfg(feature = "sim")]
thread_local! {
    static ACTIVE: std::cell::Cell<Option<Mutant>> = const { std::cell::Cell::new(None) };
}

/// Whether `m` is switched on (only ever in the simulation's build).
#[inline]
pub fn on(m: Mutant) -> bool {
    #[cfg(feature = "sim")]
    {
        ACTIVE.with(|a| a.get() == Some(m))
    }
    #[cfg(not(feature = "sim"))]
    {
        let _ = m;
        false
    }
}

/// Switch `m` on for this thread (None: every fix in place).
#[cfg(feature = "sim")]
pub fn set(m: Option<Mutant>) {
    ACTIVE.with(|a| a.set(m));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_read_back() {
        for m in Mutant::ALL {
            assert_eq!(Mutant::parse(m.name()), Some(m));
            assert!(m.commit().len() == 7 || ["sim", "claim", "groups"].contains(&m.commit()));
        }
        assert_eq!(Mutant::parse("none"), None);
    }
}
