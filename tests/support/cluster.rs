//! The test cluster (`tests/cluster.sh`) from Rust, shared by the cluster
//! tests (`tests/it/cluster.rs`) and the cluster benchmarks
//! (`benches/inplace_bench.rs`): the one cluster a test run shares
//! (`shared`), kubectl in the calling thread's namespace, the TrainJobs they
//! run (PyTorch from the test venv through a read-only hostPath, as the
//! container tests bind-mount it) and their pods.
#![allow(dead_code, reason = "the benchmarks use only the TrainJob helpers")]

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::{python, repo};

/// `CLUSTER_PORT_BASE` (default 26400).
fn port_base() -> u32 {
    std::env::var("CLUSTER_PORT_BASE").ok().and_then(|b| b.parse().ok()).unwrap_or(26400)
}

/// The cluster's state directory (certificates, kubeconfigs, logs), as
/// tests/cluster.sh names it for the port base.
pub fn run_dir() -> PathBuf {
    match port_base() {
        26400 => repo().join("target/cluster/run"),
        base => repo().join(format!("target/cluster/run-{base}")),
    }
}

/// The API server's loopback port (`CLUSTER_PORT_BASE` + 2) and the
/// cluster's CA certificate.
pub fn api_server() -> (u32, PathBuf) {
    (port_base() + 2, run_dir().join("pki/ca.crt"))
}

/// The cluster of this test run, shared by every cluster test and
/// benchmark: `tests/cluster.sh ensure` reuses the one that is up (the
/// test command's) or starts one, which then stops when this process
/// ends, however it ends. Brought up once per process; an error is every
/// caller's error.
pub fn shared() -> Result<(), String> {
    static UP: OnceLock<Result<(), String>> = OnceLock::new();
    UP.get_or_init(|| {
        let pid = std::process::id().to_string();
        let (ok, out) = cluster(&["ensure", "--owner", &pid]);
        if ok { Ok(()) } else { Err(format!("tests/cluster.sh ensure: {out}")) }
    })
    .clone()
}

thread_local! {
    /// The namespace kubectl works in on this thread (the test's own).
    static NAMESPACE: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Make `ns` (or the default namespace) the one this thread's kubectl works in.
pub fn set_namespace(ns: Option<&str>) {
    NAMESPACE.with(|n| *n.borrow_mut() = ns.map(str::to_string));
}

/// This thread's namespace, "default" when none was set.
pub fn namespace() -> String {
    NAMESPACE.with(|n| n.borrow().clone()).unwrap_or_else(|| "default".to_string())
}

/// `bash tests/cluster.sh kubectl --namespace NS ARGS...` as a command to run.
pub fn kubectl_command(args: &[&str]) -> Command {
    let mut cmd = Command::new("bash");
    cmd.arg(repo().join("tests/cluster.sh")).args(["kubectl", "--namespace", &namespace()]).args(args);
    cmd
}

/// The venv's site-packages (torch), for a read-only mount into images
/// whose python is Debian bookworm's 3.11.
pub fn torch_site() -> PathBuf {
    let lib = PathBuf::from(python()).parent().and_then(|b| b.parent()).expect("venv").join("lib");
    let site = std::fs::read_dir(&lib)
        .expect("venv lib")
        .filter_map(|e| e.ok().map(|e| e.path().join("site-packages")))
        .find(|p| p.join("torch").is_dir())
        .expect("torch in the venv");
    assert!(
        site.display().to_string().contains("python3.11"),
        "the images run Debian bookworm's python3.11; the venv has {}",
        site.display()
    );
    site
}

/// Whether a command succeeded, and its stdout and stderr.
fn outcome(out: &std::process::Output) -> (bool, String) {
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// `bash tests/cluster.sh ARGS...`: whether it succeeded, and its output.
pub fn cluster(args: &[&str]) -> (bool, String) {
    outcome(&Command::new("bash").arg(repo().join("tests/cluster.sh")).args(args).output().expect("bash"))
}

/// kubectl against the cluster (the admin's kubeconfig), in this thread's
/// namespace.
pub fn kubectl(args: &[&str]) -> (bool, String) {
    outcome(&kubectl_command(args).output().expect("bash"))
}

/// `kubectl` with `input` on its stdin.
pub fn kubectl_stdin(args: &[&str], input: &str) -> (bool, String) {
    use std::io::Write;
    let mut child = kubectl_command(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("bash");
    child.stdin.take().expect("stdin").write_all(input.as_bytes()).expect("write");
    outcome(&child.wait_with_output().expect("wait"))
}

/// A TrainJob's `runtimePatches` (the test's own manager) that add hostPath
/// mounts to the `node` container of each named replicatedJob: (volume,
/// host path, mount path, read-only).
pub fn mounts_patch(jobs: &[&str], mounts: &[(&str, &Path, &str, bool)]) -> String {
    let mut out = String::from(
        "  runtimePatches:\n  - manager: trainlet.dev/tests\n    trainingRuntimeSpec:\n      template:\n        spec:\n          replicatedJobs:\n",
    );
    for job in jobs {
        out.push_str(&format!(
            "          - name: {job}\n            template:\n              spec:\n                template:\n                  spec:\n                    containers:\n                    - name: node\n                      volumeMounts:\n"
        ));
        for (name, _, at, ro) in mounts {
            out.push_str(&format!("                      - {{name: {name}, mountPath: {at}, readOnly: {ro}}}\n"));
        }
        out.push_str("                    volumes:\n");
        for (name, host, _, _) in mounts {
            out.push_str(&format!(
                "                    - {{name: {name}, hostPath: {{path: {}, type: Directory}}}}\n",
                host.display()
            ));
        }
    }
    out
}

/// The `runtimePatches` entry of [`mounts_patch`] for the `node` job, with
/// the venv's torch (`/opt/torch`) and the fixtures (`/fixtures`), as JSON:
/// what a driver passes as `trainlet_client.up(..., patches=)`.
pub fn mounts_patch_json() -> String {
    let site = torch_site();
    let fixtures = repo().join("tests/fixtures");
    let mounts = [("torch", site.as_path(), "/opt/torch"), ("fixtures", fixtures.as_path(), "/fixtures")];
    let container = serde_json::json!({
        "name": "node",
        "volumeMounts": mounts.iter().map(|(n, _, at)| serde_json::json!({"name": n, "mountPath": at, "readOnly": true})).collect::<Vec<_>>(),
    });
    let volumes: Vec<_> = mounts
        .iter()
        .map(|(n, host, _)| serde_json::json!({"name": n, "hostPath": {"path": host, "type": "Directory"}}))
        .collect();
    serde_json::json!([{
        "manager": "trainlet.dev/tests",
        "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [{"name": "node", "template": {"spec": {"template": {"spec": {"containers": [container], "volumes": volumes}}}}}]}}},
    }])
    .to_string()
}

/// `kubectl get ARGS -o json`, parsed (panics when kubectl fails).
pub fn get_json(args: &[&str]) -> serde_json::Value {
    let mut all = vec!["get"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["-o", "json"]);
    let (ok, out) = kubectl(&all);
    assert!(ok, "kubectl {all:?}: {out}");
    serde_json::from_str(&out).expect("json")
}

/// The TrainJob's pods by completion index (node rank).
pub fn pods_of(job: &str) -> BTreeMap<String, serde_json::Value> {
    let label = format!("jobset.sigs.k8s.io/jobset-name={job}");
    get_json(&["pods", "-l", &label])["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| {
            Some((p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"].as_str()?.to_string(), p.clone()))
        })
        .collect()
}

/// The log of `pod`'s container.
pub fn logs_of(pod: &serde_json::Value) -> String {
    let name = pod["metadata"]["name"].as_str().expect("name");
    kubectl(&["logs", name]).1
}

/// A TrainJob of `runtime` on 2 pods x 2 workers running `command`, with the
/// venv's site-packages at /opt/torch (PYTHONPATH), the fixtures at
/// /fixtures and `mounts` (hostPaths), plus `env`.
pub fn job_on(
    runtime: &str,
    name: &str,
    command: &str,
    env: &[(&str, &str)],
    mounts: &[(&str, &Path, &str, bool)],
) -> String {
    let site = torch_site();
    let fixtures = repo().join("tests/fixtures");
    let mut vars = String::from("    - {name: PYTHONPATH, value: /opt/torch}\n");
    for (k, v) in env {
        vars.push_str(&format!("    - {{name: {k}, value: \"{v}\"}}\n"));
    }
    let mut all =
        vec![("torch", site.as_path(), "/opt/torch", true), ("fixtures", fixtures.as_path(), "/fixtures", true)];
    all.extend_from_slice(mounts);
    let patch = mounts_patch(&["node"], &all);
    format!(
        "apiVersion: trainer.kubeflow.org/v1alpha1
kind: TrainJob
metadata: {{name: {name}}}
spec:
  runtimeRef: {{name: {runtime}}}
  trainer:
    numNodes: 2
    numProcPerNode: 2
    command: {command}
    env:
{vars}{patch}"
    )
}

/// `kubectl apply -f FILE` in this thread's namespace, one at a time in
/// this process: the tests apply the same runtimes (cluster-scoped) side by
/// side, and two first applies of one object race (one of them is refused
/// as AlreadyExists). Then it waits (2 min at most) until Trainer's
/// admission webhook finds each ClusterTrainingRuntime of FILE: the webhook
/// reads its manager's informer cache, not the API server, and after a test
/// restarted the API server that cache took seconds to catch up (seen: a
/// TrainJob created right after the apply refused with "specified
/// clusterTrainingRuntime must be created before the TrainJob is created").
pub fn apply_file(file: &Path) -> (bool, String) {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let applied = {
        let _one = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        kubectl(&["apply", "-f", &file.display().to_string()])
    };
    if !applied.0 {
        return applied;
    }
    let text = std::fs::read_to_string(file).unwrap_or_default();
    for runtime in cluster_runtimes(&text) {
        if let Err(e) = wait_for_webhook_to_find(&runtime) {
            return (false, format!("{}\n{e}", applied.1));
        }
    }
    applied
}

/// The names of the ClusterTrainingRuntimes in a manifest (its documents
/// split at `---`; the name is the first `  name:` under `metadata:`).
pub fn cluster_runtimes(manifest: &str) -> Vec<String> {
    manifest
        .split("\n---")
        .filter(|doc| doc.lines().any(|l| l.trim_end() == "kind: ClusterTrainingRuntime"))
        .filter_map(|doc| {
            let mut lines = doc.lines().skip_while(|l| l.trim_end() != "metadata:").skip(1);
            lines.find_map(|l| l.strip_prefix("  name: ")).map(|n| n.trim().to_string())
        })
        .collect()
}

/// Waits until a server-side dry run of a TrainJob on RUNTIME is no longer
/// refused because Trainer's webhook does not know RUNTIME yet.
fn wait_for_webhook_to_find(runtime: &str) -> Result<(), String> {
    let probe = format!(
        "apiVersion: trainer.kubeflow.org/v1alpha1\nkind: TrainJob\nmetadata: {{name: webhook-probe}}\nspec:\n  runtimeRef: {{name: {runtime}}}\n"
    );
    let started = Instant::now();
    let mut said = false;
    loop {
        let (_, out) = kubectl_stdin(&["create", "--dry-run=server", "-f", "-"], &probe);
        // Not found by the cache yet, or the webhook not reachable yet.
        let lagging =
            out.contains("specified clusterTrainingRuntime must be created") || out.contains("failed calling webhook");
        if !lagging {
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(120) {
            return Err(format!("Trainer's webhook still does not find {runtime} 120 s after its apply: {out}"));
        }
        if !said {
            eprintln!(
                "waiting for Trainer's webhook to find the ClusterTrainingRuntime {runtime} (its cache lags the API server)"
            );
            said = true;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Every runtime file of `runtimes/` names one ClusterTrainingRuntime, found
/// where `apply_file` looks for it (the webhook wait checks nothing if not).
#[test]
fn each_runtime_file_names_its_cluster_training_runtime() {
    let mut files = 0;
    for entry in std::fs::read_dir(repo().join("runtimes")).expect("runtimes/") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "yaml") {
            files += 1;
            let names = cluster_runtimes(&std::fs::read_to_string(&path).expect("read"));
            assert_eq!(names.len(), 1, "{}: {names:?}", path.display());
            assert!(names[0].starts_with("trainlet-"), "{}: {names:?}", path.display());
        }
    }
    assert!(files >= 8, "{files} runtime files");
}
