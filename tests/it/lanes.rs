//! Several actors at once on the same served pods (issue 42, part 3): 2
//! simulated pods (127.0.0.1-2) x 2 worker slots, real torch (gloo, CPU),
//! driven by the repository's Python client
//! (`tests/fixtures/lanes_driver.py`, the reinforcement-learning pattern
//! of the docs: a trainer and a rollout actor, weights handed over through
//! the pods). The driver prints one JSON line per step; the assertions are
//! here.

use std::collections::{BTreeSet, HashMap};

use crate::serve::{json, start};
use crate::util::*;

fn ranks(v: &serde_json::Value) -> &Vec<serde_json::Value> {
    v.as_array().unwrap_or_else(|| panic!("not a list of ranks: {v}"))
}

fn pids(v: &serde_json::Value) -> BTreeSet<u64> {
    ranks(v).iter().filter_map(|r| r["pid"].as_u64()).collect()
}

/// One phase of `lanes_driver.py`: its steps by name, and its output.
fn phase(s: &crate::serve::Served, args: &[&str]) -> (HashMap<String, serde_json::Value>, String) {
    let out = std::process::Command::new("timeout")
        .args(["600", &python()])
        .arg(fixture("lanes_driver.py"))
        .args([s.url.as_str(), &s.token_file.display().to_string()])
        .args(args)
        .output()
        .expect("driver");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let pods: Vec<String> = s.pods.iter().enumerate().map(|(i, p)| format!("pod {i}:\n{}", p.stderr())).collect();
    assert!(
        out.status.success(),
        "lanes_driver.py {args:?} failed: {}\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr),
        pods.join("\n")
    );
    let steps = stdout.lines().map(json).map(|v| (v["step"].as_str().unwrap_or("").to_string(), v)).collect();
    (steps, stdout)
}

#[test]
fn a_trainer_and_a_rollout_actor_run_side_by_side_and_hand_weights_over_through_the_pods() {
    let mut s = start(2, &[]);
    let (steps, stdout) = phase(&s, &["all"]);
    let step = |name: &str| steps.get(name).unwrap_or_else(|| panic!("no step {name}:\n{stdout}"));

    // Placed: the trainer is the main run on slot 0, the rollout a lane on slot 1.
    let placed = step("placed");
    let runs = ranks(&placed["runs"]);
    assert_eq!(runs.len(), 2, "{placed}");
    assert_eq!((runs[0]["lane"].as_bool(), runs[0]["first_slot"].as_u64()), (Some(false), Some(0)), "{placed}");
    assert_eq!((runs[1]["lane"].as_bool(), runs[1]["first_slot"].as_u64()), (Some(true), Some(1)), "{placed}");

    // Each turn: two process groups of 2 (one worker per pod each), the
    // rollout's weights equal to the trainer's on every rank, and the
    // trainer's weights moving from turn to turn.
    let turns = ranks(&step("turns")["turns"]);
    assert_eq!(turns.len(), 3, "{stdout}");
    let mut digests = BTreeSet::new();
    for (i, turn) in turns.iter().enumerate() {
        let (trained, loaded) = (ranks(&turn["trained"]), ranks(&turn["loaded"]));
        assert_eq!((trained.len(), loaded.len()), (2, 2), "turn {i}: {turn}");
        for (r, (t, l)) in trained.iter().zip(loaded).enumerate() {
            assert_eq!((t["rank"].as_u64(), l["rank"].as_u64()), (Some(r as u64), Some(r as u64)), "{turn}");
            assert_eq!((t["world"].as_u64(), l["world"].as_u64()), (Some(2), Some(2)), "{turn}");
            assert_eq!((t["local_world"].as_u64(), l["local_world"].as_u64()), (Some(1), Some(1)), "{turn}");
            assert_ne!(t["port"], l["port"], "each its own worker store: {turn}");
            assert_eq!(l["all_reduce"].as_f64(), Some(2.0), "the rollout's own group: {turn}");
            assert_eq!(t["digest"], l["digest"], "turn {i}, rank {r}: the rollout has the trainer's weights");
        }
        assert_eq!(trained[0]["digest"], trained[1]["digest"], "DDP kept the trainer's ranks identical: {turn}");
        digests.insert(trained[0]["digest"].as_str().unwrap_or("").to_string());
        assert!(pids(&turn["trained"]).is_disjoint(&pids(&turn["loaded"])), "separate workers: {turn}");
    }
    assert_eq!(digests.len(), 3, "the weights changed every turn: {digests:?}");

    // A call to the rollout answers while the trainer's call still runs.
    let beside = step("beside");
    assert_eq!(beside["slow_done_when_pinged"], false, "{beside}");
    assert_eq!(beside["slow"], serde_json::json!([0, 1]), "{beside}");

    // A lane actor's call past its wait says where its rank is: in the
    // method, read by the lane's agent and gathered with the pod's.
    let held = step("lane_timeout");
    let where_ = held["where"].as_object().expect("where");
    assert_eq!(where_.len(), 2, "the lane's rank on each pod: {held}");
    for place in where_.values() {
        // The driver's classes run from the shipped __main__ (_trainlet_main_<digest>.py).
        let place = place.as_str().unwrap_or_default();
        assert!(place.starts_with("_trainlet_main_") && place.ends_with(" in Rollout.hold"), "{held}");
    }

    // No slot left: 409 naming both holders.
    let full = step("full");
    assert_eq!(full["status"], 409, "{full}");
    let message = full["message"].as_str().unwrap_or("");
    for r in runs {
        let id = r["id"].as_str().expect("id");
        assert!(message.contains(id), "{id} named in: {message}");
    }
    assert!(message.contains("nproc_per_node"), "{message}");

    // A replace asking for both slots, with the lane on slot 1: refused
    // before anything is stopped; the main actor answers, same processes.
    let refused = step("replace_refused");
    assert_eq!(refused["status"], 409, "{refused}");
    assert!(refused["message"].as_str().is_some_and(|m| m.contains("was not stopped")), "{refused}");
    assert_eq!(pids(&refused["before"]), pids(&refused["after"]), "{refused}");

    // The rollout's rank 1 killed: it restarts (the rollout answers again,
    // both ranks anew), the trainer keeps its processes and state.
    let die = step("die");
    assert_eq!((die["raised"].as_str(), die["rank"].as_u64()), (Some("WorkerDied"), Some(1)), "{die}");
    assert_eq!(pids(&die["trainer_before"]), pids(&die["trainer_after"]), "{die}");
    assert_eq!(ranks(&die["trainer_before"])[0]["digest"], ranks(&die["trainer_after"])[0]["digest"], "{die}");
    assert_eq!(ranks(&die["rollout_after"]).len(), 2, "{die}");

    // Closed slots are taken again: a lane after a lane, the main run
    // around a lane.
    let reuse = step("reuse");
    assert_eq!(ranks(&reuse["again"]).len(), 2, "{reuse}");
    assert_eq!(ranks(&reuse["main"]).len(), 2, "{reuse}");
    let open: Vec<(bool, u64)> = ranks(&reuse["runs"])
        .iter()
        .map(|r| (r["lane"].as_bool().unwrap_or(false), r["first_slot"].as_u64().unwrap_or(9)))
        .collect();
    assert_eq!(open, vec![(true, 1), (false, 0)], "{reuse}");
    assert_eq!(step("closed")["runs"], serde_json::json!([]), "{stdout}");

    // Every lane agent is gone once its lane closed.
    for p in &mut s.pods {
        p.wait_for_stderr("the lane's agent is gone", std::time::Duration::from_secs(60));
    }
}

/// A lost pod replaced: its lane agents start again with the others, the
/// lanes' rounds regroup; the rollout, in survivors mode, keeps its
/// process and state on the pod that stayed, and the weights go on
/// moving through the pods.
#[test]
fn the_lanes_come_back_on_a_pod_that_replaces_a_lost_one() {
    let timeout = ["--heartbeat-timeout", "3"];
    let mut s = start(2, &timeout);
    let (up, stdout) = phase(&s, &["up"]);
    let up = up.get("up").unwrap_or_else(|| panic!("no step up:\n{stdout}"));
    let loaded = ranks(&up["loaded"]);
    assert_eq!(loaded.len(), 2, "{up}");
    assert_eq!(loaded[0]["digest"], ranks(&up["trained"])[0]["digest"], "{up}");

    s.pods[1].signal(nix::sys::signal::Signal::SIGKILL);
    let _ = s.pods[1].child.wait();
    std::fs::remove_dir_all(s.dir.path().join("pod1")).expect("pod1's serve dir");
    let control: u16 = s.url.rsplit(':').next().and_then(|p| p.parse().ok()).expect("port");
    s.pods[1] = crate::serve::start_pod(&s, (control, 2), 1, &timeout);
    let (ids_t, ids_r) = (up["trainer"].as_str().expect("id"), up["rollout"].as_str().expect("id"));
    let (again, stdout) = phase(&s, &["again", ids_t, ids_r]);
    let again = again.get("again").unwrap_or_else(|| panic!("no step again:\n{stdout}"));
    let pinged = ranks(&again["pinged"]);
    assert_eq!(pinged.len(), 2, "{again}");
    assert_eq!(pinged[0]["pid"], loaded[0]["pid"], "the rollout's rank on pod 0 kept its process: {again}");
    assert_ne!(pinged[1]["pid"], loaded[1]["pid"], "pod 1's rank is new: {again}");
    let (trained, loaded) = (ranks(&again["trained"]), ranks(&again["loaded"]));
    for (t, l) in trained.iter().zip(loaded) {
        assert_eq!(t["digest"], l["digest"], "{again}");
        assert_eq!(l["all_reduce"].as_f64(), Some(2.0), "{again}");
    }
    s.pods[1].wait_for_stderr("started the agent of a lane", std::time::Duration::from_secs(5));
}

/// One standalone pod (its run id drawn at random, which its lane agents
/// take from it): a lane beside the main actor, then, once that actor is
/// closed, a plain run on the idle main run's slots while the lane still
/// answers (the lane's sequence number does not hold the idle pods back).
#[test]
fn a_standalone_pod_runs_a_lane_and_then_a_main_run_beside_it() {
    let dir = tempfile::tempdir().expect("tmp");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, format!("{}\n", crate::serve::TOKEN)).expect("token");
    let control = free_port();
    let serve_dir = dir.path().join("pod0");
    let args = crate::serve::standalone_args(control, &token_file, &serve_dir);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut pod = Pod::start(&args, &[("TRAINLET_TEST_MARKER", "lanes-standalone")]);
    pod.wait_for_stderr("control API listening", std::time::Duration::from_secs(30));
    let s = crate::serve::Served {
        pods: vec![pod],
        url: format!("http://127.0.0.1:{control}"),
        token_file,
        dir,
        store_port: 0,
    };
    let (steps, stdout) = phase(&s, &["standalone"]);
    let st = steps.get("standalone").unwrap_or_else(|| panic!("no step standalone:\n{stdout}"));
    assert_eq!((ranks(&st["a"]).len(), ranks(&st["b"]).len()), (1, 1), "{st}");
    assert_ne!(ranks(&st["a"])[0]["port"], ranks(&st["b"])[0]["port"], "each its own worker store: {st}");
    assert_eq!(st["run_ok"], true, "{st}");
    assert!(st["lines"].as_str().is_some_and(|l| l.contains("a main run beside a lane")), "{st}");
    assert_eq!(ranks(&st["b_after"])[0]["pid"], ranks(&st["b"])[0]["pid"], "the lane went on: {st}");
}
