//! TorchFT replica groups (`compare -- torchft`): how much the surviving
//! group trains while a peer group restarts, under `trainlet run
//! --replica-groups 2` (2 simulated pods x 2 workers, real torchft 0.2.0
//! on CPU, tests/fixtures/torchft_train.py). A worker of group 1 kills
//! itself at step 30; trainlet restarts group 1 alone. The row compares
//! the steps group 0 committed between that death and group 1's first
//! commit after it with what group 0 commits in the same time when nothing
//! fails (its rate over the steps before the death): 1x is no step lost,
//! the goal. One world of every rank (torchrun, or trainlet without
//! groups) commits none in that window: every rank restarts.

use std::path::Path;
use std::process::Command;

use super::support::{free_port, python, repo};
use super::{Row, trainlet};

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

/// Run the job once; (steps committed in the window, expected at the
/// steady rate, window in seconds).
fn once() -> Option<(usize, f64, f64)> {
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
                    ("TORCHFT_STEPS", "150".to_string()),
                    ("STEP_SLEEP", "0.05".to_string()),
                    ("KILL_GROUP", "1".to_string()),
                    ("KILL_RANK", "1".to_string()),
                    ("KILL_AT_STEP", "30".to_string()),
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
    let g0 = commits(&marks.join("steps.g0"));
    let back = commits(&marks.join("steps.g1")).into_iter().find(|(_, t)| *t > killed)?.1;
    let meanwhile = g0.iter().filter(|(_, t)| *t > killed && *t <= back).count();
    // The steady rate: group 0's commits from its 5th to the death.
    let before: Vec<f64> = g0.iter().map(|(_, t)| *t).filter(|t| *t <= killed).skip(4).collect();
    let (first, last) = (before.first()?, before.last()?);
    let rate = (before.len() - 1) as f64 / (last - first).max(1e-3);
    Some((meanwhile, rate * (back - killed), back - killed))
}

/// The surviving group's steps during a peer group's restart.
pub fn survivors(rows: &mut Vec<Row>) {
    let Some((got, expected, window)) = once() else { return };
    rows.push(Row {
        name: "TorchFT: steps the surviving group commits while a peer group restarts (2 groups x 2 workers)".into(),
        ours: format!("{got} in {:.1} s", window),
        theirs: format!("{expected:.0} at its steady rate"),
        ratio: got as f64 / expected.max(1.0),
        goal: "1x (no step lost)",
    });
}
