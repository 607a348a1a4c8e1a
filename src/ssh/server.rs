//! The embedded SSH server of `trainlet sshd`: public-key auth, session
//! channels, `exec` only (reference/mpi.md 4 and 8.4-8.8, 8.11).
//!
//! An `exec` string runs as `<login shell> -c <string>` in its own process
//! group, with the container's environment plus what sshd sets (USER,
//! LOGNAME, HOME, SHELL, SSH_CLIENT, SSH_CONNECTION), trainlet's `ssh` first
//! on PATH, and the allowed `env` requests. stdin/stdout/stderr flow over the channel; the exit is returned
//! as `exit-status` or `exit-signal`. When the command ends, the channel
//! closes or the connection drops, whatever is left of the process group
//! gets SIGTERM, then SIGKILL after the kill timeout: unlike OpenSSH, no
//! remote command outlives its session (`orted --daemonize` leaves the group
//! on purpose and is not touched).
//!
//! Refused: pty, shell, subsystems, X11, agent and port forwarding, password
//! and keyboard-interactive auth, users other than our own when root; each
//! refusal is logged at info with the peer (rate limited). There is no
//! inactivity timeout once authenticated (tree-spawn sessions idle for
//! hours); protocol keepalives find dead peers.
//!
//! Before authentication, OpenSSH's limits: a connection that has not
//! authenticated within the login grace time (`LoginGraceTime`, default
//! 120 s) is closed, whether it sent no banner, stalled in key exchange or
//! never offered an accepted key; and new connections are dropped, with
//! OpenSSH's `MaxStartups start:rate:full` probability (default 10:30:100),
//! while that many are still unauthenticated.
//!
//! Processes are started and reaped through [`Processes`], which the binary
//! wires to the one spawner thread and the one reaper: nothing here forks or
//! waits.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use russh::keys::ssh_key::{PrivateKey, PublicKey};
use russh::server::{Auth, ChannelOpenHandle, Handle, Msg, PublicKeyOffer, Session, VerifiedPublicKey};
use russh::{Channel, ChannelId, MethodKind, MethodSet, Sig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::keys::fingerprint;
use crate::ratelimit::RateLimit;
use crate::sys::{self, Exit};

/// The `exec` string with which `trainlet mpi` tells a worker's server
/// that the job is over (authenticated like any command).
pub const JOB_DONE: &str = "@trainlet job-done";

/// Variables of the server's own environment that describe its shell, not
/// a login: without SHLVL bash sees a top-level shell started by sshd and
/// reads ~/.bashrc, as under OpenSSH (reference/mpi.md 4.3).
const NOT_INHERITED: [&str; 4] = ["SHLVL", "PWD", "OLDPWD", "_"];

/// `env` request names a client may set (reference/mpi.md 8.6).
const ENV_ALLOWED: [&str; 7] = ["LANG", "LC_", "OMPI_", "PMIX_", "PRTE_", "HYDRA_", "I_MPI_"];

/// How long output is drained after the command exits (a background
/// grandchild may hold the pipes open forever; reference/mpi.md 4.5).
const DRAIN: Duration = Duration::from_secs(2);

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

/// Why [`serve`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// The launcher sent [`JOB_DONE`].
    JobDone,
    /// `stop` was cancelled (SIGTERM).
    Stopped,
}

struct Shared<P> {
    config: Arc<ServerConfig>,
    procs: Arc<P>,
    /// Fired by [`JOB_DONE`].
    done: CancellationToken,
    /// Process groups of running commands, server-wide.
    live: Mutex<HashSet<i32>>,
    /// Connections accepted and not yet authenticated.
    unauthenticated: AtomicU32,
    /// Lines a client can trigger (refusals, drops), rate limited.
    log: RateLimit,
}

/// Holds one slot of [`Shared::unauthenticated`] until authentication
/// succeeds or the connection ends.
struct Pending<P> {
    shared: Arc<Shared<P>>,
}

impl<P> Drop for Pending<P> {
    fn drop(&mut self) {
        self.shared.unauthenticated.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Serve SSH on `listener` until `stop` is cancelled or the launcher says
/// the job is done, then disconnect every client and terminate every
/// command still running (bounded by the kill timeout).
pub async fn serve<P: Processes>(
    listener: TcpListener,
    config: Arc<ServerConfig>,
    procs: Arc<P>,
    stop: CancellationToken,
) -> Ended {
    let ssh = Arc::new(russh_config(&config));
    let shared = Arc::new(Shared {
        config,
        procs,
        done: CancellationToken::new(),
        live: Mutex::new(HashSet::new()),
        unauthenticated: AtomicU32::new(0),
        log: RateLimit::new(20, Duration::from_secs(10)),
    });
    let conns = TaskTracker::new();
    let drop_all = CancellationToken::new();
    let mut failures = 0u32;
    let ended = loop {
        tokio::select! {
            () = stop.cancelled() => break Ended::Stopped,
            () = shared.done.cancelled() => break Ended::JobDone,
            accepted = listener.accept() => match accepted {
                Ok((sock, peer)) => {
                    failures = 0;
                    let pending = shared.unauthenticated.load(Ordering::Relaxed);
                    let roll = u32::try_from(sys::random_u64() % 100).unwrap_or(0);
                    if shared.config.max_startups.drops(pending, roll) {
                        let m = shared.config.max_startups;
                        crate::limited!(shared.log, info, %peer, unauthenticated = pending,
                            max_startups = %format!("{}:{}:{}", m.start, m.rate, m.full),
                            "dropped a connection past MaxStartups (too many unauthenticated connections)");
                        drop(sock);
                        continue;
                    }
                    shared.unauthenticated.fetch_add(1, Ordering::Relaxed);
                    let slot = Pending { shared: Arc::clone(&shared) };
                    let local = sock.local_addr().ok();
                    let _ = sock.set_nodelay(true);
                    let (authed_tx, authed_rx) = oneshot::channel();
                    let conn = Conn::new(Arc::clone(&shared), peer, local, slot, authed_tx);
                    let (ssh, drop_all) = (Arc::clone(&ssh), drop_all.clone());
                    let (grace, log) = (shared.config.login_grace, Arc::clone(&shared));
                    conns.spawn(async move {
                        serve_connection(ssh, sock, conn, peer, ConnControl { grace, authed: authed_rx, drop_all, log }).await;
                    });
                }
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning or dying.
                    failures += 1;
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10 * u64::from(failures.min(100)))).await;
                }
            },
        }
    };
    drop(listener);
    if ended == Ended::JobDone {
        // Let the launcher's own connection (and any straggler) finish.
        conns.close();
        let _ = tokio::time::timeout(Duration::from_secs(5), conns.wait()).await;
    }
    drop_all.cancel();
    conns.close();
    let _ = tokio::time::timeout(Duration::from_secs(2), conns.wait()).await;
    wait_for_groups(&shared).await;
    ended
}

/// What a connection task watches besides the session itself.
struct ConnControl<P> {
    /// The login grace time.
    grace: Option<Duration>,
    /// Fired when the client authenticates.
    authed: oneshot::Receiver<()>,
    /// Fired when the server shuts down.
    drop_all: CancellationToken,
    /// For rate-limited logs.
    log: Arc<Shared<P>>,
}

/// Run one connection: the handshake and session, closed at the login
/// grace time if it has not authenticated by then, or at shutdown.
async fn serve_connection<P: Processes>(
    ssh: Arc<russh::server::Config>,
    sock: tokio::net::TcpStream,
    conn: Conn<P>,
    peer: SocketAddr,
    mut ctl: ConnControl<P>,
) {
    let grace = async {
        match ctl.grace {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(grace);
    let grace_s = ctl.grace.map_or(0, |d| d.as_secs());
    // russh runs the session on a task of its own, which a disconnect
    // request does not reach before key exchange ends: cutting the socket
    // (through a second descriptor of it) ends that task at any stage.
    let cut = sock.as_fd().try_clone_to_owned().map(std::net::TcpStream::from);
    let close = move || {
        if let Ok(c) = &cut {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    };
    let session = tokio::select! {
        r = russh::server::run_stream(ssh, sock, conn) => match r {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(%peer, error = %e, "ssh handshake failed");
                return;
            }
        },
        () = &mut grace => {
            crate::limited!(ctl.log.log, info, %peer, grace_s, "closed a connection that sent no SSH banner within the login grace time (LoginGraceTime)");
            return;
        }
        () = ctl.drop_all.cancelled() => return,
    };
    // From here on the session owns the socket; `close` cuts it.
    let handle = session.handle();
    tokio::pin!(session);
    let (mut authed, mut told) = (false, false);
    loop {
        tokio::select! {
            r = &mut session => {
                if let Err(e) = r {
                    tracing::debug!(%peer, error = %e, "ssh connection ended with an error");
                }
                return;
            }
            r = &mut ctl.authed, if !told => {
                told = true;
                authed = r.is_ok();
            }
            () = &mut grace, if !authed => {
                crate::limited!(ctl.log.log, info, %peer, grace_s, "closed a connection that did not authenticate within the login grace time (LoginGraceTime)");
                break;
            }
            () = ctl.drop_all.cancelled() => break,
        }
    }
    let bye = if authed { "server shutting down" } else { "authentication timed out" };
    let _ = handle.disconnect(russh::Disconnect::ByApplication, bye.into(), "en".into()).await;
    // Give the session a moment to say so, then cut the socket.
    let _ = tokio::time::timeout(Duration::from_secs(2), &mut session).await;
    close();
}

/// Wait for the process groups of dropped sessions to go (they were sent
/// SIGTERM), then SIGKILL what is left.
async fn wait_for_groups<P>(shared: &Shared<P>) {
    let deadline = tokio::time::Instant::now() + shared.config.kill_timeout + Duration::from_millis(500);
    loop {
        let groups: Vec<i32> = lock(&shared.live).iter().copied().filter(|g| sys::group_alive(*g)).collect();
        if groups.is_empty() {
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            for g in groups {
                tracing::warn!(pgid = g, "remote command outlived the shutdown; SIGKILL");
                sys::signal_group(g, libc::SIGKILL);
            }
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn russh_config(config: &ServerConfig) -> russh::server::Config {
    russh::server::Config {
        methods: MethodSet::from(&[MethodKind::PublicKey][..]),
        // OpenSSH probes with `none` first: answer it at once. Rejections of
        // offered keys stay short, since a client may offer several.
        auth_rejection_time: Duration::from_millis(100),
        auth_rejection_time_initial: Some(Duration::ZERO),
        keys: vec![config.host_key.clone()],
        inactivity_timeout: None,
        keepalive_interval: Some(Duration::from_secs(30)),
        keepalive_max: 4,
        nodelay: true,
        preferred: super::algorithms::preferred(),
        ..Default::default()
    }
}

/// SIGTERM a process group now and SIGKILL it after `after` if any of it is
/// still there.
fn terminate_group(pgid: i32, after: Duration) {
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

#[derive(Debug, Default)]
struct Chan {
    env: Vec<(String, String)>,
    stdin: Option<mpsc::UnboundedSender<Bytes>>,
    started: bool,
}

/// One client connection.
struct Conn<P: Processes> {
    shared: Arc<Shared<P>>,
    peer: SocketAddr,
    local: Option<SocketAddr>,
    user: Option<String>,
    /// Its unauthenticated slot, released at authentication.
    pending: Option<Pending<P>>,
    /// Tells the connection task that it authenticated.
    authed: Option<oneshot::Sender<()>>,
    chans: HashMap<ChannelId, Chan>,
    /// Process group per channel, shared with the exit tasks.
    groups: Arc<Mutex<HashMap<ChannelId, i32>>>,
}

impl<P: Processes> Conn<P> {
    fn new(
        shared: Arc<Shared<P>>,
        peer: SocketAddr,
        local: Option<SocketAddr>,
        pending: Pending<P>,
        authed: oneshot::Sender<()>,
    ) -> Self {
        Self {
            shared,
            peer,
            local,
            user: None,
            pending: Some(pending),
            authed: Some(authed),
            chans: HashMap::new(),
            groups: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    fn authorized(&self, key: &PublicKey) -> bool {
        self.shared.config.authorized.iter().any(|a| a.key_data() == key.key_data())
    }

    fn user_allowed(&self, user: &str) -> bool {
        let allowed = &self.shared.config.account.allowed_users;
        allowed.is_empty() || allowed.iter().any(|u| u == user)
    }

    fn refuse(&self, session: &mut Session, ch: ChannelId, what: &str) -> Result<(), russh::Error> {
        self.refused(what);
        session.channel_failure(ch)
    }

    /// Log a refused request or channel type (rate limited: a client decides how many).
    fn refused(&self, what: &str) {
        crate::limited!(self.shared.log, info, peer = %self.peer, request = what, "refused: trainlet sshd serves exec only");
    }

    /// Log a refused authentication method.
    fn refused_auth(&self, user: &str, method: &str) -> Auth {
        crate::limited!(self.shared.log, info, peer = %self.peer, user = %crate::ssh::printable(user), method,
            "refused authentication method: trainlet sshd takes public keys only");
        Auth::reject()
    }

    /// sshd's variables for a session (reference/mpi.md 4.3).
    fn session_env(&self, extra: Vec<(String, String)>) -> Vec<(String, String)> {
        let a = &self.shared.config.account;
        let (lip, lport) = self.local.map_or_else(|| ("0.0.0.0".to_string(), 0), |l| (l.ip().to_string(), l.port()));
        let (pip, pport) = (self.peer.ip().to_string(), self.peer.port());
        let mut env = vec![
            ("USER".to_string(), a.name.clone()),
            ("LOGNAME".to_string(), a.name.clone()),
            ("HOME".to_string(), a.home.display().to_string()),
            ("SHELL".to_string(), a.shell.display().to_string()),
            ("SSH_CLIENT".to_string(), format!("{pip} {pport} {lport}")),
            ("SSH_CONNECTION".to_string(), format!("{pip} {pport} {lip} {lport}")),
        ];
        if let Some(dir) = &self.shared.config.path_prefix {
            let path = std::env::var("PATH").unwrap_or_else(|_| "/usr/local/bin:/usr/bin:/bin".into());
            env.push(("PATH".to_string(), format!("{}:{path}", dir.display())));
        }
        env.extend(extra);
        env
    }

    async fn job_done(&mut self, ch: ChannelId, session: &mut Session) -> Result<(), russh::Error> {
        tracing::info!(peer = %self.peer, "the launcher says the job is done; stopping");
        session.channel_success(ch)?;
        session.exit_status_request(ch, 0)?;
        session.eof(ch)?;
        session.close(ch)?;
        self.shared.done.cancel();
        Ok(())
    }
}

impl<P: Processes> Drop for Conn<P> {
    fn drop(&mut self) {
        let kill_after = self.shared.config.kill_timeout;
        for (_, pgid) in lock(&self.groups).drain() {
            tracing::info!(peer = %self.peer, pgid, "connection gone; terminating its remote command");
            terminate_group(pgid, kill_after);
        }
    }
}

impl<P: Processes> russh::server::Handler for Conn<P> {
    type Error = russh::Error;

    async fn auth_none(&mut self, user: &str) -> Result<Auth, Self::Error> {
        Ok(self.refused_auth(user, "none"))
    }

    async fn auth_password(&mut self, user: &str, _password: &str) -> Result<Auth, Self::Error> {
        Ok(self.refused_auth(user, "password"))
    }

    async fn auth_keyboard_interactive<'a>(
        &'a mut self,
        user: &str,
        _submethods: &str,
        _response: Option<russh::server::Response<'a>>,
    ) -> Result<Auth, Self::Error> {
        Ok(self.refused_auth(user, "keyboard-interactive"))
    }

    async fn auth_publickey_offered(&mut self, user: &str, offer: PublicKeyOffer<'_>) -> Result<Auth, Self::Error> {
        if self.authorized(offer.public_key) && self.user_allowed(user) {
            Ok(Auth::Accept)
        } else {
            tracing::warn!(peer = %self.peer, user = %crate::ssh::printable(user), key = %fingerprint(offer.public_key),
                "refused public key: not in authorized_keys, or user not allowed");
            Ok(Auth::reject())
        }
    }

    async fn auth_publickey(&mut self, user: &str, key: VerifiedPublicKey<'_>) -> Result<Auth, Self::Error> {
        if self.authorized(key.public_key) && self.user_allowed(user) {
            tracing::info!(peer = %self.peer, user, key = %fingerprint(key.public_key), "accepted public key");
            self.user = Some(user.to_string());
            self.pending = None;
            if let Some(tx) = self.authed.take() {
                let _ = tx.send(());
            }
            Ok(Auth::Accept)
        } else {
            tracing::warn!(peer = %self.peer, user = %crate::ssh::printable(user), key = %fingerprint(key.public_key), "refused public key");
            Ok(Auth::reject())
        }
    }

    async fn channel_open_session(
        &mut self,
        channel: Channel<Msg>,
        reply: ChannelOpenHandle,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        self.chans.insert(channel.id(), Chan::default());
        reply.accept().await;
        Ok(())
    }

    async fn pty_request(
        &mut self,
        ch: ChannelId,
        _term: &str,
        _cols: u32,
        _rows: u32,
        _pw: u32,
        _ph: u32,
        _modes: &[(russh::Pty, u32)],
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        self.refuse(session, ch, "pty")
    }

    async fn x11_request(
        &mut self,
        ch: ChannelId,
        _single: bool,
        _proto: &str,
        _cookie: &str,
        _screen: u32,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        self.refuse(session, ch, "x11")
    }

    async fn shell_request(&mut self, ch: ChannelId, session: &mut Session) -> Result<(), Self::Error> {
        self.refuse(session, ch, "shell")
    }

    async fn subsystem_request(&mut self, ch: ChannelId, name: &str, session: &mut Session) -> Result<(), Self::Error> {
        tracing::debug!(subsystem = %crate::ssh::printable(name), "subsystem refused");
        self.refuse(session, ch, "subsystem")
    }

    async fn agent_request(&mut self, _ch: ChannelId, _session: &mut Session) -> Result<bool, Self::Error> {
        self.refused("agent forwarding");
        Ok(false)
    }

    async fn tcpip_forward(&mut self, address: &str, port: &mut u32, _s: &mut Session) -> Result<bool, Self::Error> {
        tracing::debug!(peer = %self.peer, address, port = *port, "tcpip-forward asked");
        self.refused("tcpip-forward");
        Ok(false)
    }

    async fn channel_open_direct_tcpip(
        &mut self,
        _channel: Channel<Msg>,
        host: &str,
        port: u32,
        _oa: &str,
        _op: u32,
        _reply: ChannelOpenHandle,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        // Dropping `_reply` rejects the channel.
        tracing::debug!(peer = %self.peer, host = %crate::ssh::printable(host), port, "direct-tcpip asked");
        self.refused("direct-tcpip");
        Ok(())
    }

    async fn channel_open_x11(
        &mut self,
        _channel: Channel<Msg>,
        _address: &str,
        _port: u32,
        _reply: ChannelOpenHandle,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        self.refused("x11");
        Ok(())
    }

    async fn channel_open_forwarded_tcpip(
        &mut self,
        _channel: Channel<Msg>,
        _host: &str,
        _port: u32,
        _oa: &str,
        _op: u32,
        _reply: ChannelOpenHandle,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        self.refused("forwarded-tcpip");
        Ok(())
    }

    async fn channel_open_direct_streamlocal(
        &mut self,
        _channel: Channel<Msg>,
        _path: &str,
        _reply: ChannelOpenHandle,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        self.refused("direct-streamlocal");
        Ok(())
    }

    async fn streamlocal_forward(&mut self, _path: &str, _session: &mut Session) -> Result<bool, Self::Error> {
        self.refused("streamlocal-forward");
        Ok(false)
    }

    async fn env_request(
        &mut self,
        ch: ChannelId,
        name: &str,
        value: &str,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        let allowed = ENV_ALLOWED.iter().any(|p| if p.ends_with('_') { name.starts_with(p) } else { name == *p });
        match self.chans.get_mut(&ch) {
            Some(chan) if allowed => {
                chan.env.push((name.to_string(), value.to_string()));
                session.channel_success(ch)
            }
            _ => {
                tracing::debug!(peer = %self.peer, name, "env request not in the allow-list; ignored");
                session.channel_failure(ch)
            }
        }
    }

    async fn exec_request(&mut self, ch: ChannelId, data: &[u8], session: &mut Session) -> Result<(), Self::Error> {
        if data == JOB_DONE.as_bytes() {
            return self.job_done(ch, session).await;
        }
        let env = match self.chans.get_mut(&ch) {
            Some(chan) if !chan.started => {
                chan.started = true;
                std::mem::take(&mut chan.env)
            }
            _ => return session.channel_failure(ch),
        };
        let command = String::from_utf8_lossy(data).into_owned();
        let account = &self.shared.config.account;
        let cwd = if sys::can_enter(&account.home) { account.home.clone() } else { PathBuf::from("/") };
        let req = ExecRequest {
            shell: account.shell.clone(),
            command,
            env: self.session_env(env),
            unset: NOT_INHERITED.iter().map(|s| (*s).to_string()).collect(),
            cwd,
        };
        tracing::debug!(peer = %self.peer, command = %req.command, "exec");
        let started = match self.shared.procs.start(req).await {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(peer = %self.peer, shell = %account.shell.display(), error = %e, "cannot start the command");
                return session.channel_failure(ch);
            }
        };
        tracing::info!(peer = %self.peer, user = self.user.as_deref().unwrap_or(""), pid = started.pid, "exec started");
        session.channel_success(ch)?;
        let pgid = started.pid;
        lock(&self.shared.live).insert(pgid);
        lock(&self.groups).insert(ch, pgid);
        let (tx, rx) = mpsc::unbounded_channel();
        if let Some(chan) = self.chans.get_mut(&ch) {
            chan.stdin = Some(tx);
        }
        tokio::spawn(feed_stdin(started.stdin, rx));
        let handle = session.handle();
        let out = tokio::spawn(pump(started.stdout, handle.clone(), ch, None));
        let err = tokio::spawn(pump(started.stderr, handle.clone(), ch, Some(1)));
        let (shared, groups) = (Arc::clone(&self.shared), Arc::clone(&self.groups));
        tokio::spawn(async move {
            let exit = started.exit.await.unwrap_or(Exit::Code(255));
            let aborts = [out.abort_handle(), err.abort_handle()];
            let drained = tokio::time::timeout(DRAIN, async {
                let _ = out.await;
                let _ = err.await;
            });
            if drained.await.is_err() {
                tracing::debug!(pgid, "output still held open after exit; closing the channel anyway");
                aborts.iter().for_each(tokio::task::AbortHandle::abort);
            }
            let _ = match exit {
                Exit::Code(c) => handle.exit_status_request(ch, u32::try_from(c).unwrap_or(255)).await,
                Exit::Signal(s) => handle.exit_signal_request(ch, sig(s), false, String::new(), "en".into()).await,
            };
            let _ = handle.eof(ch).await;
            let _ = handle.close(ch).await;
            // The session is over for this command: nothing of its group stays.
            if lock(&groups).remove(&ch).is_some() {
                terminate_group(pgid, shared.config.kill_timeout);
            }
            lock(&shared.live).remove(&pgid);
        });
        Ok(())
    }

    async fn data(&mut self, ch: ChannelId, data: &[u8], _session: &mut Session) -> Result<(), Self::Error> {
        if let Some(tx) = self.chans.get(&ch).and_then(|c| c.stdin.as_ref()) {
            let _ = tx.send(Bytes::copy_from_slice(data));
        }
        Ok(())
    }

    async fn channel_eof(&mut self, ch: ChannelId, _session: &mut Session) -> Result<(), Self::Error> {
        if let Some(chan) = self.chans.get_mut(&ch) {
            chan.stdin = None; // the feeder sees the end and closes the pipe
        }
        Ok(())
    }

    async fn channel_close(&mut self, ch: ChannelId, _session: &mut Session) -> Result<(), Self::Error> {
        self.chans.remove(&ch);
        if let Some(pgid) = lock(&self.groups).remove(&ch) {
            tracing::info!(peer = %self.peer, pgid, "channel closed by the client; terminating its remote command");
            terminate_group(pgid, self.shared.config.kill_timeout);
        }
        Ok(())
    }
}

async fn feed_stdin(fd: OwnedFd, mut rx: mpsc::UnboundedReceiver<Bytes>) {
    let Ok(mut pipe) = tokio::net::unix::pipe::Sender::from_owned_fd(fd) else { return };
    while let Some(b) = rx.recv().await {
        if pipe.write_all(&b).await.is_err() {
            return;
        }
    }
}

async fn pump(fd: OwnedFd, handle: Handle, ch: ChannelId, ext: Option<u32>) {
    let Ok(mut pipe) = tokio::net::unix::pipe::Receiver::from_owned_fd(fd) else { return };
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        let n = match pipe.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let data = Bytes::copy_from_slice(&buf[..n]);
        let sent = match ext {
            None => handle.data(ch, data).await.is_ok(),
            Some(e) => handle.extended_data(ch, e, data).await.is_ok(),
        };
        if !sent {
            return;
        }
    }
}

/// RFC 4254 signal names.
fn sig(signal: i32) -> Sig {
    match signal {
        libc::SIGABRT => Sig::ABRT,
        libc::SIGALRM => Sig::ALRM,
        libc::SIGFPE => Sig::FPE,
        libc::SIGHUP => Sig::HUP,
        libc::SIGILL => Sig::ILL,
        libc::SIGINT => Sig::INT,
        libc::SIGKILL => Sig::KILL,
        libc::SIGPIPE => Sig::PIPE,
        libc::SIGQUIT => Sig::QUIT,
        libc::SIGSEGV => Sig::SEGV,
        libc::SIGTERM => Sig::TERM,
        libc::SIGUSR1 => Sig::USR1,
        other => Sig::Custom(sys::signal_name(other).trim_start_matches("SIG").to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    #[test_case("10:30:100", MaxStartups { start: 10, rate: 30, full: 100 }; "openssh default")]
    #[test_case("3", MaxStartups { start: 3, rate: 100, full: 3 }; "hard limit")]
    fn max_startups_parse(s: &str, want: MaxStartups) {
        assert_eq!(s.parse::<MaxStartups>(), Ok(want));
    }

    #[test_case("0"; "zero")]
    #[test_case("10:130:100"; "rate over 100")]
    #[test_case("10:30:5"; "full below start")]
    #[test_case("10:30"; "two fields")]
    #[test_case("a:b:c"; "not numbers")]
    fn max_startups_refused(s: &str) {
        assert!(s.parse::<MaxStartups>().is_err());
    }

    /// OpenSSH's `should_drop_connection`: none below start, rate% at
    /// start, rising linearly, all at full.
    #[test_case(9, 0, false; "below start")]
    #[test_case(10, 29, true; "at start, inside the rate")]
    #[test_case(10, 30, false; "at start, outside the rate")]
    #[test_case(55, 64, true; "halfway: 65 percent")]
    #[test_case(55, 65, false; "halfway: not the 66th percent")]
    #[test_case(99, 98, true; "near full")]
    #[test_case(100, 99, true; "at full, always")]
    fn drop_probability(pending: u32, roll: u32, dropped: bool) {
        assert_eq!(MaxStartups::default().drops(pending, roll), dropped);
    }
}
