//! A lost pod (issue 56): N real trainlet processes on this machine are the
//! pods of one static job of N nodes, one of them a spare (`--spares 1`),
//! each with its own loopback address and one `sleep` worker. Once the
//! first round formed and the spare waits, a training pod's agent and
//! worker (its session) get SIGKILL: an agent the OOM killer or a crash
//! took, with no goodbye, whose closed store connection is all the store
//! host sees. The time is from the kill to the store host's next "round
//! formed" (the spare in the lost pod's place).
//!
//! The reference is the goal (1.0 s at 4 pods, 1.5 s at 256), not
//! another launcher: torchrun has no spares, and its agents learn of a
//! dead peer only when their workers' collectives fail (`sleep` has none);
//! `benches/scale.py` measures the other steps of a job at 64-1,024 pods.
//! All pods share this machine's CPUs, so at 256 pods the time includes
//! every agent's own work of stopping its worker and joining again.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{Row, free_port, median, trainlet};

/// Longest any one wait of a run takes before the benchmark fails.
const WAIT: Duration = Duration::from_secs(120);

/// The pods of one job, killed with their workers when dropped.
struct Pods {
    children: Vec<Child>,
    dir: tempfile::TempDir,
}

impl Drop for Pods {
    fn drop(&mut self) {
        for c in &self.children {
            let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(c.id() as i32), nix::sys::signal::SIGKILL);
        }
        for c in &mut self.children {
            let _ = c.wait();
        }
    }
}

impl Pods {
    /// `n` pods (one a spare) of one worker each running `worker`, with `env`.
    fn start(n: u32, worker: &[&str], env: &[(&str, String)]) -> Self {
        let dir = tempfile::tempdir().expect("tmp");
        let port = free_port().to_string();
        let children = (0..n)
            .map(|i| {
                let log = std::fs::File::create(dir.path().join(format!("{i}.err"))).expect("log");
                Command::new(trainlet())
                    .args(["run", "--nnodes", &n.to_string(), "--spares", "1"])
                    .args(worker)
                    .envs(env.iter().map(|(k, v)| (k, v)))
                    .env("PET_NPROC_PER_NODE", "1")
                    .env("PET_NODE_RANK", i.to_string())
                    .env("PET_MASTER_ADDR", "127.0.0.1")
                    .env("PET_MASTER_PORT", &port)
                    .env("PET_LOCAL_ADDR", format!("127.0.{}.{}", i / 250, i % 250 + 1))
                    .env("TRAINLET_LOG", "info")
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(log)
                    .process_group(0)
                    .spawn()
                    .expect("trainlet")
            })
            .collect();
        Self { children, dir }
    }

    /// The spare, once the first round formed and it waits.
    fn spare(&self) -> usize {
        let n = self.children.len();
        let spare = |p: &Self| (1..n).find(|&i| p.log(i).contains("waiting as a spare"));
        self.until("first round with a waiting spare", |p| formed(&p.log(0)) >= 1 && spare(p).is_some());
        spare(self).expect("a spare")
    }

    /// SIGKILL a training pod (not the store host's, not the spare) with
    /// its workers; when it was sent.
    fn kill_one(&self, spare: usize) -> Instant {
        let victim = (1..self.children.len()).rev().find(|&i| i != spare).expect("a training pod");
        let pgid = nix::unistd::Pid::from_raw(self.children[victim].id() as i32);
        let killed = Instant::now();
        nix::sys::signal::killpg(pgid, nix::sys::signal::SIGKILL).expect("kill the pod");
        killed
    }

    fn log(&self, i: usize) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("{i}.err"))).unwrap_or_default()
    }

    fn until(&self, what: &str, mut done: impl FnMut(&Self) -> bool) {
        let started = Instant::now();
        while !done(self) {
            assert!(
                started.elapsed() < WAIT,
                "lost pod: no {what} in {WAIT:?}; the store host's log:\n{}",
                self.log(0)
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

fn formed(log: &str) -> usize {
    log.matches("round formed").count()
}

/// One run: the time from the SIGKILL to the next round.
fn once(n: u32) -> Duration {
    let pods = Pods::start(n, &["--max-restarts", "0", "--no-python", "sleep", "600"], &[]);
    let spare = pods.spare();
    // The round settles: workers up, heartbeats beating.
    std::thread::sleep(Duration::from_secs(1));
    let before = formed(&pods.log(0));
    let killed = pods.kill_one(spare);
    pods.until("round after the SIGKILL", |p| formed(&p.log(0)) > before);
    let took = killed.elapsed();
    pods.until("takeover by the spare (its log)", |p| p.log(spare).contains("this spare takes over"));
    took
}

/// SIGKILL of a training pod at `n` pods (a spare among them), median of
/// `runs`, against `goal`.
pub(super) fn sigkill(rows: &mut Vec<Row>, n: u32, runs: usize, goal: Duration) {
    let took = median((0..runs).map(|_| once(n)).collect());
    rows.push(Row {
        name: format!("SIGKILL of a training pod -> the spare's round formed, {n} pods (1 spare)"),
        ours: super::ms(took),
        theirs: format!("{} (goal)", super::ms(goal)),
        ratio: goal.as_secs_f64() / took.as_secs_f64(),
        goal: "the goal (issue 56)",
    });
}

/// Real gloo workers (tests/fixtures/ckpt_train.py, data-parallel with a
/// checkpoint every step by rank 0, 0.1 s a step), 3 training pods and a
/// spare, `--preload torch`: the time from the SIGKILL of a training pod
/// to the first checkpoint of the round the spare joined (rank 0's
/// checkpoint file changed after the store host started that round's
/// workers). Median of `runs`, against the goal of 1.5 s.
pub(super) fn gloo_checkpoint(rows: &mut Vec<Row>, runs: usize) {
    let script = super::support::repo().join("tests/fixtures/ckpt_train.py").display().to_string();
    let once = || -> Duration {
        let ckpt = tempfile::tempdir().expect("ckpt dir");
        let file = ckpt.path().join("ckpt.json");
        let env = [
            ("CKPT_DIR", ckpt.path().display().to_string()),
            ("CKPT_EVERY", "1".into()),
            ("STEPS", "100000".into()),
            ("TRAINLET_PYTHON", super::python()),
        ];
        let worker = ["--max-restarts", "3", "--preload", "torch", script.as_str()];
        let pods = Pods::start(4, &worker, &env);
        let spare = pods.spare();
        let step = || -> u64 {
            let text = std::fs::read_to_string(&file).unwrap_or_default();
            serde_json::from_str::<serde_json::Value>(&text).ok().and_then(|v| v["step"].as_u64()).unwrap_or(0)
        };
        pods.until("the first round's fifth checkpoint", |_| step() >= 5);
        let started = |p: &Pods| p.log(0).matches("starting workers").count();
        let before = started(&pods);
        let killed = pods.kill_one(spare);
        pods.until("the next round's workers (the store host's log)", |p| started(p) > before);
        let at = std::fs::read(&file).unwrap_or_default();
        pods.until("a checkpoint of the next round", |_| std::fs::read(&file).unwrap_or_default() != at);
        let took = killed.elapsed();
        pods.until("takeover by the spare (its log)", |p| p.log(spare).contains("this spare takes over"));
        took
    };
    let took = median((0..runs).map(|_| once()).collect());
    let goal = Duration::from_millis(1500);
    rows.push(Row {
        name: "SIGKILL of a training pod -> first checkpoint of the spare's round, 3 pods + 1 spare x 1 gloo worker (--preload torch)".into(),
        ours: super::ms(took),
        theirs: format!("{} (goal)", super::ms(goal)),
        ratio: goal.as_secs_f64() / took.as_secs_f64(),
        goal: "the goal (issue 56)",
    });
}
