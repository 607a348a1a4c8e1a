//! Fault tolerance with real PyTorch (gloo): a data-parallel job that
//! checkpoints and resumes (tests/fixtures/ckpt_train.py) survives worker
//! crashes, lost pods and a lost store host, and ends with exactly the
//! parameters of an uninterrupted run, or fails with the documented code.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use crate::util::{Pod, fixture, free_port, processes_with_marker, python, unique_marker, wait_until_gone};

const LIMIT: Duration = Duration::from_secs(180);

/// The final-parameter digest of an uninterrupted run (60 steps).
fn reference() -> String {
    reference_of("60")
}

/// The final-parameter digest of an uninterrupted run of `steps` steps.
pub(crate) fn reference_of(steps: &str) -> String {
    let out = std::process::Command::new(python())
        .args([&fixture("ckpt_train.py"), "--reference"])
        .env("STEPS", steps)
        .output()
        .expect("python");
    let s = String::from_utf8_lossy(&out.stdout);
    s.split_whitespace().nth(1).expect("FINAL <digest>").to_string()
}

/// The digest a job printed (`FINAL <digest> world=<n>`) and its world size.
pub(crate) fn final_of(out: &str) -> (String, String) {
    let line = out.lines().rfind(|l| l.contains("FINAL ")).unwrap_or_else(|| panic!("no FINAL line in:\n{out}"));
    let mut words = line.split("FINAL ").nth(1).unwrap_or_default().split_whitespace();
    (words.next().unwrap_or_default().to_string(), words.next().unwrap_or_default().to_string())
}

fn ckpt_step(dir: &Path) -> Option<(u64, String)> {
    let text = std::fs::read_to_string(dir.join("ckpt.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    Some((v["step"].as_u64()?, v["reason"].as_str()?.to_string()))
}

fn wait_for_step(dir: &Path, step: u64, pods: &mut [&mut Pod]) {
    let start = Instant::now();
    while ckpt_step(dir).is_none_or(|(s, _)| s < step) {
        for p in pods.iter_mut() {
            if let Some(st) = p.child.try_wait().expect("try_wait") {
                panic!("a pod exited ({st:?}) before step {step}:\n{}\n{}", p.stdout(), p.stderr());
            }
        }
        assert!(start.elapsed() < LIMIT, "no checkpoint of step {step}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One simulated pod of a job: node `node` at 127.0.0.<node+1>.
struct Job {
    port: u16,
    nnodes: String,
    nproc: u32,
    args: Vec<String>,
    env: Vec<(String, String)>,
    marker: String,
    dir: tempfile::TempDir,
}

impl Job {
    fn new(nnodes: &str, nproc: u32, args: &[&str], env: &[(&str, &str)]) -> Job {
        let dir = tempfile::tempdir().expect("tmp");
        let marker = unique_marker();
        let mut all: Vec<(String, String)> = vec![
            ("CKPT_DIR".into(), dir.path().display().to_string()),
            ("TRAINLET_TEST_MARKER".into(), marker.clone()),
            ("TRAINLET_HEARTBEAT_TIMEOUT".into(), "3".into()),
            ("TRAINLET_LAST_CALL_TIMEOUT".into(), "1".into()),
            ("TRAINLET_JOIN_TIMEOUT".into(), "60".into()),
        ];
        all.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        Job {
            port: free_port(),
            nnodes: nnodes.into(),
            nproc,
            args: args.iter().map(|s| s.to_string()).collect(),
            env: all,
            marker,
            dir,
        }
    }

    fn pod(&self, node: u32) -> Pod {
        self.pod_with(node, &[])
    }

    fn pod_with(&self, node: u32, extra: &[(&str, &str)]) -> Pod {
        let mut args: Vec<&str> = vec!["run", "--nnodes", &self.nnodes];
        args.extend(self.args.iter().map(String::as_str));
        let script = fixture("ckpt_train.py");
        args.push(&script);
        let addr = format!("127.0.0.{}", node + 1);
        let (port, nproc, rank) = (self.port.to_string(), self.nproc.to_string(), node.to_string());
        let mut env: Vec<(&str, &str)> = vec![
            ("PET_NPROC_PER_NODE", &nproc),
            ("PET_NODE_RANK", &rank),
            ("PET_MASTER_ADDR", "127.0.0.1"),
            ("PET_MASTER_PORT", &port),
            ("PET_LOCAL_ADDR", &addr),
        ];
        env.extend(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        env.extend(extra.iter().copied());
        Pod::start(&args, &env)
    }

    fn pods(&self, n: u32) -> Vec<Pod> {
        (0..n).map(|i| self.pod(i)).collect()
    }

    fn dir(&self) -> &Path {
        self.dir.path()
    }
}

fn all_succeed(pods: &mut [Pod]) {
    for p in pods.iter_mut() {
        assert_eq!(p.code(LIMIT), 0, "stdout:\n{}\nstderr:\n{}", p.stdout(), p.stderr());
    }
}

#[test]
fn a_worker_killed_mid_training_restarts_every_pod_and_the_job_resumes_exactly() {
    let want = reference();
    let job = Job::new("2", 2, &["--max-restarts", "1"], &[]);
    let mut pods = job.pods(2);
    {
        let (a, b) = pods.split_at_mut(1);
        wait_for_step(job.dir(), 10, &mut [&mut a[0], &mut b[0]]);
    }
    let agents: Vec<i32> = pods.iter().map(Pod::pid).collect();
    let worker = processes_with_marker(&job.marker).into_iter().find(|p| !agents.contains(p)).expect("a worker");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(worker), Signal::SIGKILL).expect("kill");
    all_succeed(&mut pods);
    for p in &pods {
        assert!(p.stderr().contains("restarting every pod's workers"), "{}", p.stderr());
        assert!(p.stderr().contains("verdict=restart:1"), "{}", p.stderr());
    }
    let (digest, world) = final_of(&pods[0].stdout());
    assert_eq!(digest, want, "the resumed job must end with the uninterrupted run's parameters");
    assert_eq!(world, "world=4");
    assert!(pods[0].stdout().contains("restart=1"), "{}", pods[0].stdout());
}

#[test]
fn an_elastic_job_shrinks_when_a_pod_dies_and_grows_when_it_returns() {
    let want = reference_of("90");
    let job = Job::new("2:3", 1, &["--max-restarts", "0"], &[("STEPS", "90")]);
    let mut pods = job.pods(3);
    {
        let (a, rest) = pods.split_at_mut(1);
        let (b, c) = rest.split_at_mut(1);
        wait_for_step(job.dir(), 10, &mut [&mut a[0], &mut b[0], &mut c[0]]);
    }
    // The whole non-store pod dies (agent SIGKILLed; its worker follows).
    pods[2].signal(Signal::SIGKILL);
    pods[2].wait(LIMIT);
    pods[0].wait_for_stderr("nnodes=2 world_size=2", LIMIT);
    assert!(pods[0].stderr().contains("members stopped heartbeating") || pods[1].stderr().contains("verdict=regroup"));
    // Kubernetes restarts it in place: same address, same env.
    pods[2] = job.pod(2);
    all_succeed(&mut pods);
    let (digest, world) = final_of(&pods[0].stdout());
    assert_eq!(digest, want, "shrinking and growing must not change the result");
    assert_eq!(world, "world=3", "the job finished with the returned pod");
    for p in &pods[..2] {
        let err = p.stderr();
        assert!(err.contains("verdict=regroup"), "{err}");
        assert!(!err.contains("verdict=restart"), "membership changes cost no restart:\n{err}");
    }
}

#[test]
fn the_store_host_killed_and_restarted_resumes_the_job() {
    let want = reference();
    let job = Job::new("2", 1, &[], &[]);
    let mut pods = job.pods(2);
    {
        let (a, b) = pods.split_at_mut(1);
        wait_for_step(job.dir(), 10, &mut [&mut a[0], &mut b[0]]);
    }
    pods[0].signal(Signal::SIGKILL);
    pods[0].wait(LIMIT);
    pods[1].wait_for_stderr("waiting for the store host to come back", LIMIT);
    pods[0] = job.pod(0);
    all_succeed(&mut pods);
    assert!(pods[1].stderr().contains("reconnected to the rendezvous store"), "{}", pods[1].stderr());
    let (digest, _) = final_of(&pods[0].stdout());
    assert_eq!(digest, want);
}

#[test]
fn exit_3_under_a_fail_rule_fails_the_job_at_once_with_the_failjob_code() {
    let job = Job::new(
        "2",
        1,
        &["--on-exit", "3=fail", "--max-restarts", "3"],
        &[("FAIL_AT", "1@0"), ("FAIL_CODE", "3"), ("FAIL_STEP", "5")],
    );
    let mut pods = job.pods(2);
    for p in pods.iter_mut() {
        assert_eq!(p.code(LIMIT), 205, "{}", p.stderr());
        let err = p.stderr();
        assert!(err.contains("worker rank 1 (exit code 3) matched a fail rule"), "{err}");
        assert!(!err.contains("restarting every pod"), "{err}");
    }
    wait_until_gone(&job.marker, Duration::from_secs(10));
}

#[test]
fn the_restart_budget_is_shared_by_all_pods() {
    // Pod 0's worker fails in the first run, pod 1's in the second: with a
    // job-wide budget of 1 the second failure ends the job (torchrun's
    // per-agent budget would restart again).
    let job =
        Job::new("2", 1, &["--max-restarts", "1"], &[("FAIL_AT", "0@0,1@1"), ("FAIL_CODE", "7"), ("FAIL_STEP", "3")]);
    let mut pods = job.pods(2);
    for p in pods.iter_mut() {
        assert_eq!(p.code(LIMIT), 7, "{}", p.stderr());
        let err = p.stderr();
        assert_eq!(err.matches("restarting every pod's workers").count(), 1, "{err}");
        assert!(err.contains("worker rank 1 failed with exit code 7; no restarts left"), "{err}");
        assert!(
            err.contains("rank      : 0 (local_rank: 0)") && err.contains("rank      : 1 (local_rank: 0)"),
            "{err}"
        );
    }
}

#[test]
fn sigterm_with_a_checkpoint_signal_lets_workers_checkpoint_then_exits_143() {
    let want = reference();
    let dir = tempfile::tempdir().expect("tmp");
    let marker = unique_marker();
    let d = dir.path().display().to_string();
    let env = [
        ("CKPT_DIR", d.as_str()),
        ("CKPT_SIGNAL", "SIGUSR1"),
        ("CKPT_EVERY", "1000"),
        ("STEP_SLEEP", "0.05"),
        ("TRAINLET_TEST_MARKER", marker.as_str()),
    ];
    let script = fixture("ckpt_train.py");
    let args = [
        "run",
        "--nproc-per-node",
        "2",
        "--checkpoint-signal",
        "SIGUSR1",
        "--checkpoint-timeout",
        "10",
        "--shutdown-timeout",
        "20",
        &script,
    ];
    let mut pod = Pod::start(&args, &env);
    pod.wait_for_output("START rank=0", LIMIT);
    std::thread::sleep(Duration::from_secs(1));
    let stopped = Instant::now();
    pod.signal(Signal::SIGTERM);
    assert_eq!(pod.code(LIMIT), 143, "{}", pod.stderr());
    assert!(stopped.elapsed() < Duration::from_secs(10), "the workers exit on their own: {:?}", stopped.elapsed());
    wait_until_gone(&marker, Duration::from_secs(10));
    let (step, reason) = ckpt_step(dir.path())
        .unwrap_or_else(|| panic!("no checkpoint was written:\n{}\n{}", pod.stdout(), pod.stderr()));
    assert_eq!(reason, "signal", "written by the workers' handler");
    assert!(step > 0, "{step}");
    assert!(pod.stdout().contains(&format!("CHECKPOINT step={step} reason=signal")), "{}", pod.stdout());

    // Resuming from that checkpoint ends where an uninterrupted run does.
    let mut again = Pod::start(&args, &env);
    assert_eq!(again.code(LIMIT), 0, "{}", again.stderr());
    assert!(again.stdout().contains(&format!("START rank=0 world=2 step={step}")), "{}", again.stdout());
    assert_eq!(final_of(&again.stdout()).0, want);
}

/// The pod of `pods` that waits as a spare, once exactly one says so.
fn the_spare(pods: &mut [Pod]) -> usize {
    let start = Instant::now();
    loop {
        let spares: Vec<usize> =
            (0..pods.len()).filter(|&i| pods[i].stderr().contains("the round is full; waiting as a spare")).collect();
        if let [one] = spares[..] {
            return one;
        }
        assert!(spares.len() < 2, "two spares: {spares:?}");
        assert!(start.elapsed() < LIMIT, "no pod waits as a spare");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The group rank a pod's workers last started with.
fn group_rank(stderr: &str) -> String {
    let line = stderr.lines().rfind(|l| l.contains("starting workers")).expect("workers started");
    let at = line.find("group_rank=").expect("group_rank");
    line[at..].split_whitespace().next().unwrap_or_default().to_string()
}

/// Wait for the checkpoint of `step`, with every pod of `pods` alive.
fn wait_for_step_all(job: &Job, step: u64, pods: &mut [Pod]) {
    let mut refs: Vec<&mut Pod> = pods.iter_mut().collect();
    wait_for_step(job.dir(), step, &mut refs);
}

#[test]
fn a_spare_takes_a_lost_pods_rank_and_a_second_loss_waits_for_a_replacement_that_becomes_the_spare() {
    let want = reference_of("150");
    let job = Job::new("3", 1, &["--spares", "1", "--max-restarts", "0"], &[("STEPS", "150")]);
    let mut pods = job.pods(3);
    wait_for_step_all(&job, 10, &mut pods);
    let spare = the_spare(&mut pods);
    // A training pod that does not host the store is lost with its workers.
    let first = if spare == 1 { 2 } else { 1 };
    let lost_rank = group_rank(&pods[first].stderr());
    pods[first].signal(Signal::SIGKILL);
    pods[first].wait(LIMIT);
    pods[spare].wait_for_stderr("this spare takes over group rank", LIMIT);
    assert_eq!(group_rank(&pods[spare].stderr()), lost_rank, "the spare takes the lost pod's rank");
    let resumed = ckpt_step(job.dir()).map_or(0, |(s, _)| s);
    wait_for_step(job.dir(), resumed + 10, &mut []);
    // The other training pod is lost too: no spare is left, so the job
    // waits for a replacement pod and says so.
    let second = 3 - first;
    pods[second].signal(Signal::SIGKILL);
    pods[second].wait(LIMIT);
    pods[0].wait_for_stderr("no spare is waiting (the job has 1), so the round waits for another pod", LIMIT);
    pods[first] = job.pod(u32::try_from(first).expect("small"));
    pods[second] = job.pod(u32::try_from(second).expect("small"));
    all_succeed(&mut pods);
    let (digest, world) = final_of(&pods[0].stdout());
    assert_eq!(digest, want, "the takeovers must not change the result");
    assert_eq!(world, "world=2", "the world keeps its size");
    let back = [first, second].into_iter().filter(|&i| pods[i].stderr().contains("waiting as a spare")).count();
    assert_eq!(back, 1, "one of the replacements trains, the other becomes the spare");
    for p in &pods {
        assert!(!p.stderr().contains("verdict=restart"), "a lost pod costs no restart:\n{}", p.stderr());
    }
}

/// A training pod's agent and workers killed together by SIGKILL (an OOM
/// kill, a crashed agent): the store host reads its heartbeat connection's
/// close and declares it dead after the grace, and the spare takes over
/// long before the heartbeat timeout (two minutes here) could have.
#[test]
fn a_training_pod_killed_by_sigkill_is_dead_by_its_closed_connection_not_after_the_heartbeat_timeout() {
    let want = reference_of("90");
    let job = Job::new(
        "3",
        1,
        &["--spares", "1", "--max-restarts", "0"],
        &[("STEPS", "90"), ("TRAINLET_HEARTBEAT_TIMEOUT", "120")],
    );
    let mut pods = job.pods(3);
    wait_for_step_all(&job, 10, &mut pods);
    let spare = the_spare(&mut pods);
    let lost = if spare == 1 { 2 } else { 1 };
    let agents: Vec<i32> = pods.iter().map(Pod::pid).collect();
    let addr = format!("PET_LOCAL_ADDR=127.0.0.{}", lost + 1);
    let mut doomed: Vec<i32> = processes_with_marker(&job.marker)
        .into_iter()
        .filter(|p| {
            let environ = std::fs::read(format!("/proc/{p}/environ")).unwrap_or_default();
            !agents.contains(p) && environ.split(|b| *b == 0).any(|kv| kv == addr.as_bytes())
        })
        .collect();
    assert!(!doomed.is_empty(), "the lost pod's workers");
    doomed.push(pods[lost].pid());
    let killed = Instant::now();
    for p in doomed {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(p), Signal::SIGKILL);
    }
    pods[lost].wait(LIMIT);
    pods[spare].wait_for_stderr("this spare takes over group rank", LIMIT);
    let took = killed.elapsed();
    assert!(took < Duration::from_secs(60), "the spare took over {took:?} after the kill");
    let host = pods[0].stderr();
    assert!(host.contains("closed without a bye and did not come back"), "{host}");
    assert!(!host.contains("stopped heartbeating"), "{host}");
    for i in (0..3).filter(|&i| i != lost) {
        assert_eq!(pods[i].code(LIMIT), 0, "{}", pods[i].stderr());
    }
    let (digest, world) = final_of(&pods[0].stdout());
    assert_eq!((digest.as_str(), world.as_str()), (want.as_str(), "world=2"));
}

#[test]
fn a_training_pod_that_turns_unhealthy_leaves_with_207_and_the_spare_takes_over() {
    let want = reference_of("90");
    let job = Job::new("3", 1, &["--spares", "1", "--max-restarts", "1"], &[("STEPS", "90")]);
    let ckpt: Vec<String> = (0..3).map(|n| job.dir().join(format!("local-{n}")).display().to_string()).collect();
    let mut pods: Vec<Pod> =
        (0..3).map(|n| job.pod_with(n, &[("TRAINLET_CHECKPOINT_DIR", ckpt[n as usize].as_str())])).collect();
    wait_for_step_all(&job, 10, &mut pods);
    let spare = the_spare(&mut pods);
    let sick = if spare == 1 { 2 } else { 1 };
    // Its checkpoint directory goes bad, then its worker fails: before the
    // restart's round it finds the fault and leaves instead of joining.
    std::fs::remove_dir_all(&ckpt[sick]).expect("rm");
    std::fs::write(&ckpt[sick], b"not a directory").expect("file");
    let agents: Vec<i32> = pods.iter().map(Pod::pid).collect();
    let addr = format!("PET_LOCAL_ADDR=127.0.0.{}", sick + 1);
    let worker = processes_with_marker(&job.marker)
        .into_iter()
        .find(|p| {
            let environ = std::fs::read(format!("/proc/{p}/environ")).unwrap_or_default();
            !agents.contains(p) && environ.split(|b| *b == 0).any(|kv| kv == addr.as_bytes())
        })
        .expect("the sick pod's worker");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(worker), Signal::SIGKILL).expect("kill");
    assert_eq!(pods[sick].code(LIMIT), 207, "{}", pods[sick].stderr());
    assert!(pods[sick].stderr().contains("is not writable"), "{}", pods[sick].stderr());
    pods[spare].wait_for_stderr("this spare takes over group rank", LIMIT);
    for i in (0..3).filter(|&i| i != sick) {
        assert_eq!(pods[i].code(LIMIT), 0, "{}", pods[i].stderr());
    }
    let (digest, world) = final_of(&pods[0].stdout());
    assert_eq!((digest.as_str(), world.as_str()), (want.as_str(), "world=2"));
}

/// A restart with a spare (no pod lost): every member keeps its place and
/// rank, even with a restart backoff that lets the spare reach the next
/// round first; no takeover.
#[test]
fn a_restart_keeps_every_member_in_place_and_the_spare_waiting() {
    let want = reference();
    let args = ["--spares", "1", "--max-restarts", "1", "--restart-backoff", "1"];
    let job = Job::new("3", 1, &args, &[("FAIL_AT", "1@0"), ("FAIL_CODE", "1"), ("FAIL_STEP", "5")]);
    let mut pods = job.pods(3);
    all_succeed(&mut pods);
    let spare = the_spare(&mut pods);
    for (i, p) in pods.iter().enumerate() {
        let err = p.stderr();
        assert!(!err.contains("takes over"), "no pod was lost:\n{err}");
        if i != spare {
            let ranks: BTreeSet<String> =
                err.lines().filter(|l| l.contains("starting workers")).map(group_rank).collect();
            assert_eq!(ranks.len(), 1, "a member keeps its rank through the restart:\n{err}");
            assert!(err.contains("verdict=restart:1"), "{err}");
        }
    }
    assert_eq!(final_of(&pods[0].stdout()).0, want);
}

/// An elastic job with a spare (`--nnodes 2:4 --spares 1`: rounds of 2 to
/// 3 pods, 4 pods): the first lost pod's place goes to the spare, the world
/// stays at 3; the second loss finds no spare and the job shrinks to 2 and
/// ends with the parameters of an uninterrupted run.
#[test]
fn an_elastic_job_with_a_spare_takes_it_first_then_shrinks() {
    let want = reference_of("150");
    let job = Job::new("2:4", 1, &["--spares", "1", "--max-restarts", "0"], &[("STEPS", "150")]);
    let mut pods = job.pods(4);
    wait_for_step_all(&job, 10, &mut pods);
    let spare = the_spare(&mut pods);
    let members: Vec<usize> = (1..4).filter(|&i| i != spare).collect();
    pods[members[0]].signal(Signal::SIGKILL);
    pods[members[0]].wait(LIMIT);
    pods[spare].wait_for_stderr("this spare takes over group rank", LIMIT);
    assert!(
        pods[spare].stderr().contains("nnodes=3 world_size=3"),
        "the world keeps its size:\n{}",
        pods[spare].stderr()
    );
    let resumed = ckpt_step(job.dir()).map_or(0, |(s, _)| s);
    wait_for_step(job.dir(), resumed + 10, &mut []);
    pods[members[1]].signal(Signal::SIGKILL);
    pods[members[1]].wait(LIMIT);
    pods[0].wait_for_stderr("nnodes=2 world_size=2", LIMIT);
    for i in [0, spare] {
        assert_eq!(pods[i].code(LIMIT), 0, "{}", pods[i].stderr());
    }
    let (digest, world) = final_of(&pods[0].stdout());
    assert_eq!(
        (digest.as_str(), world.as_str()),
        (want.as_str(), "world=2"),
        "the job shrank after the spare was used"
    );
}
