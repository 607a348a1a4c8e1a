//! Actors on served pods: 2 simulated pods (127.0.0.1-2) x 2 workers, real
//! torch (gloo, CPU), driven by the repository's Python client
//! (`tests/fixtures/actor_driver_test.py`, and a Jupyter notebook run by
//! `tests/fixtures/notebook_actor_driver.py`), which print one JSON line
//! per step; the assertions are here.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use crate::serve::{json, start};
use crate::util::*;

/// Weights of `actor_trainer.py --reference STEPS WORLD`: one process, the
/// ranks' gradients averaged as DDP does.
fn reference(steps: u32, world: u32) -> Vec<f64> {
    let out = std::process::Command::new(python())
        .arg(fixture("actor_trainer.py"))
        .args(["--reference", &steps.to_string(), &world.to_string()])
        .output()
        .expect("python");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("weights")
}

fn close(a: &serde_json::Value, b: &[f64]) -> bool {
    let a: Vec<f64> = a.as_array().expect("weights").iter().filter_map(serde_json::Value::as_f64).collect();
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-5)
}

#[test]
fn an_actor_keeps_its_state_across_calls_and_survives_exceptions_and_a_killed_rank() {
    let mut s = start(2, &[]);
    let out = std::process::Command::new(python())
        .arg(fixture("actor_driver_test.py"))
        .args([s.url.as_str(), &s.token_file.display().to_string(), &fixture("actor_trainer.py")])
        .output()
        .expect("driver");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "driver failed: {}\n{stdout}\npod 0:\n{}\npod 1:\n{}",
        String::from_utf8_lossy(&out.stderr),
        s.pods[0].stderr(),
        s.pods[1].stderr()
    );
    let steps: HashMap<String, serde_json::Value> =
        stdout.lines().map(json).map(|v| (v["step"].as_str().unwrap_or("").to_string(), v)).collect();
    let step = |name: &str| steps.get(name).unwrap_or_else(|| panic!("no step {name}:\n{stdout}"));

    // State kept across five calls: counters and parameters the same on every
    // rank, equal to the single-process reference; one process per rank.
    let five = step("five_calls")["states"].as_array().expect("states");
    assert_eq!(five.len(), 5, "{stdout}");
    for (i, call) in five.iter().enumerate() {
        let ranks = call.as_array().expect("ranks");
        assert_eq!(ranks.len(), 4, "every rank answered call {i}: {call}");
        let want = if i == 4 { 8 } else { 2 * (i as u64 + 1) };
        for (r, st) in ranks.iter().enumerate() {
            assert_eq!(st["rank"], r as u64, "results come in rank order: {call}");
            assert_eq!(st["steps"], want, "call {i}: {call}");
            assert_eq!(st["world"], 4, "{call}");
        }
        let params: BTreeSet<&str> = ranks.iter().filter_map(|st| st["params"].as_str()).collect();
        assert_eq!(params.len(), 1, "DDP kept the ranks identical: {call}");
    }
    let last = &five[4].as_array().expect("ranks")[0];
    assert!(close(&last["weights"], &reference(8, 4)), "equal to the one-process reference: {last}");
    let pids: BTreeSet<u64> = five
        .iter()
        .flat_map(|c| c.as_array().expect("ranks").iter().map(|st| st["pid"].as_u64().unwrap_or(0)))
        .collect();
    assert_eq!(pids.len(), 4, "one process per rank for every call: {pids:?}");

    // A call that does not return in time says where each rank is: inside
    // the method, at its loop's line (read from outside the workers).
    let timeout = step("timeout");
    let message = timeout["message"].as_str().unwrap_or_default();
    assert!(message.contains("still running after 1s; rank 0 at actor_trainer.py:"), "{timeout}");
    let where_ = timeout["where"].as_object().expect("where");
    assert_eq!(where_.len(), 4, "every rank: {timeout}");
    for place in where_.values() {
        let place = place.as_str().unwrap_or_default();
        assert!(place.starts_with("actor_trainer.py:") && place.ends_with(" in Trainer.slow"), "{timeout}");
    }

    // A call answers while another runs in the same processes.
    let conc = step("concurrent");
    assert_eq!(conc["slow_done_when_state_answered"], false, "{conc}");
    assert_eq!(conc["slow"], serde_json::json!([0, 1, 2, 3]), "{conc}");
    let during: BTreeSet<u64> =
        conc["state"].as_array().expect("state").iter().filter_map(|st| st["pid"].as_u64()).collect();
    assert_eq!(during, pids, "the same worker processes: {conc}");

    // Cancelled: the method's thread got the exception, well before 60 s.
    let cancel = step("cancel");
    assert_eq!(cancel["raised"]["type"], "CallCancelled", "{cancel}");
    assert!(cancel["seconds"].as_f64().unwrap_or(99.0) < 20.0, "{cancel}");

    // An exception comes back with its rank and remote traceback; the actor lives on.
    let fail = step("fail");
    let raised = &fail["raised"];
    assert_eq!((raised["type"].as_str(), raised["rank"].as_u64()), (Some("ValueError"), Some(1)), "{fail}");
    assert!(raised["message"].as_str().is_some_and(|m| m.contains("rank 1")), "{fail}");
    assert!(
        raised["traceback"].as_str().is_some_and(|t| t.contains("actor_trainer.py") && t.contains("in fail")),
        "{fail}"
    );
    let after = fail["after"].as_array().expect("after");
    assert!(after.iter().all(|st| st["steps"] == 9), "train() works after the exception, state kept: {fail}");

    // A killed rank: WorkerDied naming rank 3 and SIGKILL; the actor is
    // rebuilt (every rank re-instantiated) and answers again.
    let die = step("die");
    let raised = &die["raised"];
    assert_eq!((raised["class"].as_str(), raised["rank"].as_u64()), (Some("WorkerDied"), Some(3)), "{die}");
    let root = raised["failures"].as_array().expect("failures").iter().find(|f| f[0] == 3).expect("rank 3");
    assert_eq!(root[1]["signal"], "SIGKILL", "{die}");
    let after = die["after"].as_array().expect("after");
    assert_eq!(after.len(), 4, "{die}");
    let new_pids: BTreeSet<u64> = after.iter().filter_map(|st| st["pid"].as_u64()).collect();
    assert!(new_pids.is_disjoint(&pids), "every rank re-instantiated: {die}");
    assert!(after.iter().all(|st| st["steps"] == 0), "{die}");

    // The cache directory outlives the actor that wrote into it.
    let paths = step("cache_put")["paths"].as_array().expect("paths").clone();
    assert!(
        paths.iter().all(|p| p.as_str().is_some_and(|p| p.contains(&s.dir.path().display().to_string()))),
        "{paths:?}"
    );
    assert_eq!(
        step("cache_get")["texts"],
        serde_json::json!(["across actors", "across actors", "across actors", "across actors"]),
        "{stdout}"
    );

    // A function is a one-method actor.
    let f = step("function");
    let values = f["values"].as_array().unwrap_or_else(|| panic!("{f}"));
    assert_eq!(values.len(), 4, "{f}");
    assert!(close(&values[0], &reference(2, 1)), "{f}");

    for p in &mut s.pods {
        p.wait_for_stderr("actor instantiated", Duration::from_secs(5));
    }

    // Each pod's cache use in GET /v1/status: the one file of 13 bytes
    // ("across actors") the first actor wrote on each pod.
    let want = |c: &serde_json::Value| {
        let pods: BTreeSet<&str> = c.as_array().into_iter().flatten().filter_map(|u| u["pod"].as_str()).collect();
        let all = c.as_array().is_some_and(|c| c.iter().all(|u| u["files"] == 1 && u["bytes"] == 13));
        pods == BTreeSet::from(["127.0.0.1", "127.0.0.2"]) && all
    };
    let until = std::time::Instant::now() + Duration::from_secs(60);
    let cache = loop {
        let (code, body) = crate::serve::http(&s.url, "GET", "/v1/status", Some(crate::serve::TOKEN), "");
        assert_eq!(code, 200, "{body}");
        let cache = json(&body)["cache"].clone();
        if want(&cache) || std::time::Instant::now() > until {
            break cache;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    assert!(want(&cache), "{cache}");
    assert!(cache[0]["dir"].as_str().is_some_and(|d| d.ends_with("/cache")), "{cache}");
}

fn setup_phase(s: &crate::serve::Served, wheels: &std::path::Path, args: &[&str]) -> serde_json::Value {
    let out = std::process::Command::new(python())
        .arg(fixture("actor_setup.py"))
        .args([s.url.as_str(), &s.token_file.display().to_string(), &wheels.display().to_string()])
        .args(args)
        .output()
        .expect("driver");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "actor_setup.py {args:?} failed: {}\n{stdout}\npod 0:\n{}\npod 1:\n{}",
        String::from_utf8_lossy(&out.stderr),
        s.pods[0].stderr(),
        s.pods[1].stderr()
    );
    json(stdout.lines().last().unwrap_or(""))
}

/// Setup steps (a variable, a wheel installed by pip from a local
/// directory, a bash step appending to a file) run once on every pod, and
/// a pod that replaces a killed one (with a fresh serve directory) replays
/// them before its workers instantiate the actor again.
#[test]
fn setup_steps_are_replayed_on_a_replacement_pod_before_its_next_call() {
    let mut s = start(2, &["--heartbeat-timeout", "3"]);
    let wheels = s.dir.path().join("wheels");
    let first = setup_phase(&s, &wheels, &["first"]);
    let probe = first["probe"].as_array().expect("probe");
    assert_eq!(probe.len(), 4, "{first}");
    for p in probe {
        assert_eq!((p["tlmark"].as_str(), p["var"].as_str()), (Some("from the wheel"), Some("set")), "{first}");
        assert_eq!(p["marker"], "applied\n", "the bash step ran once on each pod: {first}");
    }
    let old_site = probe[2]["site"].as_str().expect("site").to_string();
    // Pod 1 is lost; its replacement has a fresh serve directory.
    s.pods[1].signal(nix::sys::signal::Signal::SIGKILL);
    let _ = s.pods[1].child.wait();
    std::fs::remove_dir_all(s.dir.path().join("pod1")).expect("pod1's serve dir");
    let control: u16 = s.url.rsplit(':').next().and_then(|p| p.parse().ok()).expect("port");
    s.pods[1] = crate::serve::start_pod(&s, (control, 2), 1, &["--heartbeat-timeout", "3"]);
    let id = first["id"].as_str().expect("id");
    let again = setup_phase(&s, &wheels, &["again", id]);
    let probe = again["probe"].as_array().expect("probe");
    assert_eq!(probe.len(), 4, "{again}");
    for p in probe {
        assert_eq!((p["tlmark"].as_str(), p["var"].as_str()), (Some("from the wheel"), Some("set")), "{again}");
        assert_eq!(p["marker"], "applied\n", "applied once per pod, on the new one too: {again}");
    }
    assert_eq!(probe[2]["site"].as_str(), Some(old_site.as_str()), "{again}");
    s.pods[1].wait_for_stderr("applying a setup step", Duration::from_secs(5));
}

/// One phase of `actor_survivors.py`: its steps by name.
fn survivors_phase(s: &crate::serve::Served, args: &[&str]) -> HashMap<String, serde_json::Value> {
    let out = std::process::Command::new(python())
        .arg(fixture("actor_survivors.py"))
        .args([s.url.as_str(), &s.token_file.display().to_string(), &fixture("actor_trainer.py")])
        .args(args)
        .output()
        .expect("driver");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let pods: Vec<String> = s.pods.iter().enumerate().map(|(i, p)| format!("pod {i}:\n{}", p.stderr())).collect();
    assert!(
        out.status.success(),
        "actor_survivors.py {args:?} failed: {}\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr),
        pods.join("\n")
    );
    stdout.lines().map(json).map(|v| (v["step"].as_str().unwrap_or("").to_string(), v)).collect()
}

/// Every rank's state of a step, in rank order.
fn ranks_of(steps: &HashMap<String, serde_json::Value>, name: &str) -> Vec<serde_json::Value> {
    let step = steps.get(name).unwrap_or_else(|| panic!("no step {name}: {steps:?}"));
    let states = step["states"].as_array().unwrap_or_else(|| panic!("{step}")).clone();
    for (r, st) in states.iter().enumerate() {
        assert_eq!((st["rank"].as_u64(), st["env_rank"].as_u64()), (Some(r as u64), Some(r as u64)), "{step}");
    }
    states
}

fn field(states: &[serde_json::Value], name: &str) -> Vec<u64> {
    states.iter().map(|st| st[name].as_u64().unwrap_or(u64::MAX)).collect()
}

fn one_model(states: &[serde_json::Value]) -> bool {
    states.iter().filter_map(|st| st["params"].as_str()).collect::<BTreeSet<_>>().len() == 1
}

/// Survivors mode (`restart="survivors"`), 2 pods x 2 workers, real torch
/// and gloo: a killed rank restarts alone while ranks 0-2 keep their
/// processes, counters and trained parameters and rejoin the new process
/// group; then a lost pod is replaced and the other pod's ranks survive
/// that too. After each, a DDP step agrees on every rank.
#[test]
fn survivors_keep_their_processes_and_state_through_a_killed_rank_and_a_lost_pod() {
    let mut s = start(2, &["--heartbeat-timeout", "3"]);
    let first = survivors_phase(&s, &["first"]);
    let trained = ranks_of(&first, "trained");
    assert_eq!(field(&trained, "steps"), [3, 3, 3, 3], "{trained:?}");
    let pids = field(&trained, "pid");

    let die = &first["die"]["raised"];
    assert_eq!((die["class"].as_str(), die["rank"].as_u64()), (Some("WorkerDied"), Some(3)), "{die}");
    let root = die["failures"].as_array().expect("failures").iter().find(|f| f[0] == 3).expect("rank 3");
    assert_eq!(root[1]["signal"], "SIGKILL", "{die}");

    let after = ranks_of(&first, "after_death");
    let now = field(&after, "pid");
    assert_eq!(now[..3], pids[..3], "ranks 0-2 kept their processes: {after:?}");
    assert_ne!(now[3], pids[3], "rank 3 is a new process: {after:?}");
    assert_eq!(field(&after, "steps"), [3, 3, 3, 0], "state kept on the survivors only: {after:?}");
    assert_eq!(field(&after, "reconfigured"), [1, 1, 1, 0], "{after:?}");
    assert_eq!(field(&after, "restart_count"), [1, 1, 1, 1], "the new round's variables: {after:?}");
    assert!(after[..3].iter().all(|st| st["params"] == trained[0]["params"]), "trained parameters kept: {after:?}");
    let again = ranks_of(&first, "trained_again");
    assert_eq!(field(&again, "steps"), [4, 4, 4, 1], "{again:?}");
    assert!(one_model(&again), "the fresh rank took rank 0's parameters: {again:?}");

    // Pod 1 is lost and replaced: pod 0's ranks survive that too.
    s.pods[1].signal(nix::sys::signal::Signal::SIGKILL);
    let _ = s.pods[1].child.wait();
    std::fs::remove_dir_all(s.dir.path().join("pod1")).expect("pod1's serve dir");
    let control: u16 = s.url.rsplit(':').next().and_then(|p| p.parse().ok()).expect("port");
    s.pods[1] = crate::serve::start_pod(&s, (control, 2), 1, &["--heartbeat-timeout", "3"]);
    let id = first["trained"]["id"].as_str().expect("id").to_string();
    let later = survivors_phase(&s, &["again", &id]);
    let lost = ranks_of(&later, "after_loss");
    let pids_after = field(&lost, "pid");
    assert_eq!(pids_after[..2], pids[..2], "pod 0's ranks kept their processes: {lost:?}");
    assert!(!pids_after[2..].iter().any(|p| now.contains(p)), "pod 1's ranks are new: {lost:?}");
    assert_eq!(field(&lost, "steps"), [4, 4, 0, 0], "{lost:?}");
    assert_eq!(field(&lost, "reconfigured"), [2, 2, 0, 0], "{lost:?}");
    let trained = ranks_of(&later, "trained_after_loss");
    assert_eq!(field(&trained, "steps"), [5, 5, 1, 1], "{trained:?}");
    assert!(one_model(&trained), "{trained:?}");
    s.pods[0].wait_for_stderr("a kept worker rejoins", Duration::from_secs(5));
}

/// Survivors mode with a spare (`--spares 1`): of 3 served pods, 2 run
/// the actor (2 workers each) and 1 waits. A training pod other than the
/// store host's is lost: the spare takes its group rank at once (no
/// replacement pod), the other pod's ranks keep their processes and
/// state, and only the spare's ranks start.
#[test]
fn survivors_go_on_with_a_spare_in_the_lost_pods_place() {
    let args = ["--heartbeat-timeout", "3", "--spares", "1"];
    let mut s = start(3, &args);
    let first = survivors_phase(&s, &["first"]);
    let pids = field(&ranks_of(&first, "after_death"), "pid");
    let waits = |p: &crate::util::Pod| p.stderr().contains("the round is full; waiting as a spare");
    let spare = (0..3).find(|&i| waits(&s.pods[i])).expect("a pod waits as a spare");
    let victim = if spare == 1 { 2 } else { 1 };
    let lost_rank = s.pods[victim].stderr().contains("group_rank=1");
    s.pods[victim].signal(nix::sys::signal::Signal::SIGKILL);
    let _ = s.pods[victim].child.wait();
    let id = first["trained"]["id"].as_str().expect("id").to_string();
    let later = survivors_phase(&s, &["again", &id]);
    s.pods[spare].wait_for_stderr("this spare takes over group rank", Duration::from_secs(5));
    let lost = ranks_of(&later, "after_loss");
    let (kept, fresh) = if lost_rank { (0..2, 2..4) } else { (2..4, 0..2) };
    let now = field(&lost, "pid");
    assert_eq!(now[kept.clone()], pids[kept.clone()], "the other pod's ranks kept their processes: {lost:?}");
    assert!(!now[fresh.clone()].iter().any(|p| pids.contains(p)), "the spare's ranks are new: {lost:?}");
    let steps = field(&lost, "steps");
    assert!(kept.clone().all(|r| steps[r] == 4) && fresh.clone().all(|r| steps[r] == 0), "{lost:?}");
    let trained = ranks_of(&later, "trained_after_loss");
    assert!(one_model(&trained), "{trained:?}");
    assert!(trained.iter().all(|st| st["world"] == 4), "the world keeps its size: {trained:?}");
}

/// Survivors mode in an elastic job (`--nnodes 1:2`): pod 1 is lost and
/// not replaced; pod 0's ranks keep their processes and state as a world
/// of 2 and train on.
#[test]
fn survivors_go_on_in_a_world_that_shrinks() {
    let mut s = start(2, &["--heartbeat-timeout", "3", "--nnodes", "1:2", "--last-call-timeout", "2"]);
    let first = survivors_phase(&s, &["first"]);
    let pids = field(&ranks_of(&first, "trained"), "pid");
    s.pods[1].signal(nix::sys::signal::Signal::SIGKILL);
    let _ = s.pods[1].child.wait();
    let id = first["trained"]["id"].as_str().expect("id").to_string();
    let later = survivors_phase(&s, &["again", &id]);
    let lost = ranks_of(&later, "after_loss");
    assert_eq!(field(&lost, "pid"), pids[..2], "{lost:?}");
    assert_eq!(field(&lost, "steps"), [4, 4], "{lost:?}");
    assert!(lost.iter().all(|st| st["world"] == 2), "{lost:?}");
    let trained = ranks_of(&later, "trained_after_loss");
    assert_eq!(field(&trained, "steps"), [5, 5], "{trained:?}");
    assert!(one_model(&trained), "{trained:?}");
}

/// Survivors mode: pod 1 is lost and pod 0 keeps its workers while it
/// waits for a replacement (the job is not elastic). Closing the actor
/// then stops them at once, not when a round forms at last, and with them
/// the `setsid()` children they started (which would otherwise rewrite the
/// next run's files after their check: issue 40, finding 4).
#[test]
fn survivors_kept_while_the_pods_wait_are_stopped_when_the_actor_is_closed() {
    let mut s = start(2, &["--heartbeat-timeout", "3"]);
    let first = survivors_phase(&s, &["first", "plant"]);
    let mut pids = field(&ranks_of(&first, "after_death"), "pid");
    let planted: Vec<u64> =
        first["planted"]["pids"].as_array().expect("planted").iter().filter_map(|p| p.as_u64()).collect();
    assert_eq!(planted.len(), 2, "ranks 0 and 1 each started one: {}", first["planted"]);
    pids.truncate(2);
    pids.extend(&planted);
    s.pods[1].signal(nix::sys::signal::Signal::SIGKILL);
    let _ = s.pods[1].child.wait();
    s.pods[0].wait_for_stderr("declaring them dead", Duration::from_secs(30));
    s.pods[0].wait_for_stderr("verdict=regroup dead=true", Duration::from_secs(10));
    let alive = |pid: u64| std::path::Path::new(&format!("/proc/{pid}")).exists();
    assert!(pids.iter().all(|&p| alive(p)), "pod 0's workers are kept: {pids:?}\n{}", s.pods[0].stderr());
    let id = first["trained"]["id"].as_str().expect("id").to_string();
    let token = crate::serve::TOKEN;
    let (status, body) = crate::serve::http(&s.url, "DELETE", &format!("/v1/actors/{id}"), Some(token), "");
    assert!(status < 300, "{status} {body}");
    let until = std::time::Instant::now() + Duration::from_secs(20);
    while pids.iter().any(|&p| alive(p)) && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        !pids.iter().any(|&p| alive(p)),
        "the closed actor's kept workers and the setsid() children they started are gone: {pids:?}\n{}",
        s.pods[0].stderr()
    );
}

/// Classes and functions from a notebook (issue 42): a real Jupyter kernel
/// (ipykernel through nbclient, tests/fixtures/notebook_actor_driver.py)
/// defines them in cells and passes them to the client as objects; they
/// run as actors on 2 simulated pods x 2 workers with what they use from
/// the notebook (a helper, a dict, a dataclass, a base class in another
/// cell), a notebook dataclass goes in and comes back pickled, and what
/// cannot travel is refused in the notebook with the reason.
#[test]
fn a_class_and_a_function_defined_in_notebook_cells_run_as_actors() {
    let s = start(2, &[]);
    let out = std::process::Command::new(python())
        .arg(fixture("notebook_actor_driver.py"))
        .args([s.url.as_str(), &s.token_file.display().to_string()])
        .output()
        .expect("driver");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let all = format!(
        "driver: {}\n{stdout}\npod 0:\n{}\npod 1:\n{}",
        String::from_utf8_lossy(&out.stderr),
        s.pods[0].stderr(),
        s.pods[1].stderr()
    );
    assert!(out.status.success(), "{all}");
    let steps: HashMap<String, serde_json::Value> = stdout
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(json)
        .map(|v| (v["step"].as_str().unwrap_or("").to_string(), v))
        .collect();
    let step = |name: &str| steps.get(name).unwrap_or_else(|| panic!("no step {name}:\n{all}"));

    let class = step("class");
    assert!(class["target"].as_str().is_some_and(|t| t.starts_with("_trainlet_main_") && t.ends_with(":Counter")));
    for (call, total) in [("first", 3), ("second", 9)] {
        let ranks = class[call].as_array().expect("ranks");
        let got: Vec<(u64, u64)> =
            ranks.iter().map(|r| (r["rank"].as_u64().unwrap_or(99), r["total"].as_u64().unwrap_or(0))).collect();
        assert_eq!(got, [(0, total), (1, total), (2, total), (3, total)], "scaled() and SCALE went along: {class}");
    }
    let pids: BTreeSet<u64> =
        class["second"].as_array().expect("ranks").iter().filter_map(|r| r["pid"].as_u64()).collect();
    assert_eq!(pids.len(), 4, "one worker per rank: {class}");

    let pickled = step("pickled");
    assert_eq!(pickled["is_cfg"], true, "the notebook's own Cfg came back: {pickled}");
    assert_eq!(pickled["type"], "__main__.Cfg", "{pickled}");
    assert_eq!((pickled["start"].as_u64(), pickled["label"].as_str()), (Some(13), Some("nb!")), "{pickled}");

    let function = step("function");
    assert_eq!(function["values"], serde_json::json!([48, 48]), "{function}");
    assert_eq!(function["again"], true, "an unchanged class is the same module: {function}");

    let refused = step("refused");
    let errors = &refused["errors"];
    for (case, words) in
        [("lambda", ["pick", "lambda"]), ("socket", ["sock", "pickle"]), ("local", ["Inner", "inside a function"])]
    {
        let e = errors[case].as_str().unwrap_or_default();
        assert!(words.iter().all(|w| e.contains(w)), "{case}: {e:?}\n{all}");
    }
    assert_eq!(refused["record"], "running", "a refusal deploys nothing and leaves the actor be: {refused}");
    let laptop = step("laptop")["error"].as_str().unwrap_or_default().to_string();
    assert!(laptop.contains("ModuleNotFoundError") && laptop.contains("laptop_only"), "{laptop}\n{all}");
}
