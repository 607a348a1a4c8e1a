//! What one read of a worker may spend, and what all reads of the pod may
//! spend at once. A worker chooses the sizes the reader meets (its memory,
//! the files it maps: a crafted ELF file says its tables are hundreds of
//! MiB), so every byte the reader keeps on a worker's behalf is counted
//! against that read's [`Budget`] before it is allocated, and a read holds
//! one of [`READS_AT_ONCE`] slots of the pod's [`POD_BYTES`] while it runs
//! (every reader: the hang capture, `trainlet stacks`, `GET /v1/stacks`):
//! the agent's memory for stacks is bounded whatever its workers map and
//! however many ask. The read's deadline travels with its budget, so the
//! loops and big reads that spend bytes also look at the clock.

use std::cell::Cell;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::rc::Rc;
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Most bytes one read of one worker keeps: tables of its mapped files
/// (a file's function index, `.eh_frame` and its index), its maps, its
/// Python code objects and frames. A torch worker's read keeps about
/// 40 MiB (libtorch_cpu's index of ~870k functions at 16 bytes each, its
/// 17 MiB `.eh_frame`).
pub const WORKER_BYTES: u64 = 80 << 20;
/// Reads of workers at once, whoever asks: the pod's reads keep at most
/// [`POD_BYTES`].
pub const READS_AT_ONCE: u64 = 3;
/// Most bytes all reads of the pod's workers keep at once.
pub const POD_BYTES: u64 = WORKER_BYTES * READS_AT_ONCE;
/// Largest piece of a file read at once: a big table is read piece by
/// piece, with a look at the deadline between pieces.
const PIECE: u64 = 1 << 20;

/// Why a read stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spent {
    /// Its bytes: [`WORKER_BYTES`].
    Bytes,
    /// Its time.
    Time,
}

#[derive(Debug)]
struct Inner {
    limit: u64,
    used: Cell<u64>,
    deadline: Option<Instant>,
    /// The first bound it met (a read goes on with what it has).
    spent: Cell<Option<Spent>>,
}

/// What one read of one worker may still keep, and until when (shared by
/// the parts of the read; a read runs on one thread).
#[derive(Debug, Clone)]
pub struct Budget(Rc<Inner>);

/// The error a read gets when it meets a bound.
pub fn over(what: Spent) -> std::io::Error {
    match what {
        Spent::Bytes => std::io::Error::other(OverBudget),
        Spent::Time => std::io::Error::from(std::io::ErrorKind::TimedOut),
    }
}

/// A file or table that would take the read past its byte budget.
#[derive(Debug, thiserror::Error)]
#[error("over the read's memory budget")]
pub struct OverBudget;

impl Budget {
    /// `limit` bytes until `deadline` (None: no time bound).
    pub fn new(limit: u64, deadline: Option<Instant>) -> Budget {
        Budget(Rc::new(Inner { limit, used: Cell::new(0), deadline, spent: Cell::new(None) }))
    }

    /// The read's deadline.
    pub fn deadline(&self) -> Option<Instant> {
        self.0.deadline
    }

    /// Bytes kept so far.
    pub fn used(&self) -> u64 {
        self.0.used.get()
    }

    /// The first bound the read met, if any.
    pub fn spent(&self) -> Option<Spent> {
        self.0.spent.get()
    }

    /// Whether the deadline is past (and if so, remembered as met).
    pub fn late(&self) -> bool {
        let late = self.0.deadline.is_some_and(|d| Instant::now() >= d);
        if late && self.0.spent.get().is_none() {
            self.0.spent.set(Some(Spent::Time));
        }
        late
    }

    /// Count `bytes` about to be kept; an error (and nothing counted) when
    /// they would take the read past its limit or its deadline is past.
    pub fn charge(&self, bytes: u64) -> std::io::Result<()> {
        if self.late() {
            return Err(over(Spent::Time));
        }
        let total = self.0.used.get().saturating_add(bytes);
        if total > self.0.limit {
            if self.0.spent.get().is_none() {
                self.0.spent.set(Some(Spent::Bytes));
            }
            return Err(over(Spent::Bytes));
        }
        self.0.used.set(total);
        Ok(())
    }

    /// `len` bytes of `file` at `offset`, counted first, read a piece at a
    /// time with a look at the deadline between pieces.
    pub fn read_file(&self, file: &File, offset: u64, len: u64) -> std::io::Result<Vec<u8>> {
        self.charge(len)?;
        self.read_counted(file, offset, len)
    }

    /// [`Self::read_file`] of bytes the caller has counted already.
    pub fn read_counted(&self, file: &File, offset: u64, len: u64) -> std::io::Result<Vec<u8>> {
        let size = usize::try_from(len).map_err(|_| over(Spent::Bytes))?;
        let mut buf = vec![0u8; size];
        let mut at = 0usize;
        while at < size {
            if self.late() {
                return Err(over(Spent::Time));
            }
            let piece = usize::try_from(PIECE).unwrap_or(usize::MAX).min(size - at);
            let pos = offset.checked_add(u64::try_from(at).unwrap_or(u64::MAX)).ok_or_else(|| over(Spent::Bytes))?;
            file.read_exact_at(&mut buf[at..at + piece], pos)?;
            at += piece;
        }
        Ok(buf)
    }
}

/// The pod's slots for reads ([`READS_AT_ONCE`]), taken before a read
/// starts and given back when it ends.
static SLOTS: Mutex<u64> = Mutex::new(READS_AT_ONCE);
static FREED: Condvar = Condvar::new();

/// One of the pod's slots for a read, held while the read runs.
#[derive(Debug)]
pub struct Slot(());

impl Slot {
    /// A slot, waiting for one until `deadline` (None: it did not come).
    pub fn take(deadline: Instant) -> Option<Slot> {
        let mut free = SLOTS.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if *free > 0 {
                *free -= 1;
                return Some(Slot(()));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left == Duration::ZERO {
                return None;
            }
            free = FREED.wait_timeout(free, left).unwrap_or_else(PoisonError::into_inner).0;
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        *SLOTS.lock().unwrap_or_else(PoisonError::into_inner) += 1;
        FREED.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_refuses_what_would_pass_it_and_remembers() {
        let b = Budget::new(100, None);
        assert!(b.charge(60).is_ok());
        assert!(b.charge(41).is_err());
        assert_eq!((b.used(), b.spent()), (60, Some(Spent::Bytes)));
        assert!(b.charge(40).is_ok());
        assert!(b.charge(u64::MAX).is_err());
        let late = Budget::new(100, Some(Instant::now()));
        assert!(late.charge(1).is_err());
        assert_eq!(late.spent(), Some(Spent::Time));
    }

    #[test]
    fn a_file_read_is_counted_before_it_is_made() {
        let file = File::open("/proc/self/exe").expect("exe");
        let b = Budget::new(4096, None);
        assert_eq!(b.read_file(&file, 0, 4).expect("read"), b"\x7fELF");
        // A length past the budget allocates nothing and reads nothing.
        let e = b.read_file(&file, 0, 1 << 40).expect_err("over");
        assert!(e.get_ref().is_some_and(|e| e.is::<OverBudget>()), "{e}");
    }

    #[test]
    fn slots_are_bounded_and_come_back() {
        let soon = Instant::now() + Duration::from_millis(50);
        let held: Vec<Slot> = std::iter::from_fn(|| Slot::take(soon)).take(64).collect();
        // Other tests may hold some: never more than the pod's.
        assert!(held.len() <= usize::try_from(READS_AT_ONCE).unwrap_or(0), "{}", held.len());
        assert!(Slot::take(Instant::now()).is_none() || held.len() < 3);
        drop(held);
        assert!(Slot::take(Instant::now() + Duration::from_secs(5)).is_some());
    }
}
