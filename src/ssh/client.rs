//! The ssh(1)-compatible client (`trainlet ssh`, or argv[0] `ssh`) that MPI
//! launchers run as their remote shell, and the connection helper that
//! `trainlet mpi` uses to probe and stop the workers.
//!
//! Connect and authentication are retried with backoff for a bounded time
//! (`TRAINLET_SSH_RETRY`, default 60 s, and at least `ConnectionAttempts`
//! tries): DNS records not yet published, a refused port, a server still
//! loading keys. MPICH hydra hangs and Intel MPI aborts on a first failure
//! (reference/mpi.md 8.3), so the retry lives here, once, for all of them.
//!
//! Exit status is the remote command's; 255 for a signal death, a lost
//! connection, or a connect/host-key/auth failure, with OpenSSH's wording.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use russh::ChannelMsg;
use russh::client::{self, Handle};
use russh::keys::PrivateKeyWithHashAlg;
use russh::keys::ssh_key::PrivateKey;
use tokio::time::Instant;

use super::argv::{HostKeyCheck, SshArgs};
use super::keys::{self, Pins, fingerprint};

/// Exit status for every failure of the client itself, as ssh(1).
pub const FAILED: u8 = 255;

/// Why a connection could not be made; the Display text is OpenSSH's.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum ConnectError {
    /// The name did not resolve.
    #[error("ssh: Could not resolve hostname {host}: {why}")]
    Resolve {
        /// The host.
        host: String,
        /// Resolver error.
        why: String,
    },
    /// TCP connect failed.
    #[error("ssh: connect to host {host} port {port}: {why}")]
    Connect {
        /// The host.
        host: String,
        /// The port.
        port: u16,
        /// OS error.
        why: String,
    },
    /// The server's host key is not pinned.
    #[error(
        "trainlet ssh: the host key of {host} port {port} ({key}) is not one of the job's pinned keys\nHost key verification failed."
    )]
    HostKey {
        /// The host.
        host: String,
        /// The port.
        port: u16,
        /// Fingerprint of what the server showed.
        key: String,
    },
    /// No identity was accepted.
    #[error("{user}@{host}: Permission denied (publickey).")]
    Auth {
        /// The user.
        user: String,
        /// The host.
        host: String,
    },
    /// The SSH protocol failed.
    #[error("ssh: {host} port {port}: {why}")]
    Protocol {
        /// The host.
        host: String,
        /// The port.
        port: u16,
        /// What failed.
        why: String,
    },
}

/// Where and as whom to connect, and what to trust.
#[derive(Debug, Clone)]
pub struct Target {
    /// Host name or address.
    pub host: String,
    /// Port.
    pub port: u16,
    /// Login name.
    pub user: String,
    /// Keys to authenticate with, in order.
    pub identities: Vec<Arc<PrivateKey>>,
    /// Host keys accepted.
    pub pins: Arc<Pins>,
    /// Strict pinning or none.
    pub check: HostKeyCheck,
}

/// How hard to try.
#[derive(Debug, Clone, Copy)]
pub struct Retry {
    /// Keep trying until then...
    pub until: Instant,
    /// ...and at least this many times.
    pub attempts: u32,
    /// Per-attempt TCP connect timeout.
    pub connect_timeout: Duration,
}

/// Host-key verifier for one connection.
#[derive(Debug)]
pub struct Verifier {
    host: String,
    port: u16,
    pins: Arc<Pins>,
    check: HostKeyCheck,
    rejected: Arc<Mutex<Option<String>>>,
}

impl client::Handler for Verifier {
    type Error = russh::Error;

    async fn check_server_key(&mut self, key: &russh::keys::PublicKeyOrCertificate) -> Result<bool, Self::Error> {
        let russh::keys::PublicKeyOrCertificate::PublicKey { key, .. } = key else {
            *self.rejected.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some("a certificate".into());
            return Ok(false);
        };
        if self.check == HostKeyCheck::Off || self.pins.accepts(&self.host, self.port, key) {
            return Ok(true);
        }
        *self.rejected.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(fingerprint(key));
        Ok(false)
    }
}

fn ssh_config() -> Arc<client::Config> {
    Arc::new(client::Config {
        inactivity_timeout: None,
        keepalive_interval: Some(Duration::from_secs(30)),
        keepalive_max: 4,
        nodelay: true,
        preferred: super::algorithms::preferred(),
        ..Default::default()
    })
}

/// One attempt: resolve, connect, verify the host key, authenticate.
async fn attempt(t: &Target, connect_timeout: Duration) -> Result<Handle<Verifier>, ConnectError> {
    let addrs: Vec<SocketAddr> = match tokio::net::lookup_host((t.host.as_str(), t.port)).await {
        Ok(a) => a.collect(),
        Err(e) => return Err(ConnectError::Resolve { host: t.host.clone(), why: resolver_text(&e) }),
    };
    let mut last = None;
    let mut sock = None;
    for addr in addrs {
        match tokio::time::timeout(connect_timeout, tokio::net::TcpStream::connect(addr)).await {
            Ok(Ok(s)) => {
                sock = Some(s);
                break;
            }
            Ok(Err(e)) => last = Some(os_text(&e)),
            Err(_) => last = Some("Connection timed out".into()),
        }
    }
    let Some(sock) = sock else {
        let why = last.unwrap_or_else(|| "Name or service not known".into());
        return Err(ConnectError::Connect { host: t.host.clone(), port: t.port, why });
    };
    let _ = sock.set_nodelay(true);
    let rejected = Arc::new(Mutex::new(None));
    let verifier = Verifier {
        host: t.host.clone(),
        port: t.port,
        pins: Arc::clone(&t.pins),
        check: t.check,
        rejected: Arc::clone(&rejected),
    };
    let protocol = |why: String| ConnectError::Protocol { host: t.host.clone(), port: t.port, why };
    let mut handle =
        match tokio::time::timeout(connect_timeout, client::connect_stream(ssh_config(), sock, verifier)).await {
            Ok(Ok(h)) => h,
            Ok(Err(e)) => {
                if let Some(key) = rejected.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take() {
                    return Err(ConnectError::HostKey { host: t.host.clone(), port: t.port, key });
                }
                return Err(protocol(e.to_string()));
            }
            Err(_) => return Err(protocol("timed out during the SSH handshake".into())),
        };
    let hash = handle.best_supported_rsa_hash().await.map_err(|e| protocol(e.to_string()))?.flatten();
    for key in &t.identities {
        let auth = handle
            .authenticate_publickey(t.user.clone(), PrivateKeyWithHashAlg::new(Arc::clone(key), hash))
            .await
            .map_err(|e| protocol(e.to_string()))?;
        if auth.success() {
            return Ok(handle);
        }
    }
    Err(ConnectError::Auth { user: t.user.clone(), host: t.host.clone() })
}

fn os_text(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::ConnectionRefused => "Connection refused".into(),
        std::io::ErrorKind::TimedOut => "Connection timed out".into(),
        std::io::ErrorKind::HostUnreachable => "No route to host".into(),
        std::io::ErrorKind::NetworkUnreachable => "Network is unreachable".into(),
        _ => e.to_string(),
    }
}

fn resolver_text(e: &std::io::Error) -> String {
    let s = e.to_string();
    if s.contains("not known") || s.contains("no record") || s.contains("failed to lookup") {
        "Name or service not known".into()
    } else {
        s
    }
}

/// Connect with retries; `on_retry` sees each failure before the wait.
pub async fn connect(
    t: &Target,
    retry: Retry,
    mut on_retry: impl FnMut(&ConnectError, u32),
) -> Result<Handle<Verifier>, ConnectError> {
    let mut tries = 0u32;
    let mut wait = Duration::from_millis(100);
    loop {
        tries += 1;
        let err = match attempt(t, retry.connect_timeout).await {
            Ok(h) => return Ok(h),
            Err(e) => e,
        };
        let now = Instant::now();
        if now + wait > retry.until && tries >= retry.attempts {
            return Err(err);
        }
        on_retry(&err, tries);
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_secs(2));
    }
}

/// Run `command` on an open connection; stdout/stderr of the remote side go
/// to `out`/`err`, stdin comes from `stdin` (None = /dev/null). Returns the
/// remote exit status, [`FAILED`] for a signal death or a lost connection.
pub async fn exec(
    handle: &Handle<Verifier>,
    command: &str,
    stdin: Option<tokio::sync::mpsc::Receiver<Vec<u8>>>,
    out: &mut (dyn Write + Send),
    err: &mut (dyn Write + Send),
) -> Result<u8, String> {
    let channel = handle.channel_open_session().await.map_err(|e| format!("channel open failed: {e}"))?;
    channel.exec(true, command).await.map_err(|e| format!("exec request failed: {e}"))?;
    let (mut rd, wr) = channel.split();
    let feeder = tokio::spawn(async move {
        if let Some(mut rx) = stdin {
            while let Some(chunk) = rx.recv().await {
                if wr.data_bytes(chunk).await.is_err() {
                    return;
                }
            }
        }
        let _ = wr.eof().await;
        // Keep the write half (and so the channel) open until the reader ends.
        std::future::pending::<()>().await;
    });
    let mut code = None;
    while let Some(msg) = rd.wait().await {
        match msg {
            ChannelMsg::Failure => {
                feeder.abort();
                return Err("exec request failed on channel 0".into());
            }
            ChannelMsg::Data { data } => {
                let _ = out.write_all(&data).and_then(|()| out.flush());
            }
            ChannelMsg::ExtendedData { data, ext: 1 } => {
                let _ = err.write_all(&data).and_then(|()| err.flush());
            }
            ChannelMsg::ExitStatus { exit_status } => code = Some(exit_status),
            ChannelMsg::Close => break,
            _ => {}
        }
    }
    feeder.abort();
    // exit-signal, or no status at all, is FAILED, as in ssh(1).
    Ok(code.map_or(FAILED, |c| u8::try_from(c & 0xff).unwrap_or(FAILED)))
}

/// The client's settings that do not come from argv.
#[derive(Debug, Clone)]
pub struct ClientEnv {
    /// Key directory.
    pub key_dir: PathBuf,
    /// Port when none is given (the workers' sshd port, 2222).
    pub default_port: u16,
    /// Retry window.
    pub retry: Duration,
    /// Host-key checking forced by the environment.
    pub check: Option<HostKeyCheck>,
    /// Our login name, the default user.
    pub local_user: String,
}

/// `trainlet ssh ARGS`: the whole client. Returns the exit status.
pub async fn run(args: SshArgs, env: ClientEnv) -> u8 {
    if args.version {
        // Tools that probe `ssh -V` read it from stderr, as OpenSSH prints it.
        eprintln!("trainlet {} ssh client (OpenSSH-compatible command line, SSH-2.0)", env!("CARGO_PKG_VERSION"));
        return 0;
    }
    if args.command.trim().is_empty() {
        eprintln!("trainlet ssh: a remote command is required (this client runs commands, not interactive shells)");
        return FAILED;
    }
    let paths =
        if args.identities.is_empty() { keys::default_identities(&env.key_dir) } else { args.identities.clone() };
    let mut identities = Vec::new();
    for p in &paths {
        match keys::load_private(p) {
            Ok(k) => identities.push(Arc::new(k)),
            Err(e) => eprintln!("trainlet ssh: {}", crate::error::error_chain(&e)),
        }
    }
    if identities.is_empty() {
        eprintln!(
            "trainlet ssh: no identity found (looked for {:?} in {}; pass -i FILE or set TRAINLET_SSH_DIR)",
            keys::IDENTITY_NAMES,
            env.key_dir.display()
        );
        return FAILED;
    }
    let check = env.check.or(args.host_key_check).unwrap_or(HostKeyCheck::Strict);
    // `UserKnownHostsFile=/dev/null` (MPI images' ssh_config) only means
    // "do not record"; the job's own pins still apply.
    let known = args.known_hosts.as_deref().filter(|p| *p != std::path::Path::new("/dev/null"));
    let pins = Arc::new(Pins::load(&env.key_dir, identities.iter().map(|k| k.public_key()), known));
    let target = Target {
        host: args.host.clone(),
        port: args.port.unwrap_or(env.default_port),
        user: args.user.clone().unwrap_or_else(|| env.local_user.clone()),
        identities,
        pins,
        check,
    };
    let retry = Retry {
        until: Instant::now() + env.retry,
        attempts: args.attempts.unwrap_or(1),
        connect_timeout: args.connect_timeout.unwrap_or(Duration::from_secs(10)),
    };
    let quiet = args.quiet;
    let handle = match connect(&target, retry, |e, n| {
        if n == 1 && !quiet {
            tracing::warn!(host = %target.host, port = target.port, error = %e, "not ready; retrying for up to {:?}", env.retry);
        }
    })
    .await
    {
        Ok(h) => h,
        Err(e) => {
            eprintln!("{e}");
            return FAILED;
        }
    };
    let stdin = (!args.no_stdin).then(read_stdin);
    let code = exec(&handle, &args.command, stdin, &mut std::io::stdout(), &mut std::io::stderr()).await;
    let _ = handle.disconnect(russh::Disconnect::ByApplication, "", "en").await;
    match code {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            FAILED
        }
    }
}

/// stdin on a plain thread (it may be a pipe that never closes, as hydra
/// keeps it; a tokio blocking task would hold the runtime open at exit).
fn read_stdin() -> tokio::sync::mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let _ = std::thread::Builder::new().name("trainlet-ssh-stdin".into()).spawn(move || {
        use std::io::Read;
        let mut buf = vec![0u8; 32 * 1024];
        let mut input = std::io::stdin().lock();
        loop {
            match input.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if tx.blocking_send(buf[..n].to_vec()).is_err() {
                        return;
                    }
                }
            }
        }
    });
    rx
}
