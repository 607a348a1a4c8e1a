//! Every `unsafe` block, raw `libc` call and signal/process syscall of
//! trainlet lives here, each unsafe block with a `// SAFETY:` note.
//!
//! Signals are collected tini-style: `main` blocks every asynchronous signal
//! before any thread exists (so all threads inherit the mask) and one thread
//! takes them with `sigtimedwait`. That also works as PID 1 of a container,
//! where the kernel drops signals that have neither a handler nor a block
//! (reference/gpu-pid1.md findings 4 and 5). Workers get an empty mask back
//! in the child before exec (`fork_exec`), since a fork copies the mask.

use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{SigSet, SigmaskHow, Signal, pthread_sigmask};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Exit {
    /// It called exit(code).
    Code(i32),
    /// It was killed by this signal.
    Signal(i32),
}

impl Exit {
    /// Did it exit 0?
    pub fn success(self) -> bool {
        self == Exit::Code(0)
    }
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Exit::Code(c) => write!(f, "exit code {c}"),
            Exit::Signal(s) => write!(f, "signal {s} ({})", signal_name(*s)),
        }
    }
}

/// "SIGTERM" for 15, "signal 99" when unknown.
pub fn signal_name(sig: i32) -> String {
    Signal::try_from(sig).map_or_else(|_| format!("signal {sig}"), |s| s.as_str().to_string())
}

/// Signals that stay unblocked: faults must reach the default handler.
const SYNCHRONOUS: [Signal; 7] =
    [Signal::SIGSEGV, Signal::SIGBUS, Signal::SIGILL, Signal::SIGFPE, Signal::SIGABRT, Signal::SIGTRAP, Signal::SIGSYS];

fn collected_set() -> SigSet {
    let mut set = SigSet::all();
    for s in SYNCHRONOUS {
        set.remove(s);
    }
    set
}

/// Signals trainlet acts on that must reach it as a container's PID 1 from
/// inside the container too (a preStop hook's `trainlet stop`, `kill 1`).
const CAUGHT: [libc::c_int; 6] =
    [libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGQUIT, libc::SIGUSR1, libc::SIGUSR2];

extern "C" fn ignore_signal(_: libc::c_int) {}

/// Give the signals of [`CAUGHT`] their default action back. Only calls
/// `signal(2)`, which is async-signal-safe: the forked child uses it too.
fn default_caught_signals() {
    for sig in CAUGHT {
        // SAFETY: resetting a disposition to SIG_DFL has no preconditions.
        unsafe { libc::signal(sig, libc::SIG_DFL) };
    }
}

/// Block every asynchronous signal in the calling thread. Call first in
/// `main`, before any thread exists, so that every thread inherits it.
///
/// The signals of [`CAUGHT`] also get a handler that does nothing (it never
/// runs: they stay blocked and the signal thread takes them with
/// `sigtimedwait`). The kernel drops a signal sent to a container's PID 1
/// from inside its PID namespace when its disposition is SIG_DFL; with a
/// handler installed it is queued like any other. The spawner resets them
/// to SIG_DFL in each child before it unblocks signals.
pub fn block_signals() -> Result<(), Errno> {
    pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&collected_set()), None)?;
    for sig in CAUGHT {
        // SAFETY: installs an async-signal-safe handler (it does nothing)
        // with an empty mask; `action` lives on the stack for the call.
        let rc = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = ignore_signal as *const () as libc::sighandler_t;
            libc::sigemptyset(&mut action.sa_mask);
            action.sa_flags = libc::SA_RESTART;
            libc::sigaction(sig, &action, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(Errno::last());
        }
    }
    Ok(())
}

/// Wait up to `timeout` for one blocked signal; returns its number.
pub fn wait_signal(timeout: Duration) -> Option<i32> {
    let set = collected_set();
    let ts = libc::timespec {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: libc::c_long::from(timeout.subsec_nanos().min(999_999_999).cast_signed()),
    };
    // SAFETY: `set.as_ref()` points to a valid sigset_t owned by `set`, which
    // outlives the call; a null siginfo pointer is allowed; `ts` is a valid
    // timespec on the stack. sigtimedwait only reads these.
    let sig = unsafe { libc::sigtimedwait(set.as_ref(), std::ptr::null_mut(), &ts) };
    (sig > 0).then_some(sig)
}

/// This binary's canonical path (links resolved), as `/proc/PID/exe` shows it.
pub fn own_exe() -> Option<std::path::PathBuf> {
    std::env::current_exe().ok().and_then(|p| std::fs::canonicalize(p).ok())
}

/// Reap every child that has exited (`waitpid(-1, WNOHANG)` until none).
pub fn reap_all() -> Vec<(i32, Exit)> {
    let mut out = Vec::new();
    loop {
        match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(pid, code)) => out.push((pid.as_raw(), Exit::Code(code))),
            Ok(WaitStatus::Signaled(pid, sig, _)) => out.push((pid.as_raw(), Exit::Signal(sig as i32))),
            Ok(WaitStatus::StillAlive) | Err(_) => return out,
            Ok(_) => {} // stopped/continued: not an exit
        }
    }
}

/// Make orphaned descendants re-parent to us when we are not PID 1.
pub fn become_subreaper() -> Result<(), Errno> {
    if std::process::id() == 1 {
        return Ok(());
    }
    nix::sys::prctl::set_child_subreaper(true)
}

/// Send `sig` to process group `pgid`. A group that no longer exists is fine.
pub fn signal_group(pgid: i32, sig: i32) {
    if pgid <= 1 {
        return; // never signal our own group or every process
    }
    if let Ok(s) = Signal::try_from(sig) {
        let _ = nix::sys::signal::killpg(Pid::from_raw(pgid), s);
    }
}

/// Send `sig` to one process.
pub fn signal_process(pid: i32, sig: i32) {
    if pid <= 1 {
        return;
    }
    if let Ok(s) = Signal::try_from(sig) {
        let _ = nix::sys::signal::kill(Pid::from_raw(pid), s);
    }
}

/// One process as `/proc/PID/stat` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    /// Its pid.
    pub pid: i32,
    /// Scheduler state letter (`R`, `S`, `D`, `Z`, ...).
    pub state: char,
    /// Parent pid.
    pub ppid: u32,
    /// Process group id.
    pub pgid: i32,
}

/// `/proc/PID/stat` of `pid`; None when it is gone.
pub fn proc_stat(pid: i32) -> Option<ProcStat> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields 3 (state), 4 (ppid) and 5 (pgrp) follow the last ')' of the
    // command name.
    let mut rest = stat.get(stat.rfind(')')? + 1..)?.split_whitespace();
    let state = rest.next()?.chars().next()?;
    let ppid = rest.next()?.parse::<u32>().ok()?;
    let pgid = rest.next()?.parse::<i32>().ok()?;
    Some(ProcStat { pid, state, ppid, pgid })
}

/// Every process, from /proc.
pub fn process_table() -> Vec<ProcStat> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(|e| proc_stat(e.ok()?.file_name().to_str()?.parse::<i32>().ok()?)).collect()
}

/// The children of `pid`, from `/proc/PID/task/*/children` (every thread's:
/// orphans are re-parented to any thread of a subreaper). None when the
/// kernel has no such files (built without CONFIG_PROC_CHILDREN); empty
/// when the process is gone.
pub fn children(pid: i32) -> Option<Vec<i32>> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Some(Vec::new()) };
    let mut out = Vec::new();
    for task in tasks.flatten() {
        match std::fs::read_to_string(task.path().join("children")) {
            Ok(text) => out.extend(text.split_whitespace().filter_map(|c| c.parse::<i32>().ok())),
            // The task is there but the file is not: no CONFIG_PROC_CHILDREN.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && task.path().join("stat").exists() => return None,
            Err(_) => {} // the task ended meanwhile
        }
    }
    Some(out)
}

/// The parent of `pid`, from /proc; None when it is gone.
pub fn parent_of(pid: i32) -> Option<u32> {
    proc_stat(pid).map(|p| p.ppid)
}

/// This process's process group id.
pub fn own_group() -> i32 {
    nix::unistd::getpgrp().as_raw()
}

/// 64 unpredictable-enough bits (std's per-process hash keys over pid and
/// time) for ids and nonces; not for cryptography.
pub fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos());
    h.finish()
}

/// Scheduler state letter of `pid` from /proc (`R`, `S`, `D`, `Z`, ...);
/// None when it is gone.
pub fn proc_state(pid: i32) -> Option<char> {
    proc_stat(pid).map(|p| p.state)
}

/// Raise the soft open-file limit to the hard limit (a store host keeps a
/// few connections per pod); returns the new soft limit.
pub fn raise_nofile() -> u64 {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => {
            if setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() {
                hard
            } else {
                soft
            }
        }
        Ok((soft, _)) => soft,
        Err(_) => 0,
    }
}

/// How one of a child's standard streams is connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChildIo {
    /// `/dev/null`.
    Null,
    /// A new pipe whose other end the parent gets.
    Pipe,
    /// The agent's own stream.
    Inherit,
}

/// Everything a child needs, prepared before the fork: after it, the child
/// may only read this (no allocation, no locks: other threads of the agent
/// may hold the allocator's lock at the moment of the fork).
#[derive(Debug)]
pub struct ExecPlan {
    /// Paths to try in order (a PATH search done before the fork).
    pub candidates: Vec<std::ffi::CString>,
    /// argv, argv[0] first.
    pub argv: Vec<std::ffi::CString>,
    /// The complete environment, `NAME=value`.
    pub envp: Vec<std::ffi::CString>,
    /// Working directory, if not the agent's.
    pub cwd: Option<std::ffi::CString>,
    /// stdin, stdout, stderr.
    pub stdio: [ChildIo; 3],
    /// CPU mask from [`cpu_mask`] for sched_setaffinity, if any.
    pub affinity: Option<Vec<libc::c_ulong>>,
    /// Written to /proc/self/oom_score_adj (best effort), if any.
    pub oom_score_adj: Option<i32>,
}

/// A started child: its pid (also its process group) and the parent's ends
/// of its piped streams.
#[derive(Debug)]
pub struct Forked {
    /// Pid and process group id.
    pub pid: i32,
    /// Write end of its stdin, for [`ChildIo::Pipe`].
    pub stdin: Option<std::os::fd::OwnedFd>,
    /// Read end of its stdout, for [`ChildIo::Pipe`].
    pub stdout: Option<std::os::fd::OwnedFd>,
    /// Read end of its stderr, for [`ChildIo::Pipe`].
    pub stderr: Option<std::os::fd::OwnedFd>,
}

/// What went wrong in [`fork_exec`], with the errno.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForkExecError {
    /// Pipes or /dev/null could not be opened before the fork.
    Setup(Errno),
    /// fork(2) failed: EAGAIN (pids limit, RLIMIT_NPROC) or ENOMEM.
    Fork(Errno),
    /// The child could not change to the working directory.
    Chdir(Errno),
    /// The child could not set itself up (death signal, standard streams).
    ChildSetup(Errno),
    /// execve failed for every candidate path (the most telling errno).
    Exec(Errno),
}

/// Stages the child reports through the error pipe.
const STAGE_SETUP: u32 = 1;
const STAGE_CHDIR: u32 = 2;
const STAGE_EXEC: u32 = 3;

/// A pipe pair with O_CLOEXEC, both ends numbered above the standard
/// streams (so that moving them onto 0-2 in the child never clobbers one
/// another, even when the agent was started with a standard stream closed).
fn pipe_above_stdio() -> Result<(std::os::fd::OwnedFd, std::os::fd::OwnedFd), Errno> {
    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    Ok((above_stdio(r)?, above_stdio(w)?))
}

fn above_stdio(fd: std::os::fd::OwnedFd) -> Result<std::os::fd::OwnedFd, Errno> {
    use std::os::fd::{AsRawFd, FromRawFd};
    if fd.as_raw_fd() > 2 {
        return Ok(fd);
    }
    // SAFETY: fcntl(F_DUPFD_CLOEXEC) on an fd we own returns a new fd that
    // nobody else owns; the original is closed when `fd` drops.
    let new = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 3) };
    if new < 0 {
        return Err(Errno::last());
    }
    // SAFETY: `new` is a freshly opened fd owned by nothing else.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(new) })
}

/// Fork and exec `plan` in a new process group, with an empty signal mask,
/// SIGPIPE at its default, killed with SIGKILL if the forking thread dies,
/// bound to `plan.affinity`. Never waits for the child: the one reaper owns
/// every exit, including that of a child whose exec failed (it `_exit`s
/// 127 after reporting).
///
/// This replaces std's `Command::spawn`, which on an exec failure calls
/// waitpid on the child and panics when the agent's reaper got it first
/// (a crash of PID 1 under `panic = "abort"`). Failures in the child come
/// back through an O_CLOEXEC pipe as (stage, errno), as in std.
///
/// Call from the one long-lived spawner thread: PDEATHSIG fires when the
/// thread that forked exits, not the process (reference/gpu-pid1.md 4.6).
/// A failed `sched_setaffinity` (the cpuset shrank since the plan) leaves
/// the worker on the agent's CPUs: binding never fails a worker.
pub fn fork_exec(plan: &ExecPlan) -> Result<Forked, ForkExecError> {
    use std::os::fd::{AsRawFd, OwnedFd};
    let setup = ForkExecError::Setup;
    let null: Option<OwnedFd> = if plan.stdio.contains(&ChildIo::Null) {
        // std opens with O_CLOEXEC.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null")
            .map_err(|e| setup(Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))))?;
        Some(above_stdio(OwnedFd::from(file)).map_err(setup)?)
    } else {
        None
    };
    // (child's end, parent's end) per stream.
    let mut pipes: [Option<(OwnedFd, OwnedFd)>; 3] = [None, None, None];
    for (i, io) in plan.stdio.iter().enumerate() {
        if *io == ChildIo::Pipe {
            let (r, w) = pipe_above_stdio().map_err(setup)?;
            pipes[i] = Some(if i == 0 { (r, w) } else { (w, r) });
        }
    }
    let (err_r, err_w) = pipe_above_stdio().map_err(setup)?;
    // Raw values the child reads: -1 = leave the stream as it is.
    let mut src = [-1i32; 3];
    for i in 0..3 {
        src[i] = match (plan.stdio[i], &pipes[i], &null) {
            (ChildIo::Pipe, Some((child, _)), _) => child.as_raw_fd(),
            (ChildIo::Null, _, Some(n)) => n.as_raw_fd(),
            _ => -1,
        };
    }
    let argv: Vec<*const libc::c_char> =
        plan.argv.iter().map(|a| a.as_ptr()).chain(std::iter::once(std::ptr::null())).collect();
    let envp: Vec<*const libc::c_char> =
        plan.envp.iter().map(|a| a.as_ptr()).chain(std::iter::once(std::ptr::null())).collect();
    let parent = nix::unistd::getpid().as_raw();
    let oom: Option<([u8; 12], usize)> = plan.oom_score_adj.map(|v| {
        let mut buf = [0u8; 12];
        let text = v.to_string();
        let n = text.len().min(buf.len());
        buf[..n].copy_from_slice(&text.as_bytes()[..n]);
        (buf, n)
    });
    let err_fd = err_w.as_raw_fd();

    // SAFETY: fork in a multi-threaded process: the child only calls
    // async-signal-safe functions (setpgid, sigprocmask, signal (also
    // through default_caught_signals), prctl,
    // getppid, dup2, fcntl, chdir, open, write, close, the raw
    // sched_setaffinity syscall, execve, _exit) on data prepared above and
    // only read here; it allocates nothing and takes no locks, and it ends
    // in execve or _exit, never returning into Rust code.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(ForkExecError::Fork(Errno::last()));
    }
    if pid == 0 {
        // SAFETY: see above; this block runs in the child only.
        unsafe {
            child_after_fork(plan, &src, &argv, &envp, parent, oom.as_ref(), err_fd);
        }
    }
    drop(err_w);
    drop(null);
    let mut ends: [Option<OwnedFd>; 3] = [None, None, None];
    for (i, p) in pipes.into_iter().enumerate() {
        if let Some((child, ours)) = p {
            drop(child);
            ends[i] = Some(ours);
        }
    }
    // EOF = exec succeeded (the CLOEXEC write end closed); 8 bytes = a
    // failure report; the child then exits 127 and the reaper takes it.
    let mut buf = [0u8; 8];
    let mut got = 0;
    while got < buf.len() {
        match nix::unistd::read(err_r.as_raw_fd(), &mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(Errno::EINTR) => {}
            Err(_) => break,
        }
    }
    if got == buf.len() {
        let stage = u32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]);
        let errno = Errno::from_raw(i32::from_ne_bytes([buf[4], buf[5], buf[6], buf[7]]));
        return Err(match stage {
            STAGE_CHDIR => ForkExecError::Chdir(errno),
            STAGE_SETUP => ForkExecError::ChildSetup(errno),
            _ => ForkExecError::Exec(errno),
        });
    }
    let [stdin, stdout, stderr] = ends;
    Ok(Forked { pid, stdin, stdout, stderr })
}

/// The child's side of [`fork_exec`].
///
/// # Safety
/// Call only in the child right after fork; every pointer must come from
/// data prepared before the fork. Never returns.
unsafe fn child_after_fork(
    plan: &ExecPlan,
    src: &[i32; 3],
    argv: &[*const libc::c_char],
    envp: &[*const libc::c_char],
    parent: i32,
    oom: Option<&([u8; 12], usize)>,
    err_fd: i32,
) -> ! {
    let fail = |stage: u32, errno: i32| -> ! {
        let mut msg = [0u8; 8];
        msg[..4].copy_from_slice(&stage.to_ne_bytes());
        msg[4..].copy_from_slice(&errno.to_ne_bytes());
        // SAFETY: write of a stack buffer to the error pipe, then _exit:
        // both async-signal-safe.
        unsafe {
            libc::write(err_fd, msg.as_ptr().cast(), msg.len());
            libc::_exit(127)
        }
    };
    // SAFETY: async-signal-safe calls on stack data and on `plan`, read only.
    unsafe {
        libc::setpgid(0, 0);
        // The agent's do-nothing handlers go back to SIG_DFL (exec would
        // reset them too, but a signal may come before exec).
        default_caught_signals();
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
        // Rust ignores SIGPIPE; an ignored signal stays ignored across exec.
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
            fail(STAGE_SETUP, *libc::__errno_location());
        }
        // The agent may have died between fork and prctl.
        if libc::getppid() != parent {
            libc::_exit(1);
        }
        for (target, &fd) in (0..3).zip(src.iter()) {
            if fd < 0 {
                continue;
            }
            // Every source is above 2 (pipe_above_stdio), so no dup2 here
            // overwrites a later source; dup2 clears FD_CLOEXEC on the copy.
            if libc::dup2(fd, target) < 0 {
                fail(STAGE_SETUP, *libc::__errno_location());
            }
        }
        if let Some(dir) = &plan.cwd
            && libc::chdir(dir.as_ptr()) != 0
        {
            fail(STAGE_CHDIR, *libc::__errno_location());
        }
        if let Some(mask) = &plan.affinity {
            libc::syscall(libc::SYS_sched_setaffinity, 0, std::mem::size_of_val(mask.as_slice()), mask.as_ptr());
        }
        if let Some((buf, n)) = oom {
            let fd = libc::open(c"/proc/self/oom_score_adj".as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd >= 0 {
                libc::write(fd, buf.as_ptr().cast(), *n);
                libc::close(fd);
            }
        }
        // execvp's rule: go on past ENOENT/ENOTDIR/ESTALE; remember EACCES
        // (a later candidate may still run); stop at anything else.
        let mut errno = libc::ENOENT;
        let mut denied = false;
        for path in &plan.candidates {
            libc::execve(path.as_ptr(), argv.as_ptr(), envp.as_ptr());
            let e = *libc::__errno_location();
            match e {
                libc::EACCES => denied = true,
                libc::ENOENT | libc::ENOTDIR | libc::ESTALE | libc::ENODEV | libc::ETIMEDOUT => {}
                _ => {
                    errno = e;
                    denied = false;
                    break;
                }
            }
            errno = e;
        }
        fail(STAGE_EXEC, if denied { libc::EACCES } else { errno })
    }
}

/// A kernel CPU (or node) bitmask: bit `b` of word `w` is number `w*64+b`,
/// with one spare trailing word so either `maxnode` convention of
/// set_mempolicy covers it (reference/gpu-pid1.md 3.4).
pub fn cpu_mask(ids: impl IntoIterator<Item = u32>) -> Vec<libc::c_ulong> {
    let bits = libc::c_ulong::BITS;
    let ids: Vec<u32> = ids.into_iter().collect();
    let words = ids.iter().max().map_or(1, |m| m / bits + 1) as usize + 1;
    let mut mask = vec![0; words];
    for id in ids {
        mask[(id / bits) as usize] |= 1 << (id % bits);
    }
    mask
}

/// The numbers set in a kernel bitmask (the inverse of [`cpu_mask`]).
pub fn mask_ids(mask: &[libc::c_ulong]) -> Vec<u32> {
    let bits = libc::c_ulong::BITS;
    (0u32..)
        .zip(mask)
        .flat_map(|(w, word)| (0..bits).filter(move |b| word & (1 << b) != 0).map(move |b| w * bits + b))
        .collect()
}

/// The CPUs this process may run on (`sched_getaffinity`: the pod's cpuset),
/// read with a buffer that grows past glibc's 1024-CPU `cpu_set_t`.
pub fn allowed_cpus() -> Vec<u32> {
    let mut words = 16usize;
    loop {
        let mut mask: Vec<libc::c_ulong> = vec![0; words];
        // SAFETY: the kernel writes at most the given byte length into the
        // buffer, which is that long and live for the call.
        let rc = unsafe {
            libc::syscall(libc::SYS_sched_getaffinity, 0, std::mem::size_of_val(mask.as_slice()), mask.as_mut_ptr())
        };
        if rc > 0 {
            return mask_ids(&mask);
        }
        if Errno::last() != Errno::EINVAL || words >= 1 << 16 {
            return Vec::new();
        }
        words *= 4;
    }
}

/// Make the calling thread's memory policy "prefer `node`" (None: the
/// default policy). A child forked afterwards inherits it across exec, as
/// `numactl --preferred` does. Fails with EPERM where seccomp's default
/// profile withholds set_mempolicy (no CAP_SYS_NICE) and EINVAL for a node
/// the kernel does not have.
pub fn set_preferred_node(node: Option<u32>) -> std::io::Result<()> {
    let mask = node.map(|n| cpu_mask([n]));
    let (mode, ptr, maxnode) = match &mask {
        Some(m) => (libc::MPOL_PREFERRED, m.as_ptr(), m.len() * libc::c_ulong::BITS as usize),
        None => (libc::MPOL_DEFAULT, std::ptr::null(), 0),
    };
    // SAFETY: `ptr` is null with maxnode 0, or points to `mask`, which holds
    // `maxnode` bits and outlives the call; the kernel only reads it.
    let rc = unsafe { libc::syscall(libc::SYS_set_mempolicy, mode, ptr, maxnode) };
    if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
}

/// Number of CPUs this process may run on (the container's cpuset).
pub fn cpu_count() -> usize {
    Some(allowed_cpus().len())
        .filter(|&n| n > 0)
        .or_else(|| std::thread::available_parallelism().ok().map(usize::from))
        .unwrap_or(1)
}

/// Listener options that accepted sockets inherit on Linux: TCP_NODELAY
/// (the store answers small requests; never wait for Nagle) and
/// TCP_DEFER_ACCEPT (accept a connection only once its first bytes, the
/// VALIDATE frame, have arrived: one wake-up and one packet less per client).
pub fn tune_listener(fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    for (opt, value) in [(libc::TCP_NODELAY, 1 as libc::c_int), (libc::TCP_DEFER_ACCEPT, 5)] {
        let len = libc::socklen_t::try_from(std::mem::size_of::<libc::c_int>()).unwrap_or(4);
        // SAFETY: `fd` is a valid open socket for the duration of the borrow;
        // the option value points to a live c_int on the stack and `len` is
        // its size. setsockopt does not retain the pointer.
        let rc = unsafe { libc::setsockopt(fd.as_raw_fd(), libc::IPPROTO_TCP, opt, (&raw const value).cast(), len) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Does any process of group `pgid` still exist?
pub fn group_alive(pgid: i32) -> bool {
    pgid > 1 && nix::sys::signal::killpg(Pid::from_raw(pgid), None).is_ok()
}

/// The account trainlet runs as: (name, home, login shell), from
/// `/etc/passwd`; None when the uid has no entry (arbitrary uids on
/// OpenShift), in which case callers fall back to the environment.
///
/// Not getpwuid(3): in a statically linked glibc binary it goes through
/// NSS modules loaded with dlopen, and for a uid missing from
/// /etc/passwd that crashed (SIGSEGV) here. Containers keep accounts in
/// /etc/passwd.
pub fn current_user() -> Option<(String, std::path::PathBuf, std::path::PathBuf)> {
    let uid = nix::unistd::geteuid().as_raw();
    passwd_entry(&std::fs::read_to_string("/etc/passwd").ok()?, uid)
}

/// The `name:x:uid:gid:gecos:home:shell` line of `uid`.
fn passwd_entry(text: &str, uid: u32) -> Option<(String, std::path::PathBuf, std::path::PathBuf)> {
    text.lines().find_map(|line| {
        let f: Vec<&str> = line.split(':').collect();
        (f.len() >= 7 && f[2].parse::<u32>().ok() == Some(uid)).then(|| (f[0].to_string(), f[5].into(), f[6].into()))
    })
}

/// Addresses configured on this machine's interfaces (what MPI launchers
/// compare hostfile entries against to tell the local node).
pub fn interface_addresses() -> Vec<std::net::IpAddr> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else { return Vec::new() };
    addrs
        .filter_map(|a| {
            let sa = a.address?;
            if let Some(v4) = sa.as_sockaddr_in() {
                Some(std::net::IpAddr::V4(v4.ip()))
            } else {
                sa.as_sockaddr_in6().map(|v6| std::net::IpAddr::V6(v6.ip()))
            }
        })
        .collect()
}

/// This machine's host name.
pub fn hostname() -> Option<String> {
    nix::unistd::gethostname().ok()?.into_string().ok()
}

/// May this process chdir into `dir`?
pub fn can_enter(dir: &std::path::Path) -> bool {
    nix::unistd::access(dir, nix::unistd::AccessFlags::X_OK).is_ok() && dir.is_dir()
}

/// Is trainlet running as root?
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Give this thread back the default signal mask: `trainlet ssh` lets
/// SIGTERM/SIGINT end it the ordinary way (the connection drops and the
/// server kills the remote command), instead of collecting them.
pub fn unblock_signals() -> Result<(), Errno> {
    // The do-nothing handlers of `block_signals` would make these signals
    // ignored once unblocked: give them their default action first.
    default_caught_signals();
    pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None)
}

/// Remapped rows of an NVML device, which nvml-wrapper does not wrap:
/// (corrected, uncorrected, pending, failed) (reference/gpu-pid1.md 1.2).
/// Runs in the NVML probe child only.
pub fn nvml_remapped_rows(
    nvml: &nvml_wrapper::Nvml,
    device: &nvml_wrapper::Device<'_>,
) -> Result<(u32, u32, bool, bool), nvml_wrapper::error::NvmlError> {
    use nvml_wrapper::error::{NvmlError, nvml_try};
    let f = nvml.lib().nvmlDeviceGetRemappedRows.as_ref().map_err(|e| NvmlError::FailedToLoadSymbol(e.to_string()))?;
    let (mut corr, mut unc, mut pending, mut failed) = (0u32, 0u32, 0u32, 0u32);
    // SAFETY: `f` is nvmlDeviceGetRemappedRows from the loaded library, whose
    // C signature bindgen typed; the handle comes from a live `Device` of
    // this `Nvml`, and the four out-pointers are to live stack u32s that the
    // function only writes during the call.
    let rc = unsafe { f(device.handle(), &mut corr, &mut unc, &mut pending, &mut failed) };
    nvml_try(rc)?;
    Ok((corr, unc, pending != 0, failed != 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwd_lines() {
        let text = "root:x:0:0:root:/root:/bin/bash\n# junk\nmpiuser:x:1000:1000::/home/mpiuser:/bin/sh\n";
        let (name, home, shell) = passwd_entry(text, 1000).expect("entry");
        assert_eq!((name.as_str(), home.to_str(), shell.to_str()), ("mpiuser", Some("/home/mpiuser"), Some("/bin/sh")));
        assert!(passwd_entry(text, 4242).is_none());
    }
}
