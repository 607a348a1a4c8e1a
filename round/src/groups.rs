//! TorchFT replica groups (`--replica-groups`): each group meets on its own
//! rendezvous keys, all on the store host's store, and the store host's
//! pod belongs to group 0. When its own group is done it keeps its store
//! (and the Lighthouse) up for the others (`trainlet::launch::replicas`):
//! it reads every other pod's heartbeat and closes only once each of them
//! is [`gone`].

use crate::mutant::{Mutant, on};

/// Another group's pod is gone for the store host once it said `bye`, or
/// once it has been silent (or never came) for the join timeout: the time
/// a pod gets to come back, as a lost store host gets.
pub fn gone(bye: bool, silent_for: u64, join_timeout: u64) -> bool {
    bye || silent_for >= join_timeout
}

/// Whether the store host, its own group done, keeps its store up:
/// while any pod of another group is not [`gone`]. Closing it under them
/// would leave them without their store mid-job.
pub fn host_outlasts(others_running: usize) -> bool {
    others_running > 0 && !on(Mutant::HostLeavesGroups)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_host_waits_for_every_other_groups_pod() {
        assert!(gone(true, 0, 600));
        assert!(gone(false, 600, 600));
        assert!(!gone(false, 599, 600));
        assert!(host_outlasts(1));
        assert!(!host_outlasts(0));
    }
}
