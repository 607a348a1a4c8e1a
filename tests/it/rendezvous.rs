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
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(b.pid()), nix::sys::signal::Signal::SIGTERM).expect("kill");
    assert_eq!(b.code(LIMIT), 143, "{}", b.stderr());
    assert_eq!(a.code(LIMIT), 203, "{}", a.stderr());
    assert!(a.stderr().contains("a peer pod left"), "{}", a.stderr());
}
