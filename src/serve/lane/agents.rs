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
/// Pause before a lane agent that died is started again.
const RESTART_PAUSE: Duration = Duration::from_secs(1);

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

    /// Stop every lane agent (each stops its workers as on a stop signal)
    /// and wait until they are gone.
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
    /// SIGTERM sent.
    stopping: bool,
}

impl Running {
    fn signal(&self, sig: i32) {
        if self.start.is_none_or(|s| sys::is_same_process(self.pid, s)) {
            sys::signal_process(self.pid, sig);
        }
    }
}

async fn follow(conf: Conf, spawner: Spawner, cancel: CancellationToken) {
    let mut link = Link::new(conf.dial.clone(), &conf.base);
    let mut running: BTreeMap<u64, Running> = BTreeMap::new();
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
        if let Some(wanted) = wanted {
            for (seq, r) in &mut running {
                if !r.stopping && !wanted.iter().any(|e| e.seq == *seq) {
                    tracing::info!(run = seq, pid = r.pid, "the lane is closed; stopping its agent");
                    r.signal(libc::SIGTERM);
                    r.stopping = true;
                }
            }
            for e in wanted {
                if let std::collections::btree_map::Entry::Vacant(slot) = running.entry(e.seq) {
                    match start_one(&conf, &spawner, e, &gone_tx).await {
                        Ok(r) => {
                            slot.insert(r);
                        }
                        Err(why) => tracing::error!(run = e.seq, "cannot start the lane's agent: {why}"),
                    }
                }
            }
        }
        let key = link.keys.lanes_wake(version + 1);
        let wake = wait_key(&conf.dial, &key);
        tokio::select! {
            () = cancel.cancelled() => break,
            _ = wake => {}
            () = tokio::time::sleep(RECHECK) => {}
            Some((seq, pid)) = gone_rx.recv() => {
                if let Some(r) = running.remove_entry(&seq).filter(|(_, r)| r.pid == pid).map(|(_, r)| r) {
                    if r.stopping {
                        tracing::info!(run = seq, pid, "the lane's agent is gone");
                    } else {
                        tracing::warn!(run = seq, pid, "the lane's agent exited while its lane is open; starting it again");
                        tokio::time::sleep(RESTART_PAUSE).await;
                    }
                }
            }
        }
    }
    stop_all(running, &mut gone_rx, conf.stop_limit).await;
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
    let board = conf.board.clone();
    let gone = gone.clone();
    tokio::spawn(async move {
        relay::read(ours, seq, board).await;
        crate::process::sweep::release(pid);
        let _ = gone.send((seq, pid));
    });
    Ok(Running { entry: e, pid, start: sys::proc_start(pid), stopping: false })
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
