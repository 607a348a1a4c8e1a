//! Every rank's stacks of a running job, on demand: 4 ranks on 2
//! simulated pods. trainlet: `trainlet stacks --json` (each agent reads its
//! workers from outside them, in parallel). The reference: what a user runs
//! by hand, `py-spy dump --pid` of each worker (py-spy from PyPI, in the
//! test venv). Interleaved runs, medians; the row also says the slowest
//! single worker read (the bound: 200 ms).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{Row, free_port, median, pod_command, python, support, time_row, trainlet};

/// py-spy next to the venv's python.
fn py_spy() -> PathBuf {
    let p = PathBuf::from(python()).with_file_name("py-spy");
    assert!(p.is_file(), "no py-spy at {}: run bash tests/venv.sh", p.display());
    p
}

/// The ranks `trainlet stacks --json` gives of `agents`' workers once
/// every worker is in the job's loop: (pid, slowest read in ms).
fn read_ours(agents: &[u32]) -> Option<(Vec<i64>, f64)> {
    let out = Command::new(trainlet()).args(["stacks", "--json"]).stderr(Stdio::null()).output().ok()?;
    let all: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).ok()?;
    let parent = |pid: i64| -> Option<u32> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        stat[stat.rfind(')')? + 1..].split_whitespace().nth(1)?.parse().ok()
    };
    let mine: Vec<&serde_json::Value> = all
        .iter()
        .filter(|r| r["stacks"]["pid"].as_i64().and_then(parent).is_some_and(|p| agents.contains(&p)))
        .collect();
    let in_loop = |r: &&serde_json::Value| {
        r["stacks"]["threads"][0]["python"].as_array().is_some_and(|f| {
            f.iter()
                .any(|f| f["function"] == "<module>" && f["file"].as_str().is_some_and(|p| p.ends_with("stall_job.py")))
                && !f.iter().any(|f| f["file"].as_str().is_some_and(|p| p.contains("importlib")))
        })
    };
    (mine.len() == 4 && mine.iter().all(in_loop)).then(|| {
        let pids = mine.iter().filter_map(|r| r["stacks"]["pid"].as_i64()).collect();
        let slowest = mine.iter().filter_map(|r| r["stacks"]["took_ms"].as_f64()).fold(0.0, f64::max);
        (pids, slowest)
    })
}

pub(super) fn gather(rows: &mut Vec<Row>, runs: usize) {
    let port = free_port().to_string();
    let job = support::repo().join("tests/fixtures/stall_job.py").display().to_string();
    let mut pods: Vec<Child> = (0..2)
        .map(|node| {
            let mut c = pod_command(false, node, &port, "stacks");
            c.env("PET_LOCAL_ADDR", format!("127.0.0.{}", node + 1)).env("STALL_RANK", "-1");
            c.args(["--nnodes", "2", "--nproc-per-node", "2", &job]);
            c.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).env("TRAINLET_LOG", "warn");
            c.spawn().expect("trainlet")
        })
        .collect();
    let agents: Vec<u32> = pods.iter().map(Child::id).collect();
    let until = Instant::now() + Duration::from_secs(180);
    let (pids, _) = loop {
        if let Some(found) = read_ours(&agents) {
            break found;
        }
        assert!(Instant::now() < until, "the job's 4 workers never showed in trainlet stacks");
        std::thread::sleep(Duration::from_millis(300));
    };
    let spy = py_spy();
    let (mut ours, mut theirs, mut slowest) = (Vec::new(), Vec::new(), 0.0f64);
    for _ in 0..runs {
        let t = Instant::now();
        let (_, s) = read_ours(&agents).expect("trainlet stacks");
        ours.push(t.elapsed());
        slowest = slowest.max(s);
        let t = Instant::now();
        for pid in &pids {
            let out = Command::new(&spy).args(["dump", "--pid", &pid.to_string()]).output().expect("py-spy");
            assert!(out.status.success(), "py-spy dump: {}", String::from_utf8_lossy(&out.stderr));
        }
        theirs.push(t.elapsed());
    }
    for p in &mut pods {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(p.id() as i32), nix::sys::signal::Signal::SIGTERM);
    }
    for mut p in pods {
        let _ = p.wait();
    }
    rows.push(time_row(
        format!("stacks of 4 ranks on 2 pods on demand (slowest worker read {slowest:.1} ms)"),
        median(ours),
        median(theirs),
        ">= 1x, <= 200 ms per worker",
    ));
}
