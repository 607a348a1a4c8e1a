//! The types every source shares and nothing else: the exit codes of
//! `trainlet init` and [`InitError`]. Sources (`hub`, `s3`, `http`,
//! `file`) import these and [`crate::config`], never the dispatcher in
//! `lib.rs` that imports them.

use crate::progress;

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
    /// A file did not match the checksum or size the source publishes; it
    /// was not published.
    pub const CHECKSUM: u8 = 223;
    /// The output volume is full, or too small for what is left to fetch;
    /// partial files are removed.
    pub const NO_SPACE: u8 = 224;
    /// The source refused the credentials (401/403, a gated repo), or needs some.
    pub const DENIED: u8 = 225;
    /// The source kept failing (unreachable, 5xx, dropped connections past
    /// the retries) or answered something unusable; partial files stay for
    /// the next run to resume.
    pub const UNAVAILABLE: u8 = 226;
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
    /// The source refused the credentials.
    #[error("{uri}: {what}")]
    Denied {
        /// The storage URI.
        uri: String,
        /// What was refused, and what to do.
        what: String,
    },
    /// The source failed or answered something unusable.
    #[error("{uri}: {what}")]
    Source {
        /// The storage URI.
        uri: String,
        /// What went wrong.
        what: String,
    },
    /// A downloaded file is not what the source publishes.
    #[error("{uri}: {path} does not match the source (expected {want}, got {got}); it was not published")]
    Checksum {
        /// The storage URI.
        uri: String,
        /// The file, relative to the output.
        path: String,
        /// What the source publishes.
        want: String,
        /// What arrived.
        got: String,
    },
    /// The volume cannot hold what is left to fetch.
    #[error("{}: {} left to fetch but {} free; nothing was written, the marker was not written", output.display(), progress::bytes(*need), progress::bytes(*free))]
    TooBig {
        /// The output directory.
        output: std::path::PathBuf,
        /// Bytes to fetch.
        need: u64,
        /// Bytes free.
        free: u64,
    },
    /// Another process took the volume's lock over while this one stalled.
    #[error("{}: another initializer took this volume over (this one's heartbeat stalled past TRAINLET_INIT_STALE_SECS); stopped without writing the marker", output.display())]
    LockLost {
        /// The output directory.
        output: std::path::PathBuf,
    },
    /// Stopped by a signal; partial files stay for the next run.
    #[error("stopped by signal {signal}; partial files were kept for the next run to resume")]
    Terminated {
        /// The signal.
        signal: i32,
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
            InitError::NoSpace { .. } | InitError::TooBig { .. } => exit::NO_SPACE,
            InitError::Io { .. } | InitError::LockLost { .. } => exit::IO,
            InitError::Denied { .. } => exit::DENIED,
            InitError::Source { .. } => exit::UNAVAILABLE,
            InitError::Checksum { .. } => exit::CHECKSUM,
            InitError::Terminated { signal } => u8::try_from(128 + signal).unwrap_or(255),
        }
    }

    /// `map_err` adapter for [`InitError::io`]: `.map_err(InitError::at("cannot write", &p))`.
    pub fn at<'a>(what: &'static str, path: &'a std::path::Path) -> impl FnOnce(std::io::Error) -> Self + 'a {
        move |e| InitError::io(what, path, e)
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
