//! The MPI worker role, `trainlet sshd`: load keys, bind, serve until
//! SIGTERM or until the launcher says the job is done, then make sure no
//! remote command outlives us. The SSH server itself is `crate::ssh`'s.
//!
//! Readiness: the listener is bound only after the host key and
//! authorized_keys are loaded, so Trainer's `tcpSocket: 2222` readiness
//! probe passing means the server can authenticate.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::sync::mpsc::UnboundedReceiver;
use tokio_util::sync::CancellationToken;

use crate::cli::SshdArgs;
use crate::process::reaper::Reaper;
use crate::process::signals::{STOP, SysEvent};
use crate::process::spawn::{SpawnError, Spawner, StdioMode, WorkerSpec};
use crate::ssh::keys;
use crate::ssh::server::{self, Account, Ended, ExecRequest, Processes, ServerConfig, Started};
use crate::ssh::sshd_config::SshdConfigError;
use crate::{exit, sys};

/// [`Processes`] on the one spawner thread and the one reaper.
#[derive(Debug, Clone)]
pub struct Spawning {
    spawner: Spawner,
    reaper: Reaper,
}

impl Spawning {
    /// Wire a spawner and a reaper together.
    pub fn new(spawner: Spawner, reaper: Reaper) -> Self {
        Self { spawner, reaper }
    }
}

impl Processes for Spawning {
    async fn start(&self, req: ExecRequest) -> std::io::Result<Started> {
        let spec = WorkerSpec {
            unset: req.unset,
            stdio: StdioMode::AllPiped,
            cwd: Some(req.cwd),
            ..WorkerSpec::piped(req.shell.display().to_string(), vec!["-c".into(), req.command], req.env)
        };
        let sp = self.spawner.spawn(spec).await.map_err(|e| match e {
            SpawnError::Exec { source, .. }
            | SpawnError::Fork { source, .. }
            | SpawnError::Chdir { source, .. }
            | SpawnError::Prepare { source, .. } => source,
            SpawnError::Gone => std::io::Error::other("spawner thread is gone"),
        })?;
        let exit = self.reaper.watch(sp.pid, sp.forked);
        match (sp.stdin, sp.stdout, sp.stderr) {
            (Some(stdin), Some(stdout), Some(stderr)) => Ok(Started { pid: sp.pid, stdin, stdout, stderr, exit }),
            _ => Err(std::io::Error::other("spawned without pipes")),
        }
    }
}

/// Why `trainlet sshd` cannot serve: its keys or its settings (exit 200).
#[derive(Debug, thiserror::Error)]
pub enum SshdError {
    /// The host key or authorized_keys cannot be loaded.
    #[error(transparent)]
    Keys(#[from] crate::ssh::KeyError),
    /// sshd(8)'s command line is bad.
    #[error("sshd")]
    Args(#[source] SshdConfigError),
    /// The sshd_config file cannot be read.
    #[error("cannot read {path}")]
    ConfigFile {
        /// `-f FILE`.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The sshd_config file is bad.
    #[error(transparent)]
    Config(SshdConfigError),
    /// TRAINLET_SSH_PORT is not a port.
    #[error(transparent)]
    Port(crate::config::Error),
    /// The address to listen on cannot be had.
    #[error("cannot listen on {at}")]
    Listen {
        /// The address or port.
        at: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The spawner thread could not start.
    #[error("cannot start the spawner thread")]
    Thread(#[source] std::io::Error),
}

impl SshdError {
    /// trainlet's exit code for this failure.
    pub fn exit_code(&self) -> u8 {
        match self {
            SshdError::Thread(_) => exit::INTERNAL,
            _ => exit::CONFIG,
        }
    }
}

fn load(args: &SshdArgs) -> Result<ServerConfig, SshdError> {
    let dir = keys::key_dir(args.ssh_dir.as_deref(), std::env::var("HOME").ok().as_deref());
    let (host_path, host_key) = keys::load_host_key(&dir, args.host_key.as_deref())?;
    let ak = args.authorized_keys.clone().unwrap_or_else(|| dir.join("authorized_keys"));
    let authorized = keys::load_authorized(&ak)?;
    let (name, home, shell) = crate::ssh::local::local_account();
    let allowed_users = if sys::is_root() {
        let mut v = vec!["root".to_string()];
        v.extend(args.allow_users.iter().cloned());
        v
    } else {
        args.allow_users.clone()
    };
    tracing::info!(
        dir = %dir.display(),
        host_key = %host_path.display(),
        fingerprint = %keys::fingerprint(host_key.public_key()),
        authorized = authorized.len(),
        user = %name,
        shell = %shell.display(),
        "keys loaded"
    );
    Ok(ServerConfig {
        host_key,
        authorized,
        account: Account { name, home, shell, allowed_users },
        kill_timeout: args.kill_timeout,
        path_prefix: None,
        login_grace: Some(args.login_grace_time).filter(|d| !d.is_zero()),
        max_startups: args.max_startups,
    })
}

/// `--listen`, else all interfaces (dual stack, IPv4 when there is no
/// IPv6). Not `store::bind_listener`: its TCP_DEFER_ACCEPT would hold back
/// SSH clients that wait for the server's banner before sending theirs.
fn bind(args: &SshdArgs) -> std::io::Result<tokio::net::TcpListener> {
    let try_bind = |addr: SocketAddr| -> std::io::Result<tokio::net::TcpListener> {
        let sock = if addr.is_ipv6() { tokio::net::TcpSocket::new_v6()? } else { tokio::net::TcpSocket::new_v4()? };
        sock.set_reuseaddr(true)?;
        sock.bind(addr)?;
        sock.listen(1024)
    };
    match args.listen {
        Some(a) => try_bind(a),
        None => try_bind(SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, args.port)))
            .or_else(|_| try_bind(SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, args.port)))),
    }
}

/// `trainlet sshd` settings from OpenSSH sshd's command line and config
/// file, for an image whose `/usr/sbin/sshd` is a link to trainlet.
pub fn args_from_sshd(argv: &[String]) -> Result<SshdArgs, SshdError> {
    use crate::ssh::sshd_config::parse_args;
    let (mut cfg, _) = parse_args(argv).map_err(SshdError::Args)?;
    if let Some(file) = cfg.config_file.clone() {
        let text =
            std::fs::read_to_string(&file).map_err(|source| SshdError::ConfigFile { path: file.clone(), source })?;
        cfg.apply_file(&text, &file.display().to_string()).map_err(SshdError::Config)?;
    }
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let (user, home, _) = crate::ssh::local::local_account();
    // sshd's own default port is 22; MPI images configure 2222.
    let from_env = match env(crate::env::TRAINLET_SSH_PORT) {
        None => None,
        Some(v) => Some(crate::config::parse_port(crate::env::TRAINLET_SSH_PORT, &v).map_err(SshdError::Port)?),
    };
    let port = cfg.port.or(from_env).unwrap_or(22);
    let ssh_dir = env(crate::env::TRAINLET_SSH_DIR)
        .map(PathBuf::from)
        .or_else(|| cfg.host_key.as_ref().and_then(|k| k.parent().map(std::path::Path::to_path_buf)));
    Ok(SshdArgs {
        listen: cfg.listen_on(port),
        port,
        ssh_dir,
        host_key: cfg.host_key.clone(),
        authorized_keys: cfg.authorized_keys_path(&home, &user),
        allow_users: Vec::new(),
        kill_timeout: std::time::Duration::from_secs(3),
        pid_file: cfg.pid_file.clone(),
        login_grace_time: cfg.login_grace.unwrap_or(std::time::Duration::from_secs(120)),
        max_startups: cfg.max_startups.unwrap_or_default(),
    })
}

/// Serve until SIGTERM or job done.
pub async fn serve(
    args: SshdArgs,
    events: UnboundedReceiver<SysEvent>,
    cancel: CancellationToken,
) -> Result<u8, SshdError> {
    let mut config = load(&args)?;
    // Tree spawn: daemons on this worker run the same agent path the
    // launcher uses; users' own `ssh` calls in ranks find trainlet's too.
    match crate::ssh::local::agent_link() {
        Ok(link) => config.path_prefix = link.parent().map(std::path::Path::to_path_buf),
        Err(e) => {
            tracing::warn!(error = %e, "cannot create the ssh agent link; tree-spawned launches from this worker will fail")
        }
    }
    let config = Arc::new(config);
    let listener = bind(&args).map_err(|source| SshdError::Listen {
        at: args.listen.map_or_else(|| format!("port {}", args.port), |a| a.to_string()),
        source,
    })?;
    let spawner = Spawner::start().map_err(SshdError::Thread)?;
    let (reaper, mut signals) = Reaper::start(events);
    let procs = Arc::new(Spawning::new(spawner, reaper));
    if let Ok(addr) = listener.local_addr() {
        // Tests and scripts read the address from this line.
        println!("trainlet sshd listening on {addr}");
    }
    if let Some(p) = &args.pid_file
        && let Err(e) = std::fs::write(p, format!("{}\n", std::process::id()))
    {
        tracing::warn!(path = %p.display(), error = %e, "cannot write the pid file");
    }
    let stop = cancel.child_token();
    let served = tokio::spawn(server::serve(listener, config, procs, stop.clone()));
    tokio::pin!(served);
    let mut open = true;
    let ended = loop {
        tokio::select! {
            r = &mut served => break r.unwrap_or(Ended::Stopped),
            sig = signals.recv(), if open => match sig {
                Some(s) if STOP.contains(&s) => {
                    tracing::info!(signal = %sys::signal_name(s), "sshd stopping");
                    stop.cancel();
                }
                Some(_) => {}
                None => {
                    open = false;
                    stop.cancel();
                }
            },
        }
    };
    tracing::info!(reason = ?ended, "sshd stopped");
    if let Some(p) = &args.pid_file {
        let _ = std::fs::remove_file(p);
    }
    Ok(exit::SUCCESS)
}
