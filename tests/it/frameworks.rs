//! JAX and XGBoost workers (real `jax`/`jaxlib` and `xgboost` from PyPI, on
//! CPU) launched by trainlet from the env Trainer's JAX and XGBoost plugins
//! inject (reference/kubeflow.md 2.3), two simulated pods on 127.0.0.1/2.

use std::time::Duration;

use crate::util::{Pod, fixture, free_port, parse_kv};

const LIMIT: Duration = Duration::from_secs(300);

/// Two pods with `env(pod index, store port)` and `args`.
fn pods(port: u16, args: &[&str], env: impl Fn(u32, u16) -> Vec<(String, String)>) -> Vec<Pod> {
    (0..2)
        .map(|i| {
            let mut e = env(i, port);
            e.push(("PET_LOCAL_ADDR".into(), format!("127.0.0.{}", i + 1)));
            let pairs: Vec<(&str, &str)> = e.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            Pod::start(args, &pairs)
        })
        .collect()
}

fn lines(pods: &mut [Pod], tag: &str) -> Vec<std::collections::HashMap<String, String>> {
    let mut out = Vec::new();
    for (i, pod) in pods.iter_mut().enumerate() {
        assert_eq!(pod.code(LIMIT), 0, "pod {i} stderr:\n{}\nstdout:\n{}", pod.stderr(), pod.stdout());
        out.extend(pod.stdout().lines().filter(|l| l.contains(tag)).map(parse_kv));
    }
    out
}

#[test]
fn jax_processes_psum_the_exact_sum_and_a_killed_one_restarts_every_pod() {
    let script = fixture("jax_psum.py");
    let port = free_port();
    let mut pods = pods(
        port,
        &["run", "--max-restarts", "1", "--shutdown-timeout", "3", "--nproc-per-node", "2", &script],
        |i, port| {
            vec![
                ("JAX_COORDINATOR_ADDRESS".into(), format!("127.0.0.1:{port}")),
                ("JAX_NUM_PROCESSES".into(), "2".into()),
                ("JAX_PROCESS_ID".into(), i.to_string()),
                ("FAIL_ID".into(), "3".into()),
            ]
        },
    );
    let seen = lines(&mut pods, "JAXSUM");
    let mut ids: Vec<u32> = seen.iter().map(|kv| kv["id"].parse().expect("id")).collect();
    ids.sort_unstable();
    assert_eq!(ids, [0, 1, 2, 3], "every process finished once: {seen:?}");
    for kv in &seen {
        assert_eq!(kv["n"], "4");
        assert_eq!(kv["sum"], "10", "1+2+3+4 on every process: {kv:?}");
        assert_eq!(kv["restart"], "1", "the job ran again after the kill: {kv:?}");
        // The coordinator is on the store host, not on trainlet's store port.
        assert!(kv["coordinator"].starts_with("127.0.0.1:"), "{kv:?}");
        assert_ne!(kv["coordinator"], format!("127.0.0.1:{port}"), "{kv:?}");
    }
    assert!(pods[1].stdout().contains("process 3 failing on purpose"));
    let err = pods[1].stderr();
    assert!(err.contains("signal 9 (SIGKILL)") && err.contains("restarting every pod's workers"), "{err}");
}

#[test]
fn xgboost_workers_train_the_reference_model_and_a_failure_restarts_with_a_new_tracker() {
    let script = fixture("xgb_train.py");
    let mut pods = pods(
        free_port(),
        &["run", "--max-restarts", "1", "--shutdown-timeout", "3", "--nproc-per-node", "2", &script],
        |i, port| {
            vec![
                ("DMLC_TRACKER_URI".into(), "127.0.0.1".into()),
                ("DMLC_TRACKER_PORT".into(), port.to_string()),
                ("DMLC_TASK_ID".into(), i.to_string()),
                ("DMLC_NUM_WORKER".into(), "2".into()),
                ("FAIL_TASK".into(), "2".into()),
            ]
        },
    );
    let seen = lines(&mut pods, "XGB ");
    let mut tasks: Vec<u32> = seen.iter().map(|kv| kv["task"].parse().expect("task")).collect();
    tasks.sort_unstable();
    assert_eq!(tasks, [0, 1, 2, 3], "DMLC_TASK_ID = pod index x 2 + local rank: {seen:?}");
    let model = &seen[0]["model"];
    for kv in &seen {
        assert_eq!(kv["world"], "4");
        assert_eq!(kv["rank"], kv["task"], "the tracker ranks by task id: {kv:?}");
        assert_eq!(&kv["model"], model, "one model on every worker: {seen:?}");
        assert_eq!(kv["model"], kv["reference"], "equal to single-process training on all the data: {kv:?}");
        assert_eq!(kv["max_diff"], "0", "{kv:?}");
        assert_eq!(kv["restart"], "1", "{kv:?}");
    }
    let host = pods[0].stderr();
    assert_eq!(host.matches("XGBoost tracker listening").count(), 2, "one tracker per round:\n{host}");
    let other = pods[1].stderr();
    assert!(other.contains("waiting for the XGBoost tracker on the store host"), "{other}");
}
