//! TorchFT replica groups (`compare -- torchft`): how much the surviving
//! group trains while a peer group restarts, under `trainlet run
//! --replica-groups 2` (2 simulated pods x 2 workers, real torchft 0.2.0
//! on CPU, tests/fixtures/torchft_train.py). A worker of group 1 kills
//! itself at step KILL_AT; trainlet restarts group 1 alone.
//!
//! The row counts the steps group 0 commits in a fixed window of WINDOW
//! seconds from that death, long enough to hold group 1's usual restart and
//! its rejoining, against the steps group 0 committed in the WINDOW seconds
//! just before the death, with both groups training (its steady rate, in
//! the same run). 1x is no step lost, the goal. Whatever the survivors lose
//! while the peer restarts (the Lighthouse's heartbeat timeout, a stall when
//! the peer rejoins, slower steps while its workers start) lowers it; a
//! fixed stall no longer weighs more the quicker the restart is. A restart
//! longer than the window widens it to hold the restart (up to group 0's
//! last commit; the row says so), so that what group 0 loses until the
//! peer is back is still counted. One world of every rank (torchrun, or
//! trainlet without groups) commits nothing until every rank is back.

use std::path::Path;
use std::process::Command;

use super::support::{free_port, python, repo};
use super::{Row, trainlet};

/// The window, seconds: the stall (2 s heartbeat timeout) and a restart of
/// group 1 (2-5 s on a 2-vCPU VM) fit in it. A slower restart (10-29 s on
/// the same VM loaded) widens it, as far as group 0's last commit, so that
/// what group 0 loses while the peer comes back is still counted.
const WINDOW: f64 = 8.0;
/// Group 1's worker dies at this step: at the fixture's fastest (20 steps
/// a second, STEP_SLEEP 0.05) group 0 is past its first steps WINDOW
/// seconds before it.
const KILL_AT: u64 = 200;
/// Steps of the run: group 0 still commits WINDOW seconds after the death
/// at the fastest rate, with no stall (20 x 8 = 160, and 40 to spare; a
/// widened window ends at its last commit).
const STEPS: u64 = KILL_AT + 200;
/// Group 0's first commits (gloo connecting, the first quorum) are not
/// steady: the window before the death must start after this many.
const WARMUP: usize = 5;
/// After group 1's first commit the window still holds this much.
const TAIL: f64 = 0.5;

/// `<step> <unix time>` lines of a marker file.
fn commits(path: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            Some((w.next()?.parse().ok()?, w.next()?.parse().ok()?))
        })
        .collect()
}

/// One run's measurement.
#[derive(Debug)]
struct Survivors {
    /// Group 0's commits in the window from the death.
    after: usize,
    /// Group 0's commits in the WINDOW seconds before the death, scaled to
    /// the window's length (the same unless it was widened).
    before: f64,
    /// The window from the death, seconds.
    window: f64,
    /// From the death to group 1's first commit after it, seconds.
    restart: f64,
}

/// Run the job once.
fn once() -> Option<Survivors> {
    let dir = tempfile::tempdir().ok()?;
    let marks = dir.path().join("marks");
    let port = free_port().to_string();
    let script = repo().join("tests/fixtures/torchft_train.py").display().to_string();
    let mut pods: Vec<_> = (0..2)
        .map(|i| {
            Command::new(trainlet())
                .args(["run", "--python", &python(), "--replica-groups", "2", "--max-restarts", "1", &script])
                .envs([
                    ("PET_NNODES", "2".to_string()),
                    ("PET_NPROC_PER_NODE", "2".to_string()),
                    ("PET_NODE_RANK", i.to_string()),
                    ("PET_MASTER_ADDR", "127.0.0.1".to_string()),
                    ("PET_MASTER_PORT", port.clone()),
                    ("PET_LOCAL_ADDR", format!("127.0.0.{}", i + 1)),
                    ("TRAINLET_LIGHTHOUSE_PORT", "0".to_string()),
                    ("TRAINLET_LOG", "warn".to_string()),
                    ("MARK_DIR", marks.display().to_string()),
                    ("TORCHFT_STEPS", STEPS.to_string()),
                    ("STEP_SLEEP", "0.05".to_string()),
                    ("KILL_GROUP", "1".to_string()),
                    ("KILL_RANK", "1".to_string()),
                    ("KILL_AT_STEP", KILL_AT.to_string()),
                ])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .expect("trainlet")
        })
        .collect();
    let ok = pods.iter_mut().all(|p| p.wait().is_ok_and(|s| s.success()));
    if !ok {
        eprintln!("torchft bench: a pod failed");
        return None;
    }
    let killed = std::fs::metadata(marks.join("killed")).ok()?.modified().ok()?;
    let killed = killed.duration_since(std::time::UNIX_EPOCH).ok()?.as_secs_f64();
    let g0: Vec<f64> = commits(&marks.join("steps.g0")).into_iter().map(|(_, t)| t).collect();
    let back = commits(&marks.join("steps.g1")).into_iter().find(|(_, t)| *t > killed)?.1;
    let restart = back - killed;
    let last = *g0.last()?;
    let window = WINDOW.max(restart + TAIL).min(last - killed);
    let in_window = |from: f64, to: f64| g0.iter().filter(|t| **t > from && **t <= to).count();
    if g0.get(WARMUP).is_none_or(|t| *t > killed - WINDOW) {
        eprintln!("torchft bench: group 0 was not steady {WINDOW} s before the death: raise KILL_AT");
        return None;
    }
    if window < WINDOW {
        eprintln!("torchft bench: the run ended {window:.1} s after the death, inside the window: raise STEPS");
        return None;
    }
    let after = in_window(killed, killed + window);
    let before = in_window(killed - WINDOW, killed) as f64 * window / WINDOW;
    eprintln!(
        "torchft bench: group 0 committed {after} in {window:.1} s from the death, {before:.0} before it; \
         group 1 back after {restart:.2} s; {:.2}x",
        after as f64 / before.max(1.0)
    );
    Some(Survivors { after, before, window, restart })
}

/// The surviving group's steps during a peer group's restart.
pub fn survivors(rows: &mut Vec<Row>) {
    let Some(s) = once() else { return };
    let widened =
        if s.window > WINDOW { format!(" (widened: the restart did not fit in {WINDOW:.0} s)") } else { String::new() };
    rows.push(Row {
        name: format!(
            "TorchFT: steps the surviving group commits in the {WINDOW:.0} s from a peer group's death, \
             restart included (2 groups x 2 workers)"
        ),
        ours: format!("{} in {:.1} s{widened}, peer back after {:.1} s", s.after, s.window, s.restart),
        theirs: format!("{:.0} in as long before the death", s.before),
        ratio: s.after as f64 / s.before.max(1.0),
        goal: "1x (no step lost)",
    });
}
