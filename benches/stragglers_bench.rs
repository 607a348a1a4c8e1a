//! What naming stragglers costs (issue 57): 2 simulated pods x 2 gloo
//! workers of `tests/fixtures/straggler_job.py` (0.1 s of compute and an
//! all_reduce per step, every rank at the same pace), run with
//! `--stragglers on` and with `--stragglers off`, interleaved. Two rows:
//! - the agents' own CPU time (user + system of each trainlet process, its
//!   threads, not its workers: `/proc/PID/stat` read just before the job
//!   ends), the difference per pod and second against the bound of 1% of a
//!   core: ratio = 1% / the cost (>= 1 meets it);
//! - the steps every rank made in the same time, off against on (1.0: no
//!   step was lost to the sampling; the bound is 1%).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{Row, free_port, python, support, trainlet};

/// How long each job runs.
const RUN_S: u64 = 40;

/// User + system ticks of `pid` itself (`/proc/PID/stat` fields 14 and 15).
fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// One job: (the agents' CPU seconds, summed; the steps of every rank).
fn job(on: bool) -> (f64, u64) {
    let port = free_port().to_string();
    let script = support::repo().join("tests/fixtures/straggler_job.py");
    let mut pods: Vec<Child> = (0..2u32)
        .map(|node| {
            Command::new(trainlet())
                .args(["run", "--nnodes", "2", "--nproc-per-node", "2", "--stragglers", if on { "on" } else { "off" }])
                .arg(&script)
                .env("PET_MASTER_ADDR", "127.0.0.1")
                .env("PET_MASTER_PORT", &port)
                .env("PET_NODE_RANK", node.to_string())
                .env("PET_LOCAL_ADDR", format!("127.0.0.{}", node + 1))
                .env("TRAINLET_PYTHON", python())
                .env("RUN_FOR", RUN_S.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .expect("trainlet")
        })
        .collect();
    // The agents' CPU just before the job ends (a dead process has no stat).
    let until = Instant::now() + Duration::from_secs(RUN_S + 120);
    let mut last = vec![0u64; pods.len()];
    while pods.iter_mut().any(|p| p.try_wait().ok().flatten().is_none()) && Instant::now() < until {
        for (i, p) in pods.iter().enumerate() {
            if let Some(t) = cpu_ticks(p.id()) {
                last[i] = t;
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let mut steps = 0;
    for p in &mut pods {
        let _ = p.kill();
        let _ = p.wait();
        let mut out = String::new();
        if let Some(mut o) = p.stdout.take() {
            let _ = std::io::Read::read_to_string(&mut o, &mut out);
        }
        steps += out.lines().filter_map(|l| l.split("steps=").nth(1)?.trim().parse::<u64>().ok()).sum::<u64>();
    }
    // The kernel's clock ticks per second for /proc (USER_HZ: 100 on Linux).
    let hz = 100.0;
    (last.iter().sum::<u64>() as f64 / hz, steps)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// `runs` jobs each way, interleaved; medians.
pub fn cost(rows: &mut Vec<Row>, runs: usize) {
    let (mut cpu_on, mut cpu_off, mut steps_on, mut steps_off) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..runs {
        let (c, s) = job(true);
        cpu_on.push(c);
        steps_on.push(s as f64);
        let (c, s) = job(false);
        cpu_off.push(c);
        steps_off.push(s as f64);
    }
    let (on, off) = (median(&mut cpu_on), median(&mut cpu_off));
    // Per pod and second of the job.
    let cost = ((on - off) / 2.0 / RUN_S as f64).max(1e-6);
    rows.push(Row {
        name: format!("naming stragglers: the sampling's CPU per pod (2 pods x 2 gloo workers, {RUN_S} s)"),
        ours: format!("{:.3}% of a core", cost * 100.0),
        theirs: "1% of a core".into(),
        ratio: 0.01 / cost,
        goal: ">= 1x (at most 1% of a core)",
    });
    let (s_on, s_off) = (median(&mut steps_on), median(&mut steps_off));
    rows.push(Row {
        name: "naming stragglers: steps of every rank, sampling on against off".into(),
        ours: format!("{s_on:.0} steps"),
        theirs: format!("{s_off:.0} steps"),
        ratio: s_on / s_off.max(1.0),
        goal: ">= 0.99x",
    });
}
