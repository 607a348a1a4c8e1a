//! A straggler on the real cluster: a TrainJob of the torch runtime, 2
//! pods x 2 gloo workers of `tests/fixtures/straggler_job.py` (0.1 s of
//! compute and an all_reduce per step), whose rank 3 computes 1.5x as long
//! from the start. The store host names it, with what it was doing, in a
//! Kubernetes Event (`kubectl get events` shows it) and in the TrainJob's
//! status (`trainlet.stragglers`, through Trainer's status server).

use std::time::Duration;

use super::{Take, events_of, metric, up, wait_for};
use crate::support::cluster::{apply_file, get_json, job_on, kubectl, kubectl_stdin};
use crate::util::repo;

#[test]
fn a_straggler_is_a_kubernetes_event_and_in_the_trainjobs_status() {
    let _up = up("straggler", Take::Beside);
    let (ok, out) = apply_file(&repo().join("runtimes/torch-distributed.yaml"));
    assert!(ok, "{out}");
    let env = [("SLOW_RANK", "3"), ("SLOW_AFTER", "0"), ("RUN_FOR", "400")];
    let job = job_on("trainlet-torch-distributed", "slow", "[torchrun, /fixtures/straggler_job.py]", &env, &[]);
    let (ok, out) = kubectl_stdin(&["apply", "-f", "-"], &job);
    assert!(ok, "{out}");
    // Pods up (seconds), then windows of 50 samples a rank at about 5 a
    // second, three in a row: about 40 s once the workers run.
    let named = wait_for("slow", "a Straggler Event", Duration::from_secs(300), || {
        let e = events_of("slow", "Straggler");
        (!e.is_empty()).then_some(e)
    });
    for e in &named {
        let note = e["note"].as_str().unwrap_or_default();
        assert!(
            note.starts_with("rank 3 (")
                && note.contains(") is a straggler: the other 3 wait for it")
                && note.contains("it computes in straggler_job.py:"),
            "{e:#}"
        );
        assert_eq!(e["type"], "Warning", "{e:#}");
        assert_eq!(e["related"]["name"], "slow", "{e:#}");
    }
    // What a person runs.
    let (ok, listed) = kubectl(&["get", "events"]);
    assert!(ok && listed.contains("Straggler") && listed.contains("rank 3 ("), "{listed}");
    let status = wait_for("slow", "the straggler in the TrainJob's status", Duration::from_secs(60), || {
        metric(&get_json(&["trainjob", "slow"]), "trainlet.stragglers")
    });
    assert!(status.starts_with("rank 3 ("), "{status}");
    let (ok, out) = kubectl(&["delete", "trainjob", "slow", "--wait=false"]);
    assert!(ok, "{out}");
}
