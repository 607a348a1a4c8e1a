//! The steps of a job's start that are not the job's own state
//! (`super::job::Job::start`): the GPUs' pre-flight checks, the worker log
//! root, and joining the rendezvous.

use std::path::PathBuf;

use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::finish::{check_writable, log_root};
use super::wait::until_stop;
use super::{Error, Result};
use crate::config::Plan;
use crate::exit;
use crate::process::signals::SysEvent;
use crate::process::spawn::Spawner;
use crate::rendezvous::{self, Member, Session, Timing};
use crate::store::{Endpoint, Guard};

/// Pre-flight GPU checks; the exit code of the first failure, if any.
/// The NVML report, when there is one, fills what sysfs left out.
pub(super) async fn preflight(plan: &mut Plan, spawner: &Spawner) -> Option<u8> {
    if plan.gpu.checks.is_empty() {
        return None;
    }
    let (g, sp) = (plan.gpu.clone(), spawner.clone());
    let verdicts = match tokio::task::spawn_blocking(move || crate::gpu::prepare::preflight(&g, &sp)).await {
        Ok((v, report)) => {
            match &report {
                Ok(r) => crate::gpu::prepare::enrich(&mut plan.gpu.gpus, r),
                // No NVML (said once): the checks before each round skip it
                // rather than wait for it again.
                Err(_) => plan.gpu.checks.retain(|c| !c.needs_nvml()),
            }
            v
        }
        Err(e) => {
            tracing::error!(error = %e, "pre-flight checks panicked");
            return Some(exit::INTERNAL);
        }
    };
    for v in &verdicts {
        tracing::debug!(check = %v.check, status = ?v.status, "pre-flight");
    }
    let (code, msg) = crate::gpu::preflight::first_failure(&verdicts)?;
    tracing::error!(code, "{msg}");
    super::finish::left_unhealthy(&format!("this pod is not healthy (exit {code}): {msg}"));
    Some(code)
}

/// The pod's GPUs sampled through NVML every `every`, for the metrics
/// (`--metrics-addr`) and for a straggler's verdict (`--stragglers`); None
/// without GPUs or either.
pub(super) fn gpu_sampler(
    plan: &Plan,
    spawner: &Spawner,
    every: std::time::Duration,
) -> Option<crate::metrics::GpuSampler> {
    let sampled = plan.gpu.metrics_addr.is_some() || plan.health.stragglers;
    (sampled && !plan.gpu.gpus.is_empty())
        .then(|| crate::metrics::sample_gpus(spawner.clone(), plan.gpu.gpus.clone(), every, plan.gpu.nvml_timeout))
}

/// The rendezvous' timing, from the plan.
pub(super) fn timing(plan: &Plan) -> Timing {
    Timing {
        last_call: plan.last_call,
        heartbeat: plan.heartbeat,
        heartbeat_timeout: plan.heartbeat_timeout,
        lost_grace: plan.lost_grace,
    }
}

/// The worker log root, and whether files can be written there. Checked
/// before anything starts: with --log-dir, an unwritable directory is a
/// configuration error; without it, worker files are off and every stream
/// goes to the console (one warning, no line lost).
pub(super) fn log_files(plan: &Plan) -> Result<(PathBuf, bool)> {
    let root = log_root(plan);
    match check_writable(&root) {
        Ok(()) => Ok((root, true)),
        Err(e) => {
            if let Some(dir) = &plan.output.log_dir {
                return Err(Error::Config(crate::config::Error::Usage(format!(
                    "--log-dir {}: cannot write worker logs under {} ({e}); give a writable directory (an emptyDir volume) or drop --log-dir",
                    dir.display(),
                    root.display()
                ))));
            }
            tracing::warn!(
                dir = %root.display(),
                error = %e,
                "cannot write worker logs, error files or the failure report under the temporary directory; worker output goes to the console only"
            );
            Ok((root, false))
        }
    }
}

/// Join the rendezvous at `endpoint`. Err(Ok(exit code)) when a stop
/// signal came first, Err(Err(error)) when the rendezvous failed.
pub(super) async fn join(
    plan: &Plan,
    (endpoint, guard): (&Endpoint, Option<Guard>),
    timing: Timing,
    events: &mut UnboundedReceiver<SysEvent>,
    cancel: &CancellationToken,
) -> std::result::Result<Session, Result<u8>> {
    let me = Member {
        uid: String::new(),
        host: plan.output.host.clone(),
        pid: std::process::id(),
        node_rank: plan.node_rank,
        nproc: plan.nproc,
        min_nodes: plan.world_nodes().0,
        max_nodes: plan.world_nodes().1,
        max_restarts: plan.max_restarts,
        spares: plan.spares,
        last_rank: None,
    };
    let deadline = Instant::now() + plan.join_timeout;
    let rdzv_id = plan.rdzv_id();
    let connect = Session::connect((endpoint, guard), &rdzv_id, plan.jobset_attempt, me, timing, deadline, cancel);
    let mut session = match until_stop(events, plan, connect).await {
        Ok(Ok(s)) => s,
        Ok(Err(e @ rendezvous::Error::Stale { .. })) => {
            tracing::error!(error = %e, "rejected: pod of an older JobSet restart attempt");
            return Err(Err(e.into()));
        }
        Ok(Err(e)) => return Err(Err(e.into())),
        Err(sig) => return Err(Ok(exit::for_signal(sig))),
    };
    let lane_reports = plan.serve.as_ref().and_then(|s| s.lane.as_ref()).is_some_and(|l| l.report);
    session.roles(rendezvous::Roles { leads: plan.serve_store || lane_reports, serving: plan.serve.is_some() });
    tracing::info!(
        %endpoint,
        node_rank = plan.node_rank,
        nnodes = %plan.nnodes_spec(),
        spares = plan.spares,
        replica_group = ?plan.groups.as_ref().map(|g| g.group),
        job_node_rank = ?plan.groups.as_ref().map(|g| g.job_node_rank),
        uid = %session.me().uid,
        "joined the rendezvous"
    );
    Ok(session)
}
