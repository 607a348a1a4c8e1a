//! Out-of-memory kills, and who the kernel picks.
//!
//! On cgroup v2 nodes Kubernetes 1.28+ sets `memory.oom.group=1` on the
//! container's cgroup, so one worker's OOM kills every process of the
//! container, trainlet included: the `137 = restart` rule never runs and
//! the pod fails instead. trainlet cannot change that from inside (the file
//! belongs to the kubelet); it says so once at start, with what to change.
//! Where the group setting is off, workers get a higher `oom_score_adj` than
//! the agent, so the kernel prefers a worker over the agent.

use std::path::{Path, PathBuf};

/// How much more workers' `oom_score_adj` is than the agent's.
pub const WORKER_BIAS: i32 = 100;

/// The container cgroup's `memory.oom.group` file when it is set to 1
/// (read under `root`, `/` outside tests): `/proc/self/cgroup`'s unified
/// (`0::`) path under `/sys/fs/cgroup`.
pub fn group_kill(root: &Path) -> Option<PathBuf> {
    let cgroups = std::fs::read_to_string(root.join("proc/self/cgroup")).ok()?;
    let rel = cgroups.lines().find_map(|l| l.strip_prefix("0::"))?.trim().trim_start_matches('/');
    let file = root.join("sys/fs/cgroup").join(rel).join("memory.oom.group");
    (std::fs::read_to_string(&file).ok()?.trim() == "1").then_some(file)
}

/// Log once what a worker's OOM will do here.
pub fn warn_if_group_kill(root: &Path) {
    if let Some(file) = group_kill(root) {
        tracing::warn!(
            file = %file.display(),
            "memory.oom.group is 1 (cgroup v2, Kubernetes >= 1.28): a worker's OOM kill takes down the whole container, \
             trainlet included, so no restart rule runs and the pod fails; to restart in place set the kubelet's \
             singleProcessOOMKill: true, or give the container more memory than its workers use"
        );
    }
}

/// The `oom_score_adj` workers get: the agent's plus [`WORKER_BIAS`], at most 1000.
pub fn worker_adj(root: &Path) -> Option<i32> {
    let agent: i32 = std::fs::read_to_string(root.join("proc/self/oom_score_adj")).ok()?.trim().parse().ok()?;
    Some(agent.saturating_add(WORKER_BIAS).min(1000))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(cgroup: &str, group: Option<&str>, adj: &str) -> tempfile::TempDir {
        let d = tempfile::tempdir().expect("tmp");
        std::fs::create_dir_all(d.path().join("proc/self")).expect("mkdir");
        std::fs::write(d.path().join("proc/self/cgroup"), cgroup).expect("write");
        std::fs::write(d.path().join("proc/self/oom_score_adj"), adj).expect("write");
        if let Some(v) = group {
            let dir = d.path().join("sys/fs/cgroup/kubepods/pod1/ctr");
            std::fs::create_dir_all(&dir).expect("mkdir");
            std::fs::write(dir.join("memory.oom.group"), v).expect("write");
        }
        d
    }

    #[test]
    fn the_group_setting_is_read_from_the_unified_cgroup() {
        let on = tree("0::/kubepods/pod1/ctr\n", Some("1\n"), "0");
        assert!(group_kill(on.path()).is_some_and(|f| f.ends_with("kubepods/pod1/ctr/memory.oom.group")));
        let off = tree("0::/kubepods/pod1/ctr\n", Some("0\n"), "0");
        assert_eq!(group_kill(off.path()), None);
        let v1 = tree("4:memory:/kubepods/pod1/ctr\n", Some("1"), "0");
        assert_eq!(group_kill(v1.path()), None, "cgroup v1 has no group kill");
        assert_eq!(group_kill(Path::new("/nonexistent")), None);
    }

    #[test]
    fn workers_score_above_the_agent() {
        assert_eq!(worker_adj(tree("", None, "-997\n").path()), Some(-897));
        assert_eq!(worker_adj(tree("", None, "950").path()), Some(1000));
        assert_eq!(worker_adj(Path::new("/nonexistent")), None);
    }
}
