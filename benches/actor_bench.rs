//! Actors on served pods (`compare -- actors`, issue 26): 2 simulated pods
//! x 2 torch workers served with `--preload torch`, driven by
//! `benches/actor_driver.py` with the repository's Python client, the
//! actor being `tests/fixtures/actor_trainer.py`'s `Trainer` (DDP, gloo):
//!
//! - call overhead: `noop()` on every rank and back (median and p99),
//!   against a `GET /v1/status` round trip with the same client (the HTTP
//!   floor), interleaved;
//! - redeploy: a changed actor (another init argument) posted -> its first
//!   call (one DDP step on every rank) answered, against a cold torchrun
//!   start of a DDP job to its first step (`serve_bench::torchrun_cold`);
//! - recovery: `die()` on rank 3 (SIGKILL) -> the next call answered by
//!   every rank, default mode (every rank re-instantiates the actor),
//!   against the same cold torchrun start;
//! - survivors recovery: the same with `restart="survivors"` (only rank 3
//!   is instantiated again; ranks 0-2 keep their processes and rejoin).

use std::process::Command;
use std::time::Duration;

use super::serve_bench::{Pods, torchrun_cold, trainlet_pod};
use super::support::{free_port, python, repo};
use super::{Row, bench_file, median, ms, quiet, time_row};

/// The call-overhead goal (issue 26): median under 5 ms on loopback.
pub const CALL_GOAL: Duration = Duration::from_millis(5);

/// What one driver run measured.
#[derive(Debug)]
pub struct Measured {
    /// No-op calls, in order.
    pub calls: Vec<Duration>,
    /// `GET /v1/status` round trips, interleaved with the calls.
    pub status: Vec<Duration>,
    /// Changed actor posted -> first call answered.
    pub redeploy: Vec<Duration>,
    /// `die(3)` posted -> next call answered.
    pub recovery: Vec<Duration>,
    /// The same in survivors mode.
    pub survivors: Vec<Duration>,
}

fn secs(v: &serde_json::Value) -> Vec<Duration> {
    v.as_array().map(|a| a.iter().filter_map(|s| s.as_f64()).map(Duration::from_secs_f64).collect()).unwrap_or_default()
}

/// Start 2 x 2 served pods with `--preload torch` and run the driver:
/// `calls` no-op calls, `redeploys` redeploys, `recoveries` recoveries in
/// each mode (default, survivors).
pub fn measure(calls: usize, redeploys: usize, recoveries: (usize, usize)) -> Measured {
    let dir = tempfile::tempdir().expect("tmp");
    let token = dir.path().join("token");
    std::fs::write(&token, "bench").expect("token");
    let (port, control) = (free_port(), free_port());
    let (token_s, control_s) = (token.display().to_string(), control.to_string());
    let pods = Pods(
        (0..2)
            .map(|node| {
                let serve_dir = dir.path().join(format!("pod{node}")).display().to_string();
                let args = [
                    "--serve",
                    "--preload",
                    "torch",
                    "--control-bind",
                    "127.0.0.1",
                    "--control-port",
                    &control_s,
                    "--control-token-file",
                    &token_s,
                    "--serve-dir",
                    &serve_dir,
                ];
                quiet(&mut trainlet_pod(node, port, &args)).spawn().expect("pod")
            })
            .collect(),
    );
    let trainer = repo().join("tests/fixtures/actor_trainer.py");
    let out = Command::new(python())
        .arg(bench_file("actor_driver.py"))
        .arg(format!("http://127.0.0.1:{control}"))
        .arg(&token)
        .arg(&trainer)
        .args([calls, redeploys, recoveries.0, recoveries.1].map(|n| n.to_string()))
        .output()
        .expect("driver");
    drop(pods);
    assert!(
        out.status.success(),
        "actor driver: {:?}\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let mut m = Measured {
        calls: Vec::new(),
        status: Vec::new(),
        redeploy: Vec::new(),
        recovery: Vec::new(),
        survivors: Vec::new(),
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("driver line {line}: {e}"));
        if let Some(c) = v.get("calls") {
            m.calls = secs(c);
            m.status = secs(&v["status"]);
        }
        if let Some(r) = v.get("redeploy") {
            m.redeploy = secs(r);
        }
        if let Some(r) = v.get("recovery") {
            m.recovery = secs(r);
        }
        if let Some(r) = v.get("survivors") {
            m.survivors = secs(r);
        }
    }
    m
}

/// The 99th percentile (nearest rank).
fn p99(mut v: Vec<Duration>) -> Duration {
    v.sort();
    let i = (v.len() * 99).div_ceil(100).saturating_sub(1);
    v[i.min(v.len() - 1)]
}

/// The rows of `m`, in this order (each only when measured): call overhead
/// against the HTTP floor (ratio: floor / call), call overhead against the
/// 5 ms goal (ratio: goal / call, >= 1 when met), redeploy and recovery
/// against `cold` (a cold torchrun start's median).
pub fn rows(rows: &mut Vec<Row>, m: &Measured, cold: Duration) {
    if !m.calls.is_empty() {
        let (call, call99) = (median(m.calls.clone()), p99(m.calls.clone()));
        let (http, http99) = (median(m.status.clone()), p99(m.status.clone()));
        let n = m.calls.len();
        rows.push(Row {
            name: format!(
                "actor call overhead: noop() on 2 pods x 2 workers, Python client -> every rank -> results, median of {n} (p99 {}), vs GET /v1/status with the same client (the HTTP floor, p99 {})",
                ms(call99),
                ms(http99)
            ),
            ours: ms(call),
            theirs: ms(http),
            ratio: http.as_secs_f64() / call.as_secs_f64(),
            goal: "report",
        });
        rows.push(Row {
            name: format!("actor call overhead as above, median of {n} (p99 {}) vs the 5 ms goal", ms(call99)),
            ours: ms(call),
            theirs: ms(CALL_GOAL),
            ratio: CALL_GOAL.as_secs_f64() / call.as_secs_f64(),
            goal: "< 5 ms (>= 1.0x)",
        });
    }
    if !m.redeploy.is_empty() {
        rows.push(time_row(
            format!(
                "actor redeploy: changed actor posted -> first call (a DDP step) answered on every rank, 2 pods x 2, --preload torch, median of {}, vs torchrun cold start -> first DDP step",
                m.redeploy.len()
            ),
            median(m.redeploy.clone()),
            cold,
            ">= 20x",
        ));
    }
    if !m.recovery.is_empty() {
        rows.push(time_row(
            format!(
                "actor recovery: die() SIGKILLs rank 3 -> next call answered, default mode (every rank re-instantiated), median of {}, vs torchrun cold start -> first DDP step",
                m.recovery.len()
            ),
            median(m.recovery.clone()),
            cold,
            "report",
        ));
    }
    if !m.survivors.is_empty() {
        rows.push(time_row(
            format!(
                "actor recovery, survivors mode: die() SIGKILLs rank 3 -> next call answered (rank 3 re-instantiated, ranks 0-2 keep their processes and rejoin), median of {}, vs torchrun cold start -> first DDP step",
                m.survivors.len()
            ),
            median(m.survivors.clone()),
            cold,
            "report",
        ));
    }
}

/// `compare -- actors`: 1,000 calls, 5 redeploys, 5 recoveries in each
/// mode, 3 cold torchrun starts (after the pods are stopped).
pub fn actors(out: &mut Vec<Row>) {
    let m = measure(1000, 5, (5, 5));
    let cold = median((0..3).map(|_| torchrun_cold()).collect());
    rows(out, &m, cold);
}
