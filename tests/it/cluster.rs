//! The runtimes of runtimes/ through a real Kubernetes control plane and
//! the real Trainer (v2.3.0) and JobSet (v0.12.0) controllers, webhooks
//! included (`tests/cluster.sh`, built by `tests/run.sh` before the tests:
//! etcd, kube-apiserver, kube-controller-manager and kube-scheduler from
//! their Go modules). A TrainJob of each runtime must become a JobSet that
//! JobSet's webhook accepts, its Jobs and its pods, and the torch pods must
//! carry what trainlet reads. No node runs the pods yet (issue 27): they
//! stay Pending.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::util::repo;

fn cluster(args: &[&str]) -> (bool, String) {
    let out = Command::new("bash").arg(repo().join("tests/cluster.sh")).args(args).output().expect("bash");
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

fn kubectl(args: &[&str]) -> (bool, String) {
    let mut all = vec!["kubectl"];
    all.extend_from_slice(args);
    cluster(&all)
}

fn kubectl_stdin(args: &[&str], input: &str) -> (bool, String) {
    use std::io::Write;
    let mut child = Command::new("bash")
        .arg(repo().join("tests/cluster.sh"))
        .arg("kubectl")
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("bash");
    child.stdin.take().expect("stdin").write_all(input.as_bytes()).expect("write");
    let out = child.wait_with_output().expect("wait");
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// The cluster, stopped (every process gone) when the test ends.
struct Up;

impl Drop for Up {
    fn drop(&mut self) {
        let (ok, out) = cluster(&["down"]);
        assert!(ok || std::thread::panicking(), "down: {out}");
    }
}

/// `kubectl get KIND -o json` items, polled until `done` says so (120 s at most).
fn items_until(args: &[&str], done: impl Fn(&[serde_json::Value]) -> bool) -> Vec<serde_json::Value> {
    let until = Instant::now() + Duration::from_secs(120);
    loop {
        let mut all = vec!["get"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["-o", "json"]);
        let (ok, out) = kubectl(&all);
        assert!(ok, "kubectl {all:?}: {out}");
        let items = serde_json::from_str::<serde_json::Value>(&out).expect("json")["items"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if done(&items) || Instant::now() > until {
            return items;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn env_of(pod: &serde_json::Value) -> BTreeMap<String, serde_json::Value> {
    pod["spec"]["containers"][0]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| Some((e["name"].as_str()?.to_string(), e.get("value").or(e.get("valueFrom"))?.clone())))
        .collect()
}

#[test]
fn every_runtime_goes_through_the_real_trainer_and_jobset_to_pods_that_carry_trainlets_contract() {
    let _ = cluster(&["down"]); // what a crashed run may have left
    let (ok, out) = cluster(&["up"]);
    let _up = Up;
    assert!(ok, "tests/cluster.sh up: {out}");

    let runtimes: Vec<String> = std::fs::read_dir(repo().join("runtimes"))
        .expect("runtimes/")
        .filter_map(|e| e.ok()?.path().to_str().map(str::to_string))
        .filter(|p| p.ends_with(".yaml"))
        .collect();
    assert!(runtimes.len() >= 8, "{runtimes:?}");
    let mut names = Vec::new();
    for file in &runtimes {
        let (ok, out) = kubectl(&["apply", "-f", file]);
        assert!(ok, "Trainer refused {file}: {out}");
        let text = std::fs::read_to_string(file).expect("read");
        let name = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("name: trainlet-"))
            .unwrap_or_else(|| panic!("{file} names no trainlet-* runtime"))
            .to_string();
        let job = format!(
            "apiVersion: trainer.kubeflow.org/v1alpha1\nkind: TrainJob\nmetadata: {{name: t-{name}, namespace: default}}\nspec:\n  runtimeRef: {{name: trainlet-{name}}}\n  trainer: {{numNodes: 2, numProcPerNode: 2, command: [torchrun, /workspace/train.py]}}\n"
        );
        let (ok, out) = kubectl_stdin(&["apply", "-f", "-"], &job);
        assert!(ok, "TrainJob of {name}: {out}");
        names.push(name);
    }

    // Each TrainJob becomes a JobSet (JobSet's webhook accepted what Trainer
    // made of the runtime) with at least one Job and its pods.
    let all = names.len();
    let jobsets = items_until(&["jobsets"], |js| js.len() >= all);
    let made: Vec<&str> = jobsets.iter().filter_map(|j| j["metadata"]["name"].as_str()).collect();
    for name in &names {
        assert!(
            made.contains(&format!("t-{name}").as_str()),
            "no JobSet for runtime {name} ({made:?}); Trainer's log: {}",
            std::fs::read_to_string(repo().join("target/cluster/run/logs/trainer.log"))
                .unwrap_or_default()
                .lines()
                .rfind(|l| l.contains(name) && l.contains("error"))
                .unwrap_or("")
        );
    }

    // The torch pods: 2, Pending (no node), with what trainlet reads.
    let pods = items_until(&["pods", "-l", "jobset.sigs.k8s.io/jobset-name=t-torch-distributed"], |p| p.len() >= 2);
    assert_eq!(pods.len(), 2, "{pods:?}");
    for pod in &pods {
        let c = &pod["spec"]["containers"][0];
        assert_eq!(c["command"][0], "torchrun", "trainlet answers as torchrun: {c}");
        let env = env_of(pod);
        assert_eq!(env.get("PET_NNODES"), Some(&serde_json::json!("2")), "{env:?}");
        assert_eq!(env.get("PET_NPROC_PER_NODE"), Some(&serde_json::json!("2")), "{env:?}");
        assert_eq!(
            env.get("PET_MASTER_ADDR"),
            Some(&serde_json::json!("t-torch-distributed-node-0-0.t-torch-distributed")),
            "{env:?}"
        );
        let rank = env.get("PET_NODE_RANK").map(|v| v["fieldRef"]["fieldPath"].clone());
        assert!(rank.as_ref().and_then(|p| p.as_str()).is_some_and(|p| p.contains("job-completion-index")), "{env:?}");
        let restart = env.get("JOBSET_RESTART_ATTEMPT").map(|v| v["fieldRef"]["fieldPath"].clone());
        assert!(restart.as_ref().and_then(|p| p.as_str()).is_some_and(|p| p.contains("restart-attempt")), "{env:?}");
        assert!(
            env.get("KUBEFLOW_TRAINER_SERVER_URL").and_then(|v| v.as_str()).is_some_and(|u| u.ends_with("/status")),
            "Trainer's status server (TrainJobStatus) is on: {env:?}"
        );
        assert_eq!(pod["status"]["phase"], "Pending", "no node runs pods yet");
    }

    // MPI: a launcher and the nodes.
    let jobs = items_until(&["jobs", "-l", "jobset.sigs.k8s.io/jobset-name=t-mpi-distributed"], |j| j.len() >= 2);
    let mut kinds: Vec<&str> =
        jobs.iter().filter_map(|j| j["metadata"]["labels"]["jobset.sigs.k8s.io/replicatedjob-name"].as_str()).collect();
    kinds.sort_unstable();
    assert_eq!(kinds, ["launcher", "node"], "{jobs:?}");
}
