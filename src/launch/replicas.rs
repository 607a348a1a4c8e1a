//! TorchFT replica groups (`--replica-groups`) at run time: the
//! Lighthouse on the store host, its address through the store, and the
//! store host staying up while other groups still train.
//!
//! Each group meets on its own rendezvous keys (`Plan::rdzv_id`), so its
//! rounds, restarts and budget are its own; the store host serves every
//! group's rounds. Job-wide keys, under `trainlet/<run_id>/j<attempt>/`:
//!
//! | key | written by | meaning |
//! |---|---|---|
//! | `lighthouse` | the store host, once it listens | the Lighthouse's `http://host:port` |
//! | `pod/<node rank>` | each pod, every round | the key its agent heartbeats (`bye` once it left) |
//!
//! The Lighthouse is the agent's own helper: restarted when it exits (with
//! a backoff), spared by the end-of-round sweep, its exit claimed from the
//! one reaper, stopped when the agent exits.

use std::time::Duration;

use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::{Lighthouse, Plan, RunLighthouse};
use crate::keys::JobKeys;
use crate::process::signals::{Heard, SysEvent};
use crate::process::spawn::{Spawner, WorkerSpec};
use crate::rendezvous;
use crate::store::{Dial, Endpoint};
use crate::supervise::output::{self, Sink};
use crate::sys::{self, Exit};

/// Longest wait for a started Lighthouse to accept connections.
const LISTEN_LIMIT: Duration = Duration::from_secs(30);
/// First wait before restarting a Lighthouse that exited; doubled each
/// time, up to [`RESTART_CAP`], and back to this after [`STABLE`] up.
const RESTART_FIRST: Duration = Duration::from_secs(1);
const RESTART_CAP: Duration = Duration::from_secs(30);
const STABLE: Duration = Duration::from_secs(60);
/// How long a Lighthouse that accepts connections must stay up to count as listening.
const ALIVE_CHECK: Duration = Duration::from_millis(300);
/// How long a stopped Lighthouse gets between SIGTERM and SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(3);
/// How often a long wait says what it waits for.
const SAY_EVERY: Duration = Duration::from_secs(60);

fn job_keys(plan: &Plan) -> JobKeys {
    JobKeys::new(&plan.run_id, plan.jobset_attempt)
}

/// The Lighthouse this agent runs, until [`Supervised::stop`].
struct Supervised {
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Supervised {
    /// Stop the Lighthouse (SIGTERM, then SIGKILL) and its supervision.
    async fn stop(self) {
        self.cancel.cancel();
        let _ = tokio::time::timeout(STOP_GRACE + Duration::from_secs(2), self.task).await;
    }
}

/// Replica groups as a feature of the job's rounds: the Lighthouse this
/// pod runs, its address for the workers, this pod's registration each
/// round, and the store host outlasting the other groups at the end.
pub(super) struct Replicas {
    /// The Lighthouse this pod runs (the store host's, when it runs one).
    lighthouse: Option<Supervised>,
    /// The Lighthouse's address, once known.
    url: Option<String>,
    /// The job's store as this pod reaches it (after the join).
    dial: Option<Dial>,
    /// The store host's own dial of its store.
    host_dial: Option<Dial>,
}

impl Replicas {
    /// Start the Lighthouse when this pod runs it, before the pod joins
    /// (`host_dial`: the store host's dial of its own store).
    pub(super) fn start(plan: &Plan, spawner: &Spawner, host_dial: Option<Dial>, cancel: &CancellationToken) -> Self {
        let lighthouse = host_dial.clone().and_then(|d| start(plan, spawner, d, cancel));
        Replicas { lighthouse, url: None, dial: None, host_dial }
    }

    /// The pod joined: wait for the Lighthouse's address. Err(Ok(exit
    /// code)) when a stop signal came first, Err(Err(error)) when it never
    /// came.
    pub(super) async fn joined(
        &mut self,
        plan: &Plan,
        (dial, endpoint): (&Dial, &Endpoint),
        events: &mut UnboundedReceiver<SysEvent>,
    ) -> Result<(), super::Result<u8>> {
        self.dial = Some(dial.clone());
        match address(plan, (dial, endpoint), plan.join_timeout, events).await {
            Ok(url) => {
                self.url = url;
                Ok(())
            }
            Err(Ok(e)) => Err(Err(e.into())),
            Err(Err(sig)) => Err(Ok(crate::exit::for_signal(sig))),
        }
    }

    /// Stop the Lighthouse, if this pod runs one.
    pub(super) async fn stop(&mut self) {
        if let Some(l) = self.lighthouse.take() {
            l.stop().await;
        }
    }
}

impl super::feature::Feature for Replicas {
    fn round_starts<'a>(&'a mut self, at: super::feature::Starting<'a>) -> super::feature::Hook<'a, Result<(), i32>> {
        Box::pin(async move {
            if let Some(dial) = &self.dial {
                register(at.plan, dial, &at.session.heartbeat_key()).await;
                refresh(at.plan, dial, &mut self.url).await;
            }
            Ok(())
        })
    }

    fn gives<'a>(&'a self, gifts: &mut super::feature::Gifts<'a>) {
        gifts.lighthouse = self.url.as_deref();
    }

    fn stopping<'a>(&'a mut self, plan: &'a Plan, why: &'a str) -> super::feature::Hook<'a, ()> {
        Box::pin(async move {
            if let Some(dial) = &self.dial {
                announce_leaving(plan, dial, why).await;
            }
        })
    }

    fn leaving<'a>(&'a mut self, at: super::feature::Leaving<'a>) -> super::feature::Hook<'a, Result<(), i32>> {
        Box::pin(async move {
            // The store host of replica groups outlasts the other groups'
            // pods, unless it is being stopped.
            let out = match &self.host_dial {
                Some(d) if !at.stopped => outlast_other_groups(at.plan, d, at.events).await,
                _ => Ok(()),
            };
            self.stop().await;
            out
        })
    }
}

/// Start the Lighthouse when this pod runs it (the store host of a job
/// with replica groups and no `TORCHFT_LIGHTHOUSE`); it publishes its
/// address in the store at `dial` once it listens.
fn start(plan: &Plan, spawner: &Spawner, dial: Dial, cancel: &CancellationToken) -> Option<Supervised> {
    let g = plan.groups.as_ref()?;
    let Lighthouse::Run(run) = &g.lighthouse else { return None };
    let program = run.program.clone().filter(|_| plan.serve_store)?;
    // Picked once: a restarted Lighthouse keeps the address the workers have.
    let port = if run.port == 0 { crate::rendezvous::host::free_port() } else { run.port };
    let url = format!("http://{}:{port}", bracketed(&plan.endpoint.host));
    let cancel = cancel.child_token();
    let job = LighthouseProc { program, port, url, run: run.clone(), key: job_keys(plan).lighthouse(), dial };
    let task = tokio::spawn(supervise(job, spawner.clone(), cancel.clone()));
    Some(Supervised { cancel, task })
}

struct LighthouseProc {
    program: String,
    port: u16,
    url: String,
    run: RunLighthouse,
    key: String,
    dial: Dial,
}

/// Run the Lighthouse, again and again, until `cancel`.
async fn supervise(job: LighthouseProc, spawner: Spawner, cancel: CancellationToken) {
    let mut wait = RESTART_FIRST;
    let mut published = false;
    loop {
        let started = Instant::now();
        // run_once stops the Lighthouse itself when cancelled.
        let Some(exit) = run_once(&job, &spawner, &mut published, &cancel).await else { return };
        if started.elapsed() >= STABLE {
            wait = RESTART_FIRST;
        }
        tracing::warn!(%exit, restart_in_s = wait.as_secs_f64(), "the TorchFT Lighthouse exited; restarting it");
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(wait) => {}
        }
        wait = (wait * 2).min(RESTART_CAP);
    }
}

/// One life of the Lighthouse: its exit, or None once stopped by `cancel`.
async fn run_once(
    job: &LighthouseProc,
    spawner: &Spawner,
    published: &mut bool,
    cancel: &CancellationToken,
) -> Option<Exit> {
    let bind = if std::path::Path::new("/proc/net/if_inet6").exists() { "[::]" } else { "0.0.0.0" };
    let r = &job.run;
    let args = vec![
        "--bind".to_string(),
        format!("{bind}:{}", job.port),
        "--min_replicas".to_string(),
        r.min_replicas.to_string(),
        "--join_timeout_ms".to_string(),
        r.join_timeout_ms.to_string(),
        "--heartbeat_timeout_ms".to_string(),
        r.heartbeat_timeout_ms.to_string(),
    ];
    // Its quorum log is at info (hundreds of lines a minute); warnings
    // unless the pod asks for more with RUST_LOG.
    let env = if r.quiet { vec![("RUST_LOG".into(), "warn".into())] } else { Vec::new() };
    // The agent's helper: the end-of-round sweep must not take it for a
    // worker's leftover, from its fork on.
    let spec = WorkerSpec { helper: true, ..WorkerSpec::piped(job.program.clone(), args, env) };
    let sp = match spawner.spawn(spec).await {
        Ok(sp) => sp,
        Err(e) => {
            tracing::error!(program = %job.program, error = %crate::error::error_chain(&e), "cannot start the TorchFT Lighthouse");
            return Some(Exit::Code(i32::from(e.exec_code().unwrap_or(crate::exit::INTERNAL))));
        }
    };
    let exited = crate::process::signals::claim(sp.pid, sp.forked);
    let sink =
        |is_err| Sink { prefix: "[lighthouse]: ".into(), console: true, file: None, is_err, tap: None, tail: None };
    if let Some(fd) = sp.stdout {
        tokio::spawn(output::drain(fd, sink(false)));
    }
    if let Some(fd) = sp.stderr {
        tokio::spawn(output::drain(fd, sink(true)));
    }
    tracing::info!(pid = sp.pid, port = job.port, min_replicas = r.min_replicas, "started the TorchFT Lighthouse");
    tokio::pin!(exited);
    // Listening: its port accepts connections while it is still alive a
    // moment later (a squatter on the port, or the store's own port, would
    // accept too, and the Lighthouse then exits: address in use).
    let mut listened = false;
    let ready = async {
        let started = Instant::now();
        let mut warned = false;
        loop {
            if tokio::net::TcpStream::connect(("127.0.0.1", job.port)).await.is_ok() {
                tokio::time::sleep(ALIVE_CHECK).await;
                return;
            }
            if !warned && started.elapsed() >= LISTEN_LIMIT {
                tracing::warn!(
                    port = job.port,
                    waited_s = LISTEN_LIMIT.as_secs(),
                    "the TorchFT Lighthouse does not accept connections yet; still waiting"
                );
                warned = true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let exit = tokio::select! {
        biased;
        e = &mut exited => Some(e),
        () = cancel.cancelled() => None,
        () = ready => {
            listened = true;
            None
        }
    };
    let exit = match exit {
        Some(e) => Some(e),
        None if cancel.is_cancelled() => None,
        None => {
            if !*published {
                tracing::info!(pid = sp.pid, port = job.port, "the TorchFT Lighthouse listens");
            }
            let publishing = async {
                while !*published {
                    *published = publish(job).await;
                    if !*published {
                        tokio::time::sleep(Duration::from_secs(2)).await;
                    }
                }
                std::future::pending::<()>().await;
            };
            tokio::select! {
                e = &mut exited => Some(e),
                () = cancel.cancelled() => None,
                () = publishing => None,
            }
        }
    };
    if !listened && exit.is_some() {
        tracing::error!(port = job.port, program = %job.program, "the TorchFT Lighthouse exited before it listened (its output is above: a port in use, a bad program?)");
    }
    let exit = match exit {
        Some(Ok(e)) => Some(e),
        // The claim's sender is never dropped before it sends.
        Some(Err(_)) => Some(Exit::Code(i32::from(crate::exit::INTERNAL))),
        None => {
            sys::signal_group(sp.pid, libc::SIGTERM);
            if tokio::time::timeout(STOP_GRACE, &mut exited).await.is_err() {
                sys::signal_group(sp.pid, libc::SIGKILL);
                let _ = tokio::time::timeout(Duration::from_secs(2), &mut exited).await;
            }
            tracing::info!(pid = sp.pid, "stopped the TorchFT Lighthouse");
            crate::process::sweep::release(sp.pid);
            return None;
        }
    };
    // What it left in its group goes with it.
    sys::signal_group(sp.pid, libc::SIGKILL);
    crate::process::sweep::release(sp.pid);
    exit
}

/// Say where the Lighthouse is; false when the store could not be told.
async fn publish(job: &LighthouseProc) -> bool {
    let told = async {
        let mut c = job.dial.connect().await?;
        c.set(&job.key, job.url.as_bytes()).await
    };
    match tokio::time::timeout(Duration::from_secs(10), told).await {
        Ok(Ok(())) => {
            tracing::info!(url = %job.url, "the TorchFT Lighthouse listens; its address is in the store");
            true
        }
        Ok(Err(e)) => {
            tracing::error!(error = %crate::error::error_chain(&e), "cannot publish the Lighthouse's address");
            false
        }
        Err(_) => {
            tracing::error!("cannot publish the Lighthouse's address: the store did not answer in 10 s");
            false
        }
    }
}

/// The Lighthouse address the workers get: the user's, or the one the
/// store host published (waited for up to `limit`). None without groups.
async fn address(
    plan: &Plan,
    (dial, endpoint): (&Dial, &Endpoint),
    limit: Duration,
    events: &mut UnboundedReceiver<SysEvent>,
) -> Result<Option<String>, Result<rendezvous::Error, i32>> {
    let Some(g) = &plan.groups else { return Ok(None) };
    if let Lighthouse::External(url) = &g.lighthouse {
        return Ok(Some(url.clone()));
    }
    let key = job_keys(plan).lighthouse();
    tracing::info!(limit_s = limit.as_secs_f64(), "waiting for the TorchFT Lighthouse's address from the store host");
    match super::wait::until_stop(events, plan, tokio::time::timeout(limit, read_when_set(dial, &key))).await {
        Ok(Ok(Ok(v))) => {
            let url = String::from_utf8_lossy(&v).into_owned();
            tracing::info!(%url, group = g.group, groups = g.count, "the TorchFT Lighthouse's address");
            Ok(Some(url))
        }
        Ok(Ok(Err(source))) => Err(Ok(rendezvous::Error::Lost { endpoint: endpoint.clone(), source })),
        Ok(Err(_)) => Err(Ok(rendezvous::Error::Timeout {
            waited: limit,
            round: 0,
            detail: "the store host published no TorchFT Lighthouse address; its log says why \
                     (torchft_lighthouse missing, failing, or its port taken)"
                .into(),
            endpoint: endpoint.clone(),
        })),
        Err(sig) => Err(Err(sig)),
    }
}

/// Read the Lighthouse's address again before a round: the store host
/// may have restarted it elsewhere (a free port) meanwhile. Best effort,
/// bounded: the address known so far stays otherwise.
async fn refresh(plan: &Plan, dial: &Dial, url: &mut Option<String>) {
    let Some(Lighthouse::Run(_)) = plan.groups.as_ref().map(|g| &g.lighthouse) else { return };
    let key = job_keys(plan).lighthouse();
    if let Ok(Ok(v)) = tokio::time::timeout(Duration::from_secs(5), read_when_set(dial, &key)).await {
        let now = String::from_utf8_lossy(&v).into_owned();
        if url.as_deref() != Some(now.as_str()) {
            tracing::info!(url = %now, "the TorchFT Lighthouse moved; the workers get its new address");
            *url = Some(now);
        }
    }
}

/// The store host is stopped: tell the other groups' pods too (each group
/// watches its own keys), so that they wait for it as for a clean leave.
async fn announce_leaving(plan: &Plan, dial: &Dial, why: &str) {
    let Some(g) = plan.groups.as_ref().filter(|g| plan.serve_store && g.count > 1) else { return };
    let tell = async {
        let mut c = dial.connect().await?;
        for i in (0..g.count).filter(|i| *i != g.group) {
            let group = JobKeys::new(&crate::config::group_rdzv_id(&plan.run_id, i), plan.jobset_attempt);
            c.set(&group.host_left(), why.as_bytes()).await?;
        }
        Ok::<(), crate::store::ClientError>(())
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), tell).await;
}

/// Say which key this pod's agent heartbeats, so that the store host
/// knows it is still there (best effort: a lost store shows elsewhere).
async fn register(plan: &Plan, dial: &Dial, heartbeat_key: &str) {
    let Some(g) = &plan.groups else { return };
    let key = job_keys(plan).pod(g.job_node_rank);
    let told = async {
        let mut c = dial.connect().await?;
        c.set(&key, heartbeat_key.as_bytes()).await
    };
    match tokio::time::timeout(Duration::from_secs(5), told).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            tracing::debug!(error = %crate::error::error_chain(&e), "cannot register this pod with the store host")
        }
        Err(_) => tracing::debug!("cannot register this pod with the store host: no answer in 5 s"),
    }
}

/// The store host's group is done; the other groups may still train on
/// its store (and Lighthouse). Wait until every other pod left (its
/// heartbeat says `bye`), or has been silent or absent for the join
/// timeout: the time a pod gets to come back (a container restarting).
/// Err(signal) when a stop signal came.
async fn outlast_other_groups(plan: &Plan, dial: &Dial, events: &mut UnboundedReceiver<SysEvent>) -> Result<(), i32> {
    let Some(g) = plan.groups.as_ref().filter(|g| g.count > 1 && plan.serve_store) else { return Ok(()) };
    let others: Vec<u32> = (0..g.job_nnodes).filter(|r| *r != g.job_node_rank).collect();
    let start = Instant::now();
    let mut seen: Vec<Seen> = others.iter().map(|_| Seen::default()).collect();
    let mut said = None::<Instant>;
    let serves = if matches!(g.lighthouse, Lighthouse::Run(_)) { "store and Lighthouse" } else { "store" };
    let mut tick = tokio::time::interval(plan.heartbeat);
    let mut client = None;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            ev = events.recv() => match Heard::of(ev, &plan.stop_signals) {
                Heard::Stop { signal, .. } => {
                    tracing::warn!(signal = %sys::signal_name(signal), "stop signal while other replica groups still train; this pod's store stops");
                    return Err(signal);
                }
                Heard::Exited { .. } | Heard::Other(_) => continue,
            },
        }
        if client.is_none() {
            client = dial.connect().await.ok();
        }
        let Some(c) = client.as_mut() else { return Ok(()) };
        let regs: Vec<String> = others.iter().map(|r| job_keys(plan).pod(*r)).collect();
        let Ok(regs) = c.multi_get(&regs).await else { return Ok(()) };
        let hb_keys: Vec<String> = regs.iter().map(|v| String::from_utf8_lossy(v).into_owned()).collect();
        let asked: Vec<String> = hb_keys.iter().filter(|k| !k.is_empty()).cloned().collect();
        let mut values = if asked.is_empty() {
            Vec::new()
        } else if let Ok(v) = c.multi_get(&asked).await {
            v
        } else {
            return Ok(());
        };
        values.reverse();
        let now = Instant::now();
        let mut running = Vec::new();
        for ((rank, key), s) in others.iter().zip(&hb_keys).zip(seen.iter_mut()) {
            let value = if key.is_empty() { None } else { values.pop() };
            if !s.gone(key, value, now, start, plan) {
                running.push(*rank);
            }
        }
        if !round::groups::host_outlasts(running.len()) {
            let absent: Vec<u32> = others.iter().zip(&seen).filter(|(_, s)| !s.bye).map(|(r, _)| *r).collect();
            if absent.is_empty() {
                tracing::info!("every other pod left; this pod's {serves} may stop", serves = serves);
            } else {
                tracing::warn!(
                    pods = ?absent,
                    limit_s = plan.join_timeout.as_secs_f64(),
                    "pods of other replica groups have been silent or absent for the join timeout; this pod's {serves} stop",
                    serves = serves
                );
            }
            return Ok(());
        }
        if said.is_none_or(|t| now.duration_since(t) >= SAY_EVERY) {
            tracing::info!(
                pods = ?running,
                limit_s = plan.join_timeout.as_secs_f64(),
                "waiting for the pods of the other replica groups to finish (a silent one is waited for up to the join timeout): this pod serves their {serves}",
                serves = serves
            );
            said = Some(now);
        }
    }
}

/// What the store host saw of one other pod.
#[derive(Debug, Default)]
struct Seen {
    key: String,
    value: Option<Vec<u8>>,
    since: Option<Instant>,
    bye: bool,
}

impl Seen {
    /// Take one reading: whether the pod is gone for the store host
    /// (`round::groups::gone`: it said `bye`, or it has been silent, or
    /// never registered, for the join timeout: the time a pod gets to come
    /// back, as a lost store host gets).
    fn gone(&mut self, key: &str, value: Option<Vec<u8>>, now: Instant, start: Instant, plan: &Plan) -> bool {
        if key != self.key {
            // A new registration: the pod (re)joined.
            *self = Seen { key: key.to_string(), ..Seen::default() };
        }
        self.bye = value.as_deref() == Some(b"bye");
        if value != self.value {
            self.value = value;
            self.since = Some(now);
        }
        let silent = now.duration_since(self.since.unwrap_or(start).max(start));
        let millis = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        round::groups::gone(self.bye, millis(silent), millis(plan.join_timeout))
    }
}

/// `key`'s value once it is set, on a connection of its own (a WAIT blocks it).
async fn read_when_set(dial: &Dial, key: &String) -> Result<Vec<u8>, crate::store::ClientError> {
    let mut c = dial.connect().await?;
    c.wait(std::slice::from_ref(key)).await?;
    c.get(key).await
}

fn bracketed(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') { format!("[{host}]") } else { host.to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_is_gone_once_it_said_bye_went_silent_or_never_came() {
        let plan = {
            let args =
                <crate::cli::TorchrunCli as clap::Parser>::try_parse_from(["torchrun", "--python", "py", "t.py"])
                    .expect("parse")
                    .run;
            let env = crate::env::Env::from_pairs(vec![("TRAINLET_SYSFS_ROOT", "/nonexistent"), ("PATH", "/bin")]);
            Plan::resolve(&args, &env, true).expect("plan")
        };
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut s = Seen::default();
        let v = |b: &[u8]| Some(b.to_vec());
        assert!(!s.gone("", None, at(5), t0, &plan), "not registered yet, within the join timeout");
        assert!(s.gone("", None, at(601), t0, &plan), "never came within the join timeout (600 s)");
        assert!(!s.gone("k/hb/a", v(b"1"), at(1), t0, &plan));
        assert!(!s.gone("k/hb/a", v(b"2"), at(9), t0, &plan), "heartbeating");
        // Silent: a container restarting gets the join timeout to come back.
        assert!(!s.gone("k/hb/a", v(b"2"), at(30), t0, &plan), "silent 21 s");
        assert!(s.gone("k/hb/a", v(b"2"), at(610), t0, &plan), "silent for the join timeout");
        assert!(!s.gone("k/hb/b", v(b"1"), at(611), t0, &plan), "came back: new key");
        assert!(s.gone("k/hb/b", v(b"bye"), at(613), t0, &plan), "left");
        assert_eq!(bracketed("fe80::1"), "[fe80::1]");
        assert_eq!(bracketed("job-0.job"), "job-0.job");
    }
}
