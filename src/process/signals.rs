//! The one thread that takes every signal and reaps every child.
//!
//! `main` blocks all asynchronous signals before any thread exists; this
//! thread collects them with `sigtimedwait` and turns them into
//! [`SysEvent`]s. On SIGCHLD it reaps with `waitpid(-1, WNOHANG)` until no
//! exited child is left, which also reaps grandchildren re-parented to us (we
//! are PID 1 or a child subreaper). It is the only place in trainlet that
//! waits for a process: nobody calls `Child::wait`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
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
    /// trainlet itself asks for a stop as by this signal (the in-place
    /// restart agent, when the JobSet restarts the pods): the workers stop
    /// gracefully, and a stop already under way keeps its grace.
    StopAsked(i32),
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

/// Set once the thread is started: there is one per process.
static STARTED: AtomicBool = AtomicBool::new(false);

/// Start the signal/reaper thread; events arrive on the returned channel.
/// A second call is refused: two reapers would race for every exit.
pub fn start() -> std::io::Result<UnboundedReceiver<SysEvent>> {
    if STARTED.swap(true, Ordering::SeqCst) {
        return Err(std::io::Error::new(std::io::ErrorKind::AlreadyExists, "the reaper thread is already running"));
    }
    let (tx, rx) = unbounded_channel();
    std::thread::Builder::new().name("trainlet-signals".into()).spawn(move || run(&tx))?;
    Ok(rx)
}

/// How many reaps the thread has done, and a condition variable woken
/// after each: the sweep waits on it for the processes it killed to be
/// gone instead of sleeping a fixed time.
static REAPS: (Mutex<u64>, Condvar) = (Mutex::new(0), Condvar::new());

fn reaps_lock() -> MutexGuard<'static, u64> {
    REAPS.0.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The number of reaps so far (pass it to [`wait_reap`]).
pub fn reaps() -> u64 {
    *reaps_lock()
}

/// Block until a reap after `seen` (a value of [`reaps`]) or `limit`.
pub fn wait_reap(seen: u64, limit: Duration) {
    let guard = reaps_lock();
    let _ = REAPS.1.wait_timeout_while(guard, limit, |n| *n == seen);
}

fn run(tx: &UnboundedSender<SysEvent>) {
    // After the agent stops listening (its mode returned), the thread goes
    // on reaping until the process exits: the exit sweep waits for what it
    // killed to be reaped.
    let mut listening = true;
    loop {
        // The timeout also catches a SIGCHLD that raced an earlier reap.
        let sig = sys::wait_signal(Duration::from_millis(500));
        if sig.is_none_or(|s| s == libc::SIGCHLD) {
            let reaped = sys::reap_all();
            if !reaped.is_empty() {
                *reaps_lock() += reaped.len() as u64;
                REAPS.1.notify_all();
            }
            for (pid, exit) in reaped {
                let ev = SysEvent::Exited { pid, exit, at_us: now_us(), reaped: std::time::Instant::now() };
                listening = listening && tx.send(ev).is_ok();
            }
        } else if let Some(s) = sig {
            listening = listening && tx.send(SysEvent::Signal(s)).is_ok();
        }
    }
}
