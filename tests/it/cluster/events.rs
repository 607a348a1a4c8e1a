//! Kubernetes Events on the real API server (`crate::events` through the
//! hidden `trainlet event`, which emits as the agent does): a Warning
//! emitted five times with the same note and twice with others is three
//! Event objects, the repeated one with a series count of 5, regarding the
//! pod (with the uid the downward API gives), related to its TrainJob,
//! written under the ServiceAccount and Role that `runtimes/` ship; under
//! an account without that Role, one warning naming the permission, and
//! the process goes on (exit 0).
//!
//! trainlet runs on this machine with a kubeconfig holding the account's
//! token, as the agent of a Pending pod (no node takes the namespace's
//! pods): everything it talks to is the real API server with RBAC on.

use std::path::Path;
use std::time::Duration;

use super::{Take, up};
use crate::support::cluster::{api_server, apply_file, get_json, kubectl, kubectl_stdin};
use crate::util::{Pod, repo};

const REASON: &str = "EventsTest";

/// A kubeconfig in `dir` for a token of ServiceAccount `sa`.
fn kubeconfig_for(dir: &Path, sa: &str) -> std::path::PathBuf {
    let (ok, token) = kubectl(&["create", "token", sa, "--duration", "10m"]);
    assert!(ok, "token for {sa}: {token}");
    let (port, ca) = api_server();
    let file = dir.join(format!("{sa}.kubeconfig"));
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: https://127.0.0.1:{port}\n    certificate-authority: {}\nusers:\n- name: {sa}\n  user:\n    token: {}\ncontexts:\n- name: test\n  context: {{cluster: test, user: {sa}}}\ncurrent-context: test\n",
        ca.display(),
        token.trim()
    );
    std::fs::write(&file, text).expect("kubeconfig");
    file
}

/// `trainlet event` as the agent of `pod`, with `kubeconfig`; its stderr.
fn emit(kubeconfig: &Path, pod: &str, uid: &str, namespace: &str, notes: &[&str]) -> String {
    let mut args = vec!["event", "--type", "Warning", "--reason", REASON, "--action", "Test"];
    args.extend_from_slice(notes);
    let kubeconfig = kubeconfig.to_str().expect("path");
    let mut p = Pod::start(
        &args,
        &[
            ("KUBECONFIG", kubeconfig),
            ("POD_NAME", pod),
            ("POD_NAMESPACE", namespace),
            ("POD_UID", uid),
            ("TRAIN_JOB_NAME", "ev-job"),
            ("TRAINLET_LOG", "info,kube=warn"),
        ],
    );
    assert_eq!(p.code(Duration::from_secs(60)), 0, "trainlet event: {}", p.stderr());
    p.stderr()
}

/// This namespace's Events written by trainlet.
fn trainlets_events() -> Vec<serde_json::Value> {
    get_json(&["events.v1.events.k8s.io"])["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["reportingController"] == "trainlet" && e["reason"] == REASON)
        .cloned()
        .collect()
}

#[test]
fn repeats_are_one_counted_event_and_no_permission_is_one_warning() {
    let up = up("events", Take::Unscheduled);
    let ns = up.namespace.clone();
    // The ServiceAccount `trainlet` and its Role, as the runtimes ship them.
    let (ok, out) = apply_file(&repo().join("runtimes/torch-distributed.yaml"));
    assert!(ok, "{out}");
    let (ok, out) = kubectl(&["create", "serviceaccount", "nobody"]);
    assert!(ok, "{out}");
    let pod = "ev-job-node-0-0-abcde";
    let manifest = format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {pod}\n  labels: {{jobset.sigs.k8s.io/jobset-name: ev-job}}\nspec:\n  containers:\n  - {{name: node, image: localhost/trainlet-test/pause:1}}\n"
    );
    let (ok, out) = kubectl_stdin(&["create", "-f", "-"], &manifest);
    assert!(ok, "{out}");
    let uid = get_json(&["pod", pod])["metadata"]["uid"].as_str().expect("uid").to_string();
    let dir = tempfile::tempdir().expect("tmp");

    let allowed = kubeconfig_for(dir.path(), "trainlet");
    let mut notes = vec!["rank 3 exited with code 1"; 5];
    notes.extend(["rank 5 hangs in \x1b[31msynchronize\x1b[0m", "rank 7 is a straggler"]);
    let stderr = emit(&allowed, pod, &uid, &ns, &notes);
    assert!(stderr.contains("Kubernetes Events: on"), "{stderr}");
    assert!(!stderr.contains("WARN"), "{stderr}");
    let events = trainlets_events();
    assert_eq!(events.len(), 3, "{events:#?}");
    let count = |note: &str| {
        let e = events.iter().find(|e| e["note"] == note).unwrap_or_else(|| panic!("{note}: {events:#?}"));
        e["series"]["count"].as_u64().unwrap_or(1)
    };
    assert_eq!(count("rank 3 exited with code 1"), 5);
    assert_eq!(count("rank 5 hangs in synchronize"), 1, "the colours are gone");
    assert_eq!(count("rank 7 is a straggler"), 1);
    for e in &events {
        assert_eq!(e["type"], "Warning", "{e}");
        assert_eq!(e["regarding"]["kind"], "Pod", "{e}");
        assert_eq!(e["regarding"]["name"], pod, "{e}");
        assert_eq!(e["regarding"]["uid"], uid.as_str(), "{e}");
        assert_eq!(e["related"]["kind"], "TrainJob", "{e}");
        assert_eq!(e["related"]["name"], "ev-job", "{e}");
        assert_eq!(e["reportingInstance"], pod, "{e}");
    }
    // What a person runs: the pod's Events, the repeat counted.
    let (ok, described) = kubectl(&["describe", "pod", pod]);
    assert!(ok && described.contains(REASON), "{described}");

    let refused = kubeconfig_for(dir.path(), "nobody");
    let stderr = emit(&refused, pod, &uid, &ns, &["rank 1 exited with code 1"; 3]);
    let warnings: Vec<&str> = stderr.lines().filter(|l| l.contains("WARN")).collect();
    assert_eq!(warnings.len(), 1, "{stderr}");
    for needed in ["`create`", "`patch`", "`events`", "`events.k8s.io`"] {
        assert!(warnings[0].contains(needed), "{needed}: {stderr}");
    }
    assert_eq!(trainlets_events().len(), 3, "nothing written without the permission");
}
