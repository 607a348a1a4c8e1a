//! Workers' progress, relayed to Kubeflow Trainer's status endpoint
//! (`TrainJob.status.trainerStatus`, reference/kubeflow.md 2.3) and to
//! Prometheus.
//!
//! With Trainer's `KUBEFLOW_TRAINER_SERVER_*` variables (or
//! `--progress-timeout`), trainlet serves a loopback endpoint with the same
//! API ([`endpoint`]) and gives each worker its address in those variables,
//! so transformers' `KubeflowCallback` and the Kubeflow SDK's
//! `update_trainjob_status` report to trainlet. The [`relay`] gathers every
//! rank's newest report of the current round on the store host, makes one
//! view of the job of them (global rank 0's report when it has one, else
//! the least advanced rank's; a failed attempt's reports are dropped),
//! merges trainlet's own facts ([`Facts`]) and posts to Trainer
//! ([`upstream`]) once per 5 s per job.

pub(crate) mod endpoint;
pub(crate) mod relay;
mod report;
mod upstream;

pub use endpoint::Board;
pub use report::{Facts, Status};
pub use upstream::Poster;

use prometheus::{Gauge, IntCounter};

/// The relay's Prometheus families (`crate::metrics` registers them).
#[derive(Debug)]
pub struct Gauges {
    /// `trainlet_progress_percent`: the newest report's progress.
    pub percent: Gauge,
    /// `trainlet_progress_remaining_seconds`: the newest report's ETA.
    pub remaining: Gauge,
    /// `trainlet_progress_reports_total`: reports taken from workers.
    pub reports: IntCounter,
    /// `trainlet_progress_posts_total`: statuses Trainer accepted.
    pub posts: IntCounter,
    /// `trainlet_progress_post_failures_total`: posts that failed.
    pub post_failures: IntCounter,
}

impl Gauges {
    fn build() -> Result<Self, prometheus::Error> {
        Ok(Self {
            percent: Gauge::new("trainlet_progress_percent", "Progress of the newest worker report, 0-100.")?,
            remaining: Gauge::new(
                "trainlet_progress_remaining_seconds",
                "Estimated seconds left, from the newest worker report.",
            )?,
            reports: IntCounter::new(
                "trainlet_progress_reports_total",
                "Progress reports taken from this pod's workers.",
            )?,
            posts: IntCounter::new("trainlet_progress_posts_total", "Statuses Trainer's status endpoint accepted.")?,
            post_failures: IntCounter::new(
                "trainlet_progress_post_failures_total",
                "Posts to Trainer's status endpoint that failed.",
            )?,
        })
    }

    /// Show `s` in the gauges.
    pub fn observe(&self, s: &Status) {
        if let Some(p) = s.progress {
            self.percent.set(f64::from(p));
        }
        if let Some(r) = s.remaining {
            self.remaining.set(f64::from(r));
        }
    }
}

/// The process's progress families.
pub fn gauges() -> &'static Gauges {
    static G: std::sync::OnceLock<Gauges> = std::sync::OnceLock::new();
    // Constant names that prometheus accepts; a failure here is a
    // programming error caught by every test.
    G.get_or_init(|| Gauges::build().expect("valid progress metric definitions"))
}
