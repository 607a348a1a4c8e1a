//! XGBoost's RabitTracker, which trainlet runs for every round of an
//! XGBoost job (Trainer's plugin leaves it to user code on rank 0).
//!
//! The store host's agent starts the tracker in the job's python (the
//! tracker is XGBoost's own, `xgboost.tracker.RabitTracker`) on the
//! round's second port, waits for it to listen, and says so in the store
//! (`rR/service`); the other pods start their workers only then, since an
//! XGBoost worker gives up on a tracker that is not there after about 6 s.
//! The tracker ends by itself when the workers shut the group down, and
//! the end-of-round sweep kills it otherwise, so a new round gets a new
//! one. A tracker that does not start is logged and its workers fail to
//! connect: the failure policy decides, as for any worker failure.

use std::time::Duration;

use crate::config::Plan;
use crate::process::spawn::{Spawner, WorkerSpec};
use crate::rendezvous::{Round, Session};
use crate::supervise::output::{self, Sink};

/// How long the tracker may take to start (python and XGBoost imports).
const START_LIMIT: Duration = Duration::from_secs(120);
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

/// Make the round's tracker ready before this pod's workers start: start
/// it on the store host, wait for it elsewhere. Never fails the round by
/// itself; a store that is gone shows in the attempt that follows.
pub(super) async fn prepare(session: &mut Session, round: &Round, plan: &Plan, spawner: &Spawner) {
    let workers = round.nnodes * plan.nproc;
    if plan.serve_store {
        let state = start(plan, workers, round.aux_port, spawner).await;
        match &state {
            Ok(pid) => {
                tracing::info!(round = round.number, port = round.aux_port, workers, pid, "XGBoost tracker listening")
            }
            Err(why) => {
                tracing::error!(round = round.number, error = %why, "cannot start the XGBoost tracker; the workers will fail to reach it")
            }
        }
        if let Err(e) = session.publish_service(round.number, state.map(|_| ())).await {
            tracing::warn!(error = %crate::error::error_chain(&e), "cannot tell the other pods the tracker's state");
        }
        return;
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
    let (tx, rx) = tokio::sync::oneshot::channel();
    let sink = |is_err| Sink { prefix: "[xgboost-tracker]: ".into(), console: true, file: None, is_err, tap: None };
    if let Some(fd) = sp.stdout {
        tokio::spawn(output::drain_watching(fd, sink(false), Some((READY, tx))));
    }
    if let Some(fd) = sp.stderr {
        tokio::spawn(output::drain(fd, sink(true)));
    }
    match tokio::time::timeout(START_LIMIT, rx).await {
        Ok(Ok(())) => Ok(sp.pid),
        Ok(Err(_)) => Err("the tracker exited before it listened (its output is above)".into()),
        Err(_) => {
            crate::sys::signal_group(sp.pid, libc::SIGKILL);
            Err(format!("the tracker did not listen within {START_LIMIT:?}"))
        }
    }
}
