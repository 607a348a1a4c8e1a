//! The one place where the job's features are listed ([`list`]): a new
//! feature is one file implementing `super::feature::Feature` and one
//! line here.

use tokio_util::sync::CancellationToken;

use super::feature::Feature;
use crate::config::Plan;
use crate::store::Dial;

/// What a feature may use when the job starts it.
pub(super) struct Setup<'a> {
    /// The job's plan.
    pub plan: &'a Plan,
    /// The job's store, as this pod reaches it.
    pub dial: Dial,
    /// Where the worker logs and the status token go.
    pub log_root: &'a std::path::Path,
    /// The job's cancellation.
    pub cancel: &'a CancellationToken,
    /// Asks this pod to leave as a straggler's (`--evict-stragglers`).
    pub evictor: Option<super::evict::Evictor>,
}

/// Every feature of the job, in the order the job calls them.
pub(super) async fn list(setup: Setup<'_>, replicas: super::replicas::Replicas) -> Vec<Box<dyn Feature>> {
    let progress = super::progress::Progress::start(setup.plan, setup.log_root, setup.dial.clone(), setup.cancel).await;
    let stragglers =
        super::stragglers::Stragglers::new(setup.plan, (setup.dial, setup.evictor), progress.facts(), setup.cancel);
    vec![
        Box::new(progress),
        Box::new(stragglers),
        Box::new(replicas),
        Box::new(super::pmi::Pmi::default()),
        Box::new(super::tracker::Xgboost::default()),
    ]
}
