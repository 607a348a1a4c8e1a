//! The modes of the binary, one file each: what `main` dispatches to once
//! `argv[0]` and the subcommand are known. Each mode returns `Ok(code)` for
//! an outcome it decided (the workers' code, doctor's verdict, mpirun's
//! status) or an [`Error`], and [`Error`]'s one `From` impl says which
//! exit code each failure is ([`crate::exit`] documents the codes;
//! [`CODES`] says which mode can return which).
//!
//! This is the top layer: it may import every module; nothing imports it
//! but `main.rs`.

pub mod doctor;
pub mod event;
pub mod init;
pub mod keygen;
pub mod mpi;
pub mod nvml_probe;
pub mod python;
pub mod run;
pub mod ssh;
pub mod sshd;
pub mod stacks;
pub mod stop;
pub mod store;

use crate::{exit, launch};

/// Why a mode ended without an outcome of its own.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A bad flag or variable.
    #[error(transparent)]
    Config(#[from] crate::config::Error),
    /// A bad argument of a mode without a `crate::config::Error` (its text says what and where).
    #[error("{0}")]
    Usage(String),
    /// The address the mode was told to listen on cannot be had.
    #[error("cannot listen on {at}")]
    Listen {
        /// The address or port.
        at: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// `trainlet sshd`'s keys or settings are bad.
    #[error(transparent)]
    Sshd(Box<sshd::SshdError>),
    /// `trainlet mpi`'s hosts or launcher cannot be had.
    #[error(transparent)]
    Mpi(#[from] crate::mpi::Error),
    /// The store's port cannot be had.
    #[error(transparent)]
    Bind(#[from] crate::store::ServerError),
    /// The runtime or the signal thread could not start.
    #[error(transparent)]
    Start(#[from] crate::process::StartError),
    /// A helper thread could not start.
    #[error("cannot start the {what} thread")]
    Thread {
        /// Which thread.
        what: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A process could not be started (`trainlet mpi`'s mpirun).
    #[error(transparent)]
    Spawn(#[from] crate::process::spawn::SpawnError),
    /// `trainlet run` failed.
    #[error(transparent)]
    Launch(Box<crate::launch::Error>),
    /// `trainlet init` failed.
    #[error(transparent)]
    Init(Box<initializers::InitError>),
    /// `trainlet keygen` could not make or write the keys.
    #[error(transparent)]
    Keygen(#[from] crate::ssh::KeyError),
    /// The store could not be served.
    #[error("cannot serve the store")]
    Serve(#[source] std::io::Error),
}

impl From<crate::launch::Error> for Error {
    fn from(e: crate::launch::Error) -> Self {
        Error::Launch(Box::new(e))
    }
}

impl From<sshd::SshdError> for Error {
    fn from(e: sshd::SshdError) -> Self {
        Error::Sshd(Box::new(e))
    }
}

impl From<initializers::InitError> for Error {
    fn from(e: initializers::InitError) -> Self {
        Error::Init(Box::new(e))
    }
}

impl From<&Error> for u8 {
    fn from(e: &Error) -> u8 {
        match e {
            Error::Config(_) | Error::Usage(_) | Error::Listen { .. } | Error::Bind(_) | Error::Sshd(_) => exit::CONFIG,
            Error::Mpi(m) => m.exit_code(),
            Error::Start(_) | Error::Thread { .. } | Error::Keygen(_) | Error::Serve(_) => exit::INTERNAL,
            Error::Launch(l) => match l.as_ref() {
                launch::Error::Config(_) | launch::Error::Store(_) => exit::CONFIG,
                launch::Error::Rendezvous(r) => r.exit_code(),
                launch::Error::Os(_) => exit::INTERNAL,
                launch::Error::InPlace(_) => exit::CONFIG,
            },
            Error::Init(i) => i.exit_code(),
            Error::Spawn(s) => s.exec_code().unwrap_or(exit::FORK_FAILED),
        }
    }
}

/// Which exit codes each mode can return, as the book's "Exit codes by mode"
/// table (`docs/src/exit-codes.md`) lists them (a test keeps the two equal).
/// `N` is a signal number.
pub const CODES: &[(&str, &str)] = &[
    ("run, torchrun", "0, 1-127, 128+N, 200-210, 211-255"),
    ("doctor", "0, 200, 202, 207, 208"),
    ("store", "0, 200, 202"),
    ("sshd", "0, 200, 202"),
    ("mpi, mpirun, mpiexec", "0, 1-127, 128+N, 200, 201, 202, 209, 210, 211-255"),
    ("ssh", "0-254 (the remote command's), 200 (a bad TRAINLET_SSH_PORT or TRAINLET_SSH_RETRY), 255"),
    ("init", "0, 143, 200, 202, 221-226"),
    ("keygen", "0, 200, 202"),
    ("stop", "0, 1"),
    ("stacks", "0, 1"),
    ("event (hidden, for tests)", "0, 200, 202"),
    ("nvml-probe", "0, 1"),
    (
        "python, python3 (the JAX/XGBoost images' links)",
        "the interpreter's, or run's for the job's entry; 126, 127 (no interpreter to exec), 202",
    ),
];

/// Logs on stderr (`TRAINLET_LOG`, else `default`), panics through tracing.
pub fn init_tracing(default: &str) {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TRAINLET_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default)),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .init();
    std::panic::set_hook(Box::new(|info| tracing::error!(%info, "trainlet panicked")));
}

/// The exit code of a mode's result; a failure is printed first, as
/// `<who>: error: <chain>`.
pub fn finish(who: &str, result: Result<u8, Error>) -> u8 {
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("{who}: error: {}", crate::error::error_chain(&e));
            u8::from(&e)
        }
    }
}
