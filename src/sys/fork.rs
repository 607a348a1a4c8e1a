//! fork + exec of one child, in one place: the pipes above stdio, the
//! child's steps between fork and exec (mask, process group, death signal,
//! CPUs, memory policy, oom score, stdio, chdir) with nothing allocated, and
//! the stage report that tells exec failures from setup failures.

use nix::errno::Errno;

use super::default_caught_signals;

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
    /// argv, `argv[0]` first.
    pub argv: Vec<std::ffi::CString>,
    /// The complete environment, `NAME=value`.
    pub envp: Vec<std::ffi::CString>,
    /// Working directory, if not the agent's.
    pub cwd: Option<std::ffi::CString>,
    /// stdin, stdout, stderr.
    pub stdio: [ChildIo; 3],
    /// CPU mask from `cpu_mask` for sched_setaffinity, if any.
    pub affinity: Option<Vec<libc::c_ulong>>,
    /// Written to /proc/self/oom_score_adj (best effort), if any.
    pub oom_score_adj: Option<i32>,
    /// A descriptor the child gets as fd 3, open across exec (a rank's
    /// `PMI_FD`); the caller keeps it open until `fork_exec` returns.
    pub pass_fd: Option<i32>,
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
    above(fd, 3)
}

/// `fd` itself when it is numbered `min` or above, else a close-on-exec
/// copy that is (the original closed).
fn above(fd: std::os::fd::OwnedFd, min: i32) -> Result<std::os::fd::OwnedFd, Errno> {
    use std::os::fd::{AsRawFd, FromRawFd};
    if fd.as_raw_fd() >= min {
        return Ok(fd);
    }
    // SAFETY: fcntl(F_DUPFD_CLOEXEC) on an fd we own returns a new fd that
    // nobody else owns; the original is closed when `fd` drops.
    let new = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, min) };
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
    // The passed descriptor becomes fd 3 in the child: neither it nor the
    // error pipe may be fd 3 before that.
    let pass: Option<OwnedFd> = match plan.pass_fd {
        Some(fd) => {
            // SAFETY: the caller keeps `fd` open for this call; the copy
            // (close-on-exec, numbered 4 or above) is ours.
            let copy = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 4) };
            if copy < 0 {
                return Err(setup(Errno::last()));
            }
            // SAFETY: `copy` is a freshly opened fd owned by nothing else.
            Some(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(copy) })
        }
        None => None,
    };
    let err_w = if pass.is_some() { above(err_w, 4).map_err(setup)? } else { err_w };
    let pass_raw = pass.as_ref().map_or(-1, |p| p.as_raw_fd());
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
            child_after_fork(plan, &src, pass_raw, &argv, &envp, parent, oom.as_ref(), err_fd);
        }
    }
    drop(err_w);
    drop(null);
    drop(pass);
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
#[expect(clippy::too_many_arguments, reason = "the child reads only what the parent prepared, passed as is")]
unsafe fn child_after_fork(
    plan: &ExecPlan,
    src: &[i32; 3],
    pass: i32,
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
        // Only the standard streams cross exec, as with torchrun's
        // Popen(close_fds=True): descriptors the agent inherited (from a
        // runtime or a shell) stay with it. Marked close-on-exec, so the
        // error pipe still reports; a kernel before 5.11 leaves them open.
        libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, libc::CLOSE_RANGE_CLOEXEC);
        // The one descriptor that does cross, as fd 3 (the source is 4 or
        // above, so dup2 makes a copy and clears FD_CLOEXEC on it).
        if pass >= 0 && libc::dup2(pass, 3) < 0 {
            fail(STAGE_SETUP, *libc::__errno_location());
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

#[cfg(test)]
mod tests {
    use std::ffi::CString;
    use std::io::Read;
    use std::os::fd::AsRawFd;

    use super::*;

    fn plan(program: &str, args: &[&str], pass: i32) -> ExecPlan {
        let mut argv = vec![CString::new(program).expect("c")];
        argv.extend(args.iter().map(|a| CString::new(*a).expect("c")));
        ExecPlan {
            candidates: vec![CString::new(program).expect("c")],
            argv,
            envp: vec![CString::new("PATH=/usr/bin:/bin").expect("c")],
            cwd: None,
            stdio: [ChildIo::Null, ChildIo::Null, ChildIo::Null],
            affinity: None,
            oom_score_adj: None,
            pass_fd: Some(pass),
        }
    }

    #[test]
    fn a_passed_descriptor_is_the_childs_fd_3_and_exec_failures_still_come_back() {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().expect("pair");
        // The child writes on fd 3 and lists its descriptors there: only 0-3
        // cross exec (and the listing's own directory).
        let script = "echo hi >&3; ls /proc/self/fd >&3";
        let child = fork_exec(&plan("/bin/sh", &["-c", script], theirs.as_raw_fd())).expect("spawn");
        assert!(child.pid > 0);
        drop(theirs);
        let mut got = String::new();
        (&ours).read_to_string(&mut got).expect("read");
        let mut lines = got.lines();
        assert_eq!(lines.next(), Some("hi"), "{got}");
        let fds: Vec<u32> = lines.filter_map(|l| l.parse().ok()).collect();
        assert!(fds.starts_with(&[0, 1, 2, 3]) && fds.len() <= 5, "{got}");
        let (_keep, theirs) = std::os::unix::net::UnixStream::pair().expect("pair");
        assert_eq!(
            fork_exec(&plan("/nonexistent/program", &[], theirs.as_raw_fd())).map(|f| f.pid),
            Err(ForkExecError::Exec(Errno::ENOENT))
        );
    }
}
