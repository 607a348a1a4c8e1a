//! Static rendezvous between simulated pods (no torch needed).

use std::time::Duration;

use crate::util::{Pod, free_port, pet_env};

const LIMIT: Duration = Duration::from_secs(60);

fn pod(nnodes: u32, nproc: u32, node: u32, port: u16, script: &str) -> Pod {
    pod_with(nnodes, nproc, node, port, script, &[])
}

/// Simulated pod `node` at 127.0.0.<node+1>, with extra env (which wins).
fn pod_with(nnodes: u32, nproc: u32, node: u32, port: u16, script: &str, extra: &[(&str, &str)]) -> Pod {
    let env = pet_env(nnodes, nproc, node, port);
    let addr = format!("127.0.0.{}", node + 1);
    let mut pairs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    pairs.push(("TRAINLET_JOIN_TIMEOUT", "20"));
    pairs.push(("PET_LOCAL_ADDR", &addr));
    pairs.extend_from_slice(extra);
    Pod::start(&["run", "--no-python", "/bin/sh", "-c", script], &pairs)
}

#[test]
fn pods_that_disagree_on_the_world_are_refused_by_name() {
    let port = free_port();
    let mut a = pod(2, 1, 0, port, "true");
    let mut b = pod(2, 2, 1, port, "true");
    for p in [&mut a, &mut b] {
        assert_eq!(p.code(LIMIT), 200, "{}", p.stderr());
        let err = p.stderr();
        assert!(err.contains("pods disagree on the job"), "{err}");
        assert!(err.contains("nproc-per-node"), "{err}");
    }
}

#[test]
fn a_second_pod_with_the_same_node_rank_is_refused() {
    let port = free_port();
    let mut a = pod(2, 1, 0, port, "sleep 4");
    let mut b = pod(2, 1, 1, port, "echo READY; sleep 4");
    b.wait_for_output("READY", LIMIT);
    // Another pod (another address) claims node rank 1.
    let mut dup = pod_with(2, 1, 1, port, "true", &[("PET_LOCAL_ADDR", "127.0.0.9")]);
    assert_eq!(dup.code(LIMIT), 200, "{}", dup.stderr());
    assert!(dup.stderr().contains("node rank 1 is already held by node rank 1 (127.0.0.2 pid"), "{}", dup.stderr());
    assert_eq!(a.code(LIMIT), 0, "{}", a.stderr());
    assert_eq!(b.code(LIMIT), 0, "{}", b.stderr());
}

/// Issue 53, finding 4: a second live agent of node rank 1 on the same
/// address (a stale pod back, a misconfigured job) is refused at once,
/// naming both agents, before it takes a slot in any round: the running
/// job keeps its one round (no churn: the store holds the same keys) and
/// ends well.
#[test]
fn a_second_live_agent_of_a_node_rank_is_refused_at_once_and_no_round_churns() {
    let port = free_port();
    let mut a = pod(2, 1, 0, port, "echo READY; sleep 8");
    let mut b = pod(2, 1, 1, port, "echo READY; sleep 8");
    a.wait_for_output("READY", LIMIT);
    b.wait_for_output("READY", LIMIT);
    let before = crate::round_keys::store_keys(port, None);
    // Same address, same node rank, same env: only its pid differs.
    let started = std::time::Instant::now();
    let mut dup = pod(2, 1, 1, port, "echo DUP");
    assert_eq!(dup.code(Duration::from_secs(20)), 200, "{}", dup.stderr());
    assert!(started.elapsed() < Duration::from_secs(8), "refused only after {:?}", started.elapsed());
    let err = dup.stderr();
    let both = format!(
        "node rank 1 is already held by node rank 1 (127.0.0.2 pid {}), which is alive; this pod (127.0.0.2 pid {}) claims it too",
        b.pid(),
        dup.pid()
    );
    assert!(err.contains(&both), "{err}");
    assert!(!dup.stdout().contains("DUP"), "the duplicate started no worker");
    let after = crate::round_keys::store_keys(port, None);
    assert_eq!(after, before, "the duplicate left nothing in the store and no round began");
    for p in [&mut a, &mut b] {
        assert_eq!(p.code(LIMIT), 0, "{}", p.stderr());
        assert_eq!(p.stderr().matches("starting workers").count(), 1, "one round only:\n{}", p.stderr());
    }
}

/// A pod whose agent was SIGKILLed and that comes back at once (the
/// container restarted in place: same address and node rank) is not a
/// duplicate: its predecessor stopped heartbeating, so it takes the node
/// rank over, and the job goes on with it.
#[test]
fn a_pod_restarted_in_place_takes_its_node_rank_back_from_its_dead_self() {
    let (dir, port, script, mut a, mut b) = two_running_pods();
    b.signal(nix::sys::signal::Signal::SIGKILL);
    let _ = b.wait(LIMIT);
    std::fs::write(dir.path().join("again"), "").expect("flag");
    let mut b2 = pod(2, 1, 1, port, &script);
    assert_eq!(b2.code(LIMIT), 0, "{}", b2.stderr());
    assert!(b2.stderr().contains("the agent that held this pod's place is gone"), "{}", b2.stderr());
    assert_eq!(a.code(LIMIT), 0, "{}", a.stderr());
    assert!(a.stdout().contains("DONE"), "{}", a.stdout());
}

/// A pod being deleted (SIGTERM; its worker takes 4 s to stop) while its
/// replacement, same address and node rank, starts (a Job creates it as
/// soon as the old pod terminates): the old agent said it is leaving, so
/// the replacement waits for it to go instead of being refused as a
/// second live claimant, then takes its place, and the job completes.
#[test]
fn a_replacement_waits_for_the_pod_it_replaces_to_finish_terminating() {
    let dir = tempfile::tempdir().expect("tmp");
    let flag = dir.path().join("again");
    let script = format!(
        "if [ -e {f} ]; then echo DONE; else echo READY; trap 'sleep 4; exit 1' TERM; sleep 100 & wait; fi",
        f = flag.display()
    );
    let port = free_port();
    let mut a = pod(2, 1, 0, port, &script);
    let mut b = pod(2, 1, 1, port, &script);
    a.wait_for_output("READY", LIMIT);
    b.wait_for_output("READY", LIMIT);
    b.signal(nix::sys::signal::Signal::SIGTERM);
    b.wait_for_stderr("stop signal; stopping workers", LIMIT);
    std::fs::write(&flag, "").expect("flag");
    let mut b2 = pod(2, 1, 1, port, &script);
    b2.wait_for_stderr("is leaving (it got a stop signal); waiting for it to go", LIMIT);
    assert!(b.child.try_wait().expect("try_wait").is_none(), "the old pod was still terminating:\n{}", b.stderr());
    assert_eq!(b.code(LIMIT), 143, "{}", b.stderr());
    assert_eq!(b2.code(LIMIT), 0, "{}", b2.stderr());
    assert!(b2.stderr().contains("the agent that held this pod's place is gone"), "{}", b2.stderr());
    assert_eq!(a.code(LIMIT), 0, "{}", a.stderr());
    assert!(a.stdout().contains("DONE"), "{}", a.stdout());
}

/// Workers that run until `flag` exists, then succeed.
fn until_flag(flag: &std::path::Path) -> String {
    format!("if [ -e {f} ]; then echo DONE; else echo READY; exec sleep 100; fi", f = flag.display())
}

/// Two pods whose workers run until `<dir>/again` exists (then succeed),
/// both running: (dir, port, script, pod 0, pod 1).
fn two_running_pods() -> (tempfile::TempDir, u16, String, Pod, Pod) {
    let dir = tempfile::tempdir().expect("tmp");
    let script = until_flag(&dir.path().join("again"));
    let port = free_port();
    let mut a = pod(2, 1, 0, port, &script);
    let mut b = pod(2, 1, 1, port, &script);
    a.wait_for_output("READY", LIMIT);
    b.wait_for_output("READY", LIMIT);
    (dir, port, script, a, b)
}

#[test]
fn a_pod_stopped_by_sigterm_leaves_cleanly_and_is_readmitted_when_it_comes_back() {
    let (dir, port, script, mut a, mut b) = two_running_pods();
    let flag = dir.path().join("again");
    b.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(b.code(LIMIT), 143, "{}", b.stderr());
    a.wait_for_stderr("round decided", LIMIT);
    assert!(a.stderr().contains("verdict=regroup"), "a clean departure costs no restart:\n{}", a.stderr());
    // Kubernetes brings the pod back (same address and env): the job goes on.
    std::fs::write(&flag, "").expect("flag");
    let mut b2 = pod(2, 1, 1, port, &script);
    assert_eq!(b2.code(LIMIT), 0, "{}", b2.stderr());
    assert_eq!(a.code(LIMIT), 0, "{}", a.stderr());
    assert!(a.stdout().contains("DONE"), "{}", a.stdout());
}

#[test]
fn a_departed_pod_that_never_comes_back_ends_the_job_at_the_join_deadline() {
    let port = free_port();
    let extra = [("TRAINLET_JOIN_TIMEOUT", "3")];
    let mut a = pod_with(2, 1, 0, port, "echo READY; exec sleep 100", &extra);
    let mut b = pod_with(2, 1, 1, port, "echo READY; exec sleep 100", &extra);
    a.wait_for_output("READY", LIMIT);
    b.wait_for_output("READY", LIMIT);
    b.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(b.code(LIMIT), 143, "{}", b.stderr());
    assert_eq!(a.code(LIMIT), 201, "{}", a.stderr());
    assert!(a.stderr().contains("node ranks [1] did not join"), "{}", a.stderr());
}

/// In a private network + mount namespace, the master's DNS name appears in
/// the hosts file only 2 s after the pods start (headless services publish
/// late): the pod that needs it retries and the job completes.
#[test]
fn a_master_name_published_late_is_retried_until_it_resolves() {
    let dir = tempfile::tempdir().expect("tmp");
    let d = dir.path().display().to_string();
    let bin = crate::util::bin().display().to_string();
    let script = format!(
        r#"set -u
ip link set lo up
cp /etc/hosts {d}/hosts
mount --bind {d}/hosts /etc/hosts
(sleep 2; echo "127.0.0.1 job-node-0-0.job" >> {d}/hosts) &
export PET_NNODES=2 PET_NPROC_PER_NODE=1 PET_MASTER_ADDR=job-node-0-0.job PET_MASTER_PORT=29555 TRAINLET_JOIN_TIMEOUT=60
PET_NODE_RANK=1 {bin} run --no-python /bin/sh -c 'echo WORKER $RANK $MASTER_ADDR' > {d}/pod1.out 2> {d}/pod1.err &
P1=$!
sleep 0.5
PET_NODE_RANK=0 {bin} run --no-python /bin/sh -c 'echo WORKER $RANK $MASTER_ADDR' > {d}/pod0.out 2> {d}/pod0.err &
P0=$!
wait $P1; R1=$?
wait $P0; R0=$?
echo "RC $R0 $R1"
"#
    );
    let out = std::process::Command::new("unshare")
        .args(["--net", "--mount", "sh", "-c", &script])
        .output()
        .expect("unshare (util-linux) is needed for namespace tests");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let read = |f: &str| std::fs::read_to_string(dir.path().join(f)).unwrap_or_default();
    assert!(
        stdout.contains("RC 0 0"),
        "{stdout}\n{}\npod0:\n{}{}\npod1:\n{}{}",
        String::from_utf8_lossy(&out.stderr),
        read("pod0.out"),
        read("pod0.err"),
        read("pod1.out"),
        read("pod1.err")
    );
    assert!(read("pod1.out").contains("WORKER 1 job-node-0-0.job"), "{}", read("pod1.out"));
    assert!(read("pod0.out").contains("WORKER 0 job-node-0-0.job"), "{}", read("pod0.out"));
}

#[test]
fn a_store_host_that_does_not_come_back_ends_the_job_at_the_join_deadline() {
    let port = free_port();
    let extra = [("TRAINLET_JOIN_TIMEOUT", "3")];
    let mut host = pod_with(2, 1, 0, port, "echo READY; exec sleep 100", &extra);
    let mut other = pod_with(2, 1, 1, port, "echo READY; exec sleep 100", &extra);
    host.wait_for_output("READY", LIMIT);
    other.wait_for_output("READY", LIMIT);
    let killed = std::time::Instant::now();
    host.signal(nix::sys::signal::Signal::SIGKILL);
    assert_eq!(other.code(LIMIT), 203, "{}", other.stderr());
    assert!(killed.elapsed() < Duration::from_secs(20), "took {:?}", killed.elapsed());
    let err = other.stderr();
    assert!(err.contains("lost the rendezvous store; waiting for the store host to come back"), "{err}");
    assert!(err.contains("the store host did not come back before the join deadline"), "{err}");
}

#[test]
fn a_pod_stopped_while_the_pods_meet_can_come_back() {
    // Pod 2 of 3 comes late; pod 1 is stopped while the others wait, then restarted.
    let port = free_port();
    let mut host = pod(3, 1, 0, port, "true");
    let mut leaver = pod(3, 1, 1, port, "true");
    leaver.wait_for_stderr("joined the rendezvous", LIMIT);
    std::thread::sleep(Duration::from_millis(300));
    let stopped = std::time::Instant::now();
    leaver.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(leaver.code(LIMIT), 143, "{}", leaver.stderr());
    assert!(stopped.elapsed() < Duration::from_secs(5), "took {:?}", stopped.elapsed());
    assert!(leaver.stderr().contains("leaving a round that has not formed"), "{}", leaver.stderr());
    let mut back = pod(3, 1, 1, port, "true");
    let mut late = pod(3, 1, 2, port, "true");
    for p in [&mut host, &mut back, &mut late] {
        assert_eq!(p.code(LIMIT), 0, "{}", p.stderr());
    }
}

#[test]
fn a_pod_from_an_older_jobset_attempt_is_rejected_and_the_job_goes_on() {
    let port = free_port();
    let attempt = [("JOBSET_RESTART_ATTEMPT", "1")];
    let mut a = pod_with(2, 1, 0, port, "echo READY; sleep 3", &attempt);
    let mut b = pod_with(2, 1, 1, port, "echo READY; sleep 3", &attempt);
    a.wait_for_output("READY", LIMIT);
    let mut old = pod_with(2, 1, 1, port, "true", &[("JOBSET_RESTART_ATTEMPT", "0"), ("PET_LOCAL_ADDR", "127.0.0.7")]);
    assert_eq!(old.code(LIMIT), 204, "{}", old.stderr());
    assert!(
        old.stderr().contains("this pod belongs to JobSet restart attempt 0, but the job is at attempt 1"),
        "{}",
        old.stderr()
    );
    assert_eq!(a.code(LIMIT), 0, "{}", a.stderr());
    assert_eq!(b.code(LIMIT), 0, "{}", b.stderr());
}

/// Lines of `log` that carry `needle`.
fn lines_with<'a>(log: &'a str, needle: &str) -> Vec<&'a str> {
    log.lines().filter(|l| l.contains(needle)).collect()
}

/// A pod that starts before the store, and pods that wait for a missing
/// peer, say at info level what they wait for: the store's address and the
/// last connect error, who joined and which node ranks are missing, and
/// how long is left; again when that changes and every 10 s while it does
/// not. The store host logs the round it formed.
#[test]
fn waiting_pods_say_what_they_wait_for_at_info_level() {
    let port = free_port();
    let extra = [("TRAINLET_JOIN_TIMEOUT", "60")];
    let mut b = pod_with(3, 1, 1, port, "true", &extra);
    let store = format!("waiting for the rendezvous store at 127.0.0.1:{port}: not reachable yet; last error: ");
    b.wait_for_stderr(&store, LIMIT);
    assert!(lines_with(&b.stderr(), &store)[0].contains(" INFO "), "{}", b.stderr());
    let mut a = pod_with(3, 1, 0, port, "true", &extra);
    let missing =
        format!("waiting for pods to join round 0 at 127.0.0.1:{port}: 2 of 3 joined; missing node ranks [2]");
    a.wait_for_stderr(&missing, LIMIT);
    b.wait_for_stderr(&missing, LIMIT);
    // Unchanged, the line comes back every 10 s (with less time left).
    let started = std::time::Instant::now();
    while lines_with(&a.stderr(), &missing).len() < 2 {
        assert!(started.elapsed() < LIMIT, "the wait went silent:\n{}", a.stderr());
        std::thread::sleep(Duration::from_millis(200));
    }
    let log = a.stderr();
    let repeats = lines_with(&log, &missing);
    let left: Vec<u64> = repeats
        .iter()
        .map(|l| crate::util::parse_kv(l).get("left_s").and_then(|v| v.parse().ok()).expect("left_s"))
        .collect();
    assert!(left[1] + 9 <= left[0] && left[0] <= 60, "{left:?}\n{log}");
    assert!(repeats.iter().all(|l| l.contains(" INFO ")), "{log}");
    let mut c = pod_with(3, 1, 2, port, "true", &extra);
    for p in [&mut a, &mut b, &mut c] {
        assert_eq!(p.code(LIMIT), 0, "{}", p.stderr());
    }
    let formed = lines_with(&a.stderr(), "round formed").join("\n");
    assert!(formed.contains("INFO") && formed.contains("round=0 nnodes=3"), "{}", a.stderr());
}

/// The store host stopped by SIGTERM leaves cleanly (preemption, scale
/// down): the other pod logs why it lost the store as a warning, not an
/// error, and carries on when the store host comes back.
#[test]
fn a_store_host_that_leaves_cleanly_is_not_an_error() {
    let (dir, port, script, mut a, mut b) = two_running_pods();
    let flag = dir.path().join("again");
    a.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(a.code(LIMIT), 143, "{}", a.stderr());
    b.wait_for_stderr("the store host left the job cleanly", LIMIT);
    std::fs::write(&flag, "").expect("flag");
    let mut a2 = pod(2, 1, 0, port, &script);
    assert_eq!(a2.code(LIMIT), 0, "{}", a2.stderr());
    assert_eq!(b.code(LIMIT), 0, "{}", b.stderr());
    let log = b.stderr();
    assert!(lines_with(&log, "the store host left the job cleanly")[0].contains(" WARN "), "{log}");
    assert!(lines_with(&log, " ERROR ").is_empty(), "a clean leave logged an error:\n{log}");
}
