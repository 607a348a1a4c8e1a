//! The one thread that takes every signal and reaps every child.
//!
//! `main` blocks all asynchronous signals before any thread exists; this
//! thread collects them with `sigtimedwait` and turns them into
//! [`SysEvent`]s. On SIGCHLD it reaps with `waitpid(-1, WNOHANG)` until no
//! exited child is left, which also reaps grandchildren re-parented to us (we
//! are PID 1 or a child subreaper). It is the only place in trainlet that
//! waits for a process: nobody calls `Child::wait`.

use std::time::Duration;

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use crate::sys::{self, Exit};

/// Signals that stop a trainlet mode that is not `run` (whose set is
/// `--signals-to-handle`): `store`, `sshd`, `mpi`.
pub const STOP: [i32; 4] = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGQUIT];

/// A signal or a reaped child.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SysEvent {
    /// A signal arrived (never SIGCHLD).
    Signal(i32),
    /// A child was reaped.
    Exited {
        /// Its pid.
        pid: i32,
        /// How it ended.
        exit: Exit,
        /// Wall-clock microseconds when it was reaped (for reports).
        at_us: u64,
        /// Monotonic time when it was reaped (for ordering against forks).
        reaped: std::time::Instant,
    },
}

/// Wall-clock microseconds since the epoch.
pub fn now_us() -> u64 {
    crate::clock::now_us()
}

/// Start the signal/reaper thread; events arrive on the returned channel.
pub fn start() -> std::io::Result<UnboundedReceiver<SysEvent>> {
    let (tx, rx) = unbounded_channel();
    std::thread::Builder::new().name("trainlet-signals".into()).spawn(move || run(&tx))?;
    Ok(rx)
}

fn run(tx: &UnboundedSender<SysEvent>) {
    loop {
        // The timeout also catches a SIGCHLD that raced an earlier reap.
        let sig = sys::wait_signal(Duration::from_millis(500));
        if sig.is_none_or(|s| s == libc::SIGCHLD) {
            for (pid, exit) in sys::reap_all() {
                if tx.send(SysEvent::Exited { pid, exit, at_us: now_us(), reaped: std::time::Instant::now() }).is_err()
                {
                    return;
                }
            }
        } else if let Some(s) = sig
            && tx.send(SysEvent::Signal(s)).is_err()
        {
            return;
        }
    }
}
