//! `trainlet mpi -- mpirun ...` (MPI launcher role): find the hosts
//! ([`super::hosts`]), wait until every one answers the SSH handshake,
//! point the MPI implementation at trainlet's client, run mpirun under
//! supervision, and tell the workers' `trainlet sshd` when the job is done.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::hosts::{find_hosts, is_local, launcher_program, mpi_env, write_hostfiles};
use crate::cli::{MpiArgs, StopWorkers};
use crate::env as names;
use crate::error::error_chain;
use crate::exit;
use crate::process::reaper::Reaper;
use crate::process::signals::{STOP as STOP_SIGNALS, SysEvent};
use crate::process::spawn::{SpawnError, Spawner, StdioMode, WorkerSpec};
use crate::ssh::argv::HostKeyCheck;
use crate::ssh::client::{self, ConnectError, Retry, Target};
use crate::ssh::keys::{self, Pins};
use crate::ssh::server::JOB_DONE;
use crate::sys::{self, Exit};

/// Why `trainlet mpi` could not run mpirun to an outcome of its own.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The hosts or the launcher program cannot be had.
    #[error(transparent)]
    Hosts(#[from] super::hosts::Error),
    /// A bad setting: no identity, no agent link, no hostfiles (its text
    /// says what and where).
    #[error("{0}")]
    Usage(String),
    /// A helper thread could not start.
    #[error("cannot start the {what} thread")]
    Thread {
        /// Which thread.
        what: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// mpirun could not be started.
    #[error(transparent)]
    Spawn(#[from] SpawnError),
}

impl Error {
    /// trainlet's exit code for this failure.
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::Hosts(_) | Error::Usage(_) => exit::CONFIG,
            Error::Thread { .. } => exit::INTERNAL,
            Error::Spawn(s) => s.exec_code().unwrap_or(exit::FORK_FAILED),
        }
    }
}

/// Probe every host until it completes the SSH handshake (host key pinned,
/// key accepted); returns the failures when the deadline passes. A probe
/// that panicked is a failure of its host, never a ready one.
async fn wait_ready(targets: &[Target], deadline: Instant) -> Vec<(String, ConnectError)> {
    let started = Instant::now();
    let probes = targets.iter().cloned().map(|t| async move {
        let retry = Retry { until: deadline, attempts: 1, connect_timeout: Duration::from_secs(10) };
        match client::connect(&t, retry, |_, _| {}).await {
            Ok(h) => {
                tracing::info!(host = %t.host, after_ms = started.elapsed().as_millis(), "host ready");
                let _ = h.disconnect(russh::Disconnect::ByApplication, "", "en").await;
                None
            }
            Err(e) => Some((t.host.clone(), e)),
        }
    });
    let done = join_all(probes).await;
    targets
        .iter()
        .zip(done)
        .filter_map(|(t, r)| match r {
            Ok(failed) => failed,
            Err(e) => Some((
                t.host.clone(),
                ConnectError::Protocol { host: t.host.clone(), port: t.port, why: format!("the probe failed: {e}") },
            )),
        })
        .collect()
}

/// Run every future on its own task; each result in input order, or the
/// task's join error (a panic) in its place.
async fn join_all<F: std::future::Future + Send + 'static>(
    futs: impl Iterator<Item = F>,
) -> Vec<Result<F::Output, tokio::task::JoinError>>
where
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futs.map(tokio::spawn).collect();
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        out.push(h.await);
    }
    out
}

/// Tell every worker's server that the job is done (bounded, best effort).
async fn stop_workers(targets: &[Target]) {
    let jobs = targets.iter().cloned().map(|t| async move {
        let retry = Retry {
            until: Instant::now() + Duration::from_secs(10),
            attempts: 1,
            connect_timeout: Duration::from_secs(5),
        };
        let result = match client::connect(&t, retry, |_, _| {}).await {
            Ok(h) => {
                let r = client::exec(&h, JOB_DONE, None, &mut std::io::sink(), &mut std::io::sink()).await;
                let _ = h.disconnect(russh::Disconnect::ByApplication, "", "en").await;
                r.map_err(|e| e.to_string())
            }
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = result {
            tracing::warn!(host = %t.host, error = %e, "could not tell the worker the job is done");
        }
    });
    for r in join_all(jobs).await {
        if let Err(e) = r {
            tracing::warn!(error = %e, "telling a worker the job is done failed");
        }
    }
}

/// What `trainlet mpi` starts from: the SSH identity's directory and
/// agent link, the hostfiles (when trainlet wrote them) and the hosts to
/// reach over SSH.
struct Hosts {
    key_dir: std::path::PathBuf,
    agent: std::path::PathBuf,
    /// Where the hostfiles are (removed at the end).
    work: std::path::PathBuf,
    /// The hostfiles in both forms, unless the command names its hosts.
    files: Option<(std::path::PathBuf, std::path::PathBuf)>,
    /// The hosts other than this pod.
    targets: Vec<Target>,
    /// Where the hosts came from, for the log.
    from: String,
}

/// Find the identity, the hosts and their SSH settings; a usage error
/// names what is missing.
fn hosts(args: &MpiArgs) -> Result<Hosts, Error> {
    let fail = |msg: String| Err(Error::Usage(msg));
    let key_dir = keys::key_dir(args.ssh_dir.as_deref(), std::env::var("HOME").ok().as_deref());
    let identities: Vec<_> = match keys::default_identities(&key_dir).iter().map(|p| keys::load_private(p)).collect() {
        Ok(v) => v,
        Err(e) => return fail(error_chain(&e)),
    };
    if identities.is_empty() {
        return fail(format!(
            "no SSH identity in {}: mount the job's SSH Secret there (sshAuthMountPath) or set {}",
            key_dir.display(),
            names::TRAINLET_SSH_DIR
        ));
    }
    let source = find_hosts(args)?;
    let agent = match crate::ssh::local::agent_link() {
        Ok(a) => a,
        Err(e) => {
            return fail(format!(
                "cannot create the ssh agent link in {}: {e}",
                crate::ssh::local::agent_dir().display()
            ));
        }
    };
    let work = std::env::temp_dir().join(format!("trainlet-mpi-{}", std::process::id()));
    // Both forms, so whichever MPI family mpirun is reads a file it parses.
    let files = if source.from_command {
        None
    } else {
        match write_hostfiles(&work, &source.hosts) {
            Ok(f) => Some(f),
            Err(e) => return fail(format!("cannot write hostfiles in {}: {e}", work.display())),
        }
    };
    let pins = Arc::new(Pins::load(&key_dir, identities.iter().map(|k| k.public_key()), None));
    let check = std::env::var(names::TRAINLET_SSH_HOST_KEY_CHECKING)
        .map_or(HostKeyCheck::Strict, |v| HostKeyCheck::from_setting(&v));
    let user = crate::ssh::local::local_account().0;
    let identities: Vec<_> = identities.into_iter().map(Arc::new).collect();
    let (own, interfaces) = (sys::hostname(), sys::interface_addresses());
    let targets: Vec<Target> = source
        .hosts
        .iter()
        .filter(|h| {
            let local = is_local(&h.name, own.as_deref(), &interfaces);
            if local {
                tracing::info!(host = %h.name, "this pod is one of the hosts; mpirun starts its processes without SSH");
            }
            !local
        })
        .map(|h| Target {
            host: h.name.clone(),
            port: args.port,
            user: h.user.clone().unwrap_or_else(|| user.clone()),
            identities: identities.clone(),
            pins: Arc::clone(&pins),
            check,
        })
        .collect();
    Ok(Hosts { key_dir, agent, work, files, targets, from: source.what.to_string() })
}

/// Run `trainlet mpi`: mpirun's code, a signal's, or the hosts' verdict.
pub async fn run(args: MpiArgs, events: UnboundedReceiver<SysEvent>, cancel: CancellationToken) -> Result<u8, Error> {
    let h = hosts(&args)?;
    let targets = &h.targets;
    tracing::info!(hosts = targets.len(), from = %h.from, port = args.port, "waiting for the MPI hosts' SSH servers");
    let (reaper, mut signals) = Reaper::start(events);
    let deadline = Instant::now() + args.wait_timeout;
    let stop_signal = async {
        loop {
            match signals.recv().await {
                Some(s) if STOP_SIGNALS.contains(&s) => return s,
                Some(_) => {}
                None => return std::future::pending().await,
            }
        }
    };
    let failures = tokio::select! {
        f = wait_ready(targets, deadline) => f,
        s = stop_signal => {
            tracing::info!(signal = %sys::signal_name(s), "stopped while waiting for the hosts");
            return Ok(exit::for_signal(s));
        }
        () = cancel.cancelled() => return Ok(exit::INTERNAL),
    };
    if !failures.is_empty() {
        let all_refused =
            failures.iter().all(|(_, e)| matches!(e, ConnectError::Auth { .. } | ConnectError::HostKey { .. }));
        eprintln!(
            "trainlet: error: {} of {} MPI hosts did not complete the SSH handshake within {:?}:",
            failures.len(),
            targets.len(),
            args.wait_timeout
        );
        for (host, e) in &failures {
            eprintln!("  {host}: {}", e.to_string().replace('\n', " "));
        }
        return Ok(if all_refused { exit::CONFIG } else { exit::RENDEZVOUS_TIMEOUT });
    }

    let get = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let files = h.files.as_ref().map(|(a, b)| (a.as_path(), b.as_path()));
    let env = mpi_env(&h.agent, &h.key_dir, args.port, args.tree_spawn, files, &get);
    let spawner = Spawner::start().map_err(|source| Error::Thread { what: "spawner", source })?;
    let program = launcher_program(&args.command[0])?;
    if program != args.command[0] {
        tracing::info!(link = %args.command[0], real = %program, "the launcher on PATH is trainlet's own link; running the real one");
    }
    let spec =
        WorkerSpec { stdio: StdioMode::Inherit, ..WorkerSpec::piped(program.clone(), args.command[1..].to_vec(), env) };
    let sp = spawner.spawn(spec).await?;
    tracing::info!(pid = sp.pid, command = %program, tree_spawn = args.tree_spawn, "mpirun started");
    let (status, stopped_by) = supervise(sp.pid, reaper.watch(sp.pid, sp.forked), &mut signals, args.grace).await;
    tracing::info!(%status, "mpirun exited");
    let _ = std::fs::remove_dir_all(&h.work);
    let stop = match args.stop_workers {
        StopWorkers::Always => true,
        StopWorkers::Success => status.success() && stopped_by.is_none(),
        StopWorkers::Never => false,
    };
    if stop {
        stop_workers(targets).await;
    }
    Ok(match stopped_by {
        Some(s) => exit::for_signal(s),
        None => exit::for_worker(status),
    })
}

/// Supervise mpirun (`pid`) until it `exited`: a stop signal sends it
/// SIGTERM, then SIGKILL after `grace` or at a second stop; SIGUSR1/2 are
/// passed on. Its exit, and the stop signal, if one came.
async fn supervise(
    pid: i32,
    exited: tokio::sync::oneshot::Receiver<Exit>,
    signals: &mut UnboundedReceiver<i32>,
    grace: Duration,
) -> (Exit, Option<i32>) {
    tokio::pin!(exited);
    let mut stopped_by: Option<i32> = None;
    let mut kill_at: Option<Instant> = None;
    let mut open = true;
    let status = loop {
        let escalate = async {
            match kill_at {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            e = &mut exited => break e.unwrap_or(Exit::Code(i32::from(exit::INTERNAL))),
            s = signals.recv(), if open => {
                let Some(s) = s else {
                    open = false;
                    continue;
                };
                if STOP_SIGNALS.contains(&s) {
                    if stopped_by.is_some() {
                        tracing::warn!("second stop signal: SIGKILL to mpirun");
                        sys::signal_group(pid, libc::SIGKILL);
                    } else {
                        tracing::info!(signal = %sys::signal_name(s), grace = ?grace, "stopping mpirun");
                        stopped_by = Some(s);
                        sys::signal_group(pid, libc::SIGTERM);
                        kill_at = Some(Instant::now() + grace);
                    }
                } else if [libc::SIGUSR1, libc::SIGUSR2].contains(&s) {
                    sys::signal_process(pid, s);
                }
            }
            () = escalate => {
                tracing::warn!("mpirun outlived the grace period: SIGKILL");
                sys::signal_group(pid, libc::SIGKILL);
                kill_at = None;
            }
        }
    };
    (status, stopped_by)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A probe that panics must not count as a host that answered.
    #[tokio::test]
    async fn a_panicking_task_is_an_error_in_its_place() {
        let got = join_all((0..3).map(|i| async move {
            assert!(i != 1, "probe {i} panics");
            i
        }))
        .await;
        assert_eq!(got.len(), 3);
        assert_eq!(got[0].as_ref().ok(), Some(&0));
        assert!(got[1].as_ref().is_err_and(tokio::task::JoinError::is_panic));
        assert_eq!(got[2].as_ref().ok(), Some(&2));
    }
}
