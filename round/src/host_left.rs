//! The store went away: what the store host said as it left decides
//! whether this pod leaves the job (and with what) or waits to rejoin.
//!
//! The store host's agent announces why it leaves (`host_left`) before its
//! store closes: the job's end with its verdict when the job is over, or
//! a clean leaving (a stop) after which a replacement comes. The agent's
//! `launch::round::reconnect` reads it (after a short settle time) and
//! calls [`after_loss`].

use crate::mutant::{Mutant, on};

/// What the store host announced as it left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Announced {
    /// Nothing (it crashed, or the announcement has not arrived).
    Nothing,
    /// It left cleanly; the job goes on without it for now.
    LeftCleanly,
    /// The job ended with this outcome (serve mode's shutdown: success).
    JobEnded {
        /// The verdict was a success.
        success: bool,
    },
}

/// Why a pod rejoins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejoin {
    /// The store that closed held the previous containers' failed job
    /// (this pod restarted in place and ran no round yet): join the host's
    /// new store.
    PreviousContainers,
    /// The store host left cleanly: wait for it or its replacement.
    HostLeftCleanly,
    /// The store was lost with no word: wait for its host to come back.
    Lost,
}

/// What the pod does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterLoss {
    /// The job is over: leave with its outcome.
    Leave {
        /// It succeeded.
        success: bool,
    },
    /// Reconnect until the join deadline, then join the next round.
    Rejoin(Rejoin),
}

/// What a pod does once its store went away with `announced`;
/// `before_any_round`: it is a container restarted in place that has run no
/// round since it started.
pub fn after_loss(announced: Announced, before_any_round: bool) -> AfterLoss {
    match announced {
        Announced::JobEnded { success: false } if before_any_round && !on(Mutant::RestartTakesOldEnd) => {
            AfterLoss::Rejoin(Rejoin::PreviousContainers)
        }
        // A spare waiting between rounds hears the job's end here.
        Announced::JobEnded { success } if !on(Mutant::SpareMissesHostsEnd) => AfterLoss::Leave { success },
        Announced::JobEnded { .. } | Announced::LeftCleanly => AfterLoss::Rejoin(Rejoin::HostLeftCleanly),
        Announced::Nothing => AfterLoss::Rejoin(Rejoin::Lost),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hosts_word_decides_whether_a_pod_leaves_or_rejoins() {
        let ended = |success| Announced::JobEnded { success };
        let table = [
            (ended(true), false, AfterLoss::Leave { success: true }),
            (ended(false), false, AfterLoss::Leave { success: false }),
            (ended(true), true, AfterLoss::Leave { success: true }),
            (ended(false), true, AfterLoss::Rejoin(Rejoin::PreviousContainers)),
            (Announced::LeftCleanly, false, AfterLoss::Rejoin(Rejoin::HostLeftCleanly)),
            (Announced::LeftCleanly, true, AfterLoss::Rejoin(Rejoin::HostLeftCleanly)),
            (Announced::Nothing, false, AfterLoss::Rejoin(Rejoin::Lost)),
        ];
        for (announced, before, want) in table {
            assert_eq!(after_loss(announced, before), want, "{announced:?} before_any_round={before}");
        }
    }
}
