//! Stragglers named from outside while a real job runs (`--stragglers`,
//! on by default): 2 simulated pods x 2 gloo workers of
//! `tests/fixtures/straggler_job.py` (0.1 s of compute and an all_reduce
//! per step) and a spare, healthy for 40 s, then rank 3 computes 1.5x
//! as long; named long enough, it is evicted (`--evict-stragglers`).

use std::time::{Duration, Instant};

use crate::util::{Pod, fixture, free_port, pet_env, start_pods};

const LIMIT: Duration = Duration::from_secs(300);
/// How long the job runs healthy before rank 3 slows down: 4 windows of
/// 10 s, room for a streak of 3 that names no one (a healthy run of 10
/// minutes, both CPUs busy, named no one in 52 windows; the book's
/// "False positives").
const HEALTHY_S: &str = "40";
/// The bound on naming it once it is slow.
const NAMED_WITHIN: Duration = Duration::from_secs(60);

/// 3 simulated pods (`--spares 1`) x 2 gloo workers; pod 1's worker of
/// local rank 1 (rank 3) computes 1.5x as long after 40 s (a slow
/// host); pod 2 starts once the round formed, so it waits as the spare.
/// - No one is named while every rank keeps the same pace; once rank 3
///   slows, the store host (only it) names it within a minute, once, with
///   what it was doing and where.
/// - Named for 10 s (`--evict-stragglers 10`), its pod is asked to leave:
///   it stops its workers and exits 207 saying why; the spare takes its
///   group rank and the job ends with exit 0 on the pods left.
#[test]
fn a_rank_slowed_by_half_is_named_within_a_minute_and_no_one_before_and_its_pod_evicted_for_the_spare() {
    let dir = tempfile::tempdir().expect("tmp");
    let (mark, stop) = (dir.path().join("slowed"), dir.path().join("stop"));
    let (mark_s, stop_s) = (mark.display().to_string(), stop.display().to_string());
    let script = fixture("straggler_job.py");
    let args = ["run", "--spares", "1", "--evict-stragglers", "10", script.as_str()];
    let port = free_port();
    let pod = |node: u32, extra: &[(&str, &str)]| {
        let mut env = pet_env(3, 2, node, port);
        env.push(("PET_LOCAL_ADDR".into(), format!("127.0.0.{}", node + 1)));
        env.push(("STOP_FILE".into(), stop_s.clone()));
        env.push(("RUN_FOR".into(), "400".into()));
        env.extend(extra.iter().map(|(k, v)| ((*k).to_string(), (*v).to_string())));
        let pairs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        Pod::start(&args, &pairs)
    };
    let mut host = pod(0, &[]);
    let slowing = [("SLOW_LOCAL_RANK", "1"), ("SLOW_AFTER", HEALTHY_S), ("SLOW_MARK", mark_s.as_str())];
    let mut slow = pod(1, &slowing);
    host.wait_for_stderr("starting workers", LIMIT);
    let mut spare = pod(2, &[]);
    spare.wait_for_stderr("the round is full; waiting as a spare", LIMIT);
    let begun = Instant::now();
    let mut slowed_at: Option<Instant> = None;
    let named_at = loop {
        let judge = host.stderr();
        let named = judge.contains("is a straggler");
        if slowed_at.is_none() && mark.exists() {
            slowed_at = Some(Instant::now());
        }
        if named {
            assert!(slowed_at.is_some(), "a straggler named while every rank kept the same pace:\n{judge}");
            break Instant::now();
        }
        if let Some(at) = slowed_at {
            assert!(at.elapsed() < NAMED_WITHIN, "rank 3 not named within {NAMED_WITHIN:?} of slowing:\n{judge}");
        }
        assert!(begun.elapsed() < LIMIT, "{judge}");
        for (name, p) in [("the store host", &mut host), ("the slow pod", &mut slow), ("the spare", &mut spare)] {
            assert!(p.child.try_wait().expect("wait").is_none(), "{name} ended early:\n{}", p.stderr());
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let took = named_at - slowed_at.expect("slowed");
    eprintln!("rank 3 named {took:?} after it slowed");

    assert_eq!(slow.code(LIMIT), 207, "{}", slow.stderr());
    let left = slow.stderr();
    assert!(
        left.contains("this pod is evicted as a straggler's: rank 3 (")
            && left.contains("has been a straggler for")
            && left.contains("--evict-stragglers 10"),
        "{left}"
    );
    assert!(left.contains("this pod left the job as a straggler's (exit 207)"), "{left}");
    spare.wait_for_stderr("this spare takes over group rank 1", LIMIT);
    spare.wait_for_stderr("starting workers", LIMIT);
    std::fs::write(&stop, b"").expect("stop");
    for (name, p) in [("the store host", &mut host), ("the spare", &mut spare)] {
        assert_eq!(p.code(LIMIT), 0, "{name}:\n{}", p.stderr());
    }
    let judge = host.stderr();
    let line = judge.lines().find(|l| l.contains("is a straggler")).expect("the line");
    assert!(
        line.contains("rank 3 (")
            && line.contains(") is a straggler: the other 3 wait for it")
            && line.contains("it computes in straggler_job.py:")
            && line.contains(" in step"),
        "{line}"
    );
    assert_eq!(judge.matches("is a straggler").count(), 1, "named once:\n{judge}");
    assert!(
        !left.contains("is a straggler:") && !spare.stderr().contains("is a straggler:"),
        "only the store host judges"
    );
    assert!(judge.contains("evicting the pod of a straggler: rank 3 ("), "{judge}");
    assert_eq!(judge.matches("evicting the pod of a straggler").count(), 1, "one pod evicted:\n{judge}");
}

/// `--stragglers off`: the same slowed job names no one.
#[test]
fn stragglers_off_names_no_one() {
    let script = fixture("straggler_job.py");
    let env = [("SLOW_RANK", "3"), ("SLOW_AFTER", "0"), ("RUN_FOR", "45")];
    let mut pods = start_pods(2, 2, &["run", "--stragglers", "off", &script], &env);
    for (i, p) in pods.iter_mut().enumerate() {
        assert_eq!(p.code(LIMIT), 0, "pod {i}:\n{}", p.stderr());
        assert!(!p.stderr().contains("straggler"), "pod {i}:\n{}", p.stderr());
    }
}
