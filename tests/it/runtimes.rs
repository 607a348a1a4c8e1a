//! The manifests in runtimes/ against the real Trainer and JobSet CRD
//! schemas (shared/kubeflow/crds beside the repository), and the failure
//! policy file they mount.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use crate::util::{Pod, python, repo};

fn crds() -> PathBuf {
    let dir = repo().join("../shared/kubeflow/crds");
    assert!(dir.is_dir(), "the CRD schemas are expected at {} (shared/ beside the repository)", dir.display());
    dir
}

fn validate(files: &[PathBuf]) -> (bool, String) {
    let out = Command::new(python())
        .arg(repo().join("tests/validate_manifests.py"))
        .arg(crds())
        .args(files)
        .output()
        .expect("python");
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn runtimes_are_valid_cluster_training_runtimes() {
    let file = repo().join("runtimes/torch-distributed.yaml");
    let (ok, out) = validate(std::slice::from_ref(&file));
    assert!(ok, "{out}");
    assert!(out.contains("ClusterTrainingRuntime trainlet-torch-distributed valid"), "{out}");
    // The exit codes the runtime routes are trainlet's documented ones.
    let text = std::fs::read_to_string(&file).expect("read");
    assert!(text.contains("values: [200, 205, 208]") && text.contains("values: [143, 204]"), "{text}");
}

#[test]
fn the_mpi_runtime_is_valid_and_runs_trainlet_on_both_ends() {
    let file = repo().join("runtimes/mpi-distributed.yaml");
    let (ok, out) = validate(std::slice::from_ref(&file));
    assert!(ok, "{out}");
    assert!(out.contains("ClusterTrainingRuntime trainlet-mpi-distributed valid"), "{out}");
    let text = std::fs::read_to_string(&file).expect("read");
    assert!(text.contains("- trainlet\n                        - sshd"), "node pods run trainlet sshd: {text}");
    assert!(text.contains("port: 2222") && !text.contains("/usr/sbin/sshd"), "{text}");
    assert!(text.contains("values: [200]"), "{text}");
}

#[test]
fn the_validator_rejects_a_broken_runtime_by_path() {
    let text = std::fs::read_to_string(repo().join("runtimes/torch-distributed.yaml")).expect("read");
    let broken = text.replace("backoffLimit: 4", "backoffLimit: four\n              bogusField: 1");
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("broken.yaml");
    std::fs::write(&path, broken).expect("write");
    let (ok, out) = validate(&[path]);
    assert!(!ok, "{out}");
    assert!(out.contains("replicatedJobs[0].template.spec.backoffLimit: expected integer"), "{out}");
    assert!(out.contains("unknown field bogusField"), "{out}");
}

#[test]
fn the_shipped_failure_policy_parses() {
    let mut pod = Pod::start(&["doctor", "--policy", "runtimes/failure-policy.toml"], &[]);
    assert_eq!(pod.code(Duration::from_secs(30)), 0, "{}", pod.stderr());
    let out = pod.stdout();
    assert!(out.contains("failure-policy.toml rule 1: 3=fail"), "{out}");
    assert!(out.contains("rule 2: 137,SIGSEGV,SIGBUS=restart"), "{out}");
}
