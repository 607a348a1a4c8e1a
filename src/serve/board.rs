//! The store host's record of served runs: each run's state, timings,
//! per-rank exits and failure report, the current world, and when the
//! control API was last used (for the idle timeout). The control API
//! writes submissions and stops; the host's agent writes what its rounds
//! decided. Waiters are woken through a version counter.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard, PoisonError};

use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::time::Instant;

use super::spec::Run;

/// Runs kept for `GET /v1/runs/{id}` (older ones that are over are forgotten).
pub const KEEP_RUNS: usize = 64;

/// Where a run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    /// Published; workers not started yet.
    Starting,
    /// Workers started.
    Running,
    /// Being stopped (DELETE or replaced).
    Stopping,
    /// Every worker succeeded.
    Succeeded,
    /// It failed (see the report).
    Failed,
    /// Stopped on request.
    Stopped,
}

impl State {
    /// Over for good.
    pub fn is_final(self) -> bool {
        matches!(self, State::Succeeded | State::Failed | State::Stopped)
    }

    /// The word stored in `serve/ended/<seq>`.
    pub fn word(self) -> &'static str {
        match self {
            State::Starting => "starting",
            State::Running => "running",
            State::Stopping => "stopping",
            State::Succeeded => "succeeded",
            State::Failed => "failed",
            State::Stopped => "stopped",
        }
    }
}

/// How one rank's last worker ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RankExit {
    /// Global rank.
    pub rank: u32,
    /// Exit code, when it exited.
    pub exit_code: Option<i32>,
    /// Signal, when one killed it.
    pub signal: Option<String>,
    /// `succeeded`, `failed` or `stopped` (stopped because another rank failed or the run was stopped).
    pub state: &'static str,
}

/// A run as the control API shows it.
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    /// Its id.
    pub id: String,
    /// Submission number.
    pub seq: u64,
    /// Where it is.
    pub state: State,
    /// What it runs.
    pub command: Vec<String>,
    /// Restarts it used.
    pub restarts: u32,
    /// Restarts it may use.
    pub max_restarts: u32,
    /// Pods and workers per pod of its last round.
    pub nnodes: Option<u32>,
    /// Workers per pod.
    pub nproc_per_node: Option<u32>,
    /// Per-rank exits, when it ended.
    pub ranks: Vec<RankExit>,
    /// The failure report (as written to failure_report.json), when it failed.
    pub report: Option<serde_json::Value>,
    /// RFC 3339 times and durations.
    pub timings: Timings,
    /// Files it carried.
    pub files: usize,
    /// Bytes of files sent to the store for it (unchanged contents are not sent again).
    pub files_sent_bytes: u64,
    /// The actor's target, when it is one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub actor: Option<String>,
    /// Its first worker slot on every pod.
    pub first_slot: u32,
    /// It runs in a lane of its own, beside the main run.
    pub lane: bool,
    /// The round whose workers run it now (None between rounds).
    #[serde(skip)]
    pub round: Option<u64>,
    /// Its lines were removed from the store.
    #[serde(skip)]
    pub logs_forgotten: bool,
}

/// When a run moved.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Timings {
    /// Accepted by the control API.
    pub submitted: String,
    /// Workers started on the store host.
    pub started: Option<String>,
    /// Decided over.
    pub ended: Option<String>,
    /// Submission to workers started, seconds.
    pub start_seconds: Option<f64>,
    /// Submission to end, seconds.
    pub total_seconds: Option<f64>,
    #[serde(skip)]
    submitted_at: Option<Instant>,
}

/// The world of the newest round.
#[derive(Debug, Clone, Default, Serialize)]
pub struct World {
    /// Round number.
    pub round: u64,
    /// Pods in it.
    pub nnodes: u32,
    /// Pods' hosts by group rank.
    pub pods: Vec<String>,
}

#[derive(Debug)]
struct Inner {
    runs: VecDeque<Record>,
    next_seq: u64,
    world: World,
    /// The pods' cache use, as last gathered.
    cache: Vec<Usage>,
    last_use: Instant,
    shutting_down: bool,
}

/// The host's record; shared by the control API and the host's agent.
#[derive(Debug)]
pub struct Board {
    inner: Mutex<Inner>,
    version: watch::Sender<u64>,
}

impl Default for Board {
    fn default() -> Self {
        Self {
            inner: Mutex::new(Inner {
                runs: VecDeque::new(),
                next_seq: 1,
                world: World::default(),
                cache: Vec::new(),
                last_use: Instant::now(),
                shutting_down: false,
            }),
            version: watch::channel(0).0,
        }
    }
}

impl Board {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn changed(&self) {
        self.version.send_modify(|v| *v += 1);
    }

    /// Wakes on every change.
    pub fn watch(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }

    /// The control API was used (resets the idle timer).
    pub fn touch(&self) {
        self.lock().last_use = Instant::now();
    }

    /// The seq the next run gets, and the run that is not over, if any.
    pub fn next_seq(&self) -> u64 {
        self.lock().next_seq
    }

    /// The main run, when it is not over: (seq, id, state). Actors in
    /// lanes of their own are not it.
    pub fn active(&self) -> Option<(u64, String, State)> {
        self.lock().runs.iter().rev().find(|r| !r.state.is_final() && !r.lane).map(|r| (r.seq, r.id.clone(), r.state))
    }

    /// What the runs not over hold of the pods' worker slots (`pod_nproc`
    /// per pod: a run that did not say takes them all).
    pub fn held(&self, pod_nproc: u32) -> Vec<super::lane::Held> {
        self.lock()
            .runs
            .iter()
            .filter(|r| !r.state.is_final())
            .map(|r| super::lane::Held {
                id: r.id.clone(),
                actor: r.actor.clone(),
                first: r.first_slot,
                nproc: r.nproc_per_node.unwrap_or(pod_nproc),
                lane: r.lane,
                stopping: r.state == State::Stopping,
            })
            .collect()
    }

    /// A run was published.
    pub fn submitted(&self, run: &Run, files_sent_bytes: u64) {
        let mut b = self.lock();
        b.next_seq = b.next_seq.max(run.seq + 1);
        b.runs.push_back(Record {
            id: run.id.clone(),
            seq: run.seq,
            state: State::Starting,
            command: run.command.clone(),
            restarts: 0,
            max_restarts: run.max_restarts,
            nnodes: None,
            nproc_per_node: run.nproc,
            ranks: Vec::new(),
            report: None,
            timings: Timings {
                submitted: crate::clock::rfc3339(crate::clock::now_us()),
                submitted_at: Some(Instant::now()),
                ..Timings::default()
            },
            files: run.files.len(),
            files_sent_bytes,
            actor: run.actor.as_ref().map(|a| a.target.clone()),
            first_slot: run.first_slot,
            lane: run.lane,
            round: None,
            logs_forgotten: false,
        });
        // Only runs that are over are forgotten (a lane's actor may outlive
        // many runs of the main run).
        while b.runs.len() > KEEP_RUNS {
            let Some(i) = b.runs.iter().position(|r| r.state.is_final()) else { break };
            b.runs.remove(i);
        }
        b.last_use = Instant::now();
        drop(b);
        self.changed();
    }

    fn update(&self, seq: u64, f: impl FnOnce(&mut Record)) {
        let mut b = self.lock();
        if let Some(r) = b.runs.iter_mut().find(|r| r.seq == seq) {
            f(r);
        }
        b.last_use = Instant::now();
        drop(b);
        self.changed();
    }

    /// The host's workers of run `seq` started in `round` (the run's
    /// restart `restarts`, with `nnodes` pods of `nproc`).
    pub fn started(&self, seq: u64, round: u64, restarts: u32, nnodes: u32, nproc: u32) {
        self.update(seq, |r| {
            r.round = Some(round);
            if r.state == State::Starting {
                r.state = State::Running;
                r.timings.started = Some(crate::clock::rfc3339(crate::clock::now_us()));
                r.timings.start_seconds = r.timings.submitted_at.map(|t| t.elapsed().as_secs_f64());
            }
            r.restarts = restarts;
            r.nnodes = Some(nnodes);
            r.nproc_per_node = Some(nproc);
        });
    }

    /// The round of run `seq` is over on the host (its workers are gone).
    pub fn round_over(&self, seq: u64) {
        self.update(seq, |r| r.round = None);
    }

    /// Run `seq`'s round whose workers run now, with its pods and workers
    /// per pod; None between rounds or when it is not running.
    pub fn running(&self, seq: u64) -> Option<(u64, u32, u32)> {
        let b = self.lock();
        let r = b.runs.iter().find(|r| r.seq == seq).filter(|r| !r.state.is_final())?;
        Some((r.round?, r.nnodes?, r.nproc_per_node?))
    }

    /// Run `seq`, by number.
    pub fn by_seq(&self, seq: u64) -> Option<Record> {
        self.lock().runs.iter().find(|r| r.seq == seq).cloned()
    }

    /// Run `seq` is being stopped; false when it is already over.
    pub fn stopping(&self, seq: u64) -> bool {
        let mut ok = false;
        self.update(seq, |r| {
            if !r.state.is_final() {
                r.state = State::Stopping;
                ok = true;
            }
        });
        ok
    }

    /// Run `seq` is over.
    pub fn ended(&self, seq: u64, state: State, ranks: Vec<RankExit>, report: Option<serde_json::Value>) {
        self.update(seq, |r| {
            if r.state.is_final() {
                return;
            }
            r.state = state;
            r.round = None;
            r.ranks = ranks;
            r.report = report;
            r.timings.ended = Some(crate::clock::rfc3339(crate::clock::now_us()));
            r.timings.total_seconds = r.timings.submitted_at.map(|t| t.elapsed().as_secs_f64());
        });
    }

    /// The runs before `below` that are over and whose lines are still
    /// in the store (a run not over keeps its lines, however old).
    pub fn logs_to_forget(&self, below: u64) -> Vec<u64> {
        let b = self.lock();
        b.runs.iter().filter(|r| r.seq < below && r.state.is_final() && !r.logs_forgotten).map(|r| r.seq).collect()
    }

    /// Run `seq`'s lines were removed from the store.
    pub fn logs_forgotten(&self, seq: u64) {
        self.update(seq, |r| r.logs_forgotten = true);
    }

    /// Run `id` (or `seq`).
    pub fn get(&self, id: &str) -> Option<Record> {
        self.lock().runs.iter().find(|r| r.id == id).cloned()
    }

    /// Every kept run, oldest first.
    pub fn list(&self) -> Vec<Record> {
        self.lock().runs.iter().cloned().collect()
    }

    /// The newest round's world.
    pub fn set_world(&self, world: World) {
        self.lock().world = world;
        self.changed();
    }

    /// The newest round's world.
    pub fn world(&self) -> World {
        self.lock().world.clone()
    }

    /// The pods' cache use, as gathered from the store.
    pub fn set_cache(&self, cache: Vec<Usage>) {
        self.lock().cache = cache;
    }

    /// The pods' cache use.
    pub fn cache(&self) -> Vec<Usage> {
        self.lock().cache.clone()
    }

    /// How long it has been idle (no run that is not over, no request
    /// other than status), None while a run is not over.
    pub fn idle_for(&self) -> Option<std::time::Duration> {
        let b = self.lock();
        b.runs.iter().all(|r| r.state.is_final()).then(|| b.last_use.elapsed())
    }

    /// Idle for longer than `limit`: no run that is not over, no request.
    pub fn idle_past(&self, limit: std::time::Duration) -> bool {
        let b = self.lock();
        b.runs.iter().all(|r| r.state.is_final()) && b.last_use.elapsed() >= limit
    }

    /// No more runs are taken (the pods are exiting).
    pub fn shut(&self) {
        self.lock().shutting_down = true;
        self.changed();
    }

    /// Are runs still taken?
    pub fn is_shut(&self) -> bool {
        self.lock().shutting_down
    }
}

/// One pod's cache, as measured.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// The pod (its host name).
    pub pod: String,
    /// The directory.
    pub dir: String,
    /// Bytes in its files.
    pub bytes: u64,
    /// Its files (anything but a directory).
    pub files: u64,
    /// The walk stopped at [`super::cache::MAX_ENTRIES`], or left out what lies below
    /// [`super::cache::MAX_DEPTH`] or could not be read: the counts are lower bounds.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn run(seq: u64) -> Run {
        Run {
            id: format!("run-{seq}"),
            seq,
            command: vec!["python".into()],
            env: Vec::new(),
            nproc: None,
            max_restarts: 1,
            base_restarts: 0,
            files: Vec::new(),
            actor: None,
            first_slot: 0,
            lane: false,
        }
    }

    #[tokio::test]
    async fn a_run_moves_through_its_states_once() {
        let b = Board::default();
        let w = b.watch();
        assert_eq!((b.next_seq(), b.active()), (1, None));
        b.submitted(&run(1), 10);
        assert!(w.has_changed().expect("watch"));
        assert_eq!(b.next_seq(), 2);
        assert_eq!(b.active().map(|a| a.2), Some(State::Starting));
        b.started(1, 1, 0, 2, 2);
        assert_eq!(b.get("run-1").map(|r| (r.state, r.nnodes)), Some((State::Running, Some(2))));
        assert!(b.stopping(1));
        b.ended(1, State::Stopped, Vec::new(), None);
        b.ended(1, State::Failed, Vec::new(), None);
        assert_eq!(b.get("run-1").map(|r| r.state), Some(State::Stopped), "the first end stays");
        assert!(!b.stopping(1), "an ended run cannot be stopped");
        assert_eq!(b.active(), None);
        assert!(b.idle_past(std::time::Duration::ZERO));
        // A lane's actor (run 2) outlives many main runs: only runs that
        // are over are forgotten.
        b.submitted(&run(2), 0);
        for s in 3..(KEEP_RUNS as u64 + 10) {
            b.submitted(&run(s), 0);
            b.ended(s, State::Succeeded, Vec::new(), None);
        }
        b.submitted(&run(KEEP_RUNS as u64 + 10), 0);
        assert_eq!(b.list().len(), KEEP_RUNS);
        assert!(b.get("run-1").is_none());
        assert!(b.get("run-2").is_some_and(|r| r.state == State::Starting), "not over: kept");
        assert!(b.get("run-3").is_none());
        assert!(!b.idle_past(std::time::Duration::ZERO), "runs not over are never idle");
    }
}
