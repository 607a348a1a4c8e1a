//! Warm pods from the driver on the real cluster (`compare -- driver`;
//! needs what `bash tests/cluster.sh up` needs, built by `bash tests/run.sh`;
//! issue 42): `benches/driver_start.py` times a script's start to the
//! first call of an actor of its own `__main__` answered on 2 pods x 2
//! workers that `trainlet_client.up` brought up on `runtimes/trainlet-dev.yaml`
//! (the images already on the nodes), and a second process's `connect` to
//! its first call. Both against the goals (15 s and 1 s): the
//! ratio is goal / measured, the median of `runs` runs.

use std::time::Duration;

use super::support::cluster::{apply_file, mounts_patch_json, run_dir, shared};
use super::support::{python, repo};
use super::{Row, median, time_row};

/// The goals of issue 42.
const FIRST_CALL_GOAL: Duration = Duration::from_secs(15);
const RECONNECT_GOAL: Duration = Duration::from_secs(1);

/// `runs` times up -> first call, and connect -> first call; two rows.
pub fn start(rows: &mut Vec<Row>, runs: usize) {
    if let Err(e) = shared() {
        panic!("driver bench (build the cluster first: bash tests/run.sh): {e}");
    }
    let (ok, out) = apply_file(&repo().join("runtimes/trainlet-dev.yaml"));
    assert!(ok, "{out}");
    let kubeconfig = run_dir().join("admin.kubeconfig").display().to_string();
    let patches = mounts_patch_json();
    let (mut first, mut reconnect) = (Vec::new(), Vec::new());
    for run in 0..runs {
        let name = format!("bench-driver-{}-{run}", std::process::id());
        let out = std::process::Command::new("timeout")
            .args(["600", &python()])
            .arg(repo().join("benches/driver_start.py"))
            .args([kubeconfig.as_str(), "default", patches.as_str(), name.as_str()])
            .output()
            .expect("driver");
        assert!(
            out.status.success(),
            "driver_start.py: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let line = String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or_default().to_string();
        let v: serde_json::Value = serde_json::from_str(&line).expect("json");
        let secs = |k: &str| Duration::from_secs_f64(v[k].as_f64().expect("seconds"));
        first.push(secs("first_call"));
        reconnect.push(secs("reconnect"));
    }
    rows.push(time_row(
        "driver: script start -> up -> first actor call, 2 pods x 2 (goal 15 s)".into(),
        median(first),
        FIRST_CALL_GOAL,
        "goal (issue 42): at most 15 s",
    ));
    rows.push(time_row(
        "driver: connect from a new process -> first call (goal 1 s)".into(),
        median(reconnect),
        RECONNECT_GOAL,
        "goal (issue 42): at most 1 s",
    ));
}
