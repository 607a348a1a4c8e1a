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

use std::collections::HashSet;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use russh::{MethodKind, MethodSet};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::conn::Conn;
pub use super::session::{Account, ExecRequest, JOB_DONE, MaxStartups, Processes, ServerConfig, Started};
use super::session::{Pending, Shared, lock};
use crate::ratelimit::RateLimit;
use crate::sys;

/// Why [`serve`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// The launcher sent [`JOB_DONE`].
    JobDone,
    /// `stop` was cancelled (SIGTERM).
    Stopped,
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
    pub(super) grace: Option<Duration>,
    /// Fired when the client authenticates.
    pub(super) authed: oneshot::Receiver<()>,
    /// Fired when the server shuts down.
    pub(super) drop_all: CancellationToken,
    /// For rate-limited logs.
    pub(super) log: Arc<Shared<P>>,
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
