//! Real PyTorch (gloo, CPU) workers launched by trainlet.

use std::time::{Duration, Instant};

use crate::util::{Pod, fixture, parse_kv, repo, start_pods};

const LIMIT: Duration = Duration::from_secs(240);

#[test]
fn standalone_ddp_four_workers_end_with_identical_parameters() {
    let script = repo().join("examples/train_ddp.py").display().to_string();
    let mut pod = Pod::start(&["run", "--nproc-per-node", "4", &script, "--steps", "10", "--check"], &[]);
    assert_eq!(pod.code(LIMIT), 0, "stderr:\n{}", pod.stderr());
    let out = pod.stdout();
    assert!(out.contains("[default0]: parameters identical on all 4 ranks: True"), "stdout:\n{out}");
    for r in 0..4 {
        assert!(out.contains(&format!("[default{r}]: rank {r}/4 step 9 loss")), "rank {r} missing:\n{out}");
    }
}

#[test]
fn three_pods_all_reduce_the_exact_sum_on_six_ranks() {
    let script = fixture("all_reduce.py");
    let mut pods = start_pods(3, 2, &["run", &script], &[]);
    let mut seen = Vec::new();
    for (node, pod) in pods.iter_mut().enumerate() {
        assert_eq!(pod.code(LIMIT), 0, "pod {node} stderr:\n{}", pod.stderr());
        for line in pod.stdout().lines().filter(|l| l.contains("ALLREDUCE")) {
            let kv = parse_kv(line);
            assert_eq!(kv["world"], "6", "{line}");
            assert_eq!(kv["sum"], "21", "{line}");
            assert_eq!(kv["ok"], "True", "{line}");
            seen.push(kv["rank"].parse::<u32>().expect("rank"));
        }
    }
    seen.sort_unstable();
    assert_eq!(seen, [0, 1, 2, 3, 4, 5], "every global rank reports exactly once");
}

#[test]
fn a_failure_on_pod_two_restarts_every_pod_with_fresh_keys() {
    let script = fixture("fail_once.py");
    let mut pods = start_pods(3, 2, &["run", "--max-restarts", "1", &script], &[("FAIL_RANK", "4")]);
    let mut attempts = Vec::new();
    for (node, pod) in pods.iter_mut().enumerate() {
        assert_eq!(pod.code(LIMIT), 0, "pod {node} stderr:\n{}", pod.stderr());
        for line in pod.stdout().lines().filter(|l| l.contains("ATTEMPT")) {
            let kv = parse_kv(line);
            assert_eq!(kv["restart_count"], "1", "{line}");
            assert_eq!(kv["stale_keys"], "0", "attempt 1 must not see attempt 0's keys: {line}");
            attempts.push(kv["rank"].clone());
        }
    }
    assert_eq!(attempts.len(), 6, "all six ranks ran attempt 1");
    assert!(pods[2].stdout().contains("rank 4 failing on purpose"));
}

#[test]
fn a_failure_without_restarts_stops_every_pod_and_reports_the_rank() {
    let script = fixture("fail_once.py");
    let started = Instant::now();
    let mut pods = start_pods(3, 2, &["run", &script], &[("FAIL_RANK", "4")]);
    for (node, pod) in pods.iter_mut().enumerate() {
        assert_eq!(pod.code(LIMIT), 3, "pod {node} must pass the worker's code through; stderr:\n{}", pod.stderr());
    }
    // The healthy workers sleep 120 s: only the agents can have stopped them.
    assert!(started.elapsed() < Duration::from_secs(100), "pods took {:?} to stop", started.elapsed());
    for pod in &pods {
        let err = pod.stderr();
        assert!(err.contains("Root Cause (exit code "), "{err}");
        let root = err.split("Root Cause").nth(1).expect("root cause section");
        assert!(root.contains("rank      : 4 (local_rank: 0)"), "{root}");
        assert!(root.contains("exitcode  : 3"), "{root}");
        let path =
            err.lines().find_map(|l| l.strip_prefix("trainlet: failure report written to ")).expect("report path");
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).expect("report")).expect("json");
        assert_eq!(json["exit_code"], 3);
        assert_eq!(json["root_cause"]["rank"], 4);
        assert_eq!(json["root_cause"]["node_rank"], 2);
    }
}

/// The worker's error file reaches the report, and its first line the
/// termination message Kubernetes shows (`TRAINLET_TERMINATION_LOG` here
/// in place of the pod's `/dev/termination-log`).
#[test]
fn the_report_carries_the_workers_error_file() {
    let dir = tempfile::tempdir().expect("tmp");
    let message = dir.path().join("termination-log");
    let env = [("TRAINLET_TERMINATION_LOG", message.to_str().expect("utf-8"))];
    let mut pod = Pod::start(&["run", "--nproc-per-node", "2", &fixture("raise_recorded.py")], &env);
    assert_eq!(pod.code(LIMIT), 1, "a Python exception exits 1; stderr:\n{}", pod.stderr());
    let said = std::fs::read_to_string(&message).expect("the termination message");
    assert!(said.starts_with("worker rank 1 failed with exit code 1"), "{said}");
    assert!(said.contains("ValueError: boom from rank 1") && !said.contains('\n'), "one line: {said}");
    let err = pod.stderr();
    let root = err.split("Root Cause").nth(1).unwrap_or_else(|| panic!("no root cause:\n{err}"));
    assert!(root.contains("rank      : 1 (local_rank: 1)"), "{root}");
    assert!(root.contains("attempt_0/1/error.json"), "{root}");
    assert!(root.contains("ValueError: boom from rank 1"), "{root}");
    assert!(root.contains("Traceback"), "{root}");
}
