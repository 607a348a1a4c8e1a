//! The pod's side of the lanes: every serving pod's own agent starts one
//! lane agent per open lane (trainlet again, with `TRAINLET_LANE`), starts
//! it again when it dies while its lane is open, and stops it when its
//! lane closes or the pod's agent stops. The lane agents are the agent's
//! helpers: the sweeps between its own rounds spare them and their
//! workers.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{Entry, relay};
use crate::config::{LANE_FD, Lane};
use crate::process::spawn::{Spawner, StdioMode, WorkerSpec};
use crate::serve::board::Board;
use crate::serve::{Link, wait_key};
use crate::store::Dial;
use crate::sys;

/// How often the lanes record is read again without a wake-up.
const RECHECK: Duration = Duration::from_secs(5);
/// Pause before a lane agent that died is started again (doubled while
/// it keeps dying, up to [`MAX_PAUSE`]); also after a failed store wait.
const RESTART_PAUSE: Duration = Duration::from_secs(1);
/// Longest pause before a lane agent is started again.
const MAX_PAUSE: Duration = Duration::from_secs(60);

/// What the pod's agent starts its lane agents with.
#[derive(Debug, Clone)]
pub struct Conf {
    /// The agents' store, as this pod dials it.
    pub dial: Dial,
    /// The job's key prefix.
    pub base: String,
    /// The control token's file.
    pub token_file: PathBuf,
    /// The pod's serve directory.
    pub dir: PathBuf,
    /// The store host's board (on the store host's pod only).
    pub board: Option<Arc<Board>>,
    /// How long a lane agent may take to stop.
    pub stop_limit: Duration,
    /// The job's run id and JobSet attempt.
    pub job: (String, u64),
}

/// The lane agents of this pod, until [`Agents::stop`].
#[derive(Debug)]
pub struct Agents {
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Agents {
    /// Follow the lanes record and keep one lane agent per open lane.
    pub fn start(conf: Conf, spawner: Spawner, cancel: CancellationToken) -> Self {
        let task = tokio::spawn(follow(conf, spawner, cancel.clone()));
        Self { cancel, task }
    }

    /// Begin to stop every lane agent (each stops its workers as on a
    /// stop signal), so that their grace runs beside the pod's own.
    pub fn begin_stop(&self) {
        self.cancel.cancel();
    }

    /// Stop every lane agent and wait until they are gone.
    pub async fn stop(self) {
        self.cancel.cancel();
        let _ = self.task.await;
    }
}

/// A lane agent running.
struct Running {
    entry: Entry,
    pid: i32,
    start: Option<u64>,
    since: tokio::time::Instant,
    /// When SIGTERM was sent (its lane closed).
    stopping: Option<tokio::time::Instant>,
}

impl Running {
    /// Signal it, while it is the process that was started.
    fn signal(&self, sig: i32) {
        if self.start.is_none_or(|s| sys::is_same_process(self.pid, s)) {
            sys::signal_process(self.pid, sig);
        }
    }
}

/// Starts of a lane agent that keeps dying: the next is not before `at`.
#[derive(Debug, Clone, Copy)]
struct Backoff {
    deaths: u32,
    at: tokio::time::Instant,
}

/// The pause before a lane agent is started again after `deaths` deaths
/// in a row: 1 s, doubled each time, at most a minute.
fn pause(deaths: u32) -> Duration {
    RESTART_PAUSE.saturating_mul(1 << deaths.saturating_sub(1).min(6)).min(MAX_PAUSE)
}

async fn follow(conf: Conf, spawner: Spawner, cancel: CancellationToken) {
    let mut link = Link::new(conf.dial.clone(), &conf.base);
    let mut running: BTreeMap<u64, Running> = BTreeMap::new();
    let mut backoff: BTreeMap<u64, Backoff> = BTreeMap::new();
    let (gone_tx, mut gone_rx) = mpsc::unbounded_channel::<(u64, i32)>();
    let mut version = 0;
    let mut refused = false;
    loop {
        let wanted = match wanted(&mut link, &conf.token_file).await {
            Ok(Some(record)) => {
                refused = false;
                version = record.version;
                Some(record.lanes)
            }
            Ok(None) => {
                version = 0;
                Some(Vec::new())
            }
            Err(why) => {
                if !std::mem::replace(&mut refused, true) {
                    tracing::warn!(reason = %why, "cannot read the open lanes; the lane agents stay as they are");
                }
                None
            }
        };
        let now = tokio::time::Instant::now();
        for (seq, r) in &mut running {
            match r.stopping {
                None if wanted.as_ref().is_some_and(|w| !w.iter().any(|e| e.seq == *seq)) => {
                    tracing::info!(run = seq, pid = r.pid, "the lane is closed; stopping its agent");
                    r.signal(libc::SIGTERM);
                    r.stopping = Some(now);
                }
                Some(at) if now.duration_since(at) > conf.stop_limit => {
                    tracing::warn!(run = seq, pid = r.pid, "a closed lane's agent did not stop in time; killing it");
                    if r.start.is_none_or(|s| sys::is_same_process(r.pid, s)) {
                        sys::signal_group(r.pid, libc::SIGKILL);
                    }
                }
                _ => {}
            }
        }
        if let Some(wanted) = wanted {
            backoff.retain(|seq, _| wanted.iter().any(|e| e.seq == *seq));
            for e in wanted {
                let (std::collections::btree_map::Entry::Vacant(slot), true) =
                    (running.entry(e.seq), backoff.get(&e.seq).is_none_or(|b| b.at <= now))
                else {
                    continue;
                };
                match start_one(&conf, &spawner, e, &gone_tx).await {
                    Ok(r) => {
                        slot.insert(r);
                    }
                    Err(why) => {
                        let deaths = backoff.get(&e.seq).map_or(1, |b| b.deaths + 1);
                        backoff.insert(e.seq, Backoff { deaths, at: now + pause(deaths) });
                        tracing::error!(
                            run = e.seq,
                            retry_in_s = pause(deaths).as_secs(),
                            "cannot start the lane's agent: {why}"
                        );
                    }
                }
            }
        }
        let key = link.keys.lanes_wake(version + 1);
        let wake = wait_key(&conf.dial, &key);
        tokio::select! {
            () = cancel.cancelled() => break,
            woke = wake => {
                // The store is not there (its host restarts): not at once again.
                if woke.is_err() {
                    tokio::select! {
                        () = cancel.cancelled() => break,
                        () = tokio::time::sleep(RESTART_PAUSE) => {}
                    }
                }
            }
            () = tokio::time::sleep(RECHECK) => {}
            Some((seq, pid)) = gone_rx.recv() => {
                if running.get(&seq).is_some_and(|r| r.pid == pid)
                    && let Some(r) = running.remove(&seq)
                {
                    gone(&conf, seq, &r, &mut backoff);
                }
            }
        }
    }
    stop_all(running, &mut gone_rx, conf.stop_limit).await;
}

/// Lane `seq`'s agent `r` is gone: its lane closed (its directory is
/// removed), or it died while its lane is open (started again after a
/// pause that grows while it keeps dying).
fn gone(conf: &Conf, seq: u64, r: &Running, backoff: &mut BTreeMap<u64, Backoff>) {
    if r.stopping.is_some() {
        tracing::info!(run = seq, pid = r.pid, "the lane's agent is gone");
        let dir = conf.dir.join(format!("lane{seq}"));
        tokio::task::spawn_blocking(move || {
            if let Err(e) = std::fs::remove_dir_all(&dir)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot remove a closed lane's directory");
            }
        });
        return;
    }
    // A life of a minute or more starts the count again.
    let deaths = match backoff.get(&seq) {
        Some(b) if r.since.elapsed() < MAX_PAUSE => b.deaths + 1,
        _ => 1,
    };
    let wait = pause(deaths);
    backoff.insert(seq, Backoff { deaths, at: tokio::time::Instant::now() + wait });
    tracing::warn!(
        run = seq,
        pid = r.pid,
        deaths,
        retry_in_s = wait.as_secs(),
        "the lane's agent exited while its lane is open; starting it again"
    );
}

/// The open lanes (None when none was published); Err(why) when they
/// cannot be read or are not the control API's.
async fn wanted(link: &mut Link, token_file: &std::path::Path) -> Result<Option<super::Record>, String> {
    let token = crate::serve::read_token(token_file).map_err(|e| format!("cannot read the control token: {e}"))?;
    let scope = match link.scope(&token).await.map_err(|e| crate::error::error_chain(&e))? {
        Some(Ok(scope)) => scope,
        Some(Err(why)) => return Err(why),
        None => return Ok(None),
    };
    match link.lanes(&token, &scope).await.map_err(|e| crate::error::error_chain(&e))? {
        Some(Ok(r)) => Ok(Some(r)),
        Some(Err(why)) => Err(why),
        None => Ok(None),
    }
}

/// Start lane `e`'s agent: trainlet again, under the name and with the
/// arguments it was started with, told its lane by `TRAINLET_LANE`, its
/// link to this agent as fd 3.
async fn start_one(
    conf: &Conf,
    spawner: &Spawner,
    e: Entry,
    gone: &mpsc::UnboundedSender<(u64, i32)>,
) -> Result<Running, String> {
    let lane = Lane {
        seq: e.seq,
        nproc: e.nproc,
        first: e.first,
        store: conf.dial.addr,
        token_file: conf.token_file.clone(),
        report: conf.board.is_some(),
        main_dir: conf.dir.clone(),
        run_id: conf.job.0.clone(),
        attempt: conf.job.1,
    };
    let json = serde_json::to_string(&lane).map_err(|e| e.to_string())?;
    let (argv0, args) = own_argv()?;
    let (ours, theirs) = std::os::unix::net::UnixStream::pair().map_err(|e| format!("socketpair: {e}"))?;
    ours.set_nonblocking(true).map_err(|e| e.to_string())?;
    let ours = tokio::net::UnixStream::from_std(ours).map_err(|e| e.to_string())?;
    let spec = WorkerSpec {
        argv0: Some(argv0),
        stdio: StdioMode::Inherit,
        helper: true,
        pass_fd: Some(Arc::new(std::os::fd::OwnedFd::from(theirs))),
        ..WorkerSpec::piped("/proc/self/exe".into(), args, vec![(crate::env::TRAINLET_LANE.into(), json)])
    };
    debug_assert_eq!(LANE_FD, 3, "the spawner passes a descriptor as fd 3");
    let sp = spawner.spawn(spec).await.map_err(|e| crate::error::error_chain(&e))?;
    let (pid, seq) = (sp.pid, e.seq);
    tracing::info!(run = seq, pid, workers = e.nproc, first_slot = e.first, "started the agent of a lane");
    let (board, gone, start) = (conf.board.clone(), gone.clone(), sys::proc_start(pid));
    tokio::spawn(async move {
        relay::read(ours, seq, board).await;
        // Its link ended: it exited, or it lives on without it, and is
        // then killed (a second agent for its lane is about to start).
        if start.is_none_or(|s| sys::is_same_process(pid, s)) {
            sys::signal_group(pid, libc::SIGKILL);
        }
        crate::process::sweep::release(pid);
        let _ = gone.send((seq, pid));
    });
    Ok(Running { entry: e, pid, start, since: tokio::time::Instant::now(), stopping: None })
}

/// This agent's `argv[0]` and arguments (a lane agent is started with them).
fn own_argv() -> Result<(String, Vec<String>), String> {
    let mut argv = std::env::args_os().map(std::ffi::OsString::into_string);
    let argv0 = argv.next().and_then(Result::ok).unwrap_or_else(|| "trainlet".into());
    let args = argv.collect::<Result<Vec<_>, _>>().map_err(|_| "an argument of this agent is not UTF-8")?;
    Ok((argv0, args))
}

/// SIGTERM every lane agent, and wait for them to be gone for at most
/// `limit` (then SIGKILL their process groups).
async fn stop_all(
    mut running: BTreeMap<u64, Running>,
    gone: &mut mpsc::UnboundedReceiver<(u64, i32)>,
    limit: Duration,
) {
    if running.is_empty() {
        return;
    }
    tracing::info!(lanes = running.len(), "stopping the lanes' agents");
    for r in running.values() {
        r.signal(libc::SIGTERM);
    }
    let _ = tokio::time::timeout(limit, async {
        while !running.is_empty() {
            match gone.recv().await {
                Some((seq, _)) => {
                    running.remove(&seq);
                }
                None => return,
            }
        }
    })
    .await;
    for (seq, r) in &running {
        tracing::warn!(
            run = seq,
            pid = r.pid,
            workers = r.entry.nproc,
            "a lane's agent did not stop in time; killing it"
        );
        if r.start.is_none_or(|s| sys::is_same_process(r.pid, s)) {
            sys::signal_group(r.pid, libc::SIGKILL);
        }
    }
}
