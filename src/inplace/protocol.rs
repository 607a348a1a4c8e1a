//! The in-place restart protocol of JobSet (KEP-467), as a pure state
//! machine: what this pod's agent does on each view of its JobSet.
//!
//! Same rules as JobSet's reference agent (`cmd/in-place-restart-agent`):
//! 1. in-place restarts disabled (the JobSet's
//!    `jobset.sigs.k8s.io/disable-in-place-restart` annotation, or another
//!    restart strategy): the barrier lifts at once;
//! 2. the pod has no attempt yet: it writes `current + 1` (0 when the
//!    JobSet has no current attempt) to its pod annotation;
//! 3. its attempt is not newer than `previousInPlaceRestartAttempt`: the
//!    JobSet restarts every pod in place, so the agent exits with
//!    `IN_PLACE_RESTART_EXIT_CODE` (the kubelet restarts the containers);
//! 4. the barrier is up and its attempt equals
//!    `currentInPlaceRestartAttempt`: every pod wrote the same attempt, and
//!    the barrier lifts (trainlet joins its rendezvous).
//!
//! No I/O here: `inplace` runs the watch and the patch around it.

/// What the agent reads of its JobSet.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct View {
    /// `spec.failurePolicy.restartStrategy` is `InPlaceRestart`.
    pub in_place: bool,
    /// The JobSet carries `jobset.sigs.k8s.io/disable-in-place-restart`.
    pub disabled: bool,
    /// `status.currentInPlaceRestartAttempt`.
    pub current: Option<i64>,
    /// `status.previousInPlaceRestartAttempt`.
    pub previous: Option<i64>,
}

/// What the agent must do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Write this attempt to the pod annotation (then call `annotated`).
    Annotate(i64),
    /// Lift the barrier: start the job.
    Lift,
    /// Exit with the in-place restart code: the JobSet restarts this pod.
    Restart,
    /// Nothing until the JobSet changes.
    Wait,
}

/// Why the barrier lifted, for the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifted {
    /// Every pod wrote this attempt.
    Attempt(i64),
    /// In-place restarts are off for this JobSet.
    Disabled,
}

/// One pod's agent.
#[derive(Debug, Default)]
pub struct Agent {
    attempt: Option<i64>,
    lifted: Option<Lifted>,
}

impl Agent {
    /// The attempt this pod wrote, once it has.
    pub fn attempt(&self) -> Option<i64> {
        self.attempt
    }

    /// Whether (and why) the barrier is down.
    pub fn lifted(&self) -> Option<Lifted> {
        self.lifted
    }

    /// The next step on this view of the JobSet. `Annotate` is repeated
    /// until `annotated` records the write; `Lift` is given once.
    pub fn step(&mut self, v: &View) -> Step {
        if v.disabled || !v.in_place {
            if self.lifted.is_some() {
                return Step::Wait;
            }
            self.lifted = Some(Lifted::Disabled);
            return Step::Lift;
        }
        let Some(attempt) = self.attempt else {
            return Step::Annotate(v.current.map_or(0, |c| c.saturating_add(1)));
        };
        if v.previous.is_some_and(|p| attempt <= p) {
            return Step::Restart;
        }
        if self.lifted.is_none() && v.current == Some(attempt) {
            self.lifted = Some(Lifted::Attempt(attempt));
            return Step::Lift;
        }
        Step::Wait
    }

    /// The pod annotation now holds `attempt`.
    pub fn annotated(&mut self, attempt: i64) {
        self.attempt = Some(attempt);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    fn view(current: Option<i64>, previous: Option<i64>) -> View {
        View { in_place: true, disabled: false, current, previous }
    }

    #[test_case(None, None, Step::Annotate(0); "a new JobSet: attempt 0")]
    #[test_case(Some(0), None, Step::Annotate(1); "after attempt 0 the next is 1")]
    #[test_case(Some(4), Some(3), Step::Annotate(5); "the next after the current")]
    fn a_pod_without_an_attempt_writes_the_next_one(current: Option<i64>, previous: Option<i64>, want: Step) {
        assert_eq!(Agent::default().step(&view(current, previous)), want);
    }

    #[test_case(1, view(None, None), Step::Wait; "no current yet")]
    #[test_case(1, view(Some(0), None), Step::Wait; "the others are still on 0")]
    #[test_case(1, view(Some(0), Some(0)), Step::Wait; "previous below the attempt")]
    #[test_case(1, view(Some(1), Some(0)), Step::Lift; "everyone wrote 1")]
    #[test_case(1, view(Some(0), Some(1)), Step::Restart; "previous reached the attempt")]
    #[test_case(1, view(Some(2), Some(2)), Step::Restart; "the job moved past this pod")]
    fn an_annotated_pod(attempt: i64, v: View, want: Step) {
        let mut a = Agent::default();
        a.annotated(attempt);
        assert_eq!(a.step(&v), want);
    }

    #[test]
    fn the_barrier_lifts_once_and_a_later_restart_still_exits() {
        let mut a = Agent::default();
        assert_eq!(a.step(&view(None, None)), Step::Annotate(0));
        assert_eq!(a.step(&view(None, None)), Step::Annotate(0), "repeated until written");
        a.annotated(0);
        assert_eq!(a.step(&view(None, None)), Step::Wait);
        assert_eq!(a.step(&view(Some(0), None)), Step::Lift);
        assert_eq!(a.lifted(), Some(Lifted::Attempt(0)));
        assert_eq!(a.step(&view(Some(0), None)), Step::Wait, "lifted once");
        // Another pod restarted and wrote 1: the controller raises previous to 0.
        assert_eq!(a.step(&view(Some(0), Some(0))), Step::Restart);
    }

    #[test_case(View { in_place: true, disabled: true, current: None, previous: None }; "the disable annotation")]
    #[test_case(View { in_place: false, disabled: false, current: None, previous: None }; "another strategy")]
    fn disabled_in_place_restarts_lift_the_barrier_without_an_attempt(v: View) {
        let mut a = Agent::default();
        assert_eq!(a.step(&v), Step::Lift);
        assert_eq!(a.lifted(), Some(Lifted::Disabled));
        assert_eq!(a.attempt(), None);
        assert_eq!(a.step(&v), Step::Wait);
    }

    #[test]
    fn a_barrier_lifted_by_the_disable_annotation_ignores_later_attempts() {
        let mut a = Agent::default();
        a.annotated(1);
        let off = View { disabled: true, ..view(Some(0), None) };
        assert_eq!(a.step(&off), Step::Lift);
        assert_eq!(a.step(&view(Some(1), None)), Step::Wait, "not lifted twice");
        assert_eq!(a.step(&view(Some(1), Some(1))), Step::Restart, "the JobSet can still restart it");
    }
}
