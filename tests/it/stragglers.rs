//! Stragglers named from outside while a real job runs (`--stragglers`,
//! on by default): 2 simulated pods x 2 gloo workers of
//! `tests/fixtures/straggler_job.py` (0.1 s of compute and an all_reduce
//! per step), healthy for a minute, then rank 3 computes 1.5x as long.

use std::time::{Duration, Instant};

use crate::util::{fixture, start_pods};

const LIMIT: Duration = Duration::from_secs(300);
/// How long the job runs healthy before rank 3 slows down.
const HEALTHY_S: u64 = 60;
/// The bound on naming it once it is slow.
const NAMED_WITHIN: Duration = Duration::from_secs(60);

/// No one is named while every rank keeps the same pace; once rank 3
/// slows, the store host names it within a minute, with what it was doing
/// and where; `--stragglers off` names no one.
#[test]
fn a_rank_slowed_to_one_and_a_half_times_its_compute_is_named_within_a_minute_and_no_one_before() {
    let dir = tempfile::tempdir().expect("tmp");
    let mark = dir.path().join("slowed");
    let stop = dir.path().join("stop");
    let (mark_s, stop_s) = (mark.display().to_string(), stop.display().to_string());
    let healthy = HEALTHY_S.to_string();
    let script = fixture("straggler_job.py");
    let env = [
        ("SLOW_RANK", "3"),
        ("SLOW_AFTER", healthy.as_str()),
        ("SLOW_MARK", mark_s.as_str()),
        ("STOP_FILE", stop_s.as_str()),
        ("RUN_FOR", "240"),
    ];
    let mut pods = start_pods(2, 2, &["run", &script], &env);
    let begun = Instant::now();
    let mut slowed_at: Option<Instant> = None;
    let named_at = loop {
        let host = pods[0].stderr();
        let named = host.contains("is a straggler");
        if slowed_at.is_none() && mark.exists() {
            slowed_at = Some(Instant::now());
        }
        if named {
            assert!(slowed_at.is_some(), "a straggler named while every rank kept the same pace:\n{host}");
            break Instant::now();
        }
        if let Some(at) = slowed_at {
            assert!(at.elapsed() < NAMED_WITHIN, "rank 3 not named within {NAMED_WITHIN:?} of slowing:\n{host}");
        }
        assert!(begun.elapsed() < LIMIT, "{host}");
        for (i, p) in pods.iter_mut().enumerate() {
            assert!(p.child.try_wait().expect("wait").is_none(), "pod {i} ended early:\n{}", p.stderr());
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    std::fs::write(&stop, b"").expect("stop");
    let took = named_at - slowed_at.expect("slowed");
    eprintln!("rank 3 named {took:?} after it slowed");
    for (i, p) in pods.iter_mut().enumerate() {
        assert_eq!(p.code(LIMIT), 0, "pod {i}:\n{}", p.stderr());
    }
    let host = pods[0].stderr();
    let line = host.lines().find(|l| l.contains("is a straggler")).expect("the line");
    assert!(
        line.contains("rank 3 (")
            && line.contains(") is a straggler: the other 3 wait for it")
            && line.contains("it computes in straggler_job.py:")
            && line.contains(" in step"),
        "{line}"
    );
    assert_eq!(host.matches("is a straggler").count(), 1, "named once:\n{host}");
    assert!(!pods[1].stderr().contains("is a straggler"), "only the store host judges");
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
