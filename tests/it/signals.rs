//! Signals and PID-1 duties with misbehaving fixture workers.

use std::time::{Duration, Instant};

use crate::util::{Pod, fixture, processes_with_marker, unique_marker, wait_until_gone};

#[test]
fn sigterm_escalates_to_sigkill_after_the_grace_and_leaves_no_process() {
    let marker = unique_marker();
    let script = fixture("stubborn_worker.sh");
    let mut pod = Pod::start(
        &["run", "--no-python", "--nproc-per-node", "2", "--shutdown-timeout", "2", &script],
        &[("TRAINLET_TEST_MARKER", &marker)],
    );
    pod.wait_for_output("READY 0", Duration::from_secs(60));
    pod.wait_for_output("READY 1", Duration::from_secs(60));
    // Workers, their in-group grandchildren and the escaped ones are all alive.
    assert!(processes_with_marker(&marker).len() >= 7, "expected agent + 2 workers + 4 grandchildren");
    let sent = Instant::now();
    pod.signal(nix::sys::signal::Signal::SIGTERM);
    let code = pod.code(Duration::from_secs(60));
    let took = sent.elapsed();
    assert_eq!(code, 143, "stderr:\n{}", pod.stderr());
    assert!(took >= Duration::from_millis(1900), "workers ignore SIGTERM, so the grace must run out ({took:?})");
    assert!(took < Duration::from_secs(20), "SIGKILL must follow the 2 s grace ({took:?})");
    wait_until_gone(&marker, Duration::from_secs(10));
}

#[test]
fn sigterm_during_rendezvous_exits_promptly() {
    // Node 1 of 2 waits for a store nobody serves; SIGTERM must still stop it.
    let port = crate::util::free_port().to_string();
    let mut pod = Pod::start(
        &["run", "--no-python", "--nnodes", "2", "--node-rank", "1", "--master-port", &port, "/bin/true"],
        &[],
    );
    std::thread::sleep(Duration::from_millis(500));
    pod.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(pod.code(Duration::from_secs(20)), 143, "stderr:\n{}", pod.stderr());
}

#[test]
fn a_worker_killed_by_a_signal_gives_128_plus_n() {
    let mut pod = Pod::start(
        &[
            "run",
            "--no-python",
            "--nproc-per-node",
            "2",
            "/bin/sh",
            "-c",
            "[ $LOCAL_RANK = 1 ] && kill -9 $$; sleep 30",
        ],
        &[],
    );
    let started = Instant::now();
    assert_eq!(pod.code(Duration::from_secs(60)), 137, "stderr:\n{}", pod.stderr());
    assert!(started.elapsed() < Duration::from_secs(25), "the sleeping worker must be stopped");
    assert!(pod.stderr().contains("rank      : 1 (local_rank: 1)"), "{}", pod.stderr());
}

#[test]
fn workers_die_with_the_agent_even_on_sigkill() {
    let marker = unique_marker();
    let mut pod = Pod::start(
        &[
            "run",
            "--no-python",
            "--nproc-per-node",
            "2",
            "/bin/sh",
            "-c",
            "trap '' TERM; echo READY $RANK; exec sleep 1000",
        ],
        &[("TRAINLET_TEST_MARKER", &marker)],
    );
    pod.wait_for_output("READY 0", Duration::from_secs(60));
    pod.wait_for_output("READY 1", Duration::from_secs(60));
    assert_eq!(processes_with_marker(&marker).len(), 3, "agent and two workers");
    pod.signal(nix::sys::signal::Signal::SIGKILL);
    pod.wait(Duration::from_secs(10));
    wait_until_gone(&marker, Duration::from_secs(10));
}
