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

/// Workers that run until `flag` exists, then succeed.
fn until_flag(flag: &std::path::Path) -> String {
    format!("if [ -e {f} ]; then echo DONE; else echo READY; exec sleep 100; fi", f = flag.display())
}

#[test]
fn a_pod_stopped_by_sigterm_leaves_cleanly_and_is_readmitted_when_it_comes_back() {
    let dir = tempfile::tempdir().expect("tmp");
    let flag = dir.path().join("again");
    let script = until_flag(&flag);
    let port = free_port();
    let mut a = pod(2, 1, 0, port, &script);
    let mut b = pod(2, 1, 1, port, &script);
    a.wait_for_output("READY", LIMIT);
    b.wait_for_output("READY", LIMIT);
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
