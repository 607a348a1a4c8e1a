//! Frameworks and progress (`compare -- jax xgboost report`): job start of
//! 2 simulated pods with real JAX and XGBoost workers under trainlet,
//! against the way Kubeflow Trainer starts them today (the pod runs the
//! user's script directly; for XGBoost the script starts the RabitTracker
//! on task 0 itself); and the step time of a training loop with progress
//! reporting to a loopback Trainer status endpoint (HTTPS, the test
//! server) against the same loop without it.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use super::support::{fixture_server::status_server, free_port, python};
use super::{Row, bench_file, median, time_pods, time_row, trainlet};

/// `pods` commands: `trainlet run SCRIPT` or `python SCRIPT`, each with `env(pod)`.
fn pods(ours: bool, script: &str, env: &dyn Fn(u32) -> Vec<(String, String)>) -> Vec<Command> {
    (0..2)
        .map(|i| {
            let mut c = if ours {
                let mut c = Command::new(trainlet());
                c.args(["run", "--python", &python(), script]);
                c.env("PET_LOCAL_ADDR", format!("127.0.0.{}", i + 1));
                c
            } else {
                let mut c = Command::new(python());
                c.arg(script);
                c
            };
            c.envs(env(i));
            c
        })
        .collect()
}

/// `name`: 2 pods running `script` under trainlet against the script
/// alone, each pod with `env(under trainlet, store port, pod)`; medians of 3.
fn start_row(rows: &mut Vec<Row>, name: &str, script: &str, env: impl Fn(bool, u16, u32) -> Vec<(String, String)>) {
    let run = |ours: bool| {
        let port = free_port();
        time_pods(pods(ours, script, &|i| env(ours, port, i)))
    };
    let ours = median((0..3).map(|_| run(true)).collect());
    let theirs = median((0..3).map(|_| run(false)).collect());
    rows.push(time_row(name.into(), ours, theirs, "~1x"));
}

/// JAX: 2 pods x 1 process, initialize + psum.
pub fn jax(rows: &mut Vec<Row>) {
    start_row(
        rows,
        "JAX job start, 2 pods x 1 process, vs the script alone",
        &bench_file("jax_start.py"),
        |_, port, i| {
            vec![
                ("JAX_COORDINATOR_ADDRESS".to_string(), format!("127.0.0.1:{port}")),
                ("JAX_NUM_PROCESSES".to_string(), "2".to_string()),
                ("JAX_PROCESS_ID".to_string(), i.to_string()),
            ]
        },
    );
}

/// XGBoost: 2 pods x 1 worker, tracker + 5 rounds.
pub fn xgboost(rows: &mut Vec<Row>) {
    let name = "XGBoost job start, 2 pods x 1 worker, vs the script with its own tracker";
    start_row(rows, name, &bench_file("xgb_start.py"), |ours, port, i| {
        vec![
            ("DMLC_TRACKER_URI".to_string(), "127.0.0.1".to_string()),
            ("DMLC_TRACKER_PORT".to_string(), port.to_string()),
            ("DMLC_TASK_ID".to_string(), i.to_string()),
            ("DMLC_NUM_WORKER".to_string(), "2".to_string()),
            ("OWN_TRACKER".to_string(), if ours { "0" } else { "1" }.to_string()),
        ]
    });
}

/// Mean step time of `benches/report_steps.py` under trainlet, with
/// Trainer's env (reporting through trainlet to the server) or without.
fn step_ms(env: &[(String, String)]) -> Duration {
    let out = Command::new(trainlet())
        .args(["run", "--python", &python(), "--progress-timeout", "60", &bench_file("report_steps.py")])
        .envs(env.iter().cloned())
        // One BLAS thread: on 2 cores a multi-threaded matmul measures
        // scheduling noise, not the loop.
        .env("OMP_NUM_THREADS", "1")
        .env("OPENBLAS_NUM_THREADS", "1")
        .env("TRAINLET_LOG", "warn")
        .output()
        .expect("trainlet");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let ms: f64 = text
        .lines()
        .find_map(|l| l.split("STEP_MS=").nth(1))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no STEP_MS in {text}"));
    Duration::from_secs_f64(ms / 1e3)
}

/// Reporting overhead: the loop's step time with and without progress
/// reporting (the ratio should be 1.0x: no measurable difference).
pub fn report(rows: &mut Vec<Row>) {
    let dir = tempfile::tempdir().expect("tmp");
    let path = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/bench/trainjobs/job/status";
    let (server, ca) = status_server(&python(), dir.path(), 0, path);
    let token = dir.path().join("token");
    let s = |p: &Path| p.display().to_string();
    let on = vec![
        ("KUBEFLOW_TRAINER_SERVER_URL".to_string(), format!("https://127.0.0.1:{}{path}", server.fields[0])),
        ("KUBEFLOW_TRAINER_SERVER_CA_CERT".to_string(), s(&ca)),
        ("KUBEFLOW_TRAINER_SERVER_TOKEN".to_string(), s(&token)),
    ];
    let mut with = Vec::new();
    let mut without = Vec::new();
    for _ in 0..3 {
        with.push(step_ms(&on));
        without.push(step_ms(&[]));
    }
    let posts = std::fs::read_to_string(dir.path().join("log")).unwrap_or_default().lines().count();
    assert!(posts > 0, "the reporting runs posted nothing:\n{}", server.log());
    // Ratio: step time without / with reporting (1.0x = no difference).
    let (with, without) = (median(with), median(without));
    let us = |d: Duration| format!("{:.1} us", d.as_secs_f64() * 1e6);
    rows.push(Row {
        name: format!(
            "training step with progress reporting (SDK -> trainlet -> HTTPS Trainer, {posts} posts) vs without"
        ),
        ours: us(with),
        theirs: us(without),
        ratio: without.as_secs_f64() / with.as_secs_f64(),
        goal: "1.0x (no measurable difference)",
    });
}
