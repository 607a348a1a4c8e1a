//! `--evict-stragglers`: a pod whose rank the store host has named a
//! straggler for that long leaves the job with 207, so a spare takes its
//! rank. The store host asks it through the store (`rR/evict/<group
//! rank>`, read by the pod's sampler after each window,
//! [`super::stragglers`]); the pod then stops as on a stop asked of it
//! (its workers stopped gracefully, the others told at once so that they
//! regroup with a spare), and its exit is 207, with why in its log, its
//! termination message and a Kubernetes Event.

use std::sync::{Arc, OnceLock};

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

use super::Result;
use crate::config::Plan;
use crate::exit;
use crate::process::signals::SysEvent;

/// The pod's eviction, once asked: why.
#[derive(Debug, Clone)]
pub struct Evictor {
    asked: Arc<OnceLock<String>>,
    stop: UnboundedSender<SysEvent>,
}

impl Evictor {
    /// Ask this pod to leave (once; later asks are ignored): its job stops as on SIGTERM.
    pub(super) fn ask(&self, why: String) {
        if self.asked.set(why.clone()).is_ok() {
            tracing::error!(
                "this pod is evicted as a straggler's: {why}; stopping its workers, a spare takes its rank"
            );
            let _ = self.stop.send(SysEvent::StopAsked(libc::SIGTERM));
        }
    }

    /// Why this pod was evicted, if it was.
    pub(super) fn asked(&self) -> Option<&str> {
        self.asked.get().map(String::as_str)
    }
}

/// The job's events with the eviction's stop joined to them, and the
/// handle that asks it (None: `--evict-stragglers` is off).
pub(super) fn start(
    plan: &Plan,
    events: UnboundedReceiver<SysEvent>,
) -> (Option<Evictor>, UnboundedReceiver<SysEvent>) {
    if plan.health.evict_stragglers.is_none() || plan.serve.is_some() {
        return (None, events);
    }
    let (stop, merged) = super::inplace::merge(events);
    (Some(Evictor { asked: Arc::new(OnceLock::new()), stop }), merged)
}

/// The job's outcome `out` as the pod's exit: an evicted pod that stopped
/// leaves with 207 (its node is at fault: the runtimes' podFailurePolicy
/// replaces it without failing the job) and says why.
pub(super) fn finish(plan: &Plan, evictor: Option<&Evictor>, out: Result<u8>) -> Result<u8> {
    let Some(why) = evictor.and_then(Evictor::asked) else { return out };
    match out {
        Ok(c) if c == exit::for_signal(libc::SIGTERM) => {
            let text = format!("this pod left the job as a straggler's (exit {}): {why}", exit::GPU_FAULT);
            tracing::error!("{text}");
            super::finish::evicted(plan, &text);
            Ok(exit::GPU_FAULT)
        }
        out => out,
    }
}
