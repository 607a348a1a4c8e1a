//! Routing of the one reaper's exits to whoever started the process, for
//! modes with many independent children (`trainlet sshd`, `trainlet mpi`).
//!
//! The signals thread stays the only place that waits for a process; this
//! task only reads its [`SysEvent`]s and hands each exit to the future that
//! [`Reaper::watch`] returned for that pid. An exit can be reaped before its
//! pid is watched (the child died between fork and registration), so exits
//! nobody asked for are kept for a while and handed out on a later watch.
//! Orphans re-parented to us (daemonized `orted`s) land there too and are
//! pruned by age. Pids are reused (pid_max is often 32768 in containers), so
//! a kept exit is handed out only when it was reaped after the watcher's
//! process was forked: an older process with the same pid cannot have been
//! reaped after that.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tokio::sync::oneshot;

use super::signals::SysEvent;
use crate::sys::Exit;

/// How long an exit nobody watched is kept.
const KEEP_UNCLAIMED: Duration = Duration::from_secs(120);

#[derive(Debug, Default)]
struct Table {
    waiting: HashMap<i32, oneshot::Sender<Exit>>,
    /// Exit and when it was reaped.
    unclaimed: HashMap<i32, (Exit, Instant)>,
}

/// Hands out the exits of watched pids.
#[derive(Debug, Clone)]
pub struct Reaper {
    table: Arc<Mutex<Table>>,
}

impl Reaper {
    /// Route `events` (from [`super::signals::start`]): exits go to
    /// watchers, signals come out of the returned channel. Must be called
    /// inside a tokio runtime.
    pub fn start(mut events: UnboundedReceiver<SysEvent>) -> (Self, UnboundedReceiver<i32>) {
        let table = Arc::new(Mutex::new(Table::default()));
        let (tx, rx): (UnboundedSender<i32>, _) = unbounded_channel();
        let routed = Arc::clone(&table);
        tokio::spawn(async move {
            while let Some(ev) = events.recv().await {
                match ev {
                    SysEvent::Signal(s) => {
                        let _ = tx.send(s);
                    }
                    // Made inside trainlet, never by the signal thread.
                    SysEvent::StopAsked(_) => {}
                    SysEvent::Exited { pid, exit, reaped, .. } => deliver(&routed, pid, exit, reaped),
                }
            }
        });
        (Self { table }, rx)
    }

    /// The exit of `pid`, forked at `forked` (taken before the fork), once
    /// reaped (at once if it already was).
    pub fn watch(&self, pid: i32, forked: Instant) -> oneshot::Receiver<Exit> {
        let (tx, rx) = oneshot::channel();
        let mut t = lock(&self.table);
        match t.unclaimed.remove(&pid) {
            Some((exit, reaped)) if reaped >= forked => {
                let _ = tx.send(exit);
            }
            _ => {
                t.waiting.insert(pid, tx);
            }
        }
        rx
    }
}

fn lock(table: &Mutex<Table>) -> std::sync::MutexGuard<'_, Table> {
    table.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn deliver(table: &Mutex<Table>, pid: i32, exit: Exit, reaped: Instant) {
    let mut t = lock(table);
    if let Some(tx) = t.waiting.remove(&pid) {
        let _ = tx.send(exit);
        return;
    }
    tracing::debug!(pid, %exit, "reaped a process nobody watches (yet)");
    let now = Instant::now();
    t.unclaimed.retain(|_, (_, at)| now.duration_since(*at) < KEEP_UNCLAIMED);
    t.unclaimed.insert(pid, (exit, reaped));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(pid: i32, exit: Exit, reaped: Instant) -> SysEvent {
        SysEvent::Exited { pid, exit, at_us: 0, reaped }
    }

    #[tokio::test]
    async fn exits_reach_watchers_before_and_after_reaping() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let (tx, rx) = unbounded_channel();
        let (reaper, mut signals) = Reaper::start(rx);
        let early = reaper.watch(10, at(100));
        tx.send(ev(10, Exit::Code(3), at(150))).expect("test setup");
        assert_eq!(early.await.expect("test setup"), Exit::Code(3));
        // Reaped first, watched later.
        tx.send(ev(11, Exit::Signal(9), at(200))).expect("test setup");
        tx.send(SysEvent::Signal(15)).expect("test setup");
        assert_eq!(signals.recv().await, Some(15));
        assert_eq!(reaper.watch(11, at(190)).await.expect("test setup"), Exit::Signal(9));
        // An older process with a reused pid: its exit is not this one's.
        tx.send(ev(12, Exit::Code(0), at(300))).expect("test setup");
        tx.send(SysEvent::Signal(1)).expect("test setup");
        assert_eq!(signals.recv().await, Some(1), "the exit of pid 12 was routed");
        let mut reused = reaper.watch(12, at(400));
        assert!(reused.try_recv().is_err(), "a stale exit must not be handed out");
        tx.send(ev(12, Exit::Code(7), at(500))).expect("test setup");
        assert_eq!(reused.await.expect("test setup"), Exit::Code(7));
    }
}
