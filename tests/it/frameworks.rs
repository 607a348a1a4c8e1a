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
    assert!(!host.contains("killed leftover processes"), "the killed tracker is not a worker's leftover:\n{host}");
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
    assert!(env.contains_key("TRAINLET_POLICY_IF_PRESENT"), "{env:?}");
    env.iter()
        .map(|(k, v)| {
            let v = v.as_str().unwrap_or_default().to_string();
            let v = if k == "TRAINLET_POLICY_IF_PRESENT" {
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
/// and g++ on first use: the venv's bin is on PATH for ninja. It is built
/// before the pods start, by [`deepspeed_op_dir`]: the cluster test
/// compiles it in the pods.)
#[test]
fn deepspeed_trains_zero_stage_1_on_two_pods_under_the_runtimes_env() {
    let script = fixture("ds_train.py");
    let venv_bin = std::path::Path::new(&python()).parent().expect("venv bin").display().to_string();
    let path = format!("{venv_bin}:{}", std::env::var("PATH").unwrap_or_default());
    let ops = deepspeed_op_dir(&path);
    let runtime = deepspeed_runtime_env();
    let port = free_port();
    let mut pods = pods(port, &["run", &script], |i, port| {
        let mut e = pet_env(2, 2, i, port);
        e.extend(runtime.iter().cloned());
        e.push(("DS_ACCELERATOR".into(), "cpu".into()));
        e.push(("PATH".into(), path.clone()));
        e.push(("TORCH_EXTENSIONS_DIR".into(), ops.clone()));
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

/// Where DeepSpeed's shared-memory op is built (target/torch-extensions),
/// once, by one process (tests/fixtures/ds_build_op.py), with `path` for
/// ninja: compiled on first use in the pods, it took 250 s of the pods'
/// 300 s on a loaded 2-core machine with a cold cache, and a pod killed at
/// the bound left torch's build lock behind, on which every later run
/// waited. Seconds once built.
fn deepspeed_op_dir(path: &str) -> String {
    let dir = repo().join("target/torch-extensions").display().to_string();
    let script = fixture("ds_build_op.py");
    let mut build =
        Pod::start_as(std::path::Path::new(&python()), &[&script, &dir], &[("DS_ACCELERATOR", "cpu"), ("PATH", path)]);
    let code = build.code(Duration::from_secs(900));
    assert_eq!(code, 0, "DeepSpeed's op did not build:\n{}\n{}", build.stdout(), build.stderr());
    dir
}

/// The TrainJob command the Kubeflow SDK's own code makes for
/// `CustomTrainer(func=sdk_train.<function>)` on `runtime` (with
/// `packages_to_install`), and the SDK version that made it.
pub(crate) fn sdk_command(runtime: &str, function: &str, packages: &[&str]) -> (Vec<String>, String) {
    let out = std::process::Command::new(python())
        .arg(repo().join("tests/fixtures/sdk_command.py"))
        .arg(repo().join("runtimes").join(runtime))
        .arg(function)
        .args(packages)
        .output()
        .expect("python");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert!(v["args"].is_null(), "the SDK sets command, never args: {v}");
    let command: Vec<String> = serde_json::from_value(v["command"].clone()).expect("command");
    (command, v["sdk"].as_str().unwrap_or_default().to_string())
}

/// The runtime's literal env for its `node` container (the failure policy
/// file, a ConfigMap in the cluster, from the repository).
fn runtime_env(runtime: &str) -> Vec<(String, String)> {
    let out = std::process::Command::new(python())
        .arg(repo().join("tests/runtime_facts.py"))
        .arg(repo().join("runtimes").join(runtime))
        .output()
        .expect("python");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).expect("json");
    let env = rows[0]["env"].as_object().expect("env");
    env.iter()
        .map(|(k, v)| match k.as_str() {
            "TRAINLET_POLICY_IF_PRESENT" => {
                (k.clone(), repo().join("runtimes/failure-policy.toml").display().to_string())
            }
            _ => (k.clone(), v.as_str().unwrap_or_default().to_string()),
        })
        .collect()
}

/// Two pods that run the SDK's `command` as a container with trainlet's JAX
/// or XGBoost image would: `python` and `python3` on PATH first are links
/// to trainlet (images/*-runtime.Dockerfile), then the interpreter's
/// directory; each pod in its own working directory (the SDK writes its
/// script there); `env(pod)` is what Trainer's policy and the runtime give.
struct SdkPods {
    pods: Vec<Pod>,
    _dirs: Vec<tempfile::TempDir>,
}

fn sdk_pods(command: &[String], env: impl Fn(u32) -> Vec<(String, String)>) -> SdkPods {
    let links = tempfile::tempdir().expect("tmp");
    // As in trainlet's images: `torchrun` too (the torch runtime's command).
    for name in ["python", "python3", "torchrun"] {
        std::os::unix::fs::symlink(crate::util::bin(), links.path().join(name)).expect("link");
    }
    let venv_bin = std::path::Path::new(&python()).parent().expect("venv bin").display().to_string();
    let path = format!("{}:{venv_bin}:/usr/local/bin:/usr/bin:/bin", links.path().display());
    let mut dirs = vec![links];
    let pods = (0..2)
        .map(|i| {
            let work = tempfile::tempdir().expect("tmp");
            // `env -C` stands for the container's working directory; the
            // command after it is the SDK's, word for word.
            let mut argv = vec!["-C".to_string(), work.path().display().to_string()];
            argv.extend(command.iter().cloned());
            let mut e = env(i);
            e.extend([
                ("PATH".to_string(), path.clone()),
                // The image sets no TRAINLET_PYTHON: the interpreter is found on PATH past the links.
                ("TRAINLET_PYTHON".to_string(), String::new()),
                ("PET_LOCAL_ADDR".to_string(), format!("127.0.0.{}", i + 1)),
            ]);
            dirs.push(work);
            let pairs: Vec<(&str, &str)> = e.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            let args: Vec<&str> = argv.iter().map(String::as_str).collect();
            Pod::start_as(std::path::Path::new("/usr/bin/env"), &args, &pairs)
        })
        .collect();
    SdkPods { pods, _dirs: dirs }
}

fn jax_env(port: u16) -> impl Fn(u32) -> Vec<(String, String)> {
    move |i| {
        let mut e = runtime_env("jax-distributed.yaml");
        e.extend([
            ("JAX_COORDINATOR_ADDRESS".into(), format!("127.0.0.1:{port}")),
            ("JAX_NUM_PROCESSES".into(), "2".into()),
            ("JAX_PROCESS_ID".into(), i.to_string()),
            ("PET_NPROC_PER_NODE".into(), "2".into()),
        ]);
        e
    }
}

/// The Kubeflow SDK's command for the JAX runtime, unchanged (`bash -c
/// "<pip install>; ...; python "sdk_train.py""`), on 2 pods x 2: the
/// `pip` calls run as plain python, the entry runs under `trainlet run`
/// (store, per-round coordinator, JAX_* per process), and a python a
/// worker starts by name is the real interpreter.
#[test]
fn the_sdks_jax_command_runs_unchanged_under_trainlet() {
    let (command, sdk) = sdk_command("jax-distributed.yaml", "train_jax", &["numpy"]);
    assert_eq!(&command[..2], ["bash", "-c"], "SDK {sdk}: {command:?}");
    assert!(command[2].trim_end().ends_with("python \"sdk_train.py\""), "SDK {sdk}: {}", command[2]);
    let mut job = sdk_pods(&command, jax_env(free_port()));
    let seen = lines(&mut job.pods, "SDKJAX");
    let mut ids: Vec<u32> = seen.iter().map(|kv| kv["id"].parse().expect("id")).collect();
    ids.sort_unstable();
    assert_eq!(ids, [0, 1, 2, 3], "2 pods x 2 processes (SDK {sdk}): {seen:?}");
    for kv in &seen {
        assert_eq!((kv["n"].as_str(), kv["sum"].as_str()), ("4", "10"), "{kv:?}");
        assert_eq!(kv["exe"], python(), "workers run the real interpreter: {kv:?}");
        assert_eq!(kv["nested"], python(), "a worker's `python` is the real one: {kv:?}");
        assert!(!kv["agent"].is_empty(), "{kv:?}");
    }
    for (i, pod) in job.pods.iter().enumerate() {
        let (out, err) = (pod.stdout(), pod.stderr());
        assert!(
            out.contains("Successfully installed Python packages"),
            "pip ran as plain python on pod {i}:\n{out}\n{err}"
        );
        assert!(err.contains("python sdk_train.py is this jax pod's entry: running it as trainlet run"), "{err}");
        assert!(err.contains("starting workers") && err.contains("world_size=4"), "pod {i}:\n{err}");
    }
}

/// The Kubeflow SDK's command for the XGBoost runtime, unchanged, on 2 pods
/// x 2: trainlet runs the tracker (without it every worker fails after
/// 6 s), the model equals single-process training, and the tracker ends
/// as trainlet's helper, never swept as a worker's leftover.
#[test]
fn the_sdks_xgboost_command_runs_unchanged_under_trainlet_with_its_tracker() {
    let (command, sdk) = sdk_command("xgboost-distributed.yaml", "train_xgboost", &[]);
    assert!(command[2].trim_end().ends_with("python \"sdk_train.py\""), "SDK {sdk}: {}", command[2]);
    let port = free_port();
    let mut job = sdk_pods(&command, |i| {
        let mut e = runtime_env("xgboost-distributed.yaml");
        e.extend([
            ("DMLC_TRACKER_URI".into(), "127.0.0.1".into()),
            ("DMLC_TRACKER_PORT".into(), port.to_string()),
            ("DMLC_TASK_ID".into(), i.to_string()),
            ("DMLC_NUM_WORKER".into(), "2".into()),
            ("PET_NPROC_PER_NODE".into(), "2".into()),
        ]);
        e
    });
    let seen = lines(&mut job.pods, "SDKXGB");
    let mut tasks: Vec<u32> = seen.iter().map(|kv| kv["task"].parse().expect("task")).collect();
    tasks.sort_unstable();
    assert_eq!(tasks, [0, 1, 2, 3], "SDK {sdk}: {seen:?}");
    for kv in &seen {
        assert_eq!((kv["world"].as_str(), kv["rank"].as_str()), ("4", kv["task"].as_str()), "{kv:?}");
        assert_eq!(kv["model"], kv["reference"], "{kv:?}");
    }
    let host = job.pods[0].stderr();
    assert_eq!(host.matches("XGBoost tracker listening").count(), 1, "{host}");
    for (i, pod) in job.pods.iter().enumerate() {
        let err = pod.stderr();
        assert!(err.contains("is this xgboost pod's entry"), "pod {i}: {err}");
        assert!(!err.contains("killed leftover processes"), "the tracker is not a leftover (pod {i}):\n{err}");
    }
}

/// A failing SDK function: the pods end as the runtime's failure policy
/// says (exit 3 matches a `fail` rule of runtimes/failure-policy.toml: 205,
/// which the runtime's podFailurePolicy turns into FailJob), with trainlet's
/// failure report naming the rank.
#[test]
fn a_failing_sdk_function_exits_with_the_workers_code_through_trainlet() {
    let (command, _) = sdk_command("jax-distributed.yaml", "train_failing", &[]);
    let mut job = sdk_pods(&command, jax_env(free_port()));
    for (i, pod) in job.pods.iter_mut().enumerate() {
        assert_eq!(pod.code(LIMIT), 205, "pod {i}:\n{}\n{}", pod.stderr(), pod.stdout());
        assert!(pod.stderr().contains("is this jax pod's entry"), "pod {i}: {}", pod.stderr());
    }
    assert!(job.pods[0].stdout().contains("rank 1 failing on purpose"), "{}", job.pods[0].stdout());
    let err = job.pods[0].stderr();
    assert!(err.contains("worker rank 1 (exit code 3) matched a fail rule"), "{err}");
}

/// The Kubeflow SDK's failure commands of the XGBoost, torch and JAX
/// runtimes on 2 pods x 2: rank 3 raises a `ValueError` mid-training and
/// its peers' collectives break (XGBoost's ring, gloo's pairs, JAX's psum),
/// some of them before rank 3 has exited. Every pod's report, termination
/// message and exit code name rank 3, the one that raised, as the root
/// cause; a peer that failed because it did is said to be a consequence.
#[test]
fn the_sdks_failure_commands_name_the_rank_that_raised_as_the_root_cause() {
    for (runtime, function) in [
        ("xgboost-distributed.yaml", "train_xgboost_failing"),
        ("torch-distributed.yaml", "train_torch_failing"),
        ("jax-distributed.yaml", "train_jax_failing"),
    ] {
        let (command, sdk) = sdk_command(runtime, function, &[]);
        let port = free_port();
        let logs = tempfile::tempdir().expect("tmp");
        let term = |i: u32| logs.path().join(format!("termination-{i}"));
        let mut job = sdk_pods(&command, |i| {
            let mut e = runtime_env(runtime);
            e.extend(match runtime {
                "xgboost-distributed.yaml" => vec![
                    ("DMLC_TRACKER_URI".to_string(), "127.0.0.1".to_string()),
                    ("DMLC_TRACKER_PORT".into(), port.to_string()),
                    ("DMLC_TASK_ID".into(), i.to_string()),
                    ("DMLC_NUM_WORKER".into(), "2".into()),
                    ("PET_NPROC_PER_NODE".into(), "2".into()),
                ],
                "jax-distributed.yaml" => jax_env(port)(i),
                _ => pet_env(2, 2, i, port),
            });
            e.push(("TRAINLET_TERMINATION_LOG".into(), term(i).display().to_string()));
            e
        });
        let codes: Vec<i32> = job.pods.iter_mut().map(|p| p.code(LIMIT)).collect();
        let all: String = job.pods.iter().enumerate().map(|(i, p)| format!("=== pod {i}\n{}\n", p.stderr())).collect();
        for (i, pod) in job.pods.iter().enumerate() {
            let (code, err) = (codes[i], pod.stderr());
            assert_eq!(code, 1, "{function} (SDK {sdk}) pod {i}: the ValueError's code\n{all}");
            let root = err.split("Root Cause").nth(1).unwrap_or_default();
            assert!(
                root.contains("rank      : 3 (local_rank: 1)"),
                "{function} pod {i}: the root cause is rank 3\n{all}"
            );
            assert!(
                root.contains("cause     : its own (ValueError:") && root.contains("failing on purpose"),
                "{function} pod {i}\n{all}"
            );
            let message = std::fs::read_to_string(term(u32::try_from(i).expect("pod"))).expect("termination message");
            assert!(
                message.starts_with("worker rank 3 ")
                    && message.contains("ValueError: ")
                    && message.contains("failing on purpose"),
                "{function} pod {i}: {message}"
            );
            // Every other failure listed is one rank 3's caused, or unexplained; never its own.
            if let Some(others) = err.split("Other failures:").nth(1) {
                assert!(!others.contains("cause     : its own"), "{function} pod {i}\n{err}");
            }
        }
    }
}
