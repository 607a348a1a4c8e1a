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
//! Sources in this build: `file://` (hard links on the same filesystem,
//! else streamed copies). `hf://`, `s3://` and `http(s)://` are recognised
//! and refused with a clear error until their backends land (issue 6).

pub mod config;
pub mod file;
pub mod pattern;
pub mod volume;

pub use config::{Config, Kind, Source};

/// Exit codes of `trainlet init` (README, "trainlet init").
pub mod exit {
    /// The output holds the source's files and the completion marker.
    pub const SUCCESS: u8 = 0;
    /// Bad configuration: the URI, its scheme, a pattern, a missing credential.
    pub const CONFIG: u8 = 200;
    /// An unexpected OS failure (permissions, a broken volume).
    pub const IO: u8 = 202;
    /// The source does not exist (bucket, repo, prefix, path).
    pub const NOT_FOUND: u8 = 221;
    /// The source has no file left after the allow and ignore patterns.
    pub const NO_FILES: u8 = 222;
    /// The output volume is full; partial files are removed.
    pub const NO_SPACE: u8 = 224;
}

/// Why an initializer failed. Messages name the URI, never a credential.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    /// A bad setting.
    #[error("{0}")]
    Config(String),
    /// The source does not exist.
    #[error("{uri}: {what}")]
    NotFound {
        /// The storage URI.
        uri: String,
        /// What is missing.
        what: String,
    },
    /// Nothing to download after filtering.
    #[error("{uri}: no file left after filtering ({filter}); nothing would be written, so the job is stopped here")]
    NoFiles {
        /// The storage URI.
        uri: String,
        /// The patterns in force.
        filter: String,
    },
    /// The output ran out of space.
    #[error("out of disk space writing {path}; partial files were removed, the marker was not written")]
    NoSpace {
        /// The file being written.
        path: std::path::PathBuf,
    },
    /// Any other I/O failure.
    #[error("{what} {path}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// On which path.
        path: std::path::PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

impl InitError {
    /// The exit code for this failure.
    pub fn exit_code(&self) -> u8 {
        match self {
            InitError::Config(_) => exit::CONFIG,
            InitError::NotFound { .. } => exit::NOT_FOUND,
            InitError::NoFiles { .. } => exit::NO_FILES,
            InitError::NoSpace { .. } => exit::NO_SPACE,
            InitError::Io { .. } => exit::IO,
        }
    }

    /// An I/O error on `path`; ENOSPC becomes [`InitError::NoSpace`].
    pub fn io(what: &'static str, path: &std::path::Path, source: std::io::Error) -> Self {
        if source.raw_os_error() == Some(libc::ENOSPC) {
            InitError::NoSpace { path: path.to_path_buf() }
        } else {
            InitError::Io { what, path: path.to_path_buf(), source }
        }
    }
}

/// What a finished run did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// This process fetched and published the files.
    Fetched {
        /// Files written.
        files: usize,
        /// Bytes written.
        bytes: u64,
    },
    /// The marker was already there, for this URI.
    AlreadyDone,
}

/// Run the initializer: take the volume's lock (or wait for whoever holds
/// it), fetch, publish the marker.
pub fn run(cfg: &Config) -> Result<Outcome, InitError> {
    volume::exactly_once(cfg, || match &cfg.source {
        Source::File(path) => file::fetch(cfg, path),
        other => Err(InitError::Config(format!(
            "{}: the {} source is not supported by this trainlet build yet; file:// is",
            cfg.uri,
            other.scheme()
        ))),
    })
}
