//! `trainlet init dataset|model`: Kubeflow Trainer's dataset and model
//! initializers (reference/kubeflow.md 4), reading the same environment
//! (`STORAGE_URI`, `IGNORE_PATTERNS`, `ACCESS_TOKEN`, `ENDPOINT`, ...) and
//! writing to the same places (`/workspace/dataset`, `/workspace/model`),
//! exactly once per volume: files are written under temporary names and
//! renamed, and the output directory gets a completion marker (source URI,
//! revision, file list) only when everything is in place. Several pods on
//! one volume: one holds a heartbeat lock file and downloads, the others
//! wait for the marker, or take over when the heartbeat stops.
//!
//! Sources: `hf://` ([`hub`], the Hub's REST API over reqwest), `s3://`
//! ([`s3`], Apache OpenDAL), `http(s)://` ([`http`], one file), all through
//! one engine ([`fetch`]: concurrent ranged reads, verification, resume),
//! and `file://` ([`file`]: hard links on the same filesystem, else
//! streamed copies).

pub mod config;
mod error;
pub mod fetch;
pub mod file;
pub mod http;
pub mod hub;
pub mod pattern;
pub mod progress;
pub mod remote;
mod resume;
pub mod s3;
pub mod sources;
mod verify;
pub mod volume;

use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering};

pub use config::{Config, Kind, Source};
pub use error::{InitError, exit};
pub use volume::Outcome;

/// What the caller shares with a run: the progress counters it reads, and
/// the stop request it sets (a signal number; 0 for none). The library
/// installs no signal handler: the agent collects signals in one place.
#[derive(Debug, Default, Clone)]
pub struct Control {
    /// Updated as files arrive.
    pub progress: Arc<progress::Progress>,
    /// Set to SIGTERM or SIGINT to stop; partial files are kept.
    pub stop: Arc<AtomicI32>,
}

impl Control {
    /// The signal that asked this run to stop, if any.
    pub fn stopped(&self) -> Option<i32> {
        Some(self.stop.load(Ordering::SeqCst)).filter(|s| *s != 0)
    }
}

/// Run the initializer: take the volume's lock (or wait for whoever holds
/// it), fetch, publish the marker.
pub fn run(cfg: &Config, opts: &fetch::Options, ctl: &Control) -> Result<Outcome, InitError> {
    volume::exactly_once(cfg, ctl, |lost| match &cfg.source {
        Source::File(path) => file::fetch(cfg, path),
        _ => fetch::remote(cfg, opts, ctl, lost),
    })
}
