//! What the SSH server's accept loop (`super::server`) and each of its
//! connections (`super::conn`) share: the server's settings, the account
//! commands run as, how commands are started ([`Processes`]), the
//! server-wide state of live commands and pending logins, and the limits
//! every session keeps.

use std::collections::HashSet;
use std::future::Future;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use russh::keys::ssh_key::{PrivateKey, PublicKey};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::ratelimit::RateLimit;
use crate::sys::{self, Exit};

/// The `exec` string with which `trainlet mpi` tells a worker's server
/// that the job is over (authenticated like any command).
pub const JOB_DONE: &str = "@trainlet job-done";

/// Variables of the server's own environment that describe its shell, not
/// a login: without SHLVL bash sees a top-level shell started by sshd and
/// reads ~/.bashrc, as under OpenSSH (reference/mpi.md 4.3).
pub(super) const NOT_INHERITED: [&str; 4] = ["SHLVL", "PWD", "OLDPWD", "_"];

/// `env` request names a client may set (reference/mpi.md 8.6).
pub(super) const ENV_ALLOWED: [&str; 7] = ["LANG", "LC_", "OMPI_", "PMIX_", "PRTE_", "HYDRA_", "I_MPI_"];

/// How long output is drained after the command exits (a background
/// grandchild may hold the pipes open forever; reference/mpi.md 4.5).
pub(super) const DRAIN: Duration = Duration::from_secs(2);

/// A command to start for a session.
#[derive(Debug, Clone)]
pub struct ExecRequest {
    /// The shell (`<shell> -c <command>`).
    pub shell: PathBuf,
    /// The command string as the client sent it.
    pub command: String,
    /// Variables set on top of the server's environment.
    pub env: Vec<(String, String)>,
    /// Variables of the server's environment the command does not get.
    pub unset: Vec<String>,
    /// Working directory.
    pub cwd: PathBuf,
}

/// A started command.
#[derive(Debug)]
pub struct Started {
    /// Its pid, also its process group.
    pub pid: i32,
    /// Write end of its stdin.
    pub stdin: OwnedFd,
    /// Read end of its stdout.
    pub stdout: OwnedFd,
    /// Read end of its stderr.
    pub stderr: OwnedFd,
    /// Resolves with its exit, from the reaper.
    pub exit: oneshot::Receiver<Exit>,
}

/// Starts commands in their own process group and reports their exits.
pub trait Processes: Send + Sync + 'static {
    /// Start one command.
    fn start(&self, req: ExecRequest) -> impl Future<Output = std::io::Result<Started>> + Send;
}

/// Who may log in, and as whom commands run.
#[derive(Debug, Clone)]
pub struct Account {
    /// Our user name (sshd's USER/LOGNAME).
    pub name: String,
    /// Home directory: HOME and the working directory.
    pub home: PathBuf,
    /// Login shell that runs `exec` strings.
    pub shell: PathBuf,
    /// User names accepted; empty = any (a non-root server can only run
    /// commands as itself anyway).
    pub allowed_users: Vec<String>,
}

/// OpenSSH's `MaxStartups start:rate:full`: with `start` or more
/// connections not yet authenticated, a new one is dropped with probability
/// `rate`%, rising linearly to 100% at `full`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxStartups {
    /// Unauthenticated connections before any is dropped.
    pub start: u32,
    /// Percent dropped at `start`.
    pub rate: u32,
    /// Unauthenticated connections at which every new one is dropped.
    pub full: u32,
}

impl Default for MaxStartups {
    /// OpenSSH's default, 10:30:100.
    fn default() -> Self {
        Self { start: 10, rate: 30, full: 100 }
    }
}

impl std::str::FromStr for MaxStartups {
    type Err = String;

    /// `start:rate:full`, or `N` (a hard limit of N, as in OpenSSH).
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("{s:?} is not start:rate:full (e.g. 10:30:100) or a number");
        let n: Vec<u32> = s.trim().split(':').map(|p| p.trim().parse().map_err(|_| bad())).collect::<Result<_, _>>()?;
        let m = match n[..] {
            [n] => Self { start: n, rate: 100, full: n },
            [start, rate, full] => Self { start, rate, full },
            _ => return Err(bad()),
        };
        if m.start == 0 || m.rate > 100 || m.full < m.start {
            return Err(format!("{s:?}: needs start >= 1, rate <= 100 and full >= start"));
        }
        Ok(m)
    }
}

impl MaxStartups {
    /// Drop a new connection while `unauthenticated` are pending? `roll`
    /// is uniform in 0..100 (OpenSSH's `should_drop_connection`).
    pub fn drops(&self, unauthenticated: u32, roll: u32) -> bool {
        if unauthenticated < self.start {
            return false;
        }
        if unauthenticated >= self.full {
            return true;
        }
        let p = (100 - self.rate) * (unauthenticated - self.start) / (self.full - self.start) + self.rate;
        roll < p
    }
}

/// Everything the server needs, loaded before it accepts.
#[derive(Debug)]
pub struct ServerConfig {
    /// Host key.
    pub host_key: PrivateKey,
    /// Keys allowed to log in.
    pub authorized: Vec<PublicKey>,
    /// Who may log in and how commands run.
    pub account: Account,
    /// SIGTERM-to-SIGKILL wait for a session's leftover processes.
    pub kill_timeout: Duration,
    /// Directory put first on commands' PATH (where trainlet's `ssh` is).
    pub path_prefix: Option<PathBuf>,
    /// Unauthenticated connections are closed after this (None: never).
    pub login_grace: Option<Duration>,
    /// When new connections are dropped while others are unauthenticated.
    pub max_startups: MaxStartups,
}

pub(super) struct Shared<P> {
    pub(super) config: Arc<ServerConfig>,
    pub(super) procs: Arc<P>,
    /// Fired by [`JOB_DONE`].
    pub(super) done: CancellationToken,
    /// Process groups of running commands, server-wide.
    pub(super) live: Mutex<HashSet<i32>>,
    /// Connections accepted and not yet authenticated.
    pub(super) unauthenticated: AtomicU32,
    /// Lines a client can trigger (refusals, drops), rate limited.
    pub(super) log: RateLimit,
}

/// Holds one slot of [`Shared::unauthenticated`] until authentication
/// succeeds or the connection ends.
pub(super) struct Pending<P> {
    pub(super) shared: Arc<Shared<P>>,
}

impl<P> Drop for Pending<P> {
    fn drop(&mut self) {
        self.shared.unauthenticated.fetch_sub(1, Ordering::Relaxed);
    }
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// SIGTERM a process group now and SIGKILL it after `after` if any of it is
/// still there.
pub(super) fn terminate_group(pgid: i32, after: Duration) {
    if !sys::group_alive(pgid) {
        return;
    }
    sys::signal_group(pgid, libc::SIGTERM);
    if let Ok(rt) = tokio::runtime::Handle::try_current() {
        rt.spawn(async move {
            tokio::time::sleep(after).await;
            if sys::group_alive(pgid) {
                tracing::warn!(pgid, "remote command ignored SIGTERM; SIGKILL");
                sys::signal_group(pgid, libc::SIGKILL);
            }
        });
    }
}
