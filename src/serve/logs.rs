//! Worker lines of a served run, from every pod to the control API.
//!
//! Each pod's [`Shipper`] takes its workers' lines (already prefixed, as
//! the console shows them) from the output drains through a bounded
//! [`LineTap`], batches them (64 KiB or 100 ms) and appends each batch as
//! one chunk under `serve/log/<seq>/<slot>/`. The control API's [`Reader`]
//! reads every slot's new chunks. Nothing blocks a worker: a full tap, a
//! pod over its [`SHIP_BUDGET`] or a store that cannot be written drops
//! lines, counted, and the count is shipped as a last line.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use super::{Error, Keys, Link};
use crate::supervise::output::LineTap;

/// Lines waiting to be shipped, per pod.
const TAP_LINES: usize = 4096;
/// Bytes per chunk before it is shipped.
const BATCH: usize = 64 * 1024;
/// Longest a line waits to be shipped.
const BATCH_TIME: Duration = Duration::from_millis(100);
/// Bytes one pod ships for one run; the rest is dropped and counted.
pub const SHIP_BUDGET: u64 = 16 * 1024 * 1024;
/// Shipping pods read per run (one per pod and replacement; a larger
/// count in the store is not believed: each slot costs a read per poll).
const MAX_SLOTS: i64 = 1024;
/// Bytes a [`Reader`] returns per call.
const READ_BATCH: usize = 4 * 1024 * 1024;
/// Chunks a [`Reader`] reads per call, over every slot.
const READ_CHUNKS: usize = 4096;
/// Most chunks one shipper writes for a run (a chunk per 100 ms for 27
/// hours; within [`SHIP_BUDGET`] anyway). A larger count in the store is
/// not believed.
pub const MAX_CHUNKS: i64 = 1 << 20;

/// The pod side: ships one run's lines until dropped.
#[derive(Debug)]
pub struct Shipper {
    tap: LineTap,
    flush: mpsc::Sender<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Shipper {
    /// Ship run `seq`'s lines to the store at `link`.
    pub fn start(link: Link, seq: u64) -> Self {
        let (tx, rx) = mpsc::channel(TAP_LINES);
        let dropped = Arc::new(AtomicU64::new(0));
        let tap = LineTap::new(tx, Arc::clone(&dropped));
        let (flush, flush_rx) = mpsc::channel(4);
        let task = tokio::spawn(ship(link, seq, rx, flush_rx, dropped));
        Self { tap, flush, task }
    }

    /// The tap the drains write into.
    pub fn tap(&self) -> LineTap {
        self.tap.clone()
    }

    /// Ship everything tapped so far; bounded.
    pub async fn flush(&self) {
        let (ack, done) = oneshot::channel();
        if self.flush.send(ack).await.is_ok() {
            let _ = tokio::time::timeout(super::STORE_WAIT, done).await;
        }
    }
}

impl Drop for Shipper {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Out {
    link: Link,
    seq: u64,
    slot: Option<i64>,
    next: i64,
    shipped: u64,
    broken: bool,
}

impl Out {
    /// Append `buf` as one chunk; false when it could not be (counted by the caller).
    async fn send(&mut self, buf: &[u8]) -> bool {
        if self.broken || self.shipped + buf.len() as u64 > SHIP_BUDGET {
            return false;
        }
        let r: Result<(), Error> = async {
            let slot = match self.slot {
                Some(s) => s,
                None => {
                    let s = self.link.add(&self.link.keys.log_slots(self.seq), 1).await? - 1;
                    self.slot = Some(s);
                    s
                }
            };
            self.link.set(&self.link.keys.log_chunk(self.seq, slot, self.next), buf).await?;
            self.link.add(&self.link.keys.log_count(self.seq, slot), 1).await?;
            Ok(())
        }
        .await;
        match r {
            Ok(()) => {
                self.next += 1;
                self.shipped += buf.len() as u64;
                true
            }
            Err(e) => {
                tracing::warn!(run = self.seq, error = %crate::error::error_chain(&e), "cannot ship worker lines to the control API; they stay on this pod's console only");
                self.broken = true;
                false
            }
        }
    }
}

async fn ship(
    link: Link,
    seq: u64,
    mut rx: mpsc::Receiver<Vec<u8>>,
    mut flush: mpsc::Receiver<oneshot::Sender<()>>,
    dropped: Arc<AtomicU64>,
) {
    let mut out = Out { link, seq, slot: None, next: 0, shipped: 0, broken: false };
    let mut buf: Vec<u8> = Vec::with_capacity(BATCH);
    let mut tick = tokio::time::interval(BATCH_TIME);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let lines = |b: &[u8]| b.iter().filter(|c| **c == b'\n').count() as u64;
    loop {
        tokio::select! {
            line = rx.recv() => {
                let Some(line) = line else { break };
                buf.extend_from_slice(&line);
                if buf.len() >= BATCH && !out.send(&buf).await {
                    dropped.fetch_add(lines(&buf), Ordering::Relaxed);
                }
                if buf.len() >= BATCH {
                    buf.clear();
                }
            }
            _ = tick.tick() => {
                if !buf.is_empty() && !out.send(&buf).await {
                    dropped.fetch_add(lines(&buf), Ordering::Relaxed);
                }
                buf.clear();
            }
            ack = flush.recv() => {
                let Some(ack) = ack else { break };
                while let Ok(line) = rx.try_recv() {
                    buf.extend_from_slice(&line);
                }
                if !buf.is_empty() && !out.send(&buf).await {
                    dropped.fetch_add(lines(&buf), Ordering::Relaxed);
                }
                buf.clear();
                let lost = dropped.swap(0, Ordering::Relaxed);
                if lost > 0 {
                    let note = format!("[trainlet] {lost} worker lines of this pod were not shipped (buffer full or over the {SHIP_BUDGET}-byte budget); they are in its console log\n");
                    // The note may go over the budget: it is the one line that must arrive.
                    out.shipped = out.shipped.min(SHIP_BUDGET - note.len() as u64);
                    let _ = out.send(note.as_bytes()).await;
                }
                let _ = ack.send(());
            }
        }
    }
}

/// The control API side: reads every pod's new chunks of one run.
#[derive(Debug)]
pub struct Reader {
    seq: u64,
    offsets: Vec<i64>,
}

fn number(raw: &[u8]) -> i64 {
    std::str::from_utf8(raw).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0)
}

impl Reader {
    /// From the start of run `seq`'s lines.
    pub fn new(seq: u64) -> Self {
        Self { seq, offsets: Vec::new() }
    }

    /// What was shipped since the last call (at most a few MiB and
    /// [`READ_CHUNKS`] chunks; call again for more). Counts are bounded
    /// ([`MAX_SLOTS`], [`MAX_CHUNKS`]), and a chunk not in the store ends
    /// that slot's read until the next call: a count ahead of the chunks
    /// costs one read per call, never a loop.
    pub async fn read(&mut self, link: &mut Link) -> Result<Vec<u8>, Error> {
        let slots = number(&link.get(&link.keys.log_slots(self.seq)).await?).clamp(0, MAX_SLOTS);
        self.offsets.resize(usize::try_from(slots).unwrap_or(0).max(self.offsets.len()), 0);
        let mut out = Vec::new();
        let mut chunks = 0;
        for (slot, at) in self.offsets.iter_mut().enumerate() {
            let slot = slot as i64;
            let n = number(&link.get(&link.keys.log_count(self.seq, slot)).await?).clamp(0, MAX_CHUNKS);
            while *at < n && out.len() < READ_BATCH && chunks < READ_CHUNKS {
                let chunk = link.get(&link.keys.log_chunk(self.seq, slot, *at)).await?;
                chunks += 1;
                if chunk.is_empty() {
                    break;
                }
                out.extend_from_slice(&chunk);
                *at += 1;
            }
        }
        Ok(out)
    }
}

/// Remove run `seq`'s lines from the store: each slot's chunks from the
/// first on, until one is missing (chunks are written in order), so the
/// work is what is stored, whatever the counters say.
pub async fn forget(link: &mut Link, keys: &Keys, seq: u64) -> Result<(), Error> {
    let slots = number(&link.get(&keys.log_slots(seq)).await?).clamp(0, MAX_SLOTS);
    for slot in 0..slots {
        let mut i = 0;
        while i < MAX_CHUNKS && link.delete(&keys.log_chunk(seq, slot, i)).await? {
            i += 1;
        }
        link.delete(&keys.log_count(seq, slot)).await?;
    }
    link.delete(&keys.log_slots(seq)).await?;
    Ok(())
}
