//! Stacks of a worker read from outside it: every Python thread's frames
//! (innermost first, file:line and function) and, for a thread blocked in
//! the kernel, its native frames (unwound with the mapped files' call frame
//! information, x86-64). No code runs in the worker, no
//! signal is sent, nothing is paused: its memory is read with
//! `process_vm_readv`, which needs ptrace access (the same uid and, under
//! Yama's `ptrace_scope` 1, being an ancestor, as the agent is of its
//! workers). Each read is bounded in time and size: in bytes per worker
//! and for the whole pod (`budget`: every table a worker's files or
//! memory state the size of is counted before it is kept), and by a
//! deadline its loops and big reads look at, so a read ends by itself.
//!
//! `python` walks CPython's own structures, `native` unwinds and names what
//! the kernel shows of a blocked thread, `elf` and `maps` read the files and memory
//! they need, `flight` and `pickle` read PyTorch's Flight Recorder dumps,
//! and `stall` turns every rank's stacks (and dumps) into who the job waits
//! for.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

pub mod budget;
mod elf;
pub mod flight;
mod maps;
mod native;
pub mod pickle;
mod python;
pub mod sampler;
pub mod stall;
pub mod straggle;

/// Why a process's stacks could not be read.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// It exited, or is a zombie.
    #[error("the process is gone")]
    Gone,
    /// No ptrace access.
    #[error(
        "not allowed to read the process's memory (it needs ptrace access: the same uid, being its ancestor under Yama ptrace_scope 1, CAP_SYS_PTRACE under ptrace_scope 2 or for a process made non-dumpable)"
    )]
    Denied,
    /// A pointer led nowhere (a torn read of a running process).
    #[error("a read of the process's memory failed (it changed while read)")]
    BadAddress,
    /// Neither the executable nor a library is a CPython interpreter.
    #[error("no Python stack: the process runs no CPython interpreter")]
    NotPython,
    /// A Python this reader does not know.
    #[error("no Python stack: {0} is not supported")]
    Unsupported(String),
    /// The read would keep more than its budget of bytes.
    #[error(
        "not read: over the read's memory budget ({} MiB of the worker's files and memory; a file it maps states huge tables?)",
        budget::WORKER_BYTES >> 20
    )]
    OverBudget,
    /// The read's time ran out before its Python stacks were read.
    #[error("not read: the read's time ran out")]
    TimedOut,
    /// The pod's reads of stacks were all taken until the deadline.
    #[error(
        "not read: the pod's reads of stacks ({} at once) were all taken until the deadline",
        budget::READS_AT_ONCE
    )]
    NoSlot,
    /// Anything else the system said.
    #[error("cannot read the process: {0}")]
    Other(String),
}

impl Error {
    /// The error for what reading `pid`'s files or memory said.
    pub fn from_io(_pid: i32, e: &std::io::Error) -> Error {
        match e.raw_os_error() {
            Some(libc::ESRCH | libc::ENOENT) => Error::Gone,
            Some(libc::EPERM | libc::EACCES) => Error::Denied,
            Some(libc::EFAULT | libc::EIO) => Error::BadAddress,
            _ if e.get_ref().is_some_and(|e| e.is::<budget::OverBudget>()) => Error::OverBudget,
            _ if e.kind() == std::io::ErrorKind::TimedOut => Error::TimedOut,
            _ if e.kind() == std::io::ErrorKind::NotFound => Error::Gone,
            _ => Error::Other(e.to_string()),
        }
    }
}

/// One Python frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Frame {
    /// The function's qualified name.
    pub function: String,
    /// Its file.
    pub file: String,
    /// The line it is at, when known.
    pub line: Option<u32>,
}

impl std::fmt::Display for Frame {
    /// `file:line in function` (`file in function` without a line).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.line {
            Some(l) => write!(f, "{}:{l} in {}", self.file, self.function),
            None => write!(f, "{} in {}", self.file, self.function),
        }
    }
}

/// One native frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NativeFrame {
    /// Its program counter, in hex.
    pub pc: String,
    /// `symbol+offset`, when the file names it.
    pub function: Option<String>,
    /// The file it is in (its name only).
    pub object: String,
}

/// One thread of a worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Thread {
    /// Kernel thread id.
    pub tid: i32,
    /// Its name (`/proc/PID/task/TID/comm`).
    pub name: String,
    /// The process's main thread?
    pub main: bool,
    /// Python frames, innermost first.
    pub python: Vec<Frame>,
    /// Native frames, innermost first (a thread blocked in the kernel's).
    pub native: Vec<NativeFrame>,
    /// What the kernel says of it: running, or blocked in which call.
    pub kernel: String,
    /// The walk stopped at a bound.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
}

/// One worker's stacks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Process {
    /// The process read (the worker, or its Python child when the worker
    /// is a wrapper).
    pub pid: i32,
    /// The interpreter's version, when one was found.
    pub python: Option<String>,
    /// Its Python threads, the main thread first.
    pub threads: Vec<Thread>,
    /// Why there is no stack, or what was left out.
    pub note: Option<String>,
    /// How long the read took, in milliseconds.
    pub took_ms: f64,
    /// Its Python stacks were not read in full, and why (None: they were,
    /// or it runs no Python). Who waits for whom does not take such a
    /// rank for one outside a collective: it says it could not be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unread: Option<Unread>,
}

/// Why a worker's Python stacks were not read in full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Unread {
    /// The read's memory budget, or the pod's, ran out.
    Budget,
    /// The read's time ran out.
    Time,
    /// The read failed.
    Failed,
    /// The pod's reads of stacks were all taken until its deadline.
    Busy,
}

impl Unread {
    /// In words, for a verdict.
    pub fn text(self) -> &'static str {
        match self {
            Unread::Budget => "over the read's memory budget",
            Unread::Time => "the read's time ran out",
            Unread::Failed => "the read failed",
            Unread::Busy => "the pod's other reads of stacks took its time",
        }
    }

    /// Why, for a read that ended in `e` (None: nothing to read).
    fn of(e: &Error) -> Option<Unread> {
        match e {
            Error::Gone | Error::NotPython | Error::Unsupported(_) => None,
            Error::OverBudget => Some(Unread::Budget),
            Error::NoSlot => Some(Unread::Busy),
            Error::TimedOut => Some(Unread::Time),
            Error::Denied | Error::BadAddress | Error::Other(_) => Some(Unread::Failed),
        }
    }
}

/// Bounds on one read.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Frames per thread.
    pub frames: usize,
    /// Wall-clock time per process.
    pub time: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { frames: 64, time: Duration::from_millis(200) }
    }
}

/// Longest text kept of a file or function name.
const MAX_NAME: usize = 512;
/// Most of a wrapper's children looked at for the Python process.
const MAX_CHILDREN: usize = 8;

/// Read `pid`'s stacks; when `pid` is not Python (a shell or launcher
/// wrapping the script), its first Python child's.
pub fn read(pid: i32, limits: &Limits) -> Process {
    read_before(pid, limits, None)
}

/// [`read`], ended by `end` when whoever asked stops waiting then: the
/// read waits for one of the pod's slots (its share of the pod's bytes)
/// until `end` (None: for its own time bound), and stops at its time
/// bound or `end`, whichever comes first, with what it has.
pub fn read_before(pid: i32, limits: &Limits, end: Option<Instant>) -> Process {
    let asked = Instant::now();
    let wait = end.or_else(|| asked.checked_add(limits.time)).unwrap_or(asked);
    let Some(_slot) = budget::Slot::take(wait) else {
        return failed(pid, &Error::NoSlot, asked);
    };
    let started = Instant::now();
    // None: a bound past the clock's range, that is none.
    let deadline = match (started.checked_add(limits.time), end) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    let spend = budget::Budget::new(budget::WORKER_BYTES, deadline);
    let mut out = match read_one(pid, limits, &spend) {
        Err(Error::NotPython) => {
            let kids = crate::sys::children(pid).unwrap_or_default();
            let found = kids.into_iter().take(MAX_CHILDREN).find_map(|c| read_one(c, limits, &spend).ok());
            found.ok_or(Error::NotPython)
        }
        other => other,
    }
    // An interpreter's file that could not be read within the budget is
    // no proof there is none.
    .map_err(|e| match (e, spend.spent()) {
        (Error::NotPython, Some(budget::Spent::Bytes)) => Error::OverBudget,
        (Error::NotPython, Some(budget::Spent::Time)) => Error::TimedOut,
        (e, _) => e,
    })
    .unwrap_or_else(|e| failed(pid, &e, asked));
    out.took_ms = started.elapsed().as_secs_f64() * 1e3;
    out
}

/// A read that ended in `e`.
fn failed(pid: i32, e: &Error, asked: Instant) -> Process {
    Process {
        pid,
        python: None,
        threads: Vec::new(),
        note: Some(e.to_string()),
        took_ms: asked.elapsed().as_secs_f64() * 1e3,
        unread: Unread::of(e),
    }
}

fn read_one(pid: i32, limits: &Limits, spend: &budget::Budget) -> Result<Process, Error> {
    let mem = maps::Mem { pid };
    let all = maps::read(pid, spend)?;
    let py = python::find(&mem, &all, spend)?;
    let walked = python::threads(&mem, &py, limits, spend)?;
    // What stopped the Python walk, if anything did (the native frames
    // read after it only name what it found).
    let unread = match spend.spent() {
        Some(budget::Spent::Bytes) => Some(Unread::Budget),
        Some(budget::Spent::Time) => Some(Unread::Time),
        None => None,
    };
    let mut symbols = native::Symbols::new(spend);
    let mut threads: Vec<Thread> = walked
        .into_iter()
        .map(|t| {
            let name = std::fs::read_to_string(format!("/proc/{pid}/task/{}/comm", t.tid)).unwrap_or_default();
            let (native, kernel) = if !spend.late() {
                native::frames(pid, t.tid, &all, &mut symbols)
            } else {
                (Vec::new(), "not read: the time bound was reached".into())
            };
            Thread {
                tid: t.tid,
                name: clean(name.trim()),
                main: t.tid == pid,
                python: t
                    .frames
                    .into_iter()
                    .map(|f| Frame { function: clean(&f.function), file: clean(&f.file), line: f.line })
                    .collect(),
                native,
                kernel,
                truncated: t.truncated,
            }
        })
        .collect();
    threads.sort_by_key(|t| !t.main);
    let note = match spend.spent() {
        Some(budget::Spent::Time) => Some(format!("stopped at the {:?} bound", limits.time)),
        Some(budget::Spent::Bytes) => Some(format!(
            "stopped at the read's memory budget ({} MiB of the worker's files and memory): {}",
            budget::WORKER_BYTES >> 20,
            if unread.is_some() { "Python frames left out" } else { "native frames left out" }
        )),
        None => None,
    };
    Ok(Process { pid, python: Some(py.version), threads, note, took_ms: 0.0, unread })
}

/// A name from another process, as data: control characters replaced,
/// at most [`MAX_NAME`] characters.
pub fn clean(s: &str) -> String {
    s.chars().take(MAX_NAME).map(|c| if c.is_control() || is_format(c) { '?' } else { c }).collect()
}

/// Unicode format characters that reorder or hide text on a terminal or a
/// web page (bidirectional overrides and isolates, zero-width ones).
fn is_format(c: char) -> bool {
    matches!(c, '\u{061c}' | '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2060}'..='\u{2069}' | '\u{feff}')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_that_is_not_python_says_so() {
        let me = i32::try_from(std::process::id()).expect("pid");
        let p = read(me, &Limits::default());
        assert_eq!(p.python, None);
        assert_eq!(p.note.as_deref(), Some("no Python stack: the process runs no CPython interpreter"));
        let gone = read(i32::MAX, &Limits::default());
        assert_eq!(gone.note.as_deref(), Some("the process is gone"));
    }

    #[test]
    fn names_are_data() {
        assert_eq!(clean("a\nb\x1b[31m"), "a?b?[31m");
        assert_eq!(clean("inner\u{202e}gnp.fdp\u{2066}x\u{200b}"), "inner?gnp.fdp?x?");
        assert_eq!(clean(&"x".repeat(2000)).len(), MAX_NAME);
    }
}
