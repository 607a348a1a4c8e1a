//! Leftover processes: find every live descendant of the agent and kill it.
//!
//! Workers run in their own process groups, and killing the group at the
//! end of a round takes their ordinary children with them. A descendant
//! that called `setsid()` (a daemon, some launcher helpers) left that group,
//! and one that double-forked was re-parented to the agent (PID 1 or a child
//! subreaper). The sweep walks the process tree below the agent from /proc
//! and kills what it finds, again and again until nothing is left, because
//! killing a parent re-parents its children to us and a daemon may fork
//! between two scans. It is bounded in time: a process in uninterruptible
//! sleep cannot be killed, and the sweep must not hang the agent.
//!
//! Long-lived helpers of the agent itself (the NVML sampling child) are
//! registered with [`keep`] and spared, with their own children.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::sys;

/// Pids of the agent's own helper processes, spared by the sweep.
static HELPERS: Mutex<Vec<i32>> = Mutex::new(Vec::new());

fn helpers() -> std::sync::MutexGuard<'static, Vec<i32>> {
    HELPERS.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Spare `pid` (and its descendants) from sweeps until [`release`]d.
pub fn keep(pid: i32) {
    helpers().push(pid);
}

/// Stop sparing `pid`.
pub fn release(pid: i32) {
    helpers().retain(|p| *p != pid);
}

/// Live (not zombie) descendants of `root`, without the subtrees of `spare`.
pub fn descendants(root: u32, spare: &[i32]) -> Vec<i32> {
    descendants_in(&sys::process_table(), root, spare)
}

fn descendants_in(table: &[(i32, u32, char)], root: u32, spare: &[i32]) -> Vec<i32> {
    let mut children: HashMap<u32, Vec<(i32, char)>> = HashMap::new();
    for &(pid, ppid, state) in table {
        children.entry(ppid).or_default().push((pid, state));
    }
    let mut out = Vec::new();
    let mut seen: HashSet<i32> = HashSet::new();
    let mut todo = vec![root];
    while let Some(parent) = todo.pop() {
        for &(pid, state) in children.get(&parent).map(Vec::as_slice).unwrap_or_default() {
            if spare.contains(&pid) || !seen.insert(pid) {
                continue;
            }
            // A zombie is dead already; the reaper collects it. Its own
            // children were re-parented and show up under us.
            if state != 'Z' && state != 'X' {
                out.push(pid);
            }
            if let Ok(p) = u32::try_from(pid) {
                todo.push(p);
            }
        }
    }
    out
}

/// What a sweep did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Swept {
    /// Distinct processes signalled.
    pub killed: usize,
    /// Processes still alive when the time was up (uninterruptible sleep).
    pub left: Vec<i32>,
}

/// SIGKILL every descendant of the agent but its helpers, repeating until
/// none is left or `limit` has passed.
pub fn kill_all(limit: Duration) -> Swept {
    let me = std::process::id();
    let deadline = Instant::now() + limit;
    let mut killed: HashSet<i32> = HashSet::new();
    loop {
        let spare = helpers().clone();
        let found = descendants(me, &spare);
        if found.is_empty() {
            return Swept { killed: killed.len(), left: Vec::new() };
        }
        if Instant::now() >= deadline {
            return Swept { killed: killed.len(), left: found };
        }
        for &pid in &found {
            sys::signal_process(pid, libc::SIGKILL);
            killed.insert(pid);
        }
        // Give the kernel a moment to deliver and re-parent.
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// SIGTERM every descendant but the helpers, wait up to `grace` for them to
/// go, then [`kill_all`] for up to `limit`.
pub fn terminate_all(grace: Duration, limit: Duration) -> Swept {
    let me = std::process::id();
    let first = descendants(me, &helpers().clone());
    if first.is_empty() {
        return Swept::default();
    }
    for &pid in &first {
        sys::signal_process(pid, libc::SIGTERM);
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline && !descendants(me, &helpers().clone()).is_empty() {
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut swept = kill_all(limit);
    swept.killed = swept.killed.max(first.len());
    swept
}

/// Log a sweep's result: one line, never one per process (a re-forking
/// daemon would flood the log).
pub fn log(swept: &Swept, when: &str) {
    if swept.killed > 0 {
        tracing::warn!(
            killed = swept.killed,
            when,
            "killed leftover processes that escaped the workers' process groups"
        );
    }
    if !swept.left.is_empty() {
        tracing::error!(pids = ?swept.left, when, "leftover processes survived SIGKILL (uninterruptible sleep?)");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descendants_walk_the_tree_skip_zombies_and_spare_helpers() {
        // 1 (agent) -> 10 -> 11 (zombie) -> 12; 1 -> 20 (helper) -> 21; 2 -> 30 (not ours).
        let table = [(10, 1, 'S'), (11, 10, 'Z'), (12, 11, 'R'), (20, 1, 'S'), (21, 20, 'S'), (30, 2, 'S')];
        let mut got = descendants_in(&table, 1, &[20]);
        got.sort_unstable();
        assert_eq!(got, vec![10, 12]);
        assert_eq!(descendants_in(&table, 1, &[]).len(), 4);
        assert!(descendants_in(&table, 99, &[]).is_empty());
    }
}
