//! Stacks of a worker read from outside it: every Python thread's frames
//! (innermost first, file:line and function) and, for a thread blocked in
//! the kernel, its native frames (unwound with the mapped files' call frame
//! information, x86-64). No code runs in the worker, no
//! signal is sent, nothing is paused: its memory is read with
//! `process_vm_readv`, which needs ptrace access (the same uid and, under
//! Yama's `ptrace_scope` 1, being an ancestor, as the agent is of its
//! workers). Each read is bounded in time and size.
//!
//! `python` walks CPython's own structures, `native` unwinds and names what
//! the kernel shows of a blocked thread, `elf` and `maps` read the files and memory
//! they need, `flight` and `pickle` read PyTorch's Flight Recorder dumps,
//! and `stall` turns every rank's stacks (and dumps) into who the job waits
//! for.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

mod elf;
pub mod flight;
mod maps;
mod native;
pub mod pickle;
mod python;
pub mod stall;

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
    let started = Instant::now();
    let mut out = match read_one(pid, limits, started) {
        Err(Error::NotPython) => {
            let kids = crate::sys::children(pid).unwrap_or_default();
            let found = kids.into_iter().take(MAX_CHILDREN).find_map(|c| read_one(c, limits, started).ok());
            found.ok_or(Error::NotPython)
        }
        other => other,
    }
    .unwrap_or_else(|e| Process {
        pid,
        python: None,
        threads: Vec::new(),
        note: Some(e.to_string()),
        took_ms: 0.0,
    });
    out.took_ms = started.elapsed().as_secs_f64() * 1e3;
    out
}

fn read_one(pid: i32, limits: &Limits, started: Instant) -> Result<Process, Error> {
    let mem = maps::Mem { pid };
    let all = maps::read(pid)?;
    let py = python::find(&mem, &all, started.checked_add(limits.time))?;
    let walked = python::threads(&mem, &py, limits, started)?;
    let mut symbols = native::Symbols::default();
    // None: a bound past the clock's range, that is none.
    let deadline = started.checked_add(limits.time);
    let mut threads: Vec<Thread> = walked
        .into_iter()
        .map(|t| {
            let name = std::fs::read_to_string(format!("/proc/{pid}/task/{}/comm", t.tid)).unwrap_or_default();
            let (native, kernel) = if started.elapsed() < limits.time {
                native::frames(pid, t.tid, &all, &mut symbols, deadline)
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
    let note = (started.elapsed() > limits.time).then(|| format!("stopped at the {:?} bound", limits.time));
    Ok(Process { pid, python: Some(py.version), threads, note, took_ms: 0.0 })
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
