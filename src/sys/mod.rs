//! Every `unsafe` block, raw `libc` call and signal/process syscall of
//! trainlet lives in this module (here, `fork.rs` and `cpu.rs`), each
//! unsafe block with a `// SAFETY:` note.
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

mod cpu;
mod fork;

pub use cpu::{allowed_cpus, cpu_count, cpu_mask, mask_ids, set_preferred_node};
pub use fork::{ChildIo, ExecPlan, ForkExecError, Forked, fork_exec};

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
pub(super) fn default_caught_signals() {
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

/// When `pid` started, in clock ticks after boot (field 22 of
/// `/proc/PID/stat`): with the pid, it names one process, never a later
/// one that reuses the pid. None when it is gone.
pub fn proc_start(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Field 22 is the 20th after the command name's last ')'.
    stat.get(stat.rfind(')')? + 1..)?.split_whitespace().nth(19)?.parse().ok()
}

/// Is `pid` still the process that started at `start` ([`proc_start`]),
/// live or not yet reaped?
pub fn is_same_process(pid: i32, start: u64) -> bool {
    proc_start(pid) == Some(start)
}

/// Every process, from /proc.
pub fn process_table() -> Vec<ProcStat> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(|e| proc_stat(e.ok()?.file_name().to_str()?.parse::<i32>().ok()?)).collect()
}

/// The children of `pid`, from `/proc/PID/task/*/children` (every thread's:
/// a child sits on the list of the thread that forked it). None when the
/// kernel has no such files (built without CONFIG_PROC_CHILDREN); empty
/// when the process is gone.
///
/// The thread group leader's list is read last. A child only moves between
/// these lists onto the leader's: an orphan re-parented to us (PID 1 or a
/// subreaper) and the children of one of our threads that exits both go to
/// the first live thread, the leader (kernel/exit.c `find_alive_thread`).
/// So a child on another thread's list when that list was read is seen
/// there, and one that moved before the leader's list was read is seen
/// there: an empty answer means `pid` had no children when the leader's
/// list was read, unless `pid` itself forked meanwhile.
pub fn children(pid: i32) -> Option<Vec<i32>> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Some(Vec::new()) };
    let leader = std::path::PathBuf::from(format!("/proc/{pid}/task/{pid}"));
    let mut out = Vec::new();
    let paths = tasks.flatten().map(|t| t.path()).filter(|p| *p != leader);
    for task in paths.chain(std::iter::once(leader.clone())) {
        match std::fs::read_to_string(task.join("children")) {
            Ok(text) => out.extend(text.split_whitespace().filter_map(|c| c.parse::<i32>().ok())),
            // The task is there but the file is not: no CONFIG_PROC_CHILDREN.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && task.join("stat").exists() => return None,
            Err(_) => {} // the task ended meanwhile
        }
    }
    Some(out)
}

/// Does this process have a child, live or not yet reaped? Asked with
/// `waitid(P_ALL, WEXITED | WNOHANG | WNOWAIT | __WALL)`, which reaps
/// nothing (the one reaper still collects every exit) and looks at every
/// thread's children under one lock: `Some(false)` (ECHILD) is atomic, no
/// child at all at that instant. None when the kernel refuses the call
/// (before Linux 4.7, `__WALL` was not accepted by waitid).
pub fn has_children() -> Option<bool> {
    use nix::sys::wait::{Id, waitid};
    let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT | WaitPidFlag::__WALL;
    match waitid(Id::All, flags) {
        Ok(_) => Some(true),
        Err(Errno::ECHILD) => Some(false),
        Err(_) => None,
    }
}

/// The parent of `pid`, from /proc; None when it is gone.
pub fn parent_of(pid: i32) -> Option<u32> {
    proc_stat(pid).map(|p| p.ppid)
}

/// This process's process group id.
pub fn own_group() -> i32 {
    nix::unistd::getpgrp().as_raw()
}

/// The CPU time (user and system) the calling thread has used so far;
/// zero when the kernel does not say.
pub fn thread_cpu() -> std::time::Duration {
    use nix::sys::resource::{UsageWho, getrusage};
    getrusage(UsageWho::RUSAGE_THREAD).map_or(std::time::Duration::ZERO, |u| {
        let tv = |t: nix::sys::time::TimeVal| {
            std::time::Duration::from_secs(u64::try_from(t.tv_sec()).unwrap_or(0))
                + std::time::Duration::from_micros(u64::try_from(t.tv_usec()).unwrap_or(0))
        };
        tv(u.user_time()) + tv(u.system_time())
    })
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

/// The size in bytes of the filesystem holding `path` (statvfs).
pub fn fs_size(path: &std::path::Path) -> std::io::Result<u64> {
    let st = nix::sys::statvfs::statvfs(path).map_err(|e| std::io::Error::from_raw_os_error(e as i32))?;
    Ok(st.blocks().saturating_mul(st.fragment_size()))
}

/// Taken once: [`take_inherited_socket`] never owns a descriptor twice.
static INHERITED_TAKEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Take the socket the parent left open as descriptor `fd` (a lane
/// agent's link to the pod's agent), once per process: None when `fd` is
/// not an open socket, or was taken already. It is made close-on-exec, so
/// that no child inherits it.
pub fn take_inherited_socket(fd: i32) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    if INHERITED_TAKEN.swap(true, std::sync::atomic::Ordering::SeqCst) {
        return None;
    }
    let stat = nix::sys::stat::fstat(fd).ok()?;
    if stat.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return None;
    }
    // SAFETY: `fd` is open (fstat succeeded) and was inherited across
    // exec: nothing in this process opened it, so nothing else owns or
    // closes it; the flag above makes this the only owner ever made.
    let owned = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC)).ok()?;
    Some(owned)
}

/// Read `buf.len()` bytes at `addr` of process `pid`'s memory with
/// `process_vm_readv` (the caller needs ptrace access to it: the same uid
/// and, under Yama's `ptrace_scope` 1, being its ancestor); how many came.
/// Nothing of `pid` is paused or changed.
pub fn read_remote(pid: i32, addr: u64, buf: &mut [u8]) -> std::io::Result<usize> {
    use nix::sys::uio::{RemoteIoVec, process_vm_readv};
    let base = usize::try_from(addr).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    let len = buf.len();
    let remote = [RemoteIoVec { base, len }];
    let mut local = [std::io::IoSliceMut::new(buf)];
    process_vm_readv(Pid::from_raw(pid), &mut local, &remote).map_err(std::io::Error::from)
}

/// The pid and uid of the process at the other end of a Unix socket
/// (`SO_PEERCRED`: who created or connected it); None when unknown.
pub fn peer_credentials(fd: std::os::fd::BorrowedFd<'_>) -> Option<(i32, u32)> {
    let c = nix::sys::socket::getsockopt(&fd, nix::sys::socket::sockopt::PeerCredentials).ok()?;
    Some((c.pid(), c.uid()))
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

    #[test]
    fn a_process_is_named_by_pid_and_start_time() {
        let me = i32::try_from(std::process::id()).expect("pid");
        let start = proc_start(me).expect("own start time");
        assert!(is_same_process(me, start));
        assert!(!is_same_process(me, start + 1), "another start time is another process");
        let mut child = std::process::Command::new("true").spawn().expect("true");
        let pid = i32::try_from(child.id()).expect("pid");
        let _ = child.wait();
        assert_eq!(proc_start(pid), None, "a reaped process has no start time");
    }
}
