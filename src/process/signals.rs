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

/// What a loop waiting on the events makes of the next one: the one rule
/// for "is this a stop, and as by which signal", shared by every loop of
/// the agent that waits on [`SysEvent`]s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Heard {
    /// Stop as by `signal`: one of the plan's stop signals
    /// (`--signals-to-handle`), or trainlet's own ask (`asked`, whatever
    /// its signal), or the end of the events (the signal thread gone:
    /// SIGTERM).
    Stop {
        /// The signal the stop is as by (its exit code is 128 + it).
        signal: i32,
        /// trainlet asked for it (an in-place restart), no signal came.
        asked: bool,
    },
    /// A child was reaped.
    Exited {
        /// Its pid.
        pid: i32,
        /// How it ended.
        exit: Exit,
        /// Wall-clock microseconds when it was reaped.
        at_us: u64,
    },
    /// A signal that is not a stop (forwarded or ignored by the caller).
    Other(i32),
}

impl Heard {
    /// Read `event` (None: the channel closed) against `stop_signals`.
    pub fn of(event: Option<SysEvent>, stop_signals: &[i32]) -> Heard {
        match event {
            Some(SysEvent::Signal(s)) if stop_signals.contains(&s) => Heard::Stop { signal: s, asked: false },
            Some(SysEvent::Signal(s)) => Heard::Other(s),
            Some(SysEvent::StopAsked(s)) => Heard::Stop { signal: s, asked: true },
            Some(SysEvent::Exited { pid, exit, at_us, .. }) => Heard::Exited { pid, exit, at_us },
            None => Heard::Stop { signal: libc::SIGTERM, asked: false },
        }
    }
}

/// Wall-clock microseconds since the epoch.
pub fn now_us() -> u64 {
    crate::clock::now_us()
}

/// Exits routed to one waiter instead of the agent's event channel: a
/// helper the agent supervises on its own, beside whatever loop reads the
/// events (the TorchFT Lighthouse). An exit can be reaped before its pid is
/// claimed (the helper died between fork and [`claim`]), so the last
/// [`RECENT`] exits are kept and handed out on a claim made after them, if
/// they were reaped after the claimant's fork (pids are reused).
struct Claims {
    waiting: Vec<(i32, tokio::sync::oneshot::Sender<Exit>)>,
    recent: std::collections::VecDeque<(i32, Exit, std::time::Instant)>,
}

/// Exits kept for a late [`claim`].
const RECENT: usize = 256;

static CLAIMS: Mutex<Claims> = Mutex::new(Claims { waiting: Vec::new(), recent: std::collections::VecDeque::new() });

fn claims() -> MutexGuard<'static, Claims> {
    CLAIMS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The exit of `pid`, forked at `forked` (taken before the fork), once the
/// one reaper reaps it; that exit is then not sent on the event channel.
pub fn claim(pid: i32, forked: std::time::Instant) -> tokio::sync::oneshot::Receiver<Exit> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let mut c = claims();
    match c.recent.iter().position(|(p, _, reaped)| *p == pid && *reaped >= forked) {
        Some(i) => {
            if let Some((_, exit, _)) = c.recent.remove(i) {
                let _ = tx.send(exit);
            }
        }
        None => c.waiting.push((pid, tx)),
    }
    rx
}

/// Route one reaped exit to its claimant; false when nobody claimed it.
fn route(pid: i32, exit: Exit, reaped: std::time::Instant) -> bool {
    let mut c = claims();
    if let Some(i) = c.waiting.iter().position(|(p, _)| *p == pid) {
        let (_, tx) = c.waiting.swap_remove(i);
        // A claimant that went away no longer cares; the exit is consumed.
        let _ = tx.send(exit);
        return true;
    }
    if c.recent.len() >= RECENT {
        c.recent.pop_front();
    }
    c.recent.push_back((pid, exit, reaped));
    false
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
                let at = std::time::Instant::now();
                if route(pid, exit, at) {
                    continue;
                }
                let ev = SysEvent::Exited { pid, exit, at_us: now_us(), reaped: at };
                listening = listening && tx.send(ev).is_ok();
            }
        } else if let Some(s) = sig {
            listening = listening && tx.send(SysEvent::Signal(s)).is_ok();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn heard_reads_stops_exits_and_other_signals_one_way() {
        let stops = [libc::SIGTERM, libc::SIGINT];
        let reaped = Instant::now();
        let cases = [
            (Some(SysEvent::Signal(libc::SIGINT)), Heard::Stop { signal: libc::SIGINT, asked: false }),
            (Some(SysEvent::Signal(libc::SIGUSR1)), Heard::Other(libc::SIGUSR1)),
            // trainlet's own ask is a stop whatever the plan's list says.
            (Some(SysEvent::StopAsked(libc::SIGHUP)), Heard::Stop { signal: libc::SIGHUP, asked: true }),
            (
                Some(SysEvent::Exited { pid: 7, exit: Exit::Code(3), at_us: 9, reaped }),
                Heard::Exited { pid: 7, exit: Exit::Code(3), at_us: 9 },
            ),
            (None, Heard::Stop { signal: libc::SIGTERM, asked: false }),
        ];
        for (event, want) in cases {
            assert_eq!(Heard::of(event, &stops), want, "{event:?}");
        }
    }

    // Pids far from any real one: the table is process-wide.
    #[test]
    fn claimed_exits_go_to_their_claimant_before_and_after_reaping() {
        let t0 = Instant::now();
        let mut early = claim(-7001, t0);
        assert!(route(-7001, Exit::Code(3), t0 + Duration::from_millis(5)), "claimed: not on the event channel");
        assert_eq!(early.try_recv().ok(), Some(Exit::Code(3)));
        // Reaped before the claim: handed out from the recent exits.
        assert!(!route(-7002, Exit::Signal(9), t0 + Duration::from_millis(10)), "nobody claimed it yet");
        assert_eq!(claim(-7002, t0).try_recv().ok(), Some(Exit::Signal(9)));
        // An older process with a reused pid: its exit is not the claimant's.
        assert!(!route(-7003, Exit::Code(0), t0 + Duration::from_millis(10)));
        let mut late = claim(-7003, t0 + Duration::from_millis(20));
        assert!(late.try_recv().is_err(), "an exit reaped before the fork is someone else's");
        assert!(route(-7003, Exit::Code(1), t0 + Duration::from_millis(30)));
        assert_eq!(late.try_recv().ok(), Some(Exit::Code(1)));
    }
}
