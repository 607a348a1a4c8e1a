//! Restarts on the real cluster (`compare -- inplace`; needs what
//! `bash tests/cluster.sh up` needs, built by `bash tests/run.sh`): a worker
//! of a 2 pods x 2 workers TrainJob SIGKILLs itself at step 10
//! (benches/inplace_steps.py), and the row is the time from that death to
//! the end of the first training step after recovery on every rank. Three
//! ways to recover, one after another on the same cluster:
//!
//! - **in place**: `runtimes/torch-distributed-inplace.yaml`; trainlet's own
//!   budget is 0, so the pod's trainlet exits, the kubelet restarts every
//!   container of both pods in place (JobSet's `InPlaceRestart`), and the
//!   new trainlets meet at the JobSet's barrier, then rendezvous;
//! - **trainlet's restart**: `runtimes/torch-distributed.yaml` with
//!   `PET_MAX_RESTARTS=1`: trainlet restarts the workers of both pods in
//!   their running containers;
//! - **cold pod** (the reference): the same runtime with torch's own
//!   `torchrun` as the container's command and the Job's `backoffLimit` 0,
//!   so the failed pod fails its Job and the JobSet recreates every pod, as
//!   Trainer's stock torch runtimes recover.
//!
//! - **spare**: `runtimes/torch-distributed-spares.yaml`, 3 pods of which
//!   2 train: the killing rank stops its pod's PID 1 instead (`LOSE=pod`,
//!   as the kubelet stops a deleted or preempted pod), and the spare takes
//!   the lost pod's rank in the next round.
//!
//! The trainlet ways run with `TRAINLET_PRELOAD=torch` (and, in the full
//! run, without). Ratios: cold pod / in place, cold pod / trainlet's
//! restart, and trainlet's restart / in place (what a container restart
//! costs over trainlet's own restart), each from the medians. The gate
//! (`gate.rs`) runs each way once; `compare -- inplace` three times, and
//! also without the preload. Trainlet's restart takes well under a second
//! idle and one or two with both CPUs busy, so one job of that way is
//! killed three times (`PET_MAX_RESTARTS=3`, `KILLS=3`) and gives three
//! samples: a single one made the ratio a draw of the scheduler.

use std::path::Path;
use std::time::{Duration, Instant};

use super::Row;
use super::support::cluster::{job_on, kubectl, kubectl_stdin, pods_of, shared};
use super::support::repo;

/// The reference runtime: the plain one with `torchrun` from torch as the
/// command (no trainlet in the pod's process tree) and no pod retry inside
/// the Job, so a failed pod restarts the whole JobSet.
fn cold_runtime(plain: &str) -> String {
    let mut out = String::new();
    let mut skip = 0usize;
    for line in plain.lines() {
        let indent = line.len() - line.trim_start().len();
        if skip > 0 && indent > skip {
            continue;
        }
        skip = 0;
        if line.trim_start().starts_with("lifecycle:") {
            skip = indent;
            continue;
        }
        out.push_str(
            &line
                .replace("name: trainlet-torch-distributed", "name: bench-torchrun-cold")
                .replace("backoffLimit: 4", "backoffLimit: 0"),
        );
        out.push('\n');
    }
    assert!(out.contains("bench-torchrun-cold") && out.contains("backoffLimit: 0"), "{out}");
    out
}

/// One way to recover: its runtime's manifest, the runtime's name, the
/// TrainJob's command and extra env, and how many times one job of it is
/// killed (each kill one sample; the env must let the job recover as often).
struct Way {
    name: &'static str,
    manifest: String,
    runtime: &'static str,
    command: &'static str,
    env: &'static [(&'static str, &'static str)],
    kills: usize,
    /// The TrainJob's pods (`numNodes`).
    pods: u32,
}

fn read_time(path: &Path) -> Option<f64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// The recoveries of a run whose marks are all in `marks`, in order: each
/// death to the first step after it on all 4 ranks; None while one is
/// missing.
fn recoveries(marks: &Path, kills: usize) -> Option<Vec<Duration>> {
    (0..kills)
        .map(|k| {
            let killed = read_time(&marks.join(format!("killed.{k}")))?;
            let firsts: Vec<f64> =
                (0..4).map(|r| read_time(&marks.join(format!("first.{}.{r}", k + 1)))).collect::<Option<_>>()?;
            let last = firsts.iter().copied().fold(f64::MIN, f64::max);
            Some(Duration::from_secs_f64((last - killed).max(0.0)))
        })
        .collect()
}

/// Run one job of `way`: each of its `kills` deaths to the first step after
/// it on all 4 ranks.
fn once(way: &Way, job: &str) -> Result<Vec<Duration>, String> {
    let marks = tempfile::tempdir().map_err(|e| e.to_string())?;
    std::fs::set_permissions(marks.path(), std::os::unix::fs::PermissionsExt::from_mode(0o777))
        .map_err(|e| e.to_string())?;
    let (ok, out) = kubectl_stdin(&["apply", "-f", "-"], &way.manifest);
    if !ok {
        return Err(format!("the {} runtime: {out}", way.name));
    }
    let benches = repo().join("benches");
    let kills = way.kills.to_string();
    let mut env = vec![("MARK_DIR", "/marks"), ("KILLS", kills.as_str())];
    env.extend_from_slice(way.env);
    let manifest = job_on(
        way.runtime,
        job,
        way.command,
        &env,
        &[("bench", &benches, "/bench", true), ("marks", marks.path(), "/marks", false)],
    )
    .replace("numNodes: 2", &format!("numNodes: {}", way.pods));
    let (ok, out) = kubectl_stdin(&["apply", "-f", "-"], &manifest);
    if !ok {
        return Err(format!("TrainJob {job}: {out}"));
    }
    let until = Instant::now() + Duration::from_secs(600);
    let result = loop {
        if let Some(took) = recoveries(marks.path(), way.kills) {
            break Ok(took);
        }
        if Instant::now() > until {
            let pods: Vec<String> = pods_of(job).values().map(|p| p["status"].to_string()).collect();
            break Err(format!(
                "{}: not every one of {} deaths followed by a first step within 600 s; pods: {pods:?}",
                way.name, way.kills
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let (ok, out) = kubectl(&["delete", "trainjob", job, "--wait=true"]);
    if !ok {
        eprintln!("inplace bench: deleting {job}: {out}");
    }
    // The next run starts on an idle machine: wait until the pods are gone.
    let gone = Instant::now() + Duration::from_secs(120);
    while !pods_of(job).is_empty() && Instant::now() < gone {
        std::thread::sleep(Duration::from_millis(500));
    }
    result
}

/// A way run by trainlet: its runtime, the extra env and the kills per job.
fn by_trainlet(
    name: &'static str,
    manifest: &str,
    runtime: &'static str,
    env: &'static [(&'static str, &'static str)],
    kills: usize,
) -> Way {
    let command = "[torchrun, /bench/inplace_steps.py]";
    Way { name, manifest: manifest.to_string(), runtime, command, env, kills, pods: 2 }
}

/// The ways, `runs` jobs each (interleaved; trainlet's restart killed three
/// times per job, the others once), and their rows from the medians: in
/// place and trainlet's restart with `TRAINLET_PRELOAD=torch` against the
/// cold pod, and against each other; with `all`, also both without the
/// preload against the cold pod.
pub fn restarts(rows: &mut Vec<Row>, runs: usize, all: bool) {
    // The test run's cluster when it is still up, else one of this
    // process's own, stopped when the process ends.
    if let Err(e) = shared() {
        panic!("inplace bench (build the cluster first: bash tests/run.sh): {e}");
    }
    let inplace = std::fs::read_to_string(repo().join("runtimes/torch-distributed-inplace.yaml")).expect("runtime");
    let plain = std::fs::read_to_string(repo().join("runtimes/torch-distributed.yaml")).expect("runtime");
    let spares = std::fs::read_to_string(repo().join("runtimes/torch-distributed-spares.yaml")).expect("runtime");
    let preload = &[("TRAINLET_PRELOAD", "torch")];
    let mut ways = vec![
        by_trainlet("in place, preload", &inplace, "trainlet-torch-distributed-inplace", preload, 1),
        by_trainlet(
            "trainlet's restart, preload",
            &plain,
            "trainlet-torch-distributed",
            &[("PET_MAX_RESTARTS", "3"), ("TRAINLET_PRELOAD", "torch")],
            3,
        ),
        Way {
            name: "cold pod",
            manifest: cold_runtime(&plain),
            runtime: "bench-torchrun-cold",
            command: "[python3, -m, torch.distributed.run, /bench/inplace_steps.py]",
            env: &[],
            kills: 1,
            pods: 2,
        },
        Way {
            pods: 3,
            ..by_trainlet(
                "spare, preload",
                &spares,
                "trainlet-torch-distributed-spares",
                &[("TRAINLET_PRELOAD", "torch"), ("LOSE", "pod")],
                1,
            )
        },
    ];
    if all {
        ways.push(by_trainlet("in place", &inplace, "trainlet-torch-distributed-inplace", &[], 1));
        ways.push(by_trainlet(
            "trainlet's restart",
            &plain,
            "trainlet-torch-distributed",
            &[("PET_MAX_RESTARTS", "3")],
            3,
        ));
    }
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); ways.len()];
    for run in 0..runs {
        for (i, way) in ways.iter().enumerate() {
            match once(way, &format!("bench-{i}-{run}")) {
                Ok(took) => {
                    let each: Vec<String> = took.iter().map(|d| format!("{:.2} s", d.as_secs_f64())).collect();
                    eprintln!("inplace bench: {}: {}", way.name, each.join(", "));
                    times[i].extend(took);
                }
                Err(e) => eprintln!("inplace bench: {e}"),
            }
        }
    }
    if times.iter().any(Vec::is_empty) {
        eprintln!("inplace bench: a way never recovered; no rows");
        return;
    }
    let medians: Vec<Duration> = times.into_iter().map(super::median).collect();
    let s = |d: Duration| format!("{:.2} s", d.as_secs_f64());
    let row = |name: &str, ours: Duration, theirs: Duration, goal: &'static str| Row {
        name: format!("worker killed -> first step after recovery, 2 pods x 2 workers on the cluster: {name}"),
        ours: s(ours),
        theirs: s(theirs),
        ratio: theirs.as_secs_f64() / ours.as_secs_f64().max(1e-3),
        goal,
    };
    let cold = medians[2];
    rows.push(row(
        "JobSet in-place restart through trainlet (TRAINLET_PRELOAD=torch) vs a cold pod (the JobSet recreates the pods, torchrun)",
        medians[0],
        cold,
        "faster than a cold pod",
    ));
    rows.push(row(
        "trainlet's own restart (TRAINLET_PRELOAD=torch) vs a cold pod",
        medians[1],
        cold,
        "faster than a cold pod",
    ));
    rows.push(row(
        "JobSet in-place restart vs trainlet's own restart (both TRAINLET_PRELOAD=torch)",
        medians[0],
        medians[1],
        "none: a container restart re-imports torch",
    ));
    let mut spare = row("a spare (TRAINLET_PRELOAD=torch) vs a cold pod", medians[3], cold, "spare: at most 1 s");
    spare.name = spare.name.replace("worker killed", "training pod lost");
    rows.push(spare);
    if all {
        rows.push(row(
            "JobSet in-place restart, no preload, vs a cold pod",
            medians[4],
            cold,
            "faster than a cold pod",
        ));
        rows.push(row("trainlet's own restart, no preload, vs a cold pod", medians[5], cold, "faster than a cold pod"));
    }
}
