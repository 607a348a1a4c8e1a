//! XGBoost's RabitTracker, which trainlet runs for every round of an
//! XGBoost job (Trainer's plugin leaves it to user code on rank 0).
//!
//! The store host's agent starts the tracker in the job's python (the
//! tracker is XGBoost's own, `xgboost.tracker.RabitTracker`) on the
//! round's second port, waits for it to listen, and says so in the store
//! (`rR/service`); the other pods start their workers only then, since an
//! XGBoost worker gives up on a tracker that is not there after about 6 s.
//! The tracker is the agent's own helper, not a leftover of the workers:
//! the end-of-round sweep spares it ([`crate::process::sweep::keep`]), and
//! [`Tracker::stop`] ends it after the round as what it is. After a round
//! whose workers all succeeded it ends by itself once they shut the group
//! down (XGBoost's `wait_for` returns a moment after the last worker
//! leaves), so it gets a short wait first; after a failed round it waits
//! for workers that are gone, so it is killed at once. Either way a new
//! round gets a new one. A tracker that does not start is logged and its
//! workers fail to connect: the failure policy decides, as for any worker
//! failure.

use std::time::Duration;

use crate::config::Plan;
use crate::process::spawn::{Spawner, WorkerSpec};
use crate::rendezvous::{Round, Session};
use crate::supervise::output::{self, Sink};

/// How long the tracker may take to start (python and XGBoost imports).
const START_LIMIT: Duration = Duration::from_secs(120);
/// How long a tracker gets to end by itself after a successful round.
const END_WAIT: Duration = Duration::from_secs(3);
/// How long a killed tracker gets to die before it is no longer spared.
const DEATH_WAIT: Duration = Duration::from_secs(2);
/// What the tracker prints once it listens.
const READY: &[u8] = b"trainlet-tracker-ready";
/// The tracker: task ids sort the ranks, so DMLC_TASK_ID is the rank.
const SCRIPT: &str = "import sys
from xgboost.tracker import RabitTracker
t = RabitTracker(n_workers=int(sys.argv[1]), host_ip='0.0.0.0', port=int(sys.argv[2]), sortby='task')
t.start()
print('trainlet-tracker-ready', flush=True)
t.wait_for()
";

/// The round's tracker process, on the store host.
#[derive(Debug)]
struct Tracker {
    pid: i32,
    round: u64,
}

impl Tracker {
    /// The round is over and its workers are gone: end the tracker.
    /// `succeeded`: every worker exited 0, so the tracker is ending by
    /// itself and gets [`END_WAIT`] to do so; otherwise it is killed now.
    async fn stop(self, succeeded: bool) {
        let started = tokio::time::Instant::now();
        let wait = if succeeded { END_WAIT } else { Duration::ZERO };
        while self.running() && started.elapsed() < wait {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if self.running() {
            // Its own process group (the spawner's), so nothing it started survives it.
            crate::sys::signal_group(self.pid, libc::SIGKILL);
            // Spared until it is dead: released while SIGKILL is still on
            // its way, a sweep would take it for a worker's leftover.
            let killed = tokio::time::Instant::now();
            while self.running() && killed.elapsed() < DEATH_WAIT {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            tracing::info!(round = self.round, pid = self.pid, "stopped the round's XGBoost tracker");
        } else {
            tracing::debug!(round = self.round, pid = self.pid, "the XGBoost tracker ended with its round");
        }
        crate::process::sweep::release(self.pid);
    }

    /// Still running (not yet exited; the one reaper reaps it at once when
    /// it does, and no other process is forked before it is stopped, so
    /// its pid is not reused meanwhile).
    fn running(&self) -> bool {
        crate::sys::proc_state(self.pid).is_some_and(|s| s != 'Z')
    }
}

/// The XGBoost tracker as a feature of the job's rounds
/// (`--framework xgboost`): made ready before the workers start, stopped
/// once they are gone.
#[derive(Debug, Default)]
pub(super) struct Xgboost {
    /// The round's tracker, on the store host.
    tracker: Option<Tracker>,
}

impl super::feature::Feature for Xgboost {
    fn round_starts<'a>(&'a mut self, at: super::feature::Starting<'a>) -> super::feature::Hook<'a, Result<(), i32>> {
        Box::pin(async move {
            if at.plan.framework != crate::config::Framework::Xgboost {
                return Ok(());
            }
            let ready = prepare(at.session, at.round, at.plan, at.spawner);
            self.tracker = super::wait::until_stop(at.events, at.plan, ready).await?;
            Ok(())
        })
    }

    fn round_ends(&mut self, succeeded: bool) -> super::feature::Hook<'_, ()> {
        Box::pin(async move {
            if let Some(t) = self.tracker.take() {
                t.stop(succeeded).await;
            }
        })
    }
}

/// Make the round's tracker ready before this pod's workers start: start
/// it on the store host (its [`Tracker`] is returned, to be stopped after
/// the round), wait for it elsewhere. Never fails the round by itself; a
/// store that is gone shows in the attempt that follows.
async fn prepare(session: &mut Session, round: &Round, plan: &Plan, spawner: &Spawner) -> Option<Tracker> {
    let workers = round.nnodes * plan.nproc;
    if plan.serve_store {
        let state = start(plan, workers, round.aux_port, spawner).await;
        let tracker = match &state {
            Ok(pid) => {
                tracing::info!(round = round.number, port = round.aux_port, workers, pid, "XGBoost tracker listening");
                Some(Tracker { pid: *pid, round: round.number })
            }
            Err(why) => {
                tracing::error!(round = round.number, error = %why, "cannot start the XGBoost tracker; the workers will fail to reach it");
                None
            }
        };
        if let Err(e) = session.publish_service(round.number, state.map(|_| ())).await {
            tracing::warn!(error = %crate::error::error_chain(&e), "cannot tell the other pods the tracker's state");
        }
        return tracker;
    }
    tracing::info!(
        round = round.number,
        limit_s = plan.join_timeout.as_secs_f64(),
        "waiting for the XGBoost tracker on the store host"
    );
    match session.wait_service(round, plan.join_timeout).await {
        Ok(Some(s)) if s == "ready" => tracing::info!(round = round.number, "the XGBoost tracker is up"),
        Ok(Some(s)) => {
            tracing::warn!(round = round.number, state = %s, "the XGBoost tracker is not up; starting the workers anyway")
        }
        Ok(None) => tracing::warn!(
            round = round.number,
            "the store host never said its XGBoost tracker was up; starting the workers anyway"
        ),
        Err(e) => {
            tracing::warn!(error = %crate::error::error_chain(&e), "lost the store while waiting for the XGBoost tracker")
        }
    }
    None
}

/// Start the tracker for `workers` on `port`; its pid once it listens.
async fn start(plan: &Plan, workers: u32, port: u16, spawner: &Spawner) -> Result<i32, String> {
    let python = plan.entry.python.clone().ok_or("no python interpreter for the tracker")?;
    if port == 0 {
        return Err("the store host found no free port for it".into());
    }
    let args = vec!["-c".to_string(), SCRIPT.to_string(), workers.to_string(), port.to_string()];
    let sp =
        spawner.spawn(WorkerSpec::piped(python, args, Vec::new())).await.map_err(|e| crate::error::error_chain(&e))?;
    // The agent's helper: the end-of-round sweep must not take it for a
    // worker's leftover ([`Tracker::stop`] ends it).
    crate::process::sweep::keep(sp.pid);
    let (tx, rx) = tokio::sync::oneshot::channel();
    let sink = |is_err| Sink {
        prefix: "[xgboost-tracker]: ".into(),
        console: true,
        file: None,
        is_err,
        tap: None,
        tail: None,
    };
    if let Some(fd) = sp.stdout {
        tokio::spawn(output::drain_watching(fd, sink(false), Some((READY, tx))));
    }
    if let Some(fd) = sp.stderr {
        tokio::spawn(output::drain(fd, sink(true)));
    }
    match tokio::time::timeout(START_LIMIT, rx).await {
        Ok(Ok(())) => Ok(sp.pid),
        Ok(Err(_)) => {
            crate::process::sweep::release(sp.pid);
            Err("the tracker exited before it listened (its output is above)".into())
        }
        Err(_) => {
            crate::sys::signal_group(sp.pid, libc::SIGKILL);
            crate::process::sweep::release(sp.pid);
            Err(format!("the tracker did not listen within {START_LIMIT:?}"))
        }
    }
}
