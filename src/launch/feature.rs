//! The one interface through which a feature takes part in the job's
//! rounds ([`Feature`]); they are listed in one place, `super::feature_list`.
//! A feature hears when a round starts on this pod (and may give its
//! workers part of their world), when the round's workers ended, what the
//! pods decided, that the pod is being stopped, and that the job leaves
//! the pod. Each hook has a default that does nothing, so a feature
//! writes only the ones it needs; the job (`super::job`) calls them in
//! the order of the list.

use std::future::Future;
use std::pin::Pin;

use tokio::sync::mpsc::UnboundedReceiver;

use crate::config::Plan;
use crate::mpi::pmi::round::Link;
use crate::process::signals::SysEvent;
use crate::process::spawn::Spawner;
use crate::rendezvous::{Round, Session};
use crate::supervise::report::Failure;
use crate::supervise::worker::StatusLink;

/// A hook's work, awaited by the job.
pub(super) type Hook<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a feature may use when a round starts on this pod.
pub(super) struct Starting<'a> {
    /// The round's plan (a served run's, in serve mode).
    pub plan: &'a Plan,
    /// The round.
    pub round: &'a Round,
    /// The pod's rendezvous session.
    pub session: &'a mut Session,
    /// Starts processes (the XGBoost tracker).
    pub spawner: &'a Spawner,
    /// The signals and exits, for a wait that a stop must cut short.
    pub events: &'a mut UnboundedReceiver<SysEvent>,
}

/// What the features give a round's workers.
#[derive(Debug, Default)]
pub(super) struct Gifts<'a> {
    /// The pod's status endpoint (progress reporting).
    pub status: Option<&'a StatusLink>,
    /// The TorchFT Lighthouse's address (replica groups).
    pub lighthouse: Option<&'a str>,
    /// The round's PMI service (`--framework mpi`).
    pub pmi: Option<&'a Link>,
    /// Why no worker of this pod can start this round.
    pub unstartable: Option<&'a str>,
}

/// What a feature may use when the job leaves this pod.
pub(super) struct Leaving<'a> {
    /// The job's plan.
    pub plan: &'a Plan,
    /// The pod was stopped by a signal (it leaves at once).
    pub stopped: bool,
    /// The signals, for a wait that a stop must cut short.
    pub events: &'a mut UnboundedReceiver<SysEvent>,
}

/// A part of the job that is not the round loop's own.
pub(super) trait Feature: Send {
    /// Before this pod's workers start in a round (not an idle one).
    /// Err(signal) when a stop signal came first.
    fn round_starts<'a>(&'a mut self, at: Starting<'a>) -> Hook<'a, Result<(), i32>> {
        let _ = at;
        Box::pin(std::future::ready(Ok(())))
    }

    /// What it gives this round's workers.
    fn gives<'a>(&'a self, gifts: &mut Gifts<'a>) {
        let _ = gifts;
    }

    /// This pod's part of the round is over (`succeeded`: every worker
    /// here exited 0), before the pods compare what happened.
    fn round_ends(&mut self, succeeded: bool) -> Hook<'_, ()> {
        let _ = succeeded;
        Box::pin(std::future::ready(()))
    }

    /// The pods decided the round; `root` is the failure that ended it.
    fn decided(&mut self, root: Option<&Failure>) {
        let _ = root;
    }

    /// This pod is being stopped (`why`, on the store host).
    fn stopping<'a>(&'a mut self, plan: &'a Plan, why: &'a str) -> Hook<'a, ()> {
        let _ = (plan, why);
        Box::pin(std::future::ready(()))
    }

    /// The job leaves this pod. Err(signal) when a stop signal cut a wait
    /// of the feature's short (the pod exits as by that signal).
    fn leaving<'a>(&'a mut self, at: Leaving<'a>) -> Hook<'a, Result<(), i32>> {
        let _ = at;
        Box::pin(std::future::ready(Ok(())))
    }
}
