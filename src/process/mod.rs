//! Processes, the bottom layer above [`crate::sys`]: the one signal and
//! reaper thread ([`signals`]), the routing of its exits ([`reaper`]), the
//! spawner thread ([`spawn`]), the sweep of leftover descendants
//! ([`sweep`]), OOM-killer scores ([`oom`]), CPU sets ([`cpuset`]) and the
//! frame of every mode that owns processes ([`supervised`]).
//!
//! Nothing here knows torch, MPI or the store; it imports only `sys` and
//! the exit codes a forked child uses.

pub mod cpuset;
pub mod oom;
pub mod reaper;
pub mod signals;
pub mod spawn;
pub mod sweep;

use std::time::Duration;

use tokio_util::sync::CancellationToken;

pub use cpuset::CpuSet;
use signals::SysEvent;

/// Why a mode that owns processes could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The tokio runtime could not be built.
    #[error("cannot start the async runtime")]
    Runtime(#[source] std::io::Error),
    /// The signal/reaper thread could not be started.
    #[error("cannot start the signal thread")]
    Signals(#[source] std::io::Error),
}

/// The runtime every process-owning mode runs on: two worker threads (the
/// agent is I/O bound, and the pod's CPUs are the workers').
pub fn runtime() -> Result<tokio::runtime::Runtime, StartError> {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().map_err(StartError::Runtime)
}

/// A one-thread runtime, for what runs one event loop: the standalone
/// store (as torch's libuv server), the ssh client, `trainlet init`'s
/// metrics endpoint.
pub fn event_loop() -> Result<tokio::runtime::Runtime, StartError> {
    tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(StartError::Runtime)
}

/// A mode that owns processes: child subreaper, the signal/reaper thread, a
/// runtime, one root cancellation token, and no descendant left behind when
/// `body` returns.
pub fn supervised<F, Fut>(body: F) -> Result<u8, StartError>
where
    F: FnOnce(tokio::sync::mpsc::UnboundedReceiver<SysEvent>, CancellationToken) -> Fut,
    Fut: std::future::Future<Output = u8>,
{
    let rt = runtime()?;
    if let Err(e) = crate::sys::become_subreaper() {
        tracing::warn!(error = %e, "cannot become a child subreaper; orphans may escape");
    }
    let events = signals::start().map_err(StartError::Signals)?;
    let cancel = CancellationToken::new();
    let code = rt.block_on(body(events, cancel.clone()));
    cancel.cancel();
    rt.shutdown_timeout(Duration::from_secs(1));
    kill_leftovers();
    Ok(code)
}

/// SIGTERM every descendant still alive (orphans re-parented to the
/// subreaper, daemons that left their process group), give them a moment,
/// then SIGKILL until none is left (bounded).
pub fn kill_leftovers() {
    let swept = sweep::terminate_all(Duration::from_secs(2), Duration::from_secs(5));
    sweep::log(&swept, "exit");
}
