//! The run's side of progress reporting: the pod's status endpoint (its
//! token file, 0600, in the run's directory), the relay to Trainer, and
//! the facts trainlet adds (restarts, round, world size, last failure).
//! Nothing here can fail the run: what cannot start is a warning and the
//! workers then get no endpoint.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::config::Plan;
use crate::rendezvous::Round;
use crate::status::relay::{Relay, Setup};
use crate::status::{Board, Facts, Poster};
use crate::supervise::report::Failure;
use crate::supervise::worker::StatusLink;

/// Progress reporting for one `trainlet run`.
#[derive(Debug)]
pub(super) struct Progress {
    link: Option<StatusLink>,
    relay: Option<Relay>,
    facts: Arc<watch::Sender<Facts>>,
}

impl Progress {
    /// Serve the endpoint and start the relay, as the plan asks.
    pub(super) async fn start(plan: &Plan, dir: &Path, store: crate::store::Dial, cancel: &CancellationToken) -> Self {
        let (facts, facts_rx) = watch::channel(Facts::default());
        let mut me = Self { link: None, relay: None, facts: Arc::new(facts) };
        if let Some(why) = &plan.progress.off_because {
            tracing::warn!("{why}");
        }
        if !plan.progress.collects() {
            return me;
        }
        let board = Arc::new(Board::default());
        let token = format!("{:016x}{:016x}", crate::sys::random_u64(), crate::sys::random_u64());
        let token_file = dir.join("status-token");
        let served = match write_private(&token_file, &token) {
            Ok(()) => crate::status::endpoint::serve(Arc::clone(&board), token, cancel.child_token()).await,
            Err(e) => Err(e),
        };
        match served {
            Ok(port) => {
                tracing::info!(port, "serving the workers' status endpoint on 127.0.0.1");
                me.link = Some(StatusLink { port, token_file, board: Arc::clone(&board) });
            }
            Err(e) => tracing::warn!(
                error = %e,
                dir = %dir.display(),
                "cannot serve the workers' status endpoint; workers get no KUBEFLOW_TRAINER_SERVER_URL and report no progress"
            ),
        }
        if let Some(up) = &plan.progress.upstream {
            let poster = plan.serve_store.then(|| Poster::new(up.clone()));
            if poster.is_some() {
                tracing::info!(url = %up.url, "posting the job's progress to Trainer (at most every 5 s)");
            }
            let setup = Setup {
                store,
                base: crate::rendezvous::job_base(&plan.rdzv_id(), plan.jobset_attempt),
                node_rank: plan.node_rank,
                nnodes: plan.nnodes,
                spares: plan.spares > 0,
                poster,
            };
            me.relay = Some(Relay::start(setup, board, facts_rx));
        }
        me
    }

    /// trainlet's facts about the job, which other features add to.
    pub(super) fn facts(&self) -> Arc<watch::Sender<Facts>> {
        Arc::clone(&self.facts)
    }

    /// A round starts: the last round's reports no longer speak for the
    /// job, and this pod's local rank 0 is global rank `group_rank x nproc`.
    fn round(&self, round: &Round, nproc: u32) {
        if let Some(link) = &self.link {
            link.board.begin_round(round.number, round.group_rank.saturating_mul(nproc));
        }
        self.facts.send_modify(|f| {
            f.round = round.number;
            f.restarts = round.restarts;
            f.world_size = round.nnodes * nproc;
        });
    }

    /// This pod's workers are gone: pass their last report on now.
    async fn flush(&self) {
        if let Some(r) = &self.relay {
            r.flush().await;
        }
    }

    /// A round ended with `root` as its first failure.
    fn failed(&self, root: Option<&Failure>) {
        if let Some(r) = root {
            let why = match (r.no_progress, r.raised) {
                (true, _) => "no progress".to_string(),
                (false, true) => "raised an exception".to_string(),
                (false, false) => r.exit().to_string(),
            };
            // With the first line of the worker's error, as the termination message has it.
            let line = match (&r.stall, r.message.as_deref().and_then(|m| m.lines().next())) {
                // A hang: who the job waited for, and where.
                (Some(s), _) => format!("hung: {s}"),
                (None, Some(m)) => format!("rank {} {why}: {}: {m}", r.rank, r.host),
                (None, None) => format!("rank {} {why}", r.rank),
            };
            self.facts.send_modify(|f| f.last_failure = Some(line));
        }
    }
}

impl super::feature::Feature for Progress {
    fn round_starts<'a>(&'a mut self, at: super::feature::Starting<'a>) -> super::feature::Hook<'a, Result<(), i32>> {
        self.round(at.round, at.plan.nproc);
        Box::pin(std::future::ready(Ok(())))
    }

    fn gives<'a>(&'a self, gifts: &mut super::feature::Gifts<'a>) {
        gifts.status = self.link.as_ref();
    }

    fn round_ends(&mut self, _succeeded: bool) -> super::feature::Hook<'_, ()> {
        Box::pin(self.flush())
    }

    fn decided(&mut self, root: Option<&Failure>) {
        self.failed(root);
    }

    fn leaving<'a>(&'a mut self, _at: super::feature::Leaving<'a>) -> super::feature::Hook<'a, Result<(), i32>> {
        Box::pin(async move {
            if let Some(r) = self.relay.take() {
                r.finish().await;
            }
            Ok(())
        })
    }
}

/// Create `path` readable by this uid only, holding `text`.
fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let _ = std::fs::remove_file(path);
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    f.write_all(text.as_bytes())
}
