//! No-progress detection with a real torch job (gloo): one rank blocks in
//! a receive nobody sends after step 5 and stops touching its heartbeat
//! file while the other keeps training (tests/fixtures/hang_train.py).

use std::time::Duration;

use crate::util::{Pod, fixture, line_of, parse_kv, repo};

const LIMIT: Duration = Duration::from_secs(240);

fn run(args: &[&str], ckpt: &std::path::Path) -> Pod {
    let script = fixture("hang_train.py");
    let ckpt = ckpt.display().to_string();
    let env = [("CKPT_DIR", ckpt.as_str()), ("HANG_RANK", "1"), ("HANG_STEP", "5"), ("STEPS", "40")];
    let mut all = vec!["run", "--nproc-per-node", "2", "--progress-timeout", "3", "--shutdown-timeout", "3"];
    all.extend_from_slice(args);
    all.push(&script);
    Pod::start(&all, &env)
}

#[test]
fn a_rank_stuck_in_a_collective_restarts_the_job_from_its_checkpoint() {
    let ckpt = tempfile::tempdir().expect("tmp");
    let mut pod = run(&["--max-restarts", "1"], ckpt.path());
    assert_eq!(pod.code(LIMIT), 0, "{}", pod.stderr());
    let out = pod.stdout();
    assert!(out.contains("rank 1 stuck at step 5"), "{out}");
    let done: Vec<_> = out.lines().filter(|l| l.contains("HANG done")).map(parse_kv).collect();
    assert_eq!(done.len(), 2, "{out}");
    for kv in &done {
        assert_eq!((kv["restart"].as_str(), kv["sum"].as_str()), ("1", "3"), "{kv:?}");
    }
    let rank1 = done.iter().find(|kv| kv["rank"] == "1").expect("rank 1");
    assert_eq!(rank1["start"], "5", "rank 1 resumed from its checkpoint: {rank1:?}");
    let err = pod.stderr();
    let line = err.lines().find(|l| l.contains("reported no progress past --progress-timeout")).expect(&err);
    assert!(line.contains("ranks=[1]"), "only the stuck rank is named: {line}");
    assert!(err.contains("failed_rank=1") && err.contains("restarting every pod's workers"), "{err}");
}

#[test]
fn with_no_restarts_left_the_job_exits_206_and_the_report_names_the_rank() {
    let ckpt = tempfile::tempdir().expect("tmp");
    let logs = tempfile::tempdir().expect("tmp");
    let log_dir = logs.path().display().to_string();
    let mut pod = run(&["--max-restarts", "0", "--log-dir", &log_dir], ckpt.path());
    assert_eq!(pod.code(LIMIT), 206, "{}", pod.stderr());
    let run_dir = std::fs::read_dir(logs.path()).expect("logs").next().expect("run dir").expect("entry").path();
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("failure_report.json")).expect("report"))
            .expect("json");
    assert_eq!(report["exit_code"], 206, "{report:#}");
    assert_eq!(report["root_cause"]["rank"], 1, "{report:#}");
    assert_eq!(report["root_cause"]["no_progress"], true, "{report:#}");
    let msg = report["root_cause"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("no progress") && msg.contains("--progress-timeout"), "{msg}");
    assert!(pod.stderr().contains("(no progress)"), "the summary says why: {}", pod.stderr());
}

/// The failure report under `dir` (one run directory).
fn report_in(dir: &std::path::Path) -> serde_json::Value {
    let run_dir = std::fs::read_dir(dir).expect("logs").next().expect("run dir").expect("entry").path();
    let text = std::fs::read_to_string(run_dir.join("failure_report.json")).expect("report");
    serde_json::from_str(&text).expect("json")
}

/// What a stall report says, the short facts first (a failure's message
/// may be cut): its verdict, then each rank's read and dump.
fn gist(report: &serde_json::Value) -> String {
    let mut s = format!("stall: {}\nstalled_ranks: {}\n", report["stall"], report["stalled_ranks"]);
    for r in report["stacks"].as_array().into_iter().flatten() {
        let p = &r["stacks"];
        let g = &r["flight"]["groups"][0];
        s += &format!(
            "rank {}: took_ms {} unread {} note {} | flight seq {} op {} done {} note {}\n",
            r["rank"], p["took_ms"], p["unread"], p["note"], g["seq"], g["op"], g["done"], r["flight"]["note"]
        );
    }
    s
}

/// Pods of `nproc` workers running tests/fixtures/stall_job.py, where rank
/// `stall` stalls by `how`; each pod with a log directory and a
/// termination message file of its own.
fn stall_job(nnodes: u32, nproc: u32, stall: u32, how: &str) -> (Vec<Pod>, Vec<tempfile::TempDir>) {
    stall_job_with(nnodes, nproc, stall, how, |_, _| Vec::new())
}

/// [`stall_job`] with more environment for each pod (given its node rank
/// and directory).
fn stall_job_with(
    nnodes: u32,
    nproc: u32,
    stall: u32,
    how: &str,
    extra: impl Fn(u32, &std::path::Path) -> Vec<(String, String)>,
) -> (Vec<Pod>, Vec<tempfile::TempDir>) {
    let dirs: Vec<tempfile::TempDir> = (0..nnodes).map(|_| tempfile::tempdir().expect("tmp")).collect();
    let port = crate::util::free_port();
    let script = fixture("stall_job.py");
    let pods = (0..nnodes)
        .map(|i| {
            let dir = dirs[i as usize].path();
            let mut env = crate::util::pet_env(nnodes, nproc, i, port);
            env.push(("PET_LOCAL_ADDR".into(), format!("127.0.0.{}", i + 1)));
            env.push(("STALL_RANK".into(), stall.to_string()));
            env.push(("STALL_HOW".into(), how.into()));
            env.push(("TRAINLET_TERMINATION_LOG".into(), dir.join("termination-log").display().to_string()));
            env.extend(extra(i, dir));
            let pairs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            let logs = dir.join("logs").display().to_string();
            let args = ["run", "--progress-timeout", "3", "--max-restarts", "0", "--log-dir", &logs, &script];
            Pod::start(&args, &pairs)
        })
        .collect();
    (pods, dirs)
}

/// 2 pods x 2 workers over gloo, no hook in the user's code: rank 2 sleeps
/// in a function of its own while the other three wait in all_reduce. The
/// job ends 206, and every pod's report, log and termination message name
/// rank 2 with the file:line of its sleep; the others are in all_reduce.
#[test]
fn a_rank_outside_the_collective_is_named_with_where_it_stalled() {
    let (mut pods, dirs) = stall_job(2, 2, 2, "sleep");
    pods[1].wait_for_output("STALL rank=2", LIMIT);
    let stalled_at = std::time::Instant::now();
    for pod in &mut pods {
        assert_eq!(pod.code(LIMIT), 206, "{}", pod.stderr());
    }
    // --progress-timeout 3 plus 5 s, with room for a busy machine.
    let took = stalled_at.elapsed();
    assert!(took < Duration::from_secs(20), "the hang took {took:?} to end the job");
    let want = format!(
        "rank 2 is not in the all_reduce the other 3 wait in: stall_job.py:{} in stall_here",
        line_of("stall_job.py", "STALL_LINE_SLEEP")
    );
    for (pod, dir) in pods.iter().zip(&dirs) {
        let report = report_in(&dir.path().join("logs"));
        assert_eq!(report["stalled_ranks"], serde_json::json!([2]), "{}\n{report:#}", gist(&report));
        assert_eq!(report["stall"], want.as_str(), "{}\n{report:#}", gist(&report));
        assert_eq!(report["root_cause"]["stall"], want.as_str(), "{report:#}");
        let stacks = report["stacks"].as_array().expect("stacks");
        let ranks: Vec<u64> = stacks.iter().filter_map(|r| r["rank"].as_u64()).collect();
        assert_eq!(ranks, [0, 1, 2, 3], "{report:#}");
        for r in stacks {
            let main = &r["stacks"]["threads"][0];
            let functions: Vec<&str> =
                main["python"].as_array().expect("frames").iter().filter_map(|f| f["function"].as_str()).collect();
            let innermost = if r["rank"] == 2 { "stall_here" } else { "all_reduce" };
            assert!(functions.contains(&innermost), "rank {}: {functions:?}", r["rank"]);
        }
        let message = std::fs::read_to_string(dir.path().join("termination-log")).expect("termination message");
        assert!(message.ends_with(&want) && message.contains("(exit 206)"), "{message}");
        assert!(pod.stderr().contains(&format!("the job hung: {want}")), "{}", pod.stderr());
    }
}

/// PyTorch's Flight Recorder at a hang: the agents set `exception_dump` in
/// the worker store, each worker's NCCL monitor dumps its recorder, and the
/// dumps' sequence numbers name the rank that never entered the collective
/// the others wait in. NCCL needs a GPU, so the monitor is a test double
/// (tests/fixtures/nccl_monitor_double: a thread named as NCCL's that polls
/// the real store key through torch's own TCPStore client, then has torch
/// write the real recorder of its gloo group, in NCCL's format, where
/// NCCL's would go); trainlet's side, the store, the dumps and torch are
/// real. tests/gpu/nccl_flight.sh runs the same job with NCCL on a GPU.
#[test]
fn the_flight_recorders_dumps_name_the_rank_that_never_entered_the_collective() {
    // Pod 0's workers name their dump file; pod 1's write where torch does
    // by default (its cache directory in HOME).
    let (mut pods, dirs) = flight_job(|node, dir| match node {
        0 => ("TORCH_FR_DUMP_TEMP_FILE".into(), dir.join("fr_").display().to_string()),
        _ => ("HOME".into(), dir.display().to_string()),
    });
    check_flight_verdict(&mut pods, &dirs, |node| if node == 0 { "fr_" } else { ".cache/torch/comm_lib_trace_rank_" });
}

/// A pod that hears the hang late still reads its workers' dumps. The key
/// that asks for them is the job's, so every worker dumps at the first
/// pod's ask; a pod whose stacks came in last, or past the others' wait,
/// asks after its own workers dumped, and takes the dumps written since
/// its round began. The schedule: pod 1's agent is stopped (SIGSTOP) from
/// rank 2's stall until its workers have dumped at pod 0's ask and 1.5 s
/// more have passed, then resumed, inside pod 0's wait for its dumps. A
/// pod that took only dumps written since its own ask (less 1 s for the
/// file system's clock) found none and named no rank from them.
#[test]
fn a_pod_that_hears_the_hang_late_still_reads_its_workers_dumps() {
    let (mut pods, dirs) =
        flight_job(|_, dir| ("TORCH_FR_DUMP_TEMP_FILE".into(), dir.join("fr_").display().to_string()));
    pods[1].wait_for_output("STALL rank=2", LIMIT);
    pods[1].signal(nix::sys::signal::Signal::SIGSTOP);
    pods[0].wait_for_stderr("read the workers' Flight Recorder dumps", LIMIT);
    let dumps = [dirs[1].path().join("fr_2"), dirs[1].path().join("fr_3")];
    let asked = std::time::Instant::now();
    while !dumps.iter().all(|d| d.exists()) {
        assert!(asked.elapsed() < LIMIT, "pod 1's workers never dumped at pod 0's ask: {}", pods[0].stderr());
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(1500));
    pods[1].signal(nix::sys::signal::Signal::SIGCONT);
    check_flight_verdict(&mut pods, &dirs, |_| "fr_");
}

/// [`stall_job`] with rank 2 stalled by a sleep and the NCCL monitor
/// double in every worker, polling every 200 ms; `place` says where each
/// pod's workers dump (a variable and its value, given the node rank and
/// the pod's directory).
fn flight_job(place: impl Fn(u32, &std::path::Path) -> (String, String)) -> (Vec<Pod>, Vec<tempfile::TempDir>) {
    let double = repo().join("tests/fixtures/nccl_monitor_double").display().to_string();
    stall_job_with(2, 2, 2, "sleep", |node, dir| {
        vec![
            ("PYTHONPATH".into(), double.clone()),
            ("TORCH_NCCL_COORD_CHECK_MILSEC".into(), "200".into()),
            place(node, dir),
        ]
    })
}

/// Every pod of a [`flight_job`] ends 206, and its report and log name
/// rank 2 from the dumps (its last collective done, the others' one
/// further and waiting), whose files are in the pod's directory under
/// `prefix(node)` plus the rank.
fn check_flight_verdict(pods: &mut [Pod], dirs: &[tempfile::TempDir], prefix: impl Fn(usize) -> &'static str) {
    for pod in pods.iter_mut() {
        assert_eq!(pod.code(LIMIT), 206, "{}", pod.stderr());
    }
    let want = format!(
        "rank 2 never entered all_reduce #{} of default_pg (Flight Recorder), which the other 3 wait in: stall_job.py:{} in stall_here",
        // Step s's all_reduce is collective s + 1; rank 2 stalls at step 3.
        3 + 1,
        line_of("stall_job.py", "STALL_LINE_SLEEP")
    );
    for (node, (pod, dir)) in pods.iter().zip(dirs).enumerate() {
        let report = report_in(&dir.path().join("logs"));
        let said = format!(
            "{}\n{report:#}\n--- the pods' output:\n{}",
            gist(&report),
            pods.iter().map(|p| p.stdout() + &p.stderr()).collect::<String>()
        );
        assert_eq!(report["stalled_ranks"], serde_json::json!([2]), "{said}");
        assert_eq!(report["stall"], want.as_str(), "{said}");
        for r in report["stacks"].as_array().expect("stacks") {
            let group = &r["flight"]["groups"][0];
            assert_eq!(group["pg"], "default_pg", "{r:#}");
            let (seq, done) = if r["rank"] == 2 { (3, true) } else { (4, false) };
            assert_eq!(
                (group["seq"].as_u64(), group["op"].as_str(), group["done"].as_bool()),
                (Some(seq), Some("all_reduce"), Some(done)),
                "{r:#}"
            );
        }
        let err = pod.stderr();
        assert!(err.contains("waiting for the workers' Flight Recorder dumps"), "{err}");
        assert!(err.contains(&format!("the job hung: {want}")), "{err}");
        for f in [format!("{}{}", prefix(node), node * 2), format!("{}{}", prefix(node), node * 2 + 1)] {
            assert!(dir.path().join(&f).exists(), "no dump {f} on pod {node}");
        }
    }
}

/// A rank blocked in C (libc's sleep through ctypes): its Python frame is
/// the call's line and its native frames show the system call it is in.
#[test]
fn a_rank_blocked_in_c_shows_its_native_frames() {
    let (mut pods, dirs) = stall_job(1, 2, 1, "ctypes");
    assert_eq!(pods[0].code(LIMIT), 206, "{}", pods[0].stderr());
    let report = report_in(&dirs[0].path().join("logs"));
    assert_eq!(report["stalled_ranks"], serde_json::json!([1]), "{report:#}");
    let rank1 = report["stacks"].as_array().expect("stacks").iter().find(|r| r["rank"] == 1).expect("rank 1").clone();
    let main = &rank1["stacks"]["threads"][0];
    assert_eq!(main["python"][0]["function"], "stall_here", "{rank1:#}");
    assert_eq!(main["python"][0]["line"], line_of("stall_job.py", "STALL_LINE_CTYPES"), "{rank1:#}");
    assert_eq!(main["kernel"], "blocked in system call clock_nanosleep", "{rank1:#}");
    let native = main["native"][0]["function"].as_str().unwrap_or_default();
    assert!(native.contains("nanosleep"), "{rank1:#}");
}

/// A worker that is not Python (a shell and its sleep): the job still ends
/// 206 and the report says there is no Python stack, for that rank.
#[test]
fn a_worker_that_is_not_python_has_no_python_stack() {
    let logs = tempfile::tempdir().expect("tmp");
    let log_dir = logs.path().display().to_string();
    let script = "touch \"$TRAINLET_HEARTBEAT_FILE\"; sleep 600";
    let args = [
        "run",
        "--progress-timeout",
        "2",
        "--max-restarts",
        "0",
        "--log-dir",
        &log_dir,
        "--no-python",
        "bash",
        "-c",
        script,
    ];
    let mut pod = Pod::start(&args, &[]);
    assert_eq!(pod.code(LIMIT), 206, "{}", pod.stderr());
    let report = report_in(logs.path());
    assert_eq!(
        report["stacks"][0]["stacks"]["note"], "no Python stack: the process runs no CPython interpreter",
        "{report:#}"
    );
    assert_eq!(report["stall"], "no rank's Python stack could be read; no Python stack from rank 0", "{report:#}");
}

/// `trainlet stacks` from another process of the container (as `kubectl
/// exec` runs it) reads a running job's workers through their agent: every
/// rank, its Python frames and a blocked thread's native ones.
#[test]
fn trainlet_stacks_reads_a_running_jobs_workers_through_their_agent() {
    let script = fixture("stall_job.py");
    let args = ["run", "--nproc-per-node", "2", "--progress-timeout", "120", &script];
    let mut pod = Pod::start(&args, &[("STALL_RANK", "-1")]);
    let until = std::time::Instant::now() + LIMIT;
    let ranks = loop {
        let out = std::process::Command::new(crate::util::bin())
            .args(["stacks", "--json"])
            .output()
            .expect("trainlet stacks");
        let all: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap_or_default();
        let in_job = |r: &serde_json::Value| {
            r["stacks"]["threads"][0]["python"]
                .as_array()
                .is_some_and(|f| f.iter().any(|f| f["file"].as_str().is_some_and(|p| p.ends_with("stall_job.py"))))
        };
        let mine: Vec<serde_json::Value> = all
            .into_iter()
            .filter(|r| r["stacks"]["pid"].as_i64().is_some_and(|p| crate::util::parent_is(p, pod.pid())))
            .collect();
        if mine.len() == 2 && mine.iter().all(in_job) {
            break mine;
        }
        assert!(std::time::Instant::now() < until, "{}\n{}", String::from_utf8_lossy(&out.stderr), pod.stderr());
        std::thread::sleep(Duration::from_millis(500));
    };
    assert_eq!(ranks.iter().map(|r| r["rank"].as_u64()).collect::<Vec<_>>(), [Some(0), Some(1)]);
    // Other tests' agents answer too, and a read under load may be cut at
    // its bound: read again until this job's frames show, as above.
    loop {
        let text = std::process::Command::new(crate::util::bin()).arg("stacks").output().expect("trainlet stacks");
        let text = String::from_utf8_lossy(&text.stdout).to_string();
        if text.contains("rank 0 (local rank 0") && text.contains("stall_job.py:") {
            break;
        }
        assert!(std::time::Instant::now() < until, "{text}");
        std::thread::sleep(Duration::from_millis(500));
    }
    pod.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(pod.code(LIMIT), 143);
}
