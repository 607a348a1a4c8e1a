//! The benchmark gate (`cargo bench --bench compare -- gate`): a fast subset
//! of the side-by-side benchmarks, each ratio checked against its floor in
//! `benches/floors.toml`. A ratio below its floor fails the run (exit 1)
//! with the measured and the expected ratio.
//!
//! Only ratios are gated, never absolute times: both sides of a ratio are
//! measured in this one process, interleaved where a row has several runs,
//! so a loaded machine slows both.
//!
//! A floor's record is `runs`, the ratios of at least [`MIN_RUNS`] whole
//! gate runs with both CPUs kept busy by two other processes (`bash
//! benches/floor_runs.sh`), and `idle`, those of whole gate runs on an
//! otherwise idle machine (`--idle`); the floor is either the lowest of them
//! all halved or the row's `goal` where every run met it. A record that is too short, or
//! a floor above what its runs allow, fails the gate before anything is
//! measured: a floor that would fail a healthy build is a bug of the gate.
//! A row without a record fails it too: a new row earns its floor from its
//! own runs. Each run appends its ratios to `target/bench-gate-runs.jsonl`,
//! where `floor_runs.sh` reads them. A floor is raised when the ratios
//! improve, never lowered to pass.
//!
//! `cargo test --bench compare -- floors` checks `benches/floors.toml`
//! alone, measuring nothing (seconds): the test command runs it right after
//! its build, so a floor without its record fails the run at once, not
//! after the tests.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use super::{
    Row, actor_bench, agent_rss, driver_bench, inplace_bench, launch_rows, lost_pod_bench, pmi_bench, restart_gap,
    serve_bench, stacks_bench, store_throughput, torchft_bench,
};

/// Fewest gate runs under load a floor's record holds.
const MIN_RUNS: usize = 10;

/// One floor of `benches/floors.toml`.
#[derive(Debug)]
struct Floor {
    floor: f64,
    source: String,
}

/// A number of TOML (a float or an integer).
fn number(v: &toml::Value) -> Option<f64> {
    v.as_float().or_else(|| v.as_integer().map(|i| i as f64))
}

/// Whether `floor` is what the record allows: at most the lowest run
/// (under load or idle) halved, or the goal when every run met it. Idle
/// runs count because some ratios are lower idle than under load: a cold
/// torchrun, the reference of several rows, slows more under load than
/// trainlet does.
fn check_record(key: &str, floor: f64, goal: Option<f64>, runs: &[f64], idle: &[f64]) -> Result<(), String> {
    if runs.len() < MIN_RUNS {
        return Err(format!(
            "[{key}] records {} runs under load; a floor needs at least {MIN_RUNS} (bash benches/floor_runs.sh)",
            runs.len()
        ));
    }
    let runs: Vec<f64> = runs.iter().chain(idle).copied().collect();
    let lowest = runs.iter().copied().fold(f64::INFINITY, f64::min);
    let halved = lowest / 2.0;
    let by_goal = goal.is_some_and(|g| (floor - g).abs() < 1e-9 && g <= lowest);
    if floor <= halved + 1e-9 || by_goal {
        return Ok(());
    }
    Err(format!(
        "[{key}] floor {floor} is above what its runs allow: the lowest of {} runs is {lowest:.3}x, halved {halved:.3}x{}",
        runs.len(),
        goal.map_or(String::new(), |g| format!(", and the goal {g} was not met by every run"))
    ))
}

fn floors_file() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/floors.toml")
}

/// `[key]` tables with `floor = <ratio>`, `source = "<why this floor>"`,
/// and where there is one, `goal = <ratio>` and the record `runs = [<ratio>, ...]`.
fn read_floors() -> Result<HashMap<String, Floor>, String> {
    let path = floors_file();
    let text = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let table: toml::Table = text.parse().map_err(|e| format!("{}: {e}", path.display()))?;
    let mut out = HashMap::new();
    for (key, v) in table {
        let floor = v.get("floor").and_then(number);
        let source = v.get("source").and_then(|s| s.as_str());
        let numbers = |name: &str| -> Option<Vec<f64>> {
            v.get(name).and_then(|r| r.as_array()).map(|a| a.iter().filter_map(number).collect())
        };
        let (runs, idle) = (numbers("runs"), numbers("idle").unwrap_or_default());
        let goal = v.get("goal").and_then(number);
        match (floor, source) {
            (Some(floor), Some(source)) => {
                let runs = runs.ok_or_else(|| {
                    format!(
                        "{}: [{key}] has no `runs`: a floor needs its record, the ratios of at least {MIN_RUNS} \
                         gate runs with both CPUs kept busy (bash benches/floor_runs.sh)",
                        path.display()
                    )
                })?;
                check_record(&key, floor, goal, &runs, &idle).map_err(|e| format!("{}: {e}", path.display()))?;
                out.insert(key, Floor { floor, source: source.to_string() });
            }
            _ => return Err(format!("{}: [{key}] needs a number `floor` and a text `source`", path.display())),
        }
    }
    Ok(out)
}

/// Measure the subset; pairs of (floor key, row).
fn measure() -> Vec<(&'static str, Row)> {
    let mut gated = Vec::new();
    let mut take = |keys: &[&'static str], rows: Vec<Row>| {
        assert_eq!(keys.len(), rows.len(), "a benchmark gave {} rows for {keys:?}", rows.len());
        for (key, row) in keys.iter().zip(rows) {
            eprintln!("gate: {key}: trainlet {} | reference {} | {:.2}x", row.ours, row.theirs, row.ratio);
            if !key.is_empty() {
                gated.push((*key, row));
            }
        }
    };
    for (n, keys) in
        [(1, ["launch_1_vs_torchrun", "launch_1_vs_bare"]), (8, ["launch_8_vs_torchrun", "launch_8_vs_bare"])]
    {
        let mut rows = Vec::new();
        launch_rows(&mut rows, n, 3, 7);
        take(&keys, rows);
    }
    let mut rows = Vec::new();
    restart_gap(&mut rows, 2, (3, 3), false);
    take(&["restart_gap_2_pods_vs_torchrun"], rows);
    let mut rows = Vec::new();
    agent_rss(&mut rows);
    take(&["agent_rss_vs_torchrun"], rows);
    let mut rows = Vec::new();
    store_throughput(&mut rows);
    // add, check and multi_get are measured by the same client run; set and get are gated.
    take(&["store_set_vs_torch", "store_get_vs_torch", "", "", ""], rows);
    let mut rows = Vec::new();
    let cold = serve_bench::redeploy(&mut rows, (3, 0, 2));
    take(&["redeploy_vs_torchrun_cold"], rows);
    // Actors, against the same cold torchrun start: 200 calls, 3 redeploys,
    // 3 recoveries in each mode.
    let mut rows = Vec::new();
    actor_bench::rows(&mut rows, &actor_bench::measure(200, 3, (3, 3)), cold);
    take(
        &[
            "actor_call_vs_http_floor",
            "actor_call_vs_goal",
            "actor_redeploy_vs_torchrun_cold",
            "actor_recovery_vs_torchrun_cold",
            "actor_survivors_recovery_vs_torchrun_cold",
        ],
        rows,
    );
    // A training pod killed by SIGKILL, its spare's round formed: 4 pods and 256.
    let mut rows = Vec::new();
    lost_pod_bench::sigkill(&mut rows, 4, 3, Duration::from_secs(1));
    lost_pod_bench::sigkill(&mut rows, 256, 1, Duration::from_millis(1500));
    take(&["lost_pod_sigkill_4_vs_goal", "lost_pod_sigkill_256_vs_goal"], rows);
    // MPI without SSH: start to MPI_Init, 4 pods x 2, against mpirun over OpenSSH.
    let mut rows = Vec::new();
    pmi_bench::start(&mut rows, 3);
    take(&["pmi_start_vs_openssh_mpirun", ""], rows);
    // TorchFT replica groups: the survivors' steps while a peer group restarts.
    let mut rows = Vec::new();
    torchft_bench::survivors(&mut rows);
    take(&["torchft_survivor_steps_vs_steady_rate"], rows);
    // Every rank's stacks on demand, 4 ranks on 2 pods, against py-spy dump of each.
    let mut rows = Vec::new();
    stacks_bench::gather(&mut rows, 3);
    take(&["stacks_4_ranks_vs_py_spy"], rows);
    // Restarts on the cluster (tests/cluster.sh), one run of each way.
    let mut rows = Vec::new();
    inplace_bench::restarts(&mut rows, 1, false);
    take(
        &["inplace_preload_vs_cold_pod", "trainlet_restart_preload_vs_cold_pod", "", "spare_preload_vs_cold_pod"],
        rows,
    );
    // Warm pods from the driver on the cluster: up -> first call, connect -> first call.
    let mut rows = Vec::new();
    driver_bench::start(&mut rows, 1);
    take(&["driver_up_first_call_vs_goal", "driver_reconnect_vs_goal"], rows);
    gated
}

/// Append this run's ratios to `target/bench-gate-runs.jsonl`, one line per
/// run (`benches/floor_runs.sh` collects them into a floor's record).
fn record_runs(gated: &[(&'static str, Row)]) {
    use std::io::Write as _;
    let ratios: serde_json::Map<String, serde_json::Value> =
        gated.iter().map(|(k, r)| ((*k).to_string(), serde_json::json!(r.ratio))).collect();
    let line = serde_json::json!({ "ratios": ratios }).to_string();
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/bench-gate-runs.jsonl");
    let written =
        std::fs::OpenOptions::new().create(true).append(true).open(&path).and_then(|mut f| writeln!(f, "{line}"));
    if let Err(e) = written {
        eprintln!("gate: cannot append this run's ratios to {}: {e}", path.display());
    }
}

/// Check `benches/floors.toml` alone (`-- floors`): 0 when every row has a
/// floor its record allows.
pub fn check_floors() -> ExitCode {
    match read_floors() {
        Ok(f) => {
            println!("gate: every floor of {} has its record ({} rows)", floors_file().display(), f.len());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gate: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Run the gate: 0 when every ratio is at or above its floor.
pub fn run() -> ExitCode {
    // `benches/floor_runs.sh` measures the records themselves: every row,
    // whatever floors.toml holds.
    if std::env::var_os("TRAINLET_GATE_RECORD_ONLY").is_some() {
        let gated = measure();
        record_runs(&gated);
        println!("gate: {} ratios recorded (TRAINLET_GATE_RECORD_ONLY: no floor checked)", gated.len());
        return ExitCode::SUCCESS;
    }
    let floors = match read_floors() {
        Ok(f) => f,
        Err(e) => {
            eprintln!("gate: {e}");
            return ExitCode::FAILURE;
        }
    };
    let started = Instant::now();
    let gated = measure();
    let took = started.elapsed();
    let mut table = String::from(
        "| ratio | trainlet | reference | measured | floor | floor's source | |\n|---|---|---|---|---|---|---|\n",
    );
    let mut failures = Vec::new();
    for (key, row) in &gated {
        let Some(f) = floors.get(*key) else {
            failures.push(format!("{key}: measured {:.2}x, no floor in {}", row.ratio, floors_file().display()));
            continue;
        };
        let ok = row.ratio >= f.floor;
        table.push_str(&format!(
            "| {key} | {} | {} | {:.2}x | {:.2}x | {} | {} |\n",
            row.ours,
            row.theirs,
            row.ratio,
            f.floor,
            f.source,
            if ok { "ok" } else { "BELOW" }
        ));
        if !ok {
            failures.push(format!(
                "{key} ({}): measured {:.2}x, floor {:.2}x ({})",
                row.name, row.ratio, f.floor, f.source
            ));
        }
    }
    print!("{table}");
    println!("gate: {} ratios in {:.0} s", gated.len(), took.as_secs_f64());
    let out = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/bench-gate.md");
    let _ = std::fs::write(out, &table);
    record_runs(&gated);
    if failures.is_empty() {
        println!("gate: every ratio is at or above its floor");
        return ExitCode::SUCCESS;
    }
    for f in &failures {
        eprintln!("gate: below the floor: {f}");
    }
    ExitCode::FAILURE
}
