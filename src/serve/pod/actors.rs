//! The actor side of serve mode in the round loop: the bridge to this
//! pod's workers of an actor run, the actor runtime's file, and the
//! workers an actor in survivors mode keeps between two rounds (its
//! `Rejoin`, and their stop once the run is over while the pods wait for
//! the next round).

use std::path::PathBuf;
use std::time::Duration;

use super::Served;
use crate::serve::actor::bridge::{Bridge, Place};
use crate::serve::spec::Run;
use crate::supervise::carry::Carry;

impl Served {
    /// The bridge to this pod's workers of `run`, when it is an actor (its
    /// runtime written beside the runs).
    pub(super) fn bridge(&self, run: &Run) -> Result<Option<Bridge>, String> {
        let (Some(actor), Some(scope)) = (&run.actor, &self.scope) else { return Ok(None) };
        let runtime = self.runtime();
        crate::serve::actor::write_runtime(&runtime)
            .map_err(|e| format!("cannot write the actor runtime {}: {e}", runtime.display()))?;
        let place = Place {
            dial: self.dial.clone(),
            base: self.base.clone(),
            token_file: self.token_file.clone(),
            scope: scope.clone(),
        };
        let socket = self.conf.dir.join(format!("actor-{}.sock", run.seq));
        Bridge::start(place, run.seq, actor.clone(), &socket)
            .map(Some)
            .map_err(|e| format!("cannot start the actor's bridge: {}", crate::error::error_chain(&e)))
    }

    /// Where the actor runtime is written.
    pub(super) fn runtime(&self) -> PathBuf {
        self.conf.dir.join("actor_runtime.py")
    }

    /// The current run's actor, when it restarts only its missing ranks.
    pub fn survivors(&self) -> Option<&dyn crate::supervise::worker::Rejoin> {
        let b = self.current.as_ref()?.bridge.as_ref()?;
        b.survivors().then_some(b as &dyn crate::supervise::worker::Rejoin)
    }

    /// Has the current run ended in the store (closed, replaced, failed)?
    /// Between two rounds, the workers kept for it are stopped then (the
    /// next round, which ends them too, may be long in coming: a lost
    /// pod's replacement). An unreadable or forged marker is not an end.
    pub async fn current_over(&mut self) -> bool {
        let (Some(c), Some(scope)) = (&self.current, &self.scope) else { return false };
        let Ok(token) = crate::serve::read_token(&self.token_file) else { return false };
        matches!(self.link.ended(&token, scope, c.run.seq, &c.run.id).await, Ok(Some(Ok(_))))
    }
}

/// How often the pods look whether the run of the workers they keep
/// between two rounds is over.
const KEPT_POLL: Duration = Duration::from_secs(2);

/// `next` (the next round), while the workers kept for the next round of
/// the current run are stopped as soon as that run is over (closed or
/// replaced): the round that would end them can be long in coming.
pub(crate) async fn kept_until<F: std::future::Future>(
    next: F,
    carry: &mut Carry,
    served: Option<&mut Served>,
    grace: Duration,
) -> F::Output {
    tokio::pin!(next);
    let Some(sv) = served else { return next.await };
    loop {
        if carry.is_empty() {
            return next.await;
        }
        tokio::select! {
            out = &mut next => return out,
            () = tokio::time::sleep(KEPT_POLL) => {
                if sv.current_over().await {
                    carry.stop(grace).await;
                    crate::process::sweep::between_rounds("after a closed run's kept workers stopped");
                }
            }
        }
    }
}
