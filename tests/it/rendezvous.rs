//! Static rendezvous between simulated pods (no torch needed).

use std::time::Duration;

use crate::util::{Pod, free_port, pet_env};

const LIMIT: Duration = Duration::from_secs(60);

fn pod(nnodes: u32, nproc: u32, node: u32, port: u16, script: &str) -> Pod {
    let env = pet_env(nnodes, nproc, node, port);
    let mut pairs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    pairs.push(("TRAINLET_JOIN_TIMEOUT", "20"));
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
    let mut a = pod(2, 1, 0, port, "sleep 3");
    let mut b = pod(2, 1, 1, port, "sleep 3");
    std::thread::sleep(Duration::from_millis(500));
    let mut dup = pod(2, 1, 1, port, "true");
    assert_eq!(dup.code(LIMIT), 200, "{}", dup.stderr());
    assert!(dup.stderr().contains("node rank 1 is already held by node rank 1"), "{}", dup.stderr());
    assert_eq!(a.code(LIMIT), 0, "{}", a.stderr());
    assert_eq!(b.code(LIMIT), 0, "{}", b.stderr());
}

#[test]
fn a_pod_stopped_by_sigterm_stops_its_peers_with_the_peer_lost_code() {
    let port = free_port();
    let mut a = pod(2, 1, 0, port, "echo READY; exec sleep 100");
    let mut b = pod(2, 1, 1, port, "echo READY; exec sleep 100");
    a.wait_for_output("READY", LIMIT);
    b.wait_for_output("READY", LIMIT);
    b.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(b.code(LIMIT), 143, "{}", b.stderr());
    assert_eq!(a.code(LIMIT), 203, "{}", a.stderr());
    assert!(a.stderr().contains("a peer pod left"), "{}", a.stderr());
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
fn losing_the_store_host_stops_the_other_pods_promptly() {
    let port = free_port();
    let mut host = pod(2, 1, 0, port, "echo READY; exec sleep 100");
    let mut other = pod(2, 1, 1, port, "echo READY; exec sleep 100");
    host.wait_for_output("READY", LIMIT);
    other.wait_for_output("READY", LIMIT);
    let killed = std::time::Instant::now();
    host.signal(nix::sys::signal::Signal::SIGKILL);
    assert_eq!(other.code(LIMIT), 203, "{}", other.stderr());
    assert!(killed.elapsed() < Duration::from_secs(20), "took {:?}", killed.elapsed());
    assert!(other.stderr().contains("lost the rendezvous store"), "{}", other.stderr());
}

#[test]
fn a_pod_stopped_while_the_pods_meet_releases_the_others_at_once() {
    // Pod 2 of 3 never comes; pod 1 is stopped while the others wait for it.
    let port = free_port();
    let mut host = pod(3, 1, 0, port, "true");
    let mut leaver = pod(3, 1, 1, port, "true");
    leaver.wait_for_stderr("joined the rendezvous", LIMIT);
    std::thread::sleep(Duration::from_millis(300));
    let stopped = std::time::Instant::now();
    leaver.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(leaver.code(LIMIT), 143, "{}", leaver.stderr());
    assert_eq!(host.code(LIMIT), 203, "{}", host.stderr());
    assert!(stopped.elapsed() < Duration::from_secs(10), "the join deadline is 20 s; took {:?}", stopped.elapsed());
    assert!(
        host.stderr().contains("node rank 1 left the rendezvous of attempt 0 (stopped by SIGTERM)"),
        "{}",
        host.stderr()
    );
}
