//! Serve mode starts on a pod: the control token's file, and [`Served`]
//! itself: on the store host the board, the serving session and the
//! control API; on every pod the cache's measure and the lane agents; in
//! a lane agent its link to the pod's agent.

use std::path::PathBuf;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::Served;
use crate::config::Plan;
use crate::process::spawn::Spawner;
use crate::serve::board::Board;
use crate::serve::lane::relay;
use crate::serve::setup::Applied;
use crate::serve::{Link, api};
use crate::store::Dial;
use crate::sys;

/// The control token's file of a served job (None without `--serve`):
/// `--control-token-file`, or on a single standalone pod a fresh one.
/// Every pod needs it before it dials the agents' store, which asks for it.
pub(crate) fn token_file(plan: &Plan) -> Result<Option<PathBuf>, crate::config::Error> {
    let Some(conf) = &plan.serve else { return Ok(None) };
    let usage = crate::config::Error::Usage;
    match &conf.token_file {
        Some(f) => {
            crate::serve::read_token(f).map_err(|e| {
                usage(format!("--control-token-file {}: {e}; mount the control Secret there", f.display()))
            })?;
            Ok(Some(f.clone()))
        }
        None if plan.serve_store && plan.nnodes == 1 => api::make_token(&conf.dir).map(Some).map_err(|e| {
            usage(format!("cannot write the control API's token under {} ({e}); give --control-token-file or a writable --serve-dir", conf.dir.display()))
        }),
        None => Err(usage(
            "--serve on more than one pod needs --control-token-file on every pod (the same Secret): the agents' store asks every pod for it, and each pod checks that a run was sealed with it".into(),
        )),
    }
}

/// A lane agent's link to the pod's agent (fd 3), as the sender of its
/// notes: held for the agent's life (its end tells the pod's agent it is gone).
fn lane_link(lane: &crate::config::Lane) -> Result<Option<relay::Sender>, crate::config::Error> {
    let refused = || {
        crate::config::Error::Usage(format!(
            "{} is set but descriptor {} is not a link to the pod's agent; it is set by trainlet for the agents it starts itself: unset it",
            crate::env::TRAINLET_LANE,
            crate::config::LANE_FD
        ))
    };
    let fd = sys::take_inherited_socket(crate::config::LANE_FD).ok_or_else(refused)?;
    let stream = std::os::unix::net::UnixStream::from(fd);
    stream.set_nonblocking(true).map_err(|_| refused())?;
    let stream = tokio::net::UnixStream::from_std(stream).map_err(|_| refused())?;
    tracing::info!(
        run = lane.seq,
        workers = lane.nproc,
        first_slot = lane.first,
        "serving a lane beside the pods' main run"
    );
    Ok(Some(relay::Sender::start(stream)))
}

impl Served {
    /// Serve mode for `plan` (None without `--serve`) with the control
    /// token in `token_file`; the store host publishes a new serving
    /// session and starts the control API.
    pub async fn start(
        plan: &Plan,
        (dial, spawner): (Dial, &Spawner),
        (token_file, rounds): (Option<PathBuf>, Option<crate::rendezvous::host::Rounds>),
        cancel: &CancellationToken,
    ) -> Result<Option<Self>, crate::config::Error> {
        let (Some(conf), Some(token_file)) = (plan.serve.clone(), token_file) else { return Ok(None) };
        let lane = conf.lane.clone();
        // How long a run takes to stop on every pod (checkpoint, grace, kill, margin).
        let stop_limit = plan.checkpoint_timeout + plan.grace + plan.kill_timeout + crate::rendezvous::STOP_SYNC_MARGIN;
        let cache = lane.as_ref().map_or(&conf.dir, |l| &l.main_dir).join("cache");
        if let Err(e) = std::fs::create_dir_all(&cache) {
            tracing::warn!(dir = %cache.display(), error = %e, "cannot make the pod's cache directory (TRAINLET_CACHE_DIR)");
        }
        let base = crate::rendezvous::job_base(&plan.run_id, plan.jobset_attempt);
        let usage = crate::config::Error::Usage;
        let mut link = match &lane {
            Some(l) => Link::for_lane(dial.clone(), &base, l.seq),
            None => Link::new(dial.clone(), &base),
        };
        let board = if plan.serve_store {
            let board = Arc::new(Board::default());
            let token = crate::serve::read_token(&token_file)
                .map_err(|e| usage(format!("--control-token-file {}: {e}", token_file.display())))?;
            let scope = link.new_session(&token).await.map_err(|e| {
                usage(format!(
                    "cannot publish the serving session in the agents' store: {}",
                    crate::error::error_chain(&e)
                ))
            })?;
            let api_conf = api::Conf {
                listen: conf.control,
                token_file: token_file.clone(),
                dial: dial.clone(),
                base: base.clone(),
                scope: scope.clone(),
                max_restarts: plan.max_restarts,
                stop_limit,
                idle_timeout: conf.idle_timeout,
                pod_nproc: plan.nproc,
                lanes: rounds.map(|r| {
                    let job = (plan.run_id.clone(), plan.jobset_attempt);
                    let lanes = crate::serve::lane::host::Lanes::new(r, job, stop_limit, cancel.child_token());
                    Arc::new(lanes)
                }),
                calls: Some(Arc::new(crate::serve::actor::calls::Desk::new(
                    crate::serve::actor::calls::Conf {
                        dial: dial.clone(),
                        base: base.clone(),
                        token_file: token_file.clone(),
                        scope: scope.clone(),
                    },
                    Arc::clone(&board),
                ))),
            };
            let addr = api::serve(api_conf, Arc::clone(&board), cancel.child_token()).await.map_err(|e| {
                usage(format!("--control-port: cannot listen on {} ({e}); choose a free port or address", conf.control))
            })?;
            crate::serve::cache::gather(dial.clone(), base.clone(), Arc::clone(&board), cancel.child_token());
            tracing::info!(%addr, token_file = %token_file.display(), idle_timeout_s = conf.idle_timeout.map(|d| d.as_secs_f64()), "control API listening");
            Some(board)
        } else {
            None
        };
        let cache_poke = Arc::new(tokio::sync::Notify::new());
        let (relay, lanes) = match &lane {
            Some(l) => (lane_link(l)?, None),
            None => {
                let pod = (plan.output.host.clone(), cache);
                let (poke, stop) = (Arc::clone(&cache_poke), cancel.child_token());
                crate::serve::cache::publish(dial.clone(), base.clone(), pod, poke, stop);
                crate::serve::stacks_on_demand::answer_requests(dial.clone(), base.clone(), cancel.child_token());
                let agents = crate::serve::lane::agents::Conf {
                    dial: dial.clone(),
                    base: base.clone(),
                    token_file: token_file.clone(),
                    dir: conf.dir.clone(),
                    board: board.clone(),
                    job: (plan.run_id.clone(), plan.jobset_attempt),
                    stop_limit,
                };
                (None, Some(crate::serve::lane::agents::Agents::start(agents, spawner.clone(), cancel.child_token())))
            }
        };
        Ok(Some(Self {
            lane,
            relay,
            lanes,
            cache_poke,
            link,
            base,
            conf,
            token_file,
            dial,
            board,
            scope: None,
            current: None,
            ended: 0,
            next_go: 1,
            refusing: false,
            spawner: spawner.clone(),
            steps: Vec::new(),
            applied: Applied::default(),
            judged: None,
        }))
    }
}
