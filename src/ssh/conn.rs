//! One SSH connection of the embedded server: authentication, the
//! session channels, `exec` (through [`super::session::Processes`]), the
//! stdio pumps and every refusal ([`super::server`] has the policy).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use russh::keys::ssh_key::PublicKey;
use russh::server::{Auth, ChannelOpenHandle, Handle, Msg, PublicKeyOffer, Session, VerifiedPublicKey};
use russh::{Channel, ChannelId, Sig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};

use super::keys::fingerprint;
use crate::sys::{self, Exit};

use super::session::{
    DRAIN, ENV_ALLOWED, ExecRequest, JOB_DONE, NOT_INHERITED, Pending, Processes, Shared, lock, terminate_group,
};

#[derive(Debug, Default)]
struct Chan {
    env: Vec<(String, String)>,
    stdin: Option<mpsc::UnboundedSender<Bytes>>,
    started: bool,
}

/// One client connection.
pub(super) struct Conn<P: Processes> {
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
    pub(super) fn new(
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
