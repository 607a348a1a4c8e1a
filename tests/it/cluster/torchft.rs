//! TorchFT replica groups on the real cluster: a TrainJob of the plain
//! `runtimes/torch-distributed.yaml` with `TRAINLET_REPLICA_GROUPS=2` on 2
//! pods x 2 workers (one pod per group), real torchft 0.2.0 from the
//! host's venv (the pods' PYTHONPATH) and its Lighthouse on node rank 0's
//! pod (tests/fixtures/torchft_lighthouse: the wheel's entry point without
//! the venv's shebang).

use super::*;

/// A worker of group 1 dies: trainlet restarts group 1's workers in its
/// pod, group 0 goes on training in the other pod, group 1 heals from it
/// across pods, and both end with the same parameters. No pod restarts.
#[test]
fn a_killed_worker_restarts_only_its_replica_group_across_real_pods() {
    let _up = up("torchft", Take::Beside);
    let marks = tempfile::tempdir().expect("tmp");
    std::fs::set_permissions(marks.path(), std::os::unix::fs::PermissionsExt::from_mode(0o777)).expect("chmod");
    let env = [
        ("TRAINLET_REPLICA_GROUPS", "2"),
        ("TRAINLET_LIGHTHOUSE", "/fixtures/torchft_lighthouse"),
        ("PET_MAX_RESTARTS", "2"),
        ("MARK_DIR", "/marks"),
        ("ADVERTISE_HOST", "fqdn"),
        ("TORCHFT_STEPS", "250"),
        ("STEP_SLEEP", "0.1"),
        ("KILL_GROUP", "1"),
        ("KILL_RANK", "1"),
        ("KILL_AT_STEP", "15"),
    ];
    let file = repo().join("runtimes/torch-distributed.yaml");
    let (ok, out) = apply_file(&file);
    assert!(ok, "{out}");
    let job = job_on(
        "trainlet-torch-distributed",
        "ft",
        "[torchrun, /fixtures/torchft_train.py]",
        &env,
        &[("marks", marks.path(), "/marks", false)],
    );
    let (ok, out) = kubectl_stdin(&["apply", "-f", "-"], &job);
    assert!(ok, "{out}");
    let uids_before = wait_for("ft", "both pods", Duration::from_secs(300), || {
        let u = uids("ft");
        (u.len() == 2).then_some(u)
    });
    assert_eq!(finished("ft", Duration::from_secs(420)), "Complete", "{}", diagnose("ft"));
    assert_eq!(uids("ft"), uids_before, "no pod was recreated");
    let pods = pods_of("ft");
    for pod in pods.values() {
        assert_eq!(pod["status"]["containerStatuses"][0]["restartCount"].as_i64(), Some(0), "{}", pod["status"]);
    }
    let (host, other) = (logs_of(&pods["0"]), logs_of(&pods["1"]));
    assert!(host.contains("the TorchFT Lighthouse listens"), "{host}");
    assert!(other.contains("restarting this replica group's workers") && other.contains("replica_group=1"), "{other}");
    assert!(!host.contains("restarting"), "group 0 never restarted: {host}");
    let starts = |g: u32| std::fs::read_to_string(marks.path().join(format!("starts.g{g}.r0"))).unwrap_or_default();
    assert_eq!((starts(0).lines().count(), starts(1).lines().count()), (1, 2), "{other}");
    let healed = std::fs::read_to_string(marks.path().join("recovered.g1.r0")).unwrap_or_default();
    assert!(
        healed.lines().any(|l| l
            .split_whitespace()
            .next()
            .and_then(|s| s.parse::<u64>().ok())
            .is_some_and(|s| s >= 15)),
        "group 1 healed from group 0 after its restart: {healed:?}\n{other}"
    );
    let check = "import sys, torch
a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2])
sys.exit(0 if a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) else 1)";
    let st = std::process::Command::new(crate::util::python())
        .args(["-c", check])
        .arg(marks.path().join("params.g0.pt"))
        .arg(marks.path().join("params.g1.pt"))
        .status()
        .expect("python");
    assert!(st.success(), "both groups end with the same parameters");
}
