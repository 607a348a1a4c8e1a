//! `--preload`: a Python zygote that imports the heavy modules once, while
//! the pod waits in the rendezvous, and forks python workers with them
//! already loaded (`zygote.py` beside this file is the Python side).
//!
//! The agent listens on a Unix socket in a private (0700) directory and
//! admits only the zygote it started (SO_PEERCRED). A worker is asked for
//! with its full environment, working directory, `sys.argv`, CPUs, memory
//! node and OOM score, and gets the write ends of its stdout and stderr
//! pipes as SCM_RIGHTS; the zygote forks it through an intermediate that
//! exits at once, so the worker is re-parented to the agent (a subreaper or
//! PID 1): the one reaper reaps it and the attempt supervises it like an
//! exec'd worker. Its process group is set before the pid comes back.
//!
//! Only workers the zygote can start exactly as `python` would are forked
//! ([`python_target`]: the zygote's interpreter with `-u`, `-B`, a script,
//! `-m` or `-c`); others are exec'd. When the zygote fails to start or
//! dies, every worker is exec'd, with one warning.

use std::io::{IoSlice, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::Serialize;
use tokio::sync::watch;

use crate::process::spawn::{SpawnError, Spawned, Spawner, StdioMode, WorkerSpec};
use crate::supervise::output::{self, Sink};

/// The Python side.
const PROGRAM: &str = include_str!("zygote.py");
/// How long the imports may take before the zygote is given up.
const READY_LIMIT: Duration = Duration::from_secs(300);
/// Bound on one fork request.
const FORK_LIMIT: Duration = Duration::from_secs(30);

/// Where the zygote is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    Importing,
    Ready,
    /// Why it is not used (warned once).
    Gone(String),
}

/// The zygote of this agent.
#[derive(Debug)]
pub struct Zygote {
    python: String,
    phase: watch::Sender<Phase>,
    sock: Mutex<Option<UnixStream>>,
    dir: PathBuf,
}

/// How `python ARGS` runs its target, as the zygote reproduces it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Target {
    /// `script`, `module` or `code`.
    pub kind: &'static str,
    /// The script's path, the module or the code.
    pub target: String,
    /// `sys.argv`.
    pub argv: Vec<String>,
    /// `-u`.
    pub unbuffered: bool,
    /// `-B`.
    pub dont_write_bytecode: bool,
}

/// What `python ARGS` runs, when the zygote can run it the same way
/// (only `-u` and `-B` before the target; any other option changes how
/// the interpreter starts and is exec'd).
pub fn python_target(args: &[String]) -> Option<Target> {
    let (mut unbuffered, mut dont_write_bytecode) = (false, false);
    let mut i = 0;
    while let Some(a) = args.get(i) {
        match a.as_str() {
            "-u" => unbuffered = true,
            "-B" => dont_write_bytecode = true,
            "-uB" | "-Bu" => (unbuffered, dont_write_bytecode) = (true, true),
            _ => break,
        }
        i += 1;
    }
    let rest = &args[i..];
    let (kind, target, argv) = match rest.first().map(String::as_str)? {
        "-m" => {
            let m = rest.get(1)?.clone();
            // runpy sets argv[0] to the module's file.
            ("module", m.clone(), std::iter::once(m).chain(rest[2..].iter().cloned()).collect())
        }
        "-c" => {
            ("code", rest.get(1)?.clone(), std::iter::once("-c".to_string()).chain(rest[2..].iter().cloned()).collect())
        }
        s if s.starts_with('-') => return None,
        s => ("script", s.to_string(), rest.to_vec()),
    };
    Some(Target { kind, target, argv, unbuffered, dont_write_bytecode })
}

#[derive(Serialize)]
struct Request<'a> {
    agent: u32,
    #[serde(flatten)]
    target: &'a Target,
    env: std::collections::BTreeMap<String, String>,
    cwd: String,
    cpus: Option<Vec<u32>>,
    mem_node: Option<u32>,
    oom_score_adj: Option<i32>,
}

impl Zygote {
    /// Start the zygote of `python` importing `modules`; it becomes ready
    /// in the background.
    pub async fn start(spawner: &Spawner, python: &str, modules: &[String]) -> Arc<Self> {
        let dir =
            std::env::temp_dir().join(format!("trainlet-zygote-{}-{:x}", std::process::id(), crate::sys::random_u64()));
        let (phase, _) = watch::channel(Phase::Importing);
        let z = Arc::new(Self { python: python.to_string(), phase, sock: Mutex::new(None), dir: dir.clone() });
        let listener = match private_listener(&dir) {
            Ok(l) => l,
            Err(e) => {
                z.give_up(format!("cannot make its socket under {} ({e})", dir.display()));
                return z;
            }
        };
        let mut args = vec!["-c".to_string(), PROGRAM.to_string()];
        args.extend(modules.iter().cloned());
        let env = vec![("TRAINLET_ZYGOTE_SOCKET".to_string(), dir.join("sock").display().to_string())];
        let mut spec = WorkerSpec::piped(python.to_string(), args, env);
        spec.stdio = StdioMode::Piped;
        // The agent's helper: sweeps spare it from its fork on.
        spec.helper = true;
        let child = match spawner.spawn(spec).await {
            Ok(c) => c,
            Err(e) => {
                z.give_up(format!("cannot start {python}: {}", crate::error::error_chain(&e)));
                return z;
            }
        };
        for (fd, is_err) in [(child.stdout, false), (child.stderr, true)] {
            if let Some(fd) = fd {
                let sink =
                    Sink { prefix: "[zygote]: ".into(), console: true, file: None, is_err, tap: None, tail: None };
                tokio::spawn(output::drain(fd, sink));
            }
        }
        tracing::info!(pid = child.pid, modules = %modules.join(","), "preloading modules in a Python zygote while the pod joins");
        let started = std::time::Instant::now();
        let zz = Arc::clone(&z);
        let pid = child.pid;
        tokio::task::spawn_blocking(move || match handshake(&listener, pid) {
            Ok((sock, threads)) => {
                *zz.sock.lock().unwrap_or_else(PoisonError::into_inner) = Some(sock);
                tracing::info!(pid, took_ms = started.elapsed().as_millis(), threads = ?threads, "zygote ready: python workers are forked from it");
                zz.phase.send_replace(Phase::Ready);
            }
            Err(why) => {
                crate::sys::signal_process(pid, libc::SIGKILL);
                zz.give_up(why);
            }
        });
        z
    }

    fn give_up(&self, why: String) {
        tracing::warn!(reason = %why, "the Python zygote is not used; workers are exec'd (imports are not preloaded)");
        *self.sock.lock().unwrap_or_else(PoisonError::into_inner) = None;
        self.phase.send_replace(Phase::Gone(why));
        let _ = std::fs::remove_dir_all(&self.dir);
    }

    /// Fork `spec` from the zygote: None when it is not a worker the zygote
    /// runs (not its python, not piped, options it cannot reproduce) or the
    /// zygote is gone (the caller execs it).
    pub async fn fork(self: &Arc<Self>, spec: &WorkerSpec) -> Option<Result<Spawned, SpawnError>> {
        if spec.program != self.python || spec.stdio != StdioMode::Piped || spec.pass_fd.is_some() {
            return None;
        }
        let target = python_target(&spec.args)?;
        let env = crate::process::spawn::worker_env_utf8(spec)?;
        let cwd = match &spec.cwd {
            Some(d) => d.to_str()?.to_string(),
            None => std::env::current_dir().ok()?.to_str()?.to_string(),
        };
        let mut phase = self.phase.subscribe();
        if *phase.borrow() == Phase::Importing {
            tracing::info!(
                limit_s = READY_LIMIT.as_secs(),
                "waiting for the Python zygote to finish its imports before starting workers"
            );
        }
        // The first workers wait for the imports (bounded): that is the point.
        let ready = match tokio::time::timeout(READY_LIMIT, phase.wait_for(|p| *p != Phase::Importing)).await {
            Ok(Ok(p)) => *p == Phase::Ready,
            _ => false,
        };
        if !ready {
            return None;
        }
        let req = Request {
            agent: std::process::id(),
            target: &target,
            env,
            cwd,
            cpus: spec.cpus.as_ref().map(|c| c.iter().collect()),
            mem_node: spec.mem_node,
            oom_score_adj: spec.oom_score_adj,
        };
        let body = serde_json::to_vec(&req).ok()?;
        let me = Arc::clone(self);
        let program = spec.program.clone();
        let out = tokio::task::spawn_blocking(move || me.fork_blocking(&body)).await.ok()?;
        match out {
            Ok(s) => Some(Ok(s)),
            Err(Failure::Fork(errno)) => {
                Some(Err(SpawnError::Fork { program, source: std::io::Error::from_raw_os_error(errno) }))
            }
            Err(Failure::Gone(why)) => {
                self.give_up(why);
                None
            }
        }
    }

    fn fork_blocking(&self, body: &[u8]) -> Result<Spawned, Failure> {
        let gone = |what: &str, e: &dyn std::fmt::Display| Failure::Gone(format!("{what}: {e}"));
        let mut guard = self.sock.lock().unwrap_or_else(PoisonError::into_inner);
        let sock = guard.as_mut().ok_or_else(|| Failure::Gone("closed".into()))?;
        let (out_r, out_w) = pipe().map_err(|e| gone("pipe", &e))?;
        let (err_r, err_w) = pipe().map_err(|e| gone("pipe", &e))?;
        let len = u32::try_from(body.len()).map_err(|e| gone("request", &e))?.to_le_bytes();
        let forked = std::time::Instant::now();
        let fds = [out_w.as_raw_fd(), err_w.as_raw_fd()];
        let iov = [IoSlice::new(&len), IoSlice::new(body)];
        let cmsg = [nix::sys::socket::ControlMessage::ScmRights(&fds)];
        let sent =
            nix::sys::socket::sendmsg::<()>(sock.as_raw_fd(), &iov, &cmsg, nix::sys::socket::MsgFlags::empty(), None)
                .map_err(|e| gone("send", &e))?;
        if sent < 4 + body.len() {
            sock.write_all(&[&len[..], body].concat()[sent..]).map_err(|e| gone("send", &e))?;
        }
        drop((out_w, err_w));
        let reply = read_message(sock).map_err(|e| gone("the zygote died", &e))?;
        let v: serde_json::Value = serde_json::from_slice(&reply).map_err(|e| gone("reply", &e))?;
        if let Some(pid) = v.get("pid").and_then(serde_json::Value::as_i64).and_then(|p| i32::try_from(p).ok()) {
            return Ok(Spawned { pid, forked, stdin: None, stdout: Some(out_r), stderr: Some(err_r) });
        }
        match v.get("errno").and_then(serde_json::Value::as_i64).and_then(|e| i32::try_from(e).ok()) {
            Some(errno) if errno == libc::EAGAIN || errno == libc::ENOMEM => Err(Failure::Fork(errno)),
            _ => Err(Failure::Gone(format!("it refused: {v}"))),
        }
    }
}

impl Drop for Zygote {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

enum Failure {
    Fork(i32),
    Gone(String),
}

fn pipe() -> nix::Result<(OwnedFd, OwnedFd)> {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
}

fn private_listener(dir: &std::path::Path) -> std::io::Result<UnixListener> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new().mode(0o700).create(dir)?;
    UnixListener::bind(dir.join("sock"))
}

/// Accept the zygote (only process `pid`) and read its ready message.
fn handshake(listener: &UnixListener, pid: i32) -> Result<(UnixStream, Vec<String>), String> {
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let deadline = std::time::Instant::now() + READY_LIMIT;
    let mut sock = loop {
        match listener.accept() {
            Ok((s, _)) => {
                let cred = nix::sys::socket::getsockopt(&s, nix::sys::socket::sockopt::PeerCredentials)
                    .map_err(|e| e.to_string())?;
                if cred.pid() == pid {
                    break s;
                }
                tracing::warn!(
                    peer_pid = cred.pid(),
                    "refused a connection to the zygote's socket from another process"
                );
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if std::time::Instant::now() > deadline {
                    return Err("it did not connect in time".into());
                }
                if crate::sys::proc_state(pid).is_none_or(|s| s == 'Z') {
                    return Err("it exited before connecting (see its [zygote] lines)".into());
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(e.to_string()),
        }
    };
    sock.set_nonblocking(false).map_err(|e| e.to_string())?;
    sock.set_read_timeout(Some(READY_LIMIT)).map_err(|e| e.to_string())?;
    let msg =
        read_message(&mut sock).map_err(|e| format!("it exited while importing (see its [zygote] lines): {e}"))?;
    let v: serde_json::Value = serde_json::from_slice(&msg).map_err(|e| e.to_string())?;
    if let Some(err) = v.get("error").and_then(serde_json::Value::as_str) {
        return Err(err.to_string());
    }
    sock.set_read_timeout(Some(FORK_LIMIT)).map_err(|e| e.to_string())?;
    let threads = v
        .get("threads")
        .and_then(serde_json::Value::as_array)
        .map(|a| a.iter().filter_map(|t| t.as_str().map(String::from)).collect())
        .unwrap_or_default();
    Ok((sock, threads))
}

fn read_message(sock: &mut UnixStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    sock.read_exact(&mut len)?;
    let n = u32::from_le_bytes(len) as usize;
    if n > 1 << 20 {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "reply too long"));
    }
    let mut buf = vec![0u8; n];
    sock.read_exact(&mut buf)?;
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(args: &[&str]) -> Option<(&'static str, String, Vec<String>, bool)> {
        let a: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        python_target(&a).map(|t| (t.kind, t.target, t.argv, t.unbuffered))
    }

    fn v(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn only_what_python_would_run_the_same_way_is_forked() {
        assert_eq!(
            t(&["-u", "train.py", "--lr", "1"]),
            Some(("script", "train.py".into(), v(&["train.py", "--lr", "1"]), true))
        );
        assert_eq!(t(&["train.py"]), Some(("script", "train.py".into(), v(&["train.py"]), false)));
        assert_eq!(t(&["-u", "-m", "pkg.main", "x"]), Some(("module", "pkg.main".into(), v(&["pkg.main", "x"]), true)));
        assert_eq!(t(&["-c", "print(1)", "a"]), Some(("code", "print(1)".into(), v(&["-c", "a"]), false)));
        assert_eq!(t(&["-uB", "t.py"]).map(|x| x.3), Some(true));
        for refused in
            [&["-O", "t.py"][..], &["-X", "dev", "t.py"], &["-E", "t.py"], &["-"], &[], &["-m"], &["-u", "-c"]]
        {
            assert_eq!(t(refused), None, "{refused:?}");
        }
    }
}
