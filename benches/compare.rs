//! Side-by-side benchmarks: trainlet against the tool a user would pick
//! instead (torchrun, torch's own libuv TCPStore server), in one run on the
//! same machine, printing ratios. Absolute times on a shared machine are
//! noise; the ratios are the result.
//!
//! Run: `cargo bench --bench compare [-- NAME...]` with torch in `.venv`
//! (or `$TRAINLET_TEST_PYTHON`). NAME filters: overhead, start, rss, store,
//! init, restart, scale, mpi, sshd, pin (GPU pinning against no pinning),
//! hub and s3 (`trainlet init` against huggingface_hub, Python OpenDAL and
//! boto3: `init_bench.rs`), jax, xgboost and report (frameworks against
//! Trainer's way of starting them, and progress reporting's cost:
//! `framework_bench.rs`), redeploy and preload (serve mode against a
//! cold torchrun start, `--preload torch` against none: `serve_bench.rs`),
//! actors (call overhead against the HTTP floor, actor redeploy and
//! recovery against a cold torchrun start: `actor_bench.rs`), torchft
//! (`torchft_bench.rs`), inplace (restarts on the cluster of
//! tests/cluster.sh, only when named: `inplace_bench.rs`), lost (a training
//! pod killed by SIGKILL, its spare's round formed, 4 and 256 pods, as the
//! gate measures it) and gloo_lost (the same with real gloo workers, to
//! their first checkpoint; only when named: `lost_pod_bench.rs`), pods32
//! (the first round and a restart of 32 pods against torchrun's c10d
//! agents; only when named: minutes).
//! `gate` runs a fast subset and checks each ratio against its floor in
//! `benches/floors.toml` (`gate.rs`); `overhead` includes the bare
//! fork/exec/wait floor (`benches/bare.rs`, no agent).
//! `TRAINLET_BENCH_BINARY` names the trainlet binary to measure (the test
//! command gives the release binary and runs the gate built in the test
//! profile: `cargo test --bench compare -- gate`).
//! Results are also written to
//! `target/bench-compare.md`. `mpi` and `sshd` compare against OpenSSH
//! (`mpi_bench.rs`); `pmi` runs MPI without SSH against `mpirun` over
//! OpenSSH and over trainlet's SSH (`pmi_bench.rs`).
//!
//! Every benchmark runs ahead of the machine's other work: the binary
//! starts itself again under `nice -n -10` (root or CAP_SYS_NICE; without,
//! it says so and measures at the default priority), so both sides of
//! every row, and their children, run at that priority. A ratio of two
//! launchers that cross different numbers of process and thread wake-ups
//! is not the same ratio on a loaded machine: each wake-up waits for a CPU
//! that other work holds. With both CPUs kept busy by two shell loops
//! (2026-11-28), at the default priority, trainlet's launch of 1 x
//! /bin/true went from 14 ms idle to 22-36 ms against the bare floor's
//! 3.8-6.1 ms (0.12x-0.17x, floor 0.13x), and an actor call's median from
//! 1.9 ms to 3.6-5.9 ms against its absolute 5 ms goal; at nice -10, in
//! ten gate runs, 0.18x-0.28x and 1.9-3.8 ms. The cluster's pods
//! (`inplace`) are the kubelet's children and keep its priority; all three
//! ways there share it.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[path = "actor_bench.rs"]
mod actor_bench;
#[path = "driver_bench.rs"]
mod driver_bench;
#[path = "framework_bench.rs"]
mod framework_bench;
#[path = "gate.rs"]
mod gate;
#[path = "init_bench.rs"]
mod init_bench;
#[path = "inplace_bench.rs"]
mod inplace_bench;
#[path = "lost_pod_bench.rs"]
mod lost_pod_bench;
#[path = "mpi_bench.rs"]
mod mpi_bench;
#[path = "pmi_bench.rs"]
mod pmi_bench;
#[path = "serve_bench.rs"]
mod serve_bench;
#[path = "stacks_bench.rs"]
mod stacks_bench;
#[path = "stragglers_bench.rs"]
mod stragglers_bench;
#[path = "../tests/support/mod.rs"]
mod support;
#[path = "torchft_bench.rs"]
mod torchft_bench;

use support::{free_port, python};

/// The trainlet binary measured: `TRAINLET_BENCH_BINARY` (the test command
/// sets it to the release binary, the artefact users run, so the gate needs
/// no build of its own in the bench profile), else the one cargo built
/// beside this benchmark.
fn trainlet() -> &'static str {
    static BINARY: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    BINARY.get_or_init(|| {
        let path = std::env::var("TRAINLET_BENCH_BINARY").unwrap_or_else(|_| env!("CARGO_BIN_EXE_trainlet").into());
        assert!(std::path::Path::new(&path).is_file(), "TRAINLET_BENCH_BINARY: no binary at {path}");
        path
    })
}

fn bench_file(name: &str) -> String {
    support::repo().join("benches").join(name).display().to_string()
}

fn quiet(cmd: &mut Command) -> &mut Command {
    cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).env("TRAINLET_LOG", "warn")
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Run the commands concurrently (simulated pods); time until all exit 0.
fn time_pods(cmds: Vec<Command>) -> Duration {
    let start = Instant::now();
    let mut children: Vec<Child> = cmds.into_iter().map(|mut c| quiet(&mut c).spawn().expect("spawn")).collect();
    for c in &mut children {
        let st = c.wait().expect("wait");
        assert!(st.success(), "benchmark command failed: {st:?}");
    }
    start.elapsed()
}

#[derive(Debug)]
struct Row {
    name: String,
    ours: String,
    theirs: String,
    ratio: f64,
    goal: &'static str,
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

/// A row comparing two durations (ratio: reference / trainlet).
fn time_row(name: String, ours: Duration, theirs: Duration, goal: &'static str) -> Row {
    Row { name, ours: ms(ours), theirs: ms(theirs), ratio: theirs.as_secs_f64() / ours.as_secs_f64(), goal }
}

/// `trainlet run --no-python --standalone --nproc-per-node N PROG`.
fn trainlet_job(n: u32, prog: &str) -> Command {
    let mut c = Command::new(trainlet());
    c.args(["run", "--no-python", "--standalone", "--nproc-per-node", &n.to_string(), prog]);
    c
}

/// torchrun (`python -m torch.distributed.run`) with the same arguments.
fn torchrun_job(n: u32, prog: &str) -> Command {
    let mut c = Command::new(python());
    c.args(["-m", "torch.distributed.run", "--no-python", "--standalone", "--nproc-per-node", &n.to_string(), prog]);
    c
}

/// The floor a launcher can reach: `benches/bare.rs`, a minimal launcher
/// that starts the same N processes and waits for them.
fn bare_job(n: u32, prog: &str) -> Command {
    let mut c = Command::new(bare_launcher());
    c.args([&n.to_string(), prog]);
    c
}

/// `benches/bare.rs` built with `rustc -O` (static, as trainlet) into
/// `target/bench-bare/bare`, once per change of its source: the same
/// program whatever profile built this benchmark.
fn bare_launcher() -> &'static PathBuf {
    static BARE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BARE.get_or_init(|| {
        let src = support::repo().join("benches/bare.rs");
        let dir = support::repo().join("target/bench-bare");
        let out = dir.join("bare");
        let fresh = |out: &PathBuf| {
            let modified = |p: &std::path::Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
            modified(out).zip(modified(&src)).is_some_and(|(o, s)| o >= s)
        };
        if !fresh(&out) {
            std::fs::create_dir_all(&dir).expect("target/bench-bare");
            let tmp = dir.join(format!("bare.{}", std::process::id()));
            let st = Command::new(std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into()))
                .args(["--edition", "2024", "-C", "opt-level=3", "-C", "target-feature=+crt-static"])
                .args(["-C", "strip=debuginfo", "-o"])
                .arg(&tmp)
                .arg(&src)
                .status()
                .expect("rustc");
            assert!(st.success(), "rustc {}: {st}", src.display());
            std::fs::rename(&tmp, &out).expect("rename");
        }
        out
    })
}

/// Launcher overhead for `n` x `/bin/true`: trainlet against torchrun and
/// against the bare fork/exec/wait floor, interleaved (`rounds` rounds of
/// one torchrun run and `per_round` runs each of trainlet and bare), medians.
/// Pushes two rows: vs torchrun (ratio torchrun / trainlet), vs bare
/// (ratio bare / trainlet: 0.5x is "within 2x of the floor").
fn launch_rows(rows: &mut Vec<Row>, n: u32, rounds: usize, per_round: usize) {
    let (mut ours, mut theirs, mut floor) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        theirs.push(time_pods(vec![torchrun_job(n, "/bin/true")]));
        for _ in 0..per_round {
            ours.push(time_pods(vec![trainlet_job(n, "/bin/true")]));
            floor.push(time_pods(vec![bare_job(n, "/bin/true")]));
        }
    }
    let (ours, theirs, floor) = (median(ours), median(theirs), median(floor));
    rows.push(time_row(format!("launcher overhead, {n} x /bin/true, vs torchrun"), ours, theirs, ">= 100x"));
    rows.push(time_row(
        format!("launcher overhead, {n} x /bin/true, vs the bare floor (fork/exec/wait, no agent)"),
        ours,
        floor,
        ">= 0.5x (within 2x)",
    ));
}

fn launcher_overhead(rows: &mut Vec<Row>) {
    for n in [1, 8] {
        launch_rows(rows, n, 3, 5);
    }
}

/// Simulated pod `node` of a multi-pod job whose store is on 127.0.0.1:`port`:
/// torchrun with the c10d backend (run id `id`), or trainlet.
fn pod_command(torch: bool, node: u32, port: &str, id: &str) -> Command {
    let mut c;
    if torch {
        c = Command::new(python());
        c.args(["-m", "torch.distributed.run", "--rdzv-backend", "c10d", "--rdzv-id", id]);
        c.args(["--rdzv-endpoint", &format!("127.0.0.1:{port}")]);
    } else {
        c = Command::new(trainlet());
        c.arg("run").env("PET_MASTER_ADDR", "127.0.0.1").env("PET_MASTER_PORT", port);
        c.env("PET_NODE_RANK", node.to_string()).env("TRAINLET_PYTHON", python());
    }
    c
}

fn job_start(rows: &mut Vec<Row>, pods: u32, script: &str) {
    let run = |torch: bool| {
        let port = free_port().to_string();
        let cmds = (0..pods)
            .map(|node| {
                let mut c = pod_command(torch, node, &port, "bench");
                c.args(["--nnodes", &pods.to_string(), "--nproc-per-node", "1", script]);
                c
            })
            .collect();
        time_pods(cmds)
    };
    let ours = median((0..3).map(|_| run(false)).collect());
    let theirs = median((0..3).map(|_| run(true)).collect());
    rows.push(time_row(format!("job start + gloo init, {pods} pods x 1 torch worker"), ours, theirs, ">= 2x"));
}

/// Crash of rank 0 to the restarted workers' first instruction (the last of
/// them), `pods` simulated pods x 1 worker, trainlet vs torchrun c10d,
/// interleaved runs, medians. With `first`, a row for the first round too:
/// the pods' launch to every worker's first instruction.
fn restart_gap(rows: &mut Vec<Row>, pods: u32, (ours_runs, theirs_runs): (usize, usize), first: bool) {
    let now_ns = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let run = |torch: bool| -> (Duration, Duration) {
        let dir = tempfile::tempdir().expect("tmp");
        let port = free_port().to_string();
        let cmds = (0..pods)
            .map(|node| {
                let mut c = pod_command(torch, node, &port, "gap");
                let addr = format!("127.0.{}.{}", node / 250, node % 250 + 1);
                if torch {
                    c.args(["--monitor-interval", "0.1", "--local-addr", &addr]);
                } else {
                    c.env("PET_LOCAL_ADDR", &addr);
                }
                c.env("GAP_DIR", dir.path());
                c.args(["--nnodes", &pods.to_string(), "--nproc-per-node", "1", "--max-restarts", "1"]);
                c.arg(bench_file("restart_gap.py"));
                c
            })
            .collect();
        let launched = now_ns();
        time_pods(cmds);
        let read = |name: &str| -> u128 {
            std::fs::read_to_string(dir.path().join(name)).expect("probe file").trim().parse().expect("ns")
        };
        let crash = read("crash");
        let last = |prefix: &str, from: u128| (0..pods).map(|r| read(&format!("{prefix}_{r}"))).max().unwrap_or(from);
        let span =
            |from: u128, to: u128| Duration::from_nanos(u64::try_from(to.saturating_sub(from)).unwrap_or(u64::MAX));
        (span(launched, last("first", launched)), span(crash, last("start", crash)))
    };
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for i in 0..ours_runs.max(theirs_runs) {
        if i < ours_runs {
            ours.push(run(false));
        }
        if i < theirs_runs {
            theirs.push(run(true));
        }
    }
    let firsts = |v: &[(Duration, Duration)]| median(v.iter().map(|r| r.0).collect());
    let gaps = |v: &[(Duration, Duration)]| median(v.iter().map(|r| r.1).collect());
    if first {
        rows.push(time_row(
            format!("first round: launch -> every worker's first instruction, {pods} pods"),
            firsts(&ours),
            firsts(&theirs),
            "report",
        ));
    }
    rows.push(time_row(
        format!("restart gap: crash -> restarted workers' first instruction, {pods} pods"),
        gaps(&ours),
        gaps(&theirs),
        ">= 20x (< 100 ms)",
    ));
}

/// 1,000 lightweight agents (tasks in this process, each with its own
/// connections) form a round against one store host, then 10 die and the
/// rest re-form. torchrun's design has no in-process equivalent; its
/// heartbeat traffic is computed from reference/torch.md 4.3.
fn rendezvous_scale(rows: &mut Vec<Row>) {
    use trainlet::rendezvous::host::{ServeFn, serve_rounds};
    use trainlet::rendezvous::{Joined, Known, Member, Session, Timing};
    const AGENTS: u32 = 1000;
    const DIE: u32 = 10;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("rt");
    let (form, detect, reform, hb_bytes) = rt.block_on(async {
        let cancel = tokio_util::sync::CancellationToken::new();
        let lp = Arc::new(trainlet::store::StoreLoop::start().expect("loop"));
        let control =
            lp.serve(Some([127, 0, 0, 1].into()), 0, std::sync::Arc::default(), cancel.child_token()).expect("store");
        let addr = control.local_addr();
        let timing = Timing {
            last_call: Duration::from_millis(300),
            heartbeat: Duration::from_millis(250),
            heartbeat_timeout: Duration::from_secs(1),
            lost_grace: Duration::from_millis(500),
        };
        let l2 = Arc::clone(&lp);
        let tok = cancel.child_token();
        let serve: ServeFn =
            Box::new(move || l2.serve(Some([127, 0, 0, 1].into()), 0, std::sync::Arc::default(), tok.child_token()));
        tokio::spawn(serve_rounds(
            trainlet::store::Dial { addr, guard: None },
            "trainlet/scale/j0".into(),
            timing,
            serve,
            // Untied: the deaths measured are those of vanished machines,
            // found by the heartbeat timeout.
            None,
            cancel.child_token(),
        ));
        let endpoint = trainlet::store::Endpoint { host: "127.0.0.1".into(), port: addr.port() };
        let started = Instant::now();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(u32, Instant, Instant)>();
        let mut tasks = Vec::new();
        for i in 0..AGENTS {
            let (endpoint, cancel, tx) = (endpoint.clone(), cancel.child_token(), tx.clone());
            tasks.push(tokio::spawn(async move {
                let me = Member {
                    uid: String::new(),
                    host: format!("agent-{i:04}"),
                    pid: i,
                    node_rank: i,
                    nproc: 1,
                    min_nodes: AGENTS - 100,
                    max_nodes: AGENTS,
                    max_restarts: 0,
                    spares: 0,
                    last_rank: None,
                };
                let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
                let mut s = Session::connect((&endpoint, None), "scale", 0, me, timing, deadline, &cancel)
                    .await
                    .expect("connect");
                let mut known = Known::default();
                let Ok(Joined::Round(r)) = s.next_round(&mut known, deadline).await else { panic!("round") };
                let formed = Instant::now();
                // Run until the round ends (a member dies), then re-form.
                let _end = s.watch_end(r.number).await;
                s.report_stopped(&r, &[]).await.expect("stopped");
                let _ = s.wait_stopped(&r, Duration::from_secs(30)).await.expect("wait");
                s.decide(r.number, trainlet::supervise::policy::Verdict::Regroup).await.expect("decide");
                s.finish_round(r.number).await.expect("finish");
                let Ok(Joined::Round(_)) = s.next_round(&mut known, deadline).await else { panic!("second round") };
                let _ = tx.send((i, formed, Instant::now()));
                s.bye().await;
            }));
        }
        // Wait for the first round, then kill 10 agents.
        let first = loop {
            let c = trainlet::store::Client::connect(addr).await.expect("client");
            let mut c = c;
            let v = c.get("trainlet/scale/j0/r0/members").await.expect("get");
            if !v.is_empty() {
                break Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let form = first - started;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let killed = Instant::now();
        for t in tasks.iter().take(DIE as usize) {
            t.abort();
        }
        // Detection: the store host declares them dead.
        let mut c = trainlet::store::Client::connect(addr).await.expect("client");
        c.wait(&["trainlet/scale/j0/r0/dead".to_string()]).await.expect("dead");
        let detected = Instant::now();
        let mut last = detected;
        for _ in DIE..AGENTS {
            let (_, _, done) = rx.recv().await.expect("agent result");
            last = last.max(done);
        }
        let key = "trainlet/scale/j0/hb/agent-0000#0#00000000";
        let per_hb = 1 + 8 + key.len() + 8 + 4;
        let per_monitor = (8 + key.len()) + (8 + 4);
        let hz = 1.0 / timing.heartbeat.as_secs_f64();
        let hb_bytes = f64::from(AGENTS) * (per_hb + per_monitor) as f64 * hz;
        cancel.cancel();
        (form, detected - killed, last - detected, hb_bytes)
    });
    rows.push(Row {
        name: format!("rendezvous: {AGENTS} agents form a round"),
        ours: ms(form),
        theirs: "n/a".into(),
        ratio: 2.0 / form.as_secs_f64(),
        goal: "< 2 s",
    });
    rows.push(Row {
        name: format!("rendezvous: {DIE} of {AGENTS} die; declared dead (heartbeat timeout 1 s)"),
        ours: ms(detect),
        theirs: "15 s (torch: 5 s x 3)".into(),
        ratio: 15.0 / detect.as_secs_f64(),
        goal: "within the timeout",
    });
    rows.push(Row {
        name: format!("rendezvous: {} survivors re-form after the death verdict (last call 0.3 s)", AGENTS - DIE),
        ours: ms(reform),
        theirs: "n/a".into(),
        ratio: 2.0 / reform.as_secs_f64(),
        goal: "< 2 s",
    });
    // torchrun's design at 1,024 nodes (reference/torch.md 4.3): a 110 KB
    // base64 state, CAS'd (expected + new) by every node every 5 s, and read
    // by every node about once a second.
    let torch_bytes = 1024.0 * (2.0 * 110e3 / 5.0 + 110e3);
    rows.push(Row {
        name: format!(
            "heartbeat traffic at {AGENTS} agents, bytes/s (heartbeat every {:?})",
            Duration::from_millis(250)
        ),
        ours: format!("{:.0} KB/s", hb_bytes / 1e3),
        theirs: format!("{:.0} MB/s", torch_bytes / 1e6),
        ratio: torch_bytes / hb_bytes,
        goal: "O(pods), not O(pods^2)",
    });
}

/// Resident memory of `pid` now, in KiB (0 when gone).
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// A row comparing two resident sizes in KiB (ratio: reference / trainlet).
fn memory_row(name: &str, ours: u64, theirs: u64, goal: &'static str) -> Row {
    Row {
        name: name.to_string(),
        ours: format!("{:.1} MB", ours as f64 / 1024.0),
        theirs: format!("{:.1} MB", theirs as f64 / 1024.0),
        ratio: theirs as f64 / ours as f64,
        goal,
    }
}

fn max_rss_kib(mut cmd: Command) -> u64 {
    let mut child = quiet(&mut cmd).spawn().expect("spawn");
    let mut max = 0;
    while child.try_wait().expect("try_wait").is_none() {
        max = u64::max(max, rss_kib(child.id()));
        std::thread::sleep(Duration::from_millis(20));
    }
    max
}

fn agent_rss(rows: &mut Vec<Row>) {
    let args = ["--no-python", "--standalone", "--nproc-per-node", "4", "/bin/sleep", "3"];
    let mut ours = Command::new(trainlet());
    ours.arg("run").args(args);
    let mut theirs = Command::new(python());
    theirs.args(["-m", "torch.distributed.run"]).args(args);
    let (o, t) = (max_rss_kib(ours), max_rss_kib(theirs));
    rows.push(memory_row("agent resident memory during a run", o, t, "<= 10 MB"));
}

fn start_trainlet_store() -> (Child, u16) {
    let mut child = Command::new(trainlet())
        .args(["store", "--port", "0", "--host", "127.0.0.1"])
        .env("TRAINLET_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("trainlet store");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("port line");
    let port = line.trim().rsplit(':').next().and_then(|p| p.parse().ok()).expect("port");
    (child, port)
}

fn start_torch_store() -> (Child, u16) {
    let mut child = Command::new(python())
        .arg(bench_file("torch_store_server.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("torch store");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("port line");
    (child, line.trim().parse().expect("port"))
}

fn stop(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
}

fn store_throughput(rows: &mut Vec<Row>) {
    let (server, port) = start_trainlet_store();
    let out =
        Command::new(python()).arg(bench_file("store_clients.py")).arg(port.to_string()).output().expect("python");
    stop(server);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    for op in ["set", "get", "add", "check", "multi_get_8"] {
        let (o, t) = (v["trainlet"][op].as_f64().unwrap_or(0.0), v["torch"][op].as_f64().unwrap_or(1.0));
        rows.push(Row {
            name: format!("torch client {op}, one connection"),
            ours: format!("{o:.0} ops/s"),
            theirs: format!("{t:.0} ops/s"),
            ratio: o / t,
            goal: "never slower",
        });
    }
}

/// Longest a store-init run may take before it counts as stalled.
const INIT_CAP: Duration = Duration::from_secs(60);

/// `ranks` simulated workers, each its own connection: connect, VALIDATE +
/// PING, ADD init/, BARRIER; time until the last is released (None: stalled
/// past [`INIT_CAP`]).
async fn store_init(port: u16, ranks: usize, barrier: &str) -> Option<Duration> {
    tokio::time::timeout(INIT_CAP, store_init_uncapped(port, ranks, barrier)).await.ok()
}

async fn store_init_uncapped(port: u16, ranks: usize, barrier: &str) -> Duration {
    let connecting = Arc::new(tokio::sync::Semaphore::new(256));
    let start = Instant::now();
    // A JoinSet aborts every rank task when dropped (e.g. on the cap).
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..ranks {
        let connecting = Arc::clone(&connecting);
        let barrier = barrier.to_string();
        tasks.spawn(async move {
            let permit = connecting.acquire_owned().await.expect("semaphore");
            let mut s = loop {
                match tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
                    Ok(s) => break s,
                    Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
                }
            };
            s.set_nodelay(true).expect("nodelay");
            let mut req = vec![0u8, 0xce, 0xf7, 0x85, 0x3c, 0x0d, 1, 2, 3, 4];
            s.write_all(&req).await.expect("validate");
            let mut echo = [0u8; 4];
            s.read_exact(&mut echo).await.expect("ping");
            drop(permit);
            req.clear();
            req.push(4);
            req.extend_from_slice(&5u64.to_le_bytes());
            req.extend_from_slice(b"init/");
            req.extend_from_slice(&1i64.to_le_bytes());
            s.write_all(&req).await.expect("add");
            let mut n = [0u8; 8];
            s.read_exact(&mut n).await.expect("add reply");
            // torch < 2.12 has no BARRIER query (its server closes the
            // connection): TRAINLET_BENCH_NO_BARRIER=1 stops after ADD.
            if std::env::var_os("TRAINLET_BENCH_NO_BARRIER").is_some() {
                return s;
            }
            req.clear();
            req.push(18);
            req.extend_from_slice(&(barrier.len() as u64).to_le_bytes());
            req.extend_from_slice(barrier.as_bytes());
            req.extend_from_slice(&(ranks as i64).to_le_bytes());
            s.write_all(&req).await.expect("barrier");
            let mut done = [0u8; 1];
            s.read_exact(&mut done).await.expect("barrier reply");
            s
        });
    }
    let mut conns = Vec::with_capacity(ranks);
    while let Some(t) = tasks.join_next().await {
        conns.push(t.expect("rank"));
    }
    let took = start.elapsed();
    drop(conns);
    took
}

/// CPU time (user + system) a process has used so far.
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let ticks: u64 = [11, 12].iter().filter_map(|&i| fields.get(i)?.parse::<u64>().ok()).sum();
    // Linux reports these in USER_HZ, which is 100 on every supported kernel.
    Duration::from_millis(ticks * 10)
}

fn store_init_rows(rows: &mut Vec<Row>) {
    // One thread for the load generator leaves the other core to the server under test.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    for ranks in [1000, 9000] {
        let (mut ours, mut theirs, mut ours_cpu, mut theirs_cpu) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for run in 0..3 {
            for (wall, cpu, start) in [
                (&mut ours, &mut ours_cpu, start_trainlet_store as fn() -> (Child, u16)),
                (&mut theirs, &mut theirs_cpu, start_torch_store as fn() -> (Child, u16)),
            ] {
                let (s, p) = start();
                let before = cpu_time(s.id());
                wall.push(rt.block_on(store_init(p, ranks, &format!("bar{run}"))));
                cpu.push(cpu_time(s.id()).saturating_sub(before));
                stop(s);
            }
        }
        // A stalled run counts as the cap, so the ratio is a lower bound then.
        let show = |v: &[Option<Duration>]| {
            let d = median(v.iter().map(|d| d.unwrap_or(INIT_CAP)).collect());
            let stalled = v.iter().filter(|d| d.is_none()).count();
            let text = if stalled > 0 {
                format!("{} ({stalled} of {} runs stalled > {INIT_CAP:?})", ms(d), v.len())
            } else {
                ms(d)
            };
            (d, text)
        };
        let ((o, ours), (t, theirs)) = (show(&ours), show(&theirs));
        rows.push(Row {
            name: format!("store init, {ranks} ranks (connect, VALIDATE, PING, ADD, BARRIER), wall"),
            ours,
            theirs,
            ratio: t.as_secs_f64() / o.as_secs_f64(),
            goal: if ranks == 9000 { ">= 1.5x" } else { "never slower" },
        });
        let (oc, tc) = (median(ours_cpu), median(theirs_cpu));
        rows.push(Row {
            name: format!("store init, {ranks} ranks, server CPU time"),
            ours: ms(oc),
            theirs: ms(tc),
            ratio: tc.as_secs_f64() / oc.as_secs_f64().max(0.01),
            goal: "",
        });
    }
}

/// What GPU pinning costs a launch: 8 workers on a fake 8-GPU machine
/// (sysfs tree + fake libnvidia-ml, 4 GPUs on each of this machine's CPUs 0
/// and 1, so the binding is applied for real), timed from agent start to
/// exit with `/bin/true` workers, with pinning and pre-flight checks (NVML
/// child included) against `--pin none --preflight none`. Interleaved runs,
/// medians; the difference is the cost.
fn pinning_cost(rows: &mut Vec<Row>) {
    let dir = tempfile::tempdir().expect("tmp");
    let bus = trainlet::gpu::sysfs::fake::DGX_BUS;
    let root = dir.path().join("root");
    trainlet::gpu::sysfs::fake::dgx_on_two_cpus(&root).expect("fake tree");
    let lib = dir.path().join("libnvidia-ml.so.1");
    let built = Command::new("gcc")
        .args(["-shared", "-fPIC", "-O2", "-Wl,-soname,libnvidia-ml.so.1", "-o"])
        .arg(&lib)
        .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/fake_nvml.c"))
        .status()
        .expect("gcc");
    assert!(built.success(), "cannot build the fake NVML");
    let run = |pin: bool| {
        let mut c = Command::new("taskset");
        c.args(["-c", "0,1", trainlet(), "run", "--standalone", "--nproc-per-node", "8"]);
        if !pin {
            c.args(["--pin", "none", "--preflight", "none"]);
        }
        c.args(["--no-python", "/bin/true"])
            .env("TRAINLET_SYSFS_ROOT", &root)
            .env("TRAINLET_NVML_LIB", &lib)
            .env("FAKE_NVML_COUNT", "8")
            .env("FAKE_NVML_BUS", bus.join(","));
        time_pods(vec![c])
    };
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for _ in 0..21 {
        with.push(run(true));
        without.push(run(false));
    }
    let (with, without) = (median(with), median(without));
    let cost = with.saturating_sub(without);
    rows.push(Row {
        name: format!(
            "pinning cost, 8 workers on a fake 8-GPU machine (pin auto + pre-flight with the NVML child vs --pin none): {}",
            ms(cost)
        ),
        ours: ms(with),
        theirs: ms(without),
        ratio: without.as_secs_f64() / with.as_secs_f64(),
        goal: "cost < 20 ms",
    });
}

/// The niceness every benchmark runs at (see the module doc).
const NICE: &str = "-10";
/// Set in the environment of the binary started again under `nice`.
const NICED: &str = "TRAINLET_BENCH_NICED";

/// Replace this process by this binary under `nice -n -10` (the same pid,
/// so whoever waits on it or signals it reaches the measuring run), once:
/// not when [`NICED`] says this is that run. Returns when it measures here,
/// at the default priority: the priority cannot be raised (said on stderr).
fn ahead_of_other_work() {
    if std::env::var_os(NICED).is_some() {
        return;
    }
    // `nice` prints the niceness it ran at.
    let raised = Command::new("nice")
        .args(["-n", NICE, "nice"])
        .stderr(Stdio::null())
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == NICE);
    let exe = std::env::current_exe();
    let (true, Ok(exe)) = (raised, exe) else {
        eprintln!(
            "compare: cannot raise the priority (nice -n {NICE} needs root or CAP_SYS_NICE); measuring at the default priority, where a loaded machine lowers some ratios (benches/compare.rs)"
        );
        return;
    };
    let e = Command::new("nice").args(["-n", NICE]).arg(exe).args(std::env::args_os().skip(1)).env(NICED, NICE).exec();
    eprintln!("compare: cannot start itself again under nice ({e}); measuring at the default priority");
}

fn main() -> std::process::ExitCode {
    ahead_of_other_work();
    let hard = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).map_or(4096, |(_, h)| h);
    let _ = nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, hard, hard);
    let _ = python(); // says what to run when torch is missing
    let wanted: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    // `loadgen PORT RANKS`: drive one running store (for profiling a server).
    if let [mode, port, ranks] = wanted.as_slice()
        && mode == "loadgen"
    {
        // TRAINLET_BENCH_GEN_THREADS: generator threads (default 1; more on big machines).
        let threads = std::env::var("TRAINLET_BENCH_GEN_THREADS").ok().and_then(|t| t.parse().ok()).unwrap_or(1);
        let rt =
            tokio::runtime::Builder::new_multi_thread().worker_threads(threads).enable_all().build().expect("runtime");
        let took = rt.block_on(store_init(port.parse().expect("port"), ranks.parse().expect("ranks"), "bar"));
        println!("{took:?}");
        return std::process::ExitCode::SUCCESS;
    }
    // `gate`: the fast subset, checked against benches/floors.toml.
    if wanted.iter().any(|w| w == "gate") {
        return gate::run();
    }
    // `floors`: benches/floors.toml's records checked, nothing measured.
    if wanted.iter().any(|w| w == "floors") {
        return gate::check_floors();
    }
    let on = |name: &str| wanted.is_empty() || wanted.iter().any(|w| w == name);
    let dir = tempfile::tempdir().expect("tmp");
    let script = dir.path().join("start.py");
    std::fs::write(
        &script,
        "import torch.distributed as d\nd.init_process_group('gloo')\nd.barrier()\nd.destroy_process_group()\n",
    )
    .expect("script");
    let script = script.display().to_string();

    let mut rows = Vec::new();
    let mut shown = 0;
    let mut progress = |rows: &Vec<Row>| {
        for r in &rows[shown..] {
            eprintln!("measured: {} | trainlet {} | reference {} | {:.1}x", r.name, r.ours, r.theirs, r.ratio);
        }
        shown = rows.len();
    };
    if on("overhead") {
        launcher_overhead(&mut rows);
        progress(&rows);
    }
    if on("pin") {
        pinning_cost(&mut rows);
        progress(&rows);
    }
    if on("start") {
        job_start(&mut rows, 2, &script);
        job_start(&mut rows, 4, &script);
        progress(&rows);
    }
    if on("rss") {
        agent_rss(&mut rows);
        progress(&rows);
    }
    if on("store") {
        store_throughput(&mut rows);
        progress(&rows);
    }
    if on("init") {
        store_init_rows(&mut rows);
        progress(&rows);
    }
    if on("redeploy") {
        serve_bench::redeploy(&mut rows, (5, 3, 3));
    }
    if on("preload") {
        serve_bench::preload(&mut rows);
    }
    if on("stacks") {
        stacks_bench::gather(&mut rows, 5);
        progress(&rows);
    }
    if on("stragglers") {
        stragglers_bench::cost(&mut rows, 3);
        progress(&rows);
    }
    if on("actors") {
        actor_bench::actors(&mut rows);
        progress(&rows);
    }
    if on("restart") {
        restart_gap(&mut rows, 2, (5, 3), false);
        restart_gap(&mut rows, 4, (5, 3), false);
        progress(&rows);
    }
    if on("scale") {
        rendezvous_scale(&mut rows);
        progress(&rows);
    }
    // Only by name (minutes: every torchrun agent imports torch): the
    // largest job of torchrun's c10d agents this machine runs, side by side.
    if wanted.iter().any(|w| w == "pods32") {
        restart_gap(&mut rows, 32, (1, 1), true);
        progress(&rows);
    }
    // A lost pod as the gate measures it (its floors' records are runs of this).
    if on("lost") {
        lost_pod_bench::sigkill(&mut rows, 4, 3, Duration::from_secs(1));
        lost_pod_bench::sigkill(&mut rows, 256, 1, Duration::from_millis(1500));
        progress(&rows);
    }
    if on("gloo_lost") {
        lost_pod_bench::gloo_checkpoint(&mut rows, 3);
        progress(&rows);
    }
    if on("hub") {
        init_bench::hub(&mut rows);
        progress(&rows);
    }
    if on("s3") {
        init_bench::s3(&mut rows);
        progress(&rows);
    }
    if on("jax") {
        framework_bench::jax(&mut rows);
        progress(&rows);
    }
    if on("xgboost") {
        framework_bench::xgboost(&mut rows);
        progress(&rows);
    }
    if on("report") {
        framework_bench::report(&mut rows);
        progress(&rows);
    }
    if on("mpi") {
        mpi_bench::launch(&mut rows);
        progress(&rows);
    }
    if on("pmi") {
        pmi_bench::start(&mut rows, 5);
        pmi_bench::exchange(&mut rows, &[64, 256], 1);
        progress(&rows);
    }
    if on("sshd") {
        mpi_bench::idle_rss(&mut rows);
        progress(&rows);
    }
    if on("torchft") {
        torchft_bench::survivors(&mut rows);
        progress(&rows);
    }
    // Only by name: these need the cluster of tests/cluster.sh.
    if wanted.iter().any(|w| w == "driver") {
        driver_bench::start(&mut rows, 3);
        progress(&rows);
    }
    if wanted.iter().any(|w| w == "inplace") {
        inplace_bench::restarts(&mut rows, 3, true);
        progress(&rows);
    }
    let mut table = String::from(
        "| benchmark | trainlet | reference | ratio (reference/trainlet; throughput: trainlet/reference) | goal |\n|---|---|---|---|---|\n",
    );
    for r in &rows {
        table.push_str(&format!("| {} | {} | {} | {:.1}x | {} |\n", r.name, r.ours, r.theirs, r.ratio, r.goal));
    }
    print!("{table}");
    let out = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/bench-compare.md");
    if let Ok(mut f) = std::fs::File::create(&out) {
        let _ = f.write_all(table.as_bytes());
    }
    let _ = std::io::stdout().flush();
    let _ = std::io::stdin().read(&mut []);
    std::process::ExitCode::SUCCESS
}
