//! JAX, XGBoost and DeepSpeed workers (real `jax`/`jaxlib`, `xgboost` and
//! `deepspeed` from PyPI, on CPU) launched by trainlet from the env
//! Trainer's plugins inject (reference/kubeflow.md 2.2, 2.3), two simulated
//! pods on 127.0.0.1/2.

use std::time::Duration;

use crate::util::{Pod, fixture, free_port, parse_kv, pet_env, python, repo, start_pods_with};

const LIMIT: Duration = Duration::from_secs(300);

/// Two pods with `env(pod index, store port)` and `args`.
fn pods(port: u16, args: &[&str], env: impl Fn(u32, u16) -> Vec<(String, String)>) -> Vec<Pod> {
    start_pods_with(2, args, |i| env(i, port))
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

/// The literal env of the `node` container of runtimes/deepspeed-distributed.yaml,
/// with its failure policy file (a ConfigMap in the cluster) from the repository.
fn deepspeed_runtime_env() -> Vec<(String, String)> {
    let out = std::process::Command::new(python())
        .arg(repo().join("tests/runtime_facts.py"))
        .arg(repo().join("runtimes/deepspeed-distributed.yaml"))
        .output()
        .expect("python");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).expect("json");
    let env = rows[0]["env"].as_object().expect("env");
    assert!(env.contains_key("TRAINLET_POLICY"), "{env:?}");
    env.iter()
        .map(|(k, v)| {
            let v = v.as_str().unwrap_or_default().to_string();
            let v = if k == "TRAINLET_POLICY" {
                repo().join("runtimes/failure-policy.toml").display().to_string()
            } else {
                v
            };
            (k.clone(), v)
        })
        .collect()
}

/// DeepSpeed with no mpirun, launcher or SSH: `deepspeed.init_distributed()`
/// takes trainlet's torchrun env, ZeRO stage 1 trains on CPU (gloo) on 2
/// pods x 2 workers under the runtime's own env, and every rank ends with
/// the same parameters. (DeepSpeed builds its shared-memory op with ninja
/// and g++ on first use: the venv's bin is on PATH for ninja.)
#[test]
fn deepspeed_trains_zero_stage_1_on_two_pods_under_the_runtimes_env() {
    let script = fixture("ds_train.py");
    let venv_bin = std::path::Path::new(&python()).parent().expect("venv bin").display().to_string();
    let path = format!("{venv_bin}:{}", std::env::var("PATH").unwrap_or_default());
    let runtime = deepspeed_runtime_env();
    let port = free_port();
    let mut pods = pods(port, &["run", &script], |i, port| {
        let mut e = pet_env(2, 2, i, port);
        e.extend(runtime.iter().cloned());
        e.push(("DS_ACCELERATOR".into(), "cpu".into()));
        e.push(("PATH".into(), path.clone()));
        e
    });
    let seen = lines(&mut pods, "DEEPSPEED");
    let mut ranks: Vec<u32> = seen.iter().map(|kv| kv["rank"].parse().expect("rank")).collect();
    ranks.sort_unstable();
    assert_eq!(ranks, [0, 1, 2, 3], "{seen:?}");
    for kv in &seen {
        assert_eq!((kv["world"].as_str(), kv["zero_stage"].as_str()), ("4", "1"), "{kv:?}");
        assert_eq!(kv["identical"], "True", "ZeRO-1 keeps every rank's parameters equal: {kv:?}");
        assert_eq!(kv["learned"], "True", "the held-out loss went down: {kv:?}");
    }
}
