//! Samples of workers' main threads, cheap enough to take several times a
//! second: where the interpreter's `_PyRuntime` is, found once per worker
//! (reading its ELF file is most of a full read's cost), then per sample
//! only the thread states, the main thread's frames and the system call
//! it is blocked in. No native frames, no files but `/proc`. Each sample
//! holds one of the pod's read slots ([`super::budget::Slot`]) and does not
//! wait for one: while a hang capture or `trainlet stacks` holds them
//! all, the sample is skipped. Each is bounded like any read: a small
//! byte budget and [`SAMPLE_TIME`].

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::budget::{Budget, Slot};
use super::maps::{self, Mem};
use super::native::{Kernel, parse_syscall};
use super::python::{self, Interpreter};
use super::{Frame, Limits, clean};

/// Longest one sample of one worker takes.
pub const SAMPLE_TIME: Duration = Duration::from_millis(50);
/// Most bytes one sample keeps (its maps when the interpreter is looked
/// for, its frames' names and line tables).
const SAMPLE_BYTES: u64 = 16 << 20;
/// Frames read of the main thread.
const FRAMES: usize = 48;
/// How long a worker with no interpreter found is left before it is looked
/// at again (a wrapper that starts Python later).
const RETRY: Duration = Duration::from_secs(10);
/// Most of a wrapper's children looked at for the Python process.
const MAX_CHILDREN: usize = 8;

/// What was found of one worker.
#[derive(Debug)]
enum Found {
    /// Its Python process (the worker or a child of it) and interpreter.
    Python(i32, Interpreter),
    /// None, as of then.
    Nothing(Instant),
}

/// The interpreters found, by worker (pid and start time).
#[derive(Debug, Default)]
pub struct Sampler {
    found: HashMap<(i32, u64), Found>,
}

/// One sample of a worker's main thread.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    /// Its Python frames, innermost first.
    pub frames: Vec<Frame>,
    /// The system call it is blocked in (None: it runs).
    pub blocked_in: Option<i64>,
}

impl Sampler {
    /// Forget the workers not in `live` (`(pid, start time)`).
    pub fn keep(&mut self, live: &[(i32, u64)]) {
        self.found.retain(|k, _| live.contains(k));
    }

    /// A sample of worker `pid` (started at `start`); None when it runs
    /// no Python that can be read now, or the pod's read slots are taken.
    pub fn sample(&mut self, pid: i32, start: u64) -> Option<Sample> {
        let _slot = Slot::take(Instant::now())?;
        let budget = Budget::new(SAMPLE_BYTES, Instant::now().checked_add(SAMPLE_TIME));
        let key = (pid, start);
        let (py_pid, py) = match self.found.get(&key) {
            Some(Found::Python(p, py)) => (*p, py.clone()),
            Some(Found::Nothing(at)) if at.elapsed() < RETRY => return None,
            _ => match find(pid, &budget) {
                Some((p, py)) => {
                    self.found.insert(key, Found::Python(p, py.clone()));
                    (p, py)
                }
                None => {
                    self.found.insert(key, Found::Nothing(Instant::now()));
                    return None;
                }
            },
        };
        let limits = Limits { frames: FRAMES, time: SAMPLE_TIME };
        let Ok(threads) = python::threads(&Mem { pid: py_pid }, &py, &limits, &budget) else {
            // Gone, or exec'd another program: looked for again next time.
            self.found.remove(&key);
            return None;
        };
        let main = threads.into_iter().find(|t| t.tid == py_pid)?;
        let frames = main
            .frames
            .into_iter()
            .map(|f| Frame { function: clean(&f.function), file: clean(&f.file), line: f.line })
            .collect();
        let syscall = std::fs::read_to_string(format!("/proc/{py_pid}/task/{py_pid}/syscall")).ok();
        let blocked_in = match syscall.as_deref().and_then(parse_syscall) {
            Some(Kernel::Blocked { nr, .. }) => Some(nr),
            _ => None,
        };
        Some(Sample { frames, blocked_in })
    }
}

/// The Python process of worker `pid` (itself, or its first Python child)
/// and its interpreter.
fn find(pid: i32, budget: &Budget) -> Option<(i32, Interpreter)> {
    let one = |p: i32| {
        let all = maps::read(p, budget).ok()?;
        python::find(&Mem { pid: p }, &all, budget).ok().map(|py| (p, py))
    };
    one(pid).or_else(|| crate::sys::children(pid)?.into_iter().take(MAX_CHILDREN).find_map(one))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_without_python_gives_no_sample_and_is_not_looked_at_again_at_once() {
        let me = i32::try_from(std::process::id()).expect("pid");
        let start = crate::sys::proc_start(me).expect("start");
        let mut s = Sampler::default();
        assert_eq!(s.sample(me, start), None);
        assert!(matches!(s.found.get(&(me, start)), Some(Found::Nothing(_))));
        assert_eq!(s.sample(me, start), None);
        s.keep(&[]);
        assert!(s.found.is_empty());
        assert_eq!(s.sample(i32::MAX, 1), None, "gone");
    }
}
