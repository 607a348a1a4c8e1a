//! Serve mode and `--preload` (`compare -- redeploy preload`):
//!
//! - redeploy: a changed `train.py` submitted to 2 served pods x 2 torch
//!   workers (with `--preload torch`) until the first training step ends
//!   on every rank, against starting the same job cold with torchrun (2
//!   agents, c10d rendezvous) until the same point; and served without
//!   preload, for reference;
//! - restart: a worker crash to the restarted workers' first training
//!   step, with `--preload torch` against without;
//! - start: job start to every rank's first step with `--preload torch`
//!   against without, with both pods at once and with the second pod
//!   1.5 s late (the imports overlap the rendezvous wait).

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::support::{free_port, python};
use super::{Row, bench_file, median, quiet, time_row, trainlet};

const STEP: &str = "serve_step.py";

fn now_ns() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0)
}

/// Wait for `<dir>/<tag>_<rank>` of every rank; the latest time in them.
fn last_step(dir: &Path, tag: &str, ranks: u32, limit: Duration) -> u128 {
    let start = Instant::now();
    loop {
        let times: Vec<u128> = (0..ranks)
            .filter_map(|r| std::fs::read_to_string(dir.join(format!("{tag}_{r}"))).ok()?.trim().parse().ok())
            .collect();
        if times.len() == ranks as usize {
            return times.into_iter().max().unwrap_or(0);
        }
        assert!(start.elapsed() < limit, "no first step of every rank in {}", dir.display());
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn since(t0: u128, t1: u128) -> Duration {
    Duration::from_nanos(u64::try_from(t1.saturating_sub(t0)).unwrap_or(u64::MAX))
}

/// `trainlet run` pods (simulated, 127.0.0.N) of a 2 x 2 job.
pub(super) fn trainlet_pod(node: u32, port: u16, args: &[&str]) -> Command {
    let mut c = Command::new(trainlet());
    c.arg("run").args(args);
    c.env("TRAINLET_PYTHON", python())
        .env("PET_NNODES", "2")
        .env("PET_NPROC_PER_NODE", "2")
        .env("PET_NODE_RANK", node.to_string())
        .env("PET_MASTER_ADDR", "127.0.0.1")
        .env("PET_MASTER_PORT", port.to_string())
        .env("PET_LOCAL_ADDR", format!("127.0.0.{}", node + 1));
    c
}

/// Wait until no run is active on the served pods.
fn wait_idle(control: u16, token: &str) {
    let start = Instant::now();
    loop {
        let mut c = std::net::TcpStream::connect(("127.0.0.1", control)).expect("connect");
        write!(c, "GET /v1/status HTTP/1.1\r\nAuthorization: Bearer {token}\r\n\r\n").expect("get");
        let mut reply = String::new();
        c.read_to_string(&mut reply).expect("reply");
        if reply.contains("\"active\":null") {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(120), "the run did not end: {reply}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn post(control: u16, token: &str, body: &str) {
    // The control API comes up once the pods have started.
    let start = Instant::now();
    let mut c = loop {
        match std::net::TcpStream::connect(("127.0.0.1", control)) {
            Ok(c) => break c,
            Err(e) => assert!(start.elapsed() < Duration::from_secs(30), "control API: {e}"),
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    write!(
        c,
        "POST /v1/runs HTTP/1.1\r\nAuthorization: Bearer {token}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("post");
    let mut reply = String::new();
    c.read_to_string(&mut reply).expect("reply");
    assert!(reply.starts_with("HTTP/1.1 201"), "{reply}");
}

/// Served pods: (submission -> every rank's first step) for each of `n`
/// redeploys of a changed file.
fn redeploy_served(preload: bool, n: usize) -> Vec<Duration> {
    let dir = tempfile::tempdir().expect("tmp");
    let token = dir.path().join("token");
    std::fs::write(&token, "bench").expect("token");
    let (port, control) = (free_port(), free_port());
    let token_s = token.display().to_string();
    let control_s = control.to_string();
    let mut args = vec!["--serve", "--control-bind", "127.0.0.1", "--control-port", &control_s];
    args.extend(["--control-token-file", &token_s]);
    if preload {
        args.extend(["--preload", "torch"]);
    }
    let pods = Pods(
        (0..2)
            .map(|node| {
                let serve_dir = dir.path().join(format!("pod{node}")).display().to_string();
                let mut a = args.clone();
                a.extend(["--serve-dir", &serve_dir]);
                quiet(&mut trainlet_pod(node, port, &a)).spawn().expect("pod")
            })
            .collect(),
    );
    let src = std::fs::read_to_string(bench_file(STEP)).expect("script");
    let mut took = Vec::new();
    // Run 0 warms the pods (the zygote's imports, the first rendezvous).
    for i in 0..=n {
        let steps = dir.path().join(format!("steps{i}"));
        std::fs::create_dir_all(&steps).expect("steps");
        let code = format!("{src}\n# change {i}\n");
        let body = format!(
            r#"{{"command": ["python", "train.py"], "env": {{"STEP_DIR": "{}"}}, "files": {{"train.py": "{}"}}}}"#,
            steps.display(),
            data_encoding::BASE64.encode(code.as_bytes())
        );
        let t0 = now_ns();
        post(control, "bench", &body);
        let t1 = last_step(&steps, "first", 4, Duration::from_secs(120));
        if i > 0 {
            took.push(since(t0, t1));
        }
        wait_idle(control, "bench");
    }
    drop(pods);
    took
}

/// Served pods never exit on their own: stopped (SIGTERM) when the
/// benchmark is done with them, also when it panics.
pub(super) struct Pods(pub(super) Vec<Child>);

impl Drop for Pods {
    fn drop(&mut self) {
        for p in self.0.drain(..) {
            stop(p);
        }
    }
}

fn stop(mut p: Child) {
    if let Ok(pid) = i32::try_from(p.id()) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM);
    }
    let _ = p.wait();
}

/// torchrun cold start of the same job: launch -> every rank's first step.
pub(super) fn torchrun_cold() -> Duration {
    let dir = tempfile::tempdir().expect("tmp");
    let port = free_port().to_string();
    let t0 = now_ns();
    let mut agents: Vec<Child> = (0..2)
        .map(|node| {
            let mut c = Command::new(python());
            c.args(["-m", "torch.distributed.run", "--rdzv-backend", "c10d", "--rdzv-id", "cold"]);
            c.args(["--rdzv-endpoint", &format!("127.0.0.1:{port}"), "--nnodes", "2", "--nproc-per-node", "2"]);
            c.args(["--local-addr", &format!("127.0.0.{}", node + 1), &bench_file(STEP)]);
            c.env("STEP_DIR", dir.path());
            quiet(&mut c).spawn().expect("torchrun")
        })
        .collect();
    let t1 = last_step(dir.path(), "first", 4, Duration::from_secs(120));
    for a in &mut agents {
        let _ = a.wait();
    }
    since(t0, t1)
}

/// Redeploy against a cold torchrun start: `preloaded` redeploys served
/// with `--preload torch`, `plain` without (no row when 0), `cold` torchrun
/// starts; medians. Returns the cold start's median (the actor rows compare
/// with it too).
pub fn redeploy(rows: &mut Vec<Row>, (preloaded, plain, cold): (usize, usize, usize)) -> Duration {
    let preloaded = median(redeploy_served(true, preloaded));
    let plain = (plain > 0).then(|| median(redeploy_served(false, plain)));
    let cold = median((0..cold).map(|_| torchrun_cold()).collect());
    rows.push(time_row(
        "redeploy: changed train.py -> first step on every rank, 2 pods x 2 torch workers, served with --preload torch, vs torchrun cold start".into(),
        preloaded,
        cold,
        "< 1 s",
    ));
    if let Some(plain) = plain {
        rows.push(time_row(
            "redeploy as above, served without --preload, vs torchrun cold start".into(),
            plain,
            cold,
            "",
        ));
    }
    cold
}

/// Standalone 2-worker job, rank 0 crashes after its first step: crash ->
/// every restarted worker's first step.
fn restart_gap(preload: bool) -> Duration {
    let dir = tempfile::tempdir().expect("tmp");
    let mut c = Command::new(trainlet());
    c.args(["run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]);
    if preload {
        c.args(["--preload", "torch"]);
    }
    c.arg(bench_file(STEP)).env("TRAINLET_PYTHON", python()).env("STEP_DIR", dir.path()).env("CRASH", "1");
    let st = quiet(&mut c).status().expect("trainlet");
    assert!(st.success(), "{st:?}");
    let crash: u128 = std::fs::read_to_string(dir.path().join("crash")).expect("crash").trim().parse().expect("ns");
    since(crash, last_step(dir.path(), "again", 2, Duration::from_secs(5)))
}

/// 2 pods x 2 workers: launch -> every rank's first step; pod 1 `late`.
fn job_start(preload: bool, late: Duration) -> Duration {
    let dir = tempfile::tempdir().expect("tmp");
    let port = free_port();
    let script = bench_file(STEP);
    let mut args = vec![script.as_str()];
    if preload {
        args.splice(0..0, ["--preload", "torch"]);
    }
    let t0 = now_ns();
    let mut first = quiet(trainlet_pod(0, port, &args).env("STEP_DIR", dir.path())).spawn().expect("pod 0");
    std::thread::sleep(late);
    let mut second = quiet(trainlet_pod(1, port, &args).env("STEP_DIR", dir.path())).spawn().expect("pod 1");
    let t1 = last_step(dir.path(), "first", 4, Duration::from_secs(120));
    let _ = (first.wait(), second.wait());
    since(t0, t1)
}

/// Restart and job start with and without `--preload torch`.
pub fn preload(rows: &mut Vec<Row>) {
    let with = median((0..3).map(|_| restart_gap(true)).collect());
    let without = median((0..3).map(|_| restart_gap(false)).collect());
    rows.push(time_row(
        "restart: worker crash -> restarted workers' first step, --preload torch vs without".into(),
        with,
        without,
        ">= 5x",
    ));
    for late in [Duration::ZERO, Duration::from_millis(1500)] {
        let with = median((0..3).map(|_| job_start(true, late)).collect());
        let without = median((0..3).map(|_| job_start(false, late)).collect());
        rows.push(time_row(
            format!(
                "job start -> every rank's first step, 2 pods x 2, pod 1 {} ms late, --preload torch vs without",
                late.as_millis()
            ),
            with,
            without,
            "import overlaps the rendezvous",
        ));
    }
}
