//! No-progress detection with a real torch job (gloo): one rank blocks in
//! a receive nobody sends after step 5 and stops touching its heartbeat
//! file while the other keeps training (tests/fixtures/hang_train.py).

use std::time::Duration;

use crate::util::{Pod, fixture, parse_kv};

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
