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
//! A scan is not atomic: a list of pids is read first and each process
//! after, so a daemon that re-forks every few ms can move to a pid the list
//! missed while the process it was has already exited. Three things close
//! that: the scan reads only the agent's subtree, down the kernel's
//! children lists (microseconds between a list and its stats, where a full
//! /proc table took milliseconds); the process group of every process seen
//! (a zombie's too) is signalled as well, and a group signal is atomic
//! against fork (a child forked meanwhile gets it too); and "none left" is
//! not read from a scan at all but proved by the agent having no child
//! left but its helpers ([`only_helpers_left`]): with the one reaper
//! collecting every exit, that needs no repeated scans and no sleeps.
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

/// Start a helper with `start` (a fork) and keep it, both while the list
/// of helpers is locked. The sweeps hold the same lock from reading the
/// list to signalling what their scan found, so a sweep on another thread
/// has either signalled before the fork or spares the new process: a
/// helper is never taken for a worker's leftover between its fork and its
/// [`keep`].
pub fn start_kept<T, E>(start: impl FnOnce() -> Result<T, E>, pid: impl FnOnce(&T) -> i32) -> Result<T, E> {
    let mut helpers = helpers();
    let started = start()?;
    helpers.push(pid(&started));
    Ok(started)
}

/// Stop sparing `pid`.
pub fn release(pid: i32) {
    helpers().retain(|p| *p != pid);
}

/// What one scan saw below the agent.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Scan {
    /// Live (not zombie) descendants.
    pub live: Vec<i32>,
    /// Process groups of every descendant seen, zombies included, other
    /// than the agent's own group.
    pub groups: Vec<i32>,
}

/// Descendants of `root`, without the subtrees of `spare`: walked down the
/// kernel's children lists (only our subtree is read, so a process and its
/// stat are read microseconds apart), else from the whole process table.
/// The groups of `spare` (each leads its own) are never among those to
/// signal: a worker's descendant may have joined one (`setpgid` within the
/// session), and is signalled by its pid instead.
pub fn scan(root: u32, spare: &[i32]) -> Scan {
    let own_group = sys::own_group();
    let mut found = match walk_children(root, spare) {
        Some(found) => from_stats(&found, own_group),
        None => scan_in(&sys::process_table(), root, spare, own_group),
    };
    found.groups.retain(|g| !spare.contains(g));
    found
}

/// Every descendant of `root` outside `spare`'s subtrees, with its stat,
/// read down the children lists; None without CONFIG_PROC_CHILDREN.
fn walk_children(root: u32, spare: &[i32]) -> Option<Vec<sys::ProcStat>> {
    let mut found = Vec::new();
    let mut seen: HashSet<i32> = HashSet::new();
    let mut todo = vec![i32::try_from(root).ok()?];
    while let Some(parent) = todo.pop() {
        for pid in sys::children(parent)? {
            if spare.contains(&pid) || !seen.insert(pid) {
                continue;
            }
            if let Some(stat) = sys::proc_stat(pid) {
                found.push(stat);
            }
            todo.push(pid);
        }
    }
    Some(found)
}

fn scan_in(table: &[sys::ProcStat], root: u32, spare: &[i32], own_group: i32) -> Scan {
    let mut children: HashMap<u32, Vec<&sys::ProcStat>> = HashMap::new();
    for p in table {
        children.entry(p.ppid).or_default().push(p);
    }
    let mut found = Vec::new();
    let mut seen: HashSet<i32> = HashSet::new();
    let mut todo = vec![root];
    while let Some(parent) = todo.pop() {
        for p in children.get(&parent).map(Vec::as_slice).unwrap_or_default() {
            if spare.contains(&p.pid) || !seen.insert(p.pid) {
                continue;
            }
            found.push(**p);
            if let Ok(pid) = u32::try_from(p.pid) {
                todo.push(pid);
            }
        }
    }
    from_stats(&found, own_group)
}

/// The live pids and the groups (other than ours) of `found`.
fn from_stats(found: &[sys::ProcStat], own_group: i32) -> Scan {
    let mut out = Scan::default();
    for p in found {
        // A zombie is dead already; the reaper collects it. Its own
        // children were re-parented and show up under us, and its group
        // may still hold a child a scan missed.
        if p.state != 'Z' && p.state != 'X' {
            out.live.push(p.pid);
        }
        if p.pgid != own_group && p.pgid > 1 && !out.groups.contains(&p.pgid) {
            out.groups.push(p.pgid);
        }
    }
    out
}

/// SIGKILL every descendant of `pid` and their process groups (not the
/// helpers'): what a worker started, `setsid()` daemons included, while
/// they are still below it (once it is gone they are re-parented out of
/// its subtree).
pub fn kill_below(pid: i32) {
    if let Ok(root) = u32::try_from(pid) {
        let spare = helpers();
        signal(&scan(root, &spare), libc::SIGKILL);
    }
}

/// Send `sig` to every group and process of `scan`.
fn signal(scan: &Scan, sig: i32) {
    for &g in &scan.groups {
        sys::signal_group(g, sig);
    }
    for &pid in &scan.live {
        sys::signal_process(pid, sig);
    }
}

/// Empty scans in a row that mean "none left", where nothing better can
/// tell (helpers are kept and the kernel has no children lists).
pub const QUIET_SCANS: u32 = 3;

/// Longest wait for a reap between two kill rounds: what was killed is
/// normally reaped sooner (the wait ends at the reap), but a missed
/// process only shows up at the next scan.
const REAP_WAIT: Duration = Duration::from_millis(2);

/// Longest wait for a reap between two scans of the grace period.
const TERM_POLL: Duration = Duration::from_millis(20);

/// Is every descendant of the agent gone but the helpers' subtrees?
/// `Some(true)` is a proof, not a guess: the agent has no child other than
/// `spare` (live or unreaped), read atomically across its threads with
/// `waitid` when no helper is kept, else from the children lists, leader
/// last ([`sys::children`]). A descendant has a chain of parents up to the
/// agent (an orphan is re-parented to it, a subreaper, or to a subreaper
/// below it), so none is left; and none can appear, since only a
/// descendant or the agent itself forks one, and the agent does not fork
/// while it sweeps. None when neither way is available.
fn only_helpers_left(me: u32, spare: &[i32]) -> Option<bool> {
    if spare.is_empty()
        && let Some(any) = sys::has_children()
    {
        return Some(!any);
    }
    let children = sys::children(i32::try_from(me).ok()?)?;
    Some(children.iter().all(|c| spare.contains(c)))
}

/// What a sweep did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Swept {
    /// Distinct processes signalled.
    pub killed: usize,
    /// Processes still alive when the time was up (uninterruptible sleep).
    pub left: Vec<i32>,
}

/// SIGKILL every descendant of the agent but its helpers (and their
/// process groups), until [`only_helpers_left`] proves none is left, or
/// (without that proof) [`QUIET_SCANS`] scans in a row find none, or
/// `limit` has passed. Between kill rounds it waits for the one reaper to
/// reap (bounded by [`REAP_WAIT`]), never a fixed time: a round's end with
/// nothing left costs one `waitid`. Needs the reaper thread
/// ([`super::signals::start`]) running: what it kills must be reaped.
pub fn kill_all(limit: Duration) -> Swept {
    let me = std::process::id();
    let deadline = Instant::now() + limit;
    let mut killed: HashSet<i32> = HashSet::new();
    let mut quiet = 0;
    loop {
        let reaps = super::signals::reaps();
        // Locked from the list to the signals: see [`start_kept`].
        let spare = helpers();
        let proof = only_helpers_left(me, &spare);
        if proof == Some(true) {
            return Swept { killed: killed.len(), left: Vec::new() };
        }
        let found = scan(me, &spare);
        signal(&found, libc::SIGKILL);
        drop(spare);
        killed.extend(&found.live);
        if proof.is_none() {
            quiet = if found.live.is_empty() { quiet + 1 } else { 0 };
            if quiet >= QUIET_SCANS {
                return Swept { killed: killed.len(), left: Vec::new() };
            }
        }
        if Instant::now() >= deadline {
            return Swept { killed: killed.len(), left: found.live };
        }
        super::signals::wait_reap(reaps, REAP_WAIT);
    }
}

/// SIGTERM every descendant but the helpers (and their groups), wait up to
/// `grace` for them to go (woken by each reap), then [`kill_all`] for up to
/// `limit`.
pub fn terminate_all(grace: Duration, limit: Duration) -> Swept {
    let me = std::process::id();
    let spare = helpers();
    if only_helpers_left(me, &spare) == Some(true) {
        return Swept::default();
    }
    let first = scan(me, &spare);
    signal(&first, libc::SIGTERM);
    drop(spare);
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        let reaps = super::signals::reaps();
        let spare = helpers().clone();
        if only_helpers_left(me, &spare) == Some(true) || scan(me, &spare).live.is_empty() {
            break;
        }
        super::signals::wait_reap(reaps, TERM_POLL);
    }
    let mut swept = kill_all(limit);
    swept.killed = swept.killed.max(first.live.len());
    swept
}

/// Longest a sweep between two rounds goes on.
const BETWEEN_ROUNDS_LIMIT: Duration = Duration::from_secs(5);

/// Between two rounds (no round's workers run): kill every descendant of
/// the agent but its helpers and the workers kept for the next round. A
/// kept worker that exited on SIGTERM, or an earlier run's process that
/// double-forked, left its daemons to the agent. On the runtime's
/// multi-thread scheduler (the agent's).
pub fn between_rounds(when: &str) {
    let swept = tokio::task::block_in_place(|| kill_all(BETWEEN_ROUNDS_LIMIT));
    log(&swept, when);
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
    fn scans_walk_the_tree_skip_zombies_spare_helpers_and_name_groups() {
        // 1 (agent, group 7) -> 10 -> 11 (zombie, group 11) -> 12; 1 -> 20 (helper) -> 21;
        // 2 -> 30 (not ours); 1 -> 40 (in the agent's own group).
        let p = |pid, ppid, state, pgid| sys::ProcStat { pid, state, ppid, pgid };
        let table = [
            p(10, 1, 'S', 10),
            p(11, 10, 'Z', 11),
            p(12, 11, 'R', 11),
            p(20, 1, 'S', 20),
            p(21, 20, 'S', 20),
            p(30, 2, 'S', 30),
            p(40, 1, 'S', 7),
        ];
        let mut got = scan_in(&table, 1, &[20], 7);
        got.live.sort_unstable();
        got.groups.sort_unstable();
        assert_eq!(got, Scan { live: vec![10, 12, 40], groups: vec![10, 11] });
        assert_eq!(scan_in(&table, 1, &[], 7).live.len(), 5);
        assert_eq!(scan_in(&table, 99, &[], 7), Scan::default());
    }

    #[test]
    fn a_helper_is_kept_before_a_sweep_can_read_the_list_and_a_failed_start_is_not() {
        // Pids no process has: the list is the process's own, shared by tests.
        let (started, pid) = (std::sync::mpsc::channel(), -4242);
        let (tx, rx) = started;
        let starter = std::thread::spawn(move || {
            start_kept(
                || {
                    tx.send(()).expect("send");
                    std::thread::sleep(Duration::from_millis(200));
                    Ok::<_, ()>(pid)
                },
                |p| *p,
            )
        });
        rx.recv().expect("the start began");
        // What a sweep reads once the fork has begun already holds the helper.
        assert!(helpers().contains(&pid));
        assert_eq!(starter.join().expect("join"), Ok(pid));
        release(pid);
        assert_eq!(start_kept(|| Err::<i32, _>("fork failed"), |p| *p), Err("fork failed"));
        assert!(!helpers().contains(&pid) && !helpers().iter().any(|p| *p < 0));
    }
}
