//! A hot spare on the real cluster (`runtimes/torch-distributed-spares.yaml`):
//! a TrainJob of 3 pods, 2 training (2 workers each, tests/fixtures/ckpt_train.py)
//! and 1 waiting as a spare, loses a training pod (deleted mid-run). The
//! spare takes the lost pod's group rank in the next round, the TrainJob
//! completes with the parameters of an uninterrupted run and without a
//! JobSet restart, and the pod the Job makes in place of the deleted one
//! waits as the next spare until the job ends; the takeover is an Event
//! on the spare's pod. And a training pod whose
//! trainlet (PID 1) the node kills with SIGKILL, as the OOM killer or a
//! crash would end it, is replaced by the spare on its closed store
//! connection, not after its heartbeat timeout.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, SystemTime};

use super::{Take, all_logs, ddp_job_on, diagnose, finished, up, wait_for};
use crate::support::cluster::{apply_file, get_json, kubectl, kubectl_stdin, logs_of, pods_of};
use crate::util::repo;

/// The completion index of the pod that waits as a spare, once two train
/// and one waits.
fn the_spare(job: &str) -> String {
    wait_for(job, "two pods training and one waiting as a spare", Duration::from_secs(240), || {
        let logs: BTreeMap<String, String> = pods_of(job).iter().map(|(i, p)| (i.clone(), logs_of(p))).collect();
        let spares: Vec<&String> =
            logs.iter().filter(|(_, l)| l.contains("the round is full; waiting as a spare")).map(|(i, _)| i).collect();
        let training = logs.values().filter(|l| l.contains("START rank=")).count();
        match spares[..] {
            [one] if training == 2 && logs.len() == 3 => Some(one.clone()),
            _ => None,
        }
    })
}

/// Steps of the jobs here (tests/fixtures/ckpt_train.py).
const STEPS: &str = "300";

/// TrainJob `job` of the spares runtime (3 pods, 2 training) with `extra`
/// env, once it checkpointed: the spare's completion index, a training pod
/// that does not host the store (node rank 0 does), and the pods then.
fn training_beside_a_spare(
    job: &str,
    ckpt: &std::path::Path,
    extra: &[(&str, &str)],
) -> (String, &'static str, BTreeMap<String, serde_json::Value>) {
    let (ok, out) = apply_file(&repo().join("runtimes/torch-distributed-spares.yaml"));
    assert!(ok, "{out}");
    let mut env = vec![("STEPS", STEPS), ("STEP_SLEEP", "0.05"), ("CKPT_EVERY", "5")];
    env.extend_from_slice(extra);
    let manifest =
        ddp_job_on("trainlet-torch-distributed-spares", job, ckpt, &env).replace("numNodes: 2", "numNodes: 3");
    let (ok, out) = kubectl_stdin(&["apply", "-f", "-"], &manifest);
    assert!(ok, "{out}");
    let spare = the_spare(job);
    let victim = if spare == "1" { "2" } else { "1" };
    let before = pods_of(job);
    wait_for(job, "a checkpoint", Duration::from_secs(120), || {
        (std::fs::read_dir(ckpt).map(|d| d.count()).unwrap_or(0) > 0).then_some(())
    });
    (spare, victim, before)
}

/// TrainJob `job` completes with the parameters of an uninterrupted run
/// on 4 workers, no restart counted by trainlet or the JobSet.
fn completes_as_if_uninterrupted(job: &str) {
    assert_eq!(finished(job, Duration::from_secs(300)), "Complete", "{}", diagnose(job));
    let logs = all_logs(job);
    let (digest, world) = crate::fault::final_of(&logs);
    assert_eq!((digest.as_str(), world.as_str()), (crate::fault::reference_of(STEPS).as_str(), "world=4"), "{logs}");
    assert!(!logs.contains("verdict=restart"), "a lost pod costs no restart: {logs}");
    let jobset = get_json(&["jobset", job]);
    assert_eq!(jobset["status"]["restarts"].as_u64().unwrap_or(0), 0, "no JobSet restart: {jobset}");
}

#[test]
fn a_spare_takes_a_deleted_training_pods_rank_and_the_trainjob_completes_without_a_jobset_restart() {
    let _up = up("spares", Take::Beside);
    let ckpt = tempfile::tempdir().expect("tmp");
    let (spare, victim, before) = training_beside_a_spare("spare", ckpt.path(), &[]);
    let lost_rank = logs_of(&before[victim])
        .lines()
        .rfind(|l| l.contains("starting workers"))
        .and_then(|l| l.split_whitespace().find(|w| w.starts_with("group_rank=")).map(str::to_string))
        .expect("the victim's group rank");
    let name = before[victim]["metadata"]["name"].as_str().expect("name").to_string();
    let (ok, out) = kubectl(&["delete", "pod", &name, "--wait=false"]);
    assert!(ok, "{out}");
    let took = wait_for("spare", "the spare taking over", Duration::from_secs(120), || {
        let log = logs_of(&pods_of("spare")[&spare]);
        log.contains("this spare takes over group rank").then_some(log)
    });
    let started = took.lines().rfind(|l| l.contains("starting workers")).unwrap_or_default();
    assert!(started.contains(&format!("{lost_rank} ")), "the spare took {lost_rank}: {started}");
    completes_as_if_uninterrupted("spare");
    let after = pods_of("spare");
    let uid = |pods: &BTreeMap<String, serde_json::Value>, index: &str| {
        let pod = pods.get(index).unwrap_or_else(|| panic!("no pod of index {index}:\n{}", diagnose("spare")));
        pod["metadata"]["uid"].as_str().unwrap_or_default().to_string()
    };
    assert_ne!(uid(&after, victim), uid(&before, victim), "the deleted pod was replaced");
    for index in ["0", spare.as_str()] {
        assert_eq!(uid(&after, index), uid(&before, index), "pod {index} stayed");
    }
    let replacement = logs_of(&after[victim]);
    assert!(replacement.contains("the round is full; waiting as a spare"), "{replacement}");
    // The TrainJob's status counts the takeover (the store host posts it).
    let tj = get_json(&["trainjob", "spare"]);
    assert_eq!(super::metric(&tj, "trainlet.spare_takeovers").as_deref(), Some("1"), "{tj}");
    assert_eq!(super::metric(&tj, "trainlet.world_size").as_deref(), Some("4"), "{tj}");
    // One Event on the spare's pod: which rank it took, and why.
    let took = super::one_event("spare", "SpareTookRank", 1);
    assert_eq!(took["regarding"]["name"], before[&spare]["metadata"]["name"], "{took:#}");
    let rank = lost_rank.trim_start_matches("group_rank=");
    let note = took["note"].as_str().unwrap_or_default();
    assert!(note.contains(&format!("took group rank {rank} in round")) && note.contains("a pod that left"), "{note}");
}

/// Seconds since the epoch of a tracing line's timestamp
/// (`2026-12-03T17:49:43.747020Z ...`), on this machine's clock (the
/// cluster's nodes are this machine).
fn utc_secs(line: &str) -> Option<f64> {
    let (date, time) = line.split_whitespace().next()?.strip_suffix('Z')?.split_once('T')?;
    let mut d = date.splitn(3, '-').map(|p| p.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    // Days from the civil date (Howard Hinnant's days_from_civil).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + day - 1;
    let days = era * 146_097 + yoe * 365 + yoe / 4 - yoe / 100 + doy - 719_468;
    let mut t = time.splitn(3, ':');
    let (h, min, sec) =
        (t.next()?.parse::<f64>().ok()?, t.next()?.parse::<f64>().ok()?, t.next()?.parse::<f64>().ok()?);
    Some(days as f64 * 86_400.0 + h * 3_600.0 + min * 60.0 + sec)
}

#[test]
fn a_spare_takes_the_rank_of_a_training_pod_killed_by_sigkill_on_its_closed_connection_not_its_heartbeat_timeout() {
    let _up = up("killed", Take::Beside);
    let ckpt = tempfile::tempdir().expect("tmp");
    // A heartbeat timeout of 120 s: a takeover well before it is the
    // closed connection's doing.
    let (spare, victim, before) =
        training_beside_a_spare("killed", ckpt.path(), &[("TRAINLET_HEARTBEAT_TIMEOUT", "120")]);
    let name = before[victim]["metadata"]["name"].as_str().expect("name").to_string();
    let pid = super::inplace::host_pid_of_pid1(&name);
    let killed_at = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).expect("clock").as_secs_f64();
    // PID 1 of the container's PID namespace: its workers die with it.
    assert!(Command::new("kill").args(["-KILL", &pid.to_string()]).status().expect("kill").success());
    let took = wait_for("killed", "the spare taking over", Duration::from_secs(60), || {
        let log = logs_of(&pods_of("killed")[&spare]);
        log.lines().find(|l| l.contains("this spare takes over group rank")).map(str::to_string)
    });
    let after = utc_secs(&took).expect("a timestamped line") - killed_at;
    eprintln!("the spare took over {after:.3} s after the SIGKILL: {took}");
    assert!(after < 60.0, "the spare took over {after:.1} s after the SIGKILL, past half the heartbeat timeout");
    let host = logs_of(&pods_of("killed")["0"]);
    assert!(host.contains("store connections closed without a bye"), "{host}");
    assert!(!host.contains("stopped heartbeating"), "{host}");
    completes_as_if_uninterrupted("killed");
}

#[test]
fn a_tracing_timestamp_is_read_as_seconds_since_the_epoch() {
    let at = |l: &str| utc_secs(l).map(|s| (s * 1e6).round() / 1e6);
    assert_eq!(at("2026-12-03T17:49:43.747020Z  INFO round formed"), Some(1_796_320_183.747_02));
    assert_eq!(at("2024-02-29T00:00:00Z x"), Some(1_709_164_800.0));
    assert_eq!(at("1970-01-01T00:00:01.5Z"), Some(1.5));
    assert_eq!(at("no time here"), None);
}
