//! A pod's side of an actor: the Unix socket its workers dial
//! ([`super::wire`]), the reader of the actor's operations in the agents'
//! store, and the writer of its ranks' outcomes.
//!
//! One task (the core) owns every decision, fed by events: operations
//! read from the store, frames from the workers, and the round loop's
//! "round started" and "round over". An operation is run by the workers
//! of its round only: one for a round this pod has not started yet is
//! held until it does; one for the round that just ended here is answered
//! "not run" (the control API sends it again); a call still queued or
//! running when its round ends is answered for each local rank with what
//! ended it: the rank's own death ([`fault::WORKER_DIED`], exit code or
//! signal), or the round's end ([`fault::ACTOR_RESTARTED`]), or the
//! actor's ([`fault::ACTOR_GONE`]).
//!
//! In survivors mode, the bridge is the attempt's [`Rejoin`]: it tells
//! which workers are ready (only those are kept at a round's end), keeps
//! the connections of the ready workers when the round ends, and hands
//! each kept worker the new round's variables (a `reconfigure` frame),
//! after which the worker says `ready` again and takes calls. A kept
//! worker whose connection is gone is killed: it could never answer.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tokio::net::UnixListener;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tokio_util::sync::CancellationToken;

use super::event::Event;
pub use super::event::Place;
use super::socket::{accept, writer};
use super::wire::ToWorker;
use super::{Error, Fault, Keys, Op, Outcome, What, fault};
use crate::serve::Link;
use crate::serve::spec::Actor;
use crate::supervise::report::{Failure, root_cause};

/// Most bytes of one rank's encoded outcome (the store takes 8 MiB values).
const MAX_OUTCOME: usize = 7 * 1024 * 1024;
/// Longest a Unix socket path may be (`sun_path`, less its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// The pids of the workers that are connected and ready.
type ReadySet = Arc<Mutex<HashSet<i32>>>;

fn lock(set: &ReadySet) -> std::sync::MutexGuard<'_, HashSet<i32>> {
    set.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// This pod's bridge to the workers of one actor.
#[derive(Debug)]
pub struct Bridge {
    tx: UnboundedSender<Event>,
    socket: PathBuf,
    cancel: CancellationToken,
    seq: u64,
    survivors: bool,
    ready: ReadySet,
}

impl Bridge {
    /// Listen on `socket` for the workers of the actor of run `seq`.
    pub fn start(place: Place, seq: u64, actor: Actor, socket: &Path) -> Result<Self, Error> {
        let io = |what, source| Error::Io { what, path: socket.display().to_string(), source };
        if socket.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(io(
                "the actor's socket path is too long (use a shorter --serve-dir)",
                std::io::ErrorKind::InvalidInput.into(),
            ));
        }
        let _ = std::fs::remove_file(socket);
        let listener = UnixListener::bind(socket).map_err(|e| io("cannot listen on", e))?;
        let cancel = CancellationToken::new();
        let (tx, rx) = unbounded_channel();
        let keys = Keys::new(&place.base, seq);
        let results = writer(Link::new(place.dial.clone(), &place.base), cancel.child_token());
        let ready = ReadySet::default();
        let survivors = actor.restart == crate::serve::spec::Restart::Survivors;
        tokio::spawn(accept(listener, tx.clone(), cancel.child_token()));
        let core = Core {
            seq,
            actor,
            keys,
            place,
            tx: tx.clone(),
            results,
            reader: None,
            cancel: cancel.child_token(),
            round: None,
            ranks: Vec::new(),
            last: None,
            workers: HashMap::new(),
            held: Vec::new(),
            calls: BTreeMap::new(),
            ready: ready.clone(),
            survivors,
            carried: HashMap::new(),
        };
        tokio::spawn(core.run(rx));
        Ok(Self { tx, socket: socket.to_path_buf(), cancel, seq, survivors, ready })
    }

    /// Does the actor keep its live workers through faults?
    pub fn survivors(&self) -> bool {
        self.survivors
    }

    /// The socket path the workers get in `TRAINLET_ACTOR_SOCKET`.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// This pod's workers of `round` (global `ranks`) are starting.
    pub fn round_started(&self, round: u64, ranks: Vec<u32>) {
        let _ = self.tx.send(Event::RoundStarted { round, ranks });
    }

    /// `round` is over on every pod: `failures` are the workers that died
    /// on their own, `why` how the round ended (`stopped`: the run was
    /// stopped, so the actor is gone).
    pub fn round_over(&self, round: u64, failures: &[Failure], why: &str, stopped: bool) {
        let _ = self.tx.send(Event::RoundOver { round, failures: failures.to_vec(), why: why.to_string(), stopped });
    }
}

impl crate::supervise::worker::Rejoin for Bridge {
    fn seq(&self) -> u64 {
        self.seq
    }

    fn ready(&self, pid: i32) -> bool {
        lock(&self.ready).contains(&pid)
    }

    fn rejoin(&self, pid: i32, start: u64, rank: u32, env: Vec<(String, String)>) {
        // Not ready until it says so again, whatever the core has read yet.
        lock(&self.ready).remove(&pid);
        let _ = self.tx.send(Event::Rejoin { pid, start, rank, env: env.into_iter().collect() });
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        self.cancel.cancel();
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// A connected worker.
struct Worker {
    conn: u64,
    pid: i32,
    tx: UnboundedSender<ToWorker>,
    ready: bool,
    /// Why its instantiation failed.
    init_failed: Option<Fault>,
}

/// Where a call stands on one local rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Queued,
    Running,
}

/// A call of the current round with local ranks.
struct Call {
    method: String,
    encoding: super::Encoding,
    args: String,
    ranks: BTreeMap<u32, Phase>,
}

struct Core {
    seq: u64,
    actor: Actor,
    keys: Keys,
    place: Place,
    tx: UnboundedSender<Event>,
    results: UnboundedSender<(String, Vec<u8>)>,
    reader: Option<CancellationToken>,
    cancel: CancellationToken,
    /// The round whose workers run here now.
    round: Option<u64>,
    /// This pod's ranks in it.
    ranks: Vec<u32>,
    /// The round that ended here last, and this pod's ranks in it.
    last: Option<(u64, Vec<u32>)>,
    workers: HashMap<u32, Worker>,
    /// Operations for a round not started here yet.
    held: Vec<Op>,
    calls: BTreeMap<u64, Call>,
    /// The pids of the ready workers (read by the attempt).
    ready: ReadySet,
    /// Survivors mode: ready workers are kept through a round's end.
    survivors: bool,
    /// Kept workers between their round's end and their rejoin, by pid.
    carried: HashMap<i32, Worker>,
}

impl Core {
    async fn run(mut self, mut rx: UnboundedReceiver<Event>) {
        loop {
            let ev = tokio::select! {
                () = self.cancel.cancelled() => break,
                ev = rx.recv() => match ev { Some(ev) => ev, None => break },
            };
            self.handle(ev);
        }
        if let Some(r) = self.reader.take() {
            r.cancel();
        }
    }

    fn handle(&mut self, ev: Event) {
        match ev {
            Event::Op(op) => self.op(op),
            Event::Hello { conn, rank, pid, tx } => self.hello(conn, rank, pid, tx),
            Event::Ready { conn } => {
                if let Some(rank) = self.rank_of(conn) {
                    if let Some(w) = self.workers.get_mut(&rank) {
                        w.ready = true;
                        lock(&self.ready).insert(w.pid);
                    }
                    tracing::info!(actor = self.seq, rank, "actor instantiated");
                    self.dispatch(rank);
                }
            }
            Event::InitFailed { conn, error } => {
                if let Some(rank) = self.rank_of(conn) {
                    tracing::error!(actor = self.seq, rank, error = %error.kind, message = %crate::serve::spec::shown(&error.message), "the actor's target could not be instantiated");
                    if let Some(w) = self.workers.get_mut(&rank) {
                        w.init_failed = Some(error);
                        lock(&self.ready).remove(&w.pid);
                    }
                }
            }
            Event::Result { conn, id, outcome } => {
                let Some(rank) = self.rank_of(conn) else { return };
                let running = self.calls.get_mut(&id).and_then(|c| c.ranks.remove(&rank)) == Some(Phase::Running);
                if running {
                    self.answer(id, rank, &outcome);
                }
                if self.calls.get(&id).is_some_and(|c| c.ranks.is_empty()) {
                    self.calls.remove(&id);
                }
            }
            Event::Gone { conn } => {
                if let Some(rank) = self.rank_of(conn) {
                    // Its calls are answered when the round ends, with what
                    // the reaper saw.
                    tracing::debug!(actor = self.seq, rank, "an actor worker's connection closed");
                    if let Some(w) = self.workers.get_mut(&rank) {
                        w.ready = false;
                        lock(&self.ready).remove(&w.pid);
                    }
                }
                self.carried.retain(|pid, w| {
                    let gone = w.conn == conn;
                    if gone {
                        lock(&self.ready).remove(pid);
                    }
                    !gone
                });
            }
            Event::Rejoin { pid, start, rank, env } => self.rejoin(pid, start, rank, env),
            Event::RoundStarted { round, ranks } => {
                if self.reader.is_none() {
                    let token = CancellationToken::new();
                    tokio::spawn(super::reader::read_ops(
                        self.place.clone(),
                        self.keys.clone(),
                        (self.seq, round),
                        self.tx.clone(),
                        token.clone(),
                    ));
                    self.reader = Some(token);
                }
                self.round = Some(round);
                self.ranks = ranks;
                self.workers.clear();
                let held = std::mem::take(&mut self.held);
                for op in held {
                    self.op(op);
                }
            }
            Event::RoundOver { round, failures, why, stopped } => self.round_over(round, &failures, &why, stopped),
        }
    }

    /// Kept worker `pid` is `rank` of the round that started here.
    fn rejoin(&mut self, pid: i32, start: u64, rank: u32, env: BTreeMap<String, String>) {
        lock(&self.ready).remove(&pid);
        let Some(mut w) = self.carried.remove(&pid).filter(|_| self.ranks.contains(&rank)) else {
            tracing::warn!(actor = self.seq, rank, pid, "a kept worker's connection is gone; killing it");
            if crate::sys::is_same_process(pid, start) {
                crate::sys::signal_group(pid, libc::SIGKILL);
            }
            return;
        };
        w.ready = false;
        w.init_failed = None;
        if w.tx.send(ToWorker::Reconfigure { env }).is_err() && crate::sys::is_same_process(pid, start) {
            crate::sys::signal_group(pid, libc::SIGKILL);
        }
        tracing::info!(actor = self.seq, rank, pid, "a kept worker rejoins the actor");
        self.workers.insert(rank, w);
    }

    fn rank_of(&self, conn: u64) -> Option<u32> {
        self.workers.iter().find(|(_, w)| w.conn == conn).map(|(r, _)| *r)
    }

    fn hello(&mut self, conn: u64, rank: u32, pid: i32, tx: UnboundedSender<ToWorker>) {
        if !self.ranks.contains(&rank) || self.workers.get(&rank).is_some_and(|w| w.ready) {
            tracing::warn!(
                actor = self.seq,
                rank,
                pid,
                "refused an actor connection: not a rank of this pod's current workers, or one already connected"
            );
            return;
        }
        let init = ToWorker::Init {
            target: self.actor.target.clone(),
            encoding: self.actor.encoding,
            args: self.actor.init.clone(),
        };
        let _ = tx.send(init);
        self.workers.insert(rank, Worker { conn, pid, tx, ready: false, init_failed: None });
    }

    fn op(&mut self, op: Op) {
        let Some(round) = self.round.filter(|r| *r >= op.round) else {
            let past = self.last.as_ref().is_some_and(|(r, _)| *r >= op.round);
            if past {
                self.not_run(&op);
            } else {
                self.held.push(op);
            }
            return;
        };
        if op.round < round {
            self.not_run(&op);
            return;
        }
        match op.what {
            What::Call { method, encoding, args, ranks } => {
                let mine: BTreeMap<u32, Phase> = self
                    .ranks
                    .iter()
                    .filter(|r| ranks.as_ref().is_none_or(|rs| rs.contains(r)))
                    .map(|r| (*r, Phase::Queued))
                    .collect();
                if mine.is_empty() {
                    return;
                }
                let todo: Vec<u32> = mine.keys().copied().collect();
                self.calls.insert(op.n, Call { method, encoding, args, ranks: mine });
                for rank in todo {
                    self.dispatch(rank);
                }
            }
            What::Cancel { call } => {
                let Some(c) = self.calls.get_mut(&call) else { return };
                let queued: Vec<u32> = c.ranks.iter().filter(|(_, p)| **p == Phase::Queued).map(|(r, _)| *r).collect();
                for rank in &queued {
                    c.ranks.remove(rank);
                }
                let running: Vec<u32> = c.ranks.keys().copied().collect();
                for rank in queued {
                    let o =
                        Outcome::fault(fault::CANCELLED, format!("cancelled before it started on rank {rank}"), false);
                    self.answer(call, rank, &o);
                }
                for rank in running {
                    if let Some(w) = self.workers.get(&rank) {
                        let _ = w.tx.send(ToWorker::Cancel { id: call });
                    }
                }
                tracing::info!(actor = self.seq, call, "cancelling a call");
            }
        }
    }

    /// Answer an operation of a round that is over here: not run.
    fn not_run(&mut self, op: &Op) {
        let What::Call { ranks, .. } = &op.what else { return };
        let Some((round, mine)) = &self.last else { return };
        if *round != op.round {
            return;
        }
        let mine: Vec<u32> = mine.iter().copied().filter(|r| ranks.as_ref().is_none_or(|rs| rs.contains(r))).collect();
        for rank in mine {
            let o = Outcome::fault(
                fault::ACTOR_RESTARTED,
                format!("round {round} of the actor ended before the call reached rank {rank}"),
                false,
            );
            self.answer(op.n, rank, &o);
        }
    }

    /// Send `rank` its queued calls, when its worker is ready.
    fn dispatch(&mut self, rank: u32) {
        let Some(w) = self.workers.get(&rank).filter(|w| w.ready) else { return };
        for (id, c) in &mut self.calls {
            if let Some(p) = c.ranks.get_mut(&rank).filter(|p| **p == Phase::Queued) {
                let frame =
                    ToWorker::Call { id: *id, method: c.method.clone(), encoding: c.encoding, args: c.args.clone() };
                if w.tx.send(frame).is_ok() {
                    *p = Phase::Running;
                }
            }
        }
    }

    fn answer(&self, n: u64, rank: u32, outcome: &Outcome) {
        match serde_json::to_vec(outcome) {
            Ok(v) if v.len() > MAX_OUTCOME => {
                let why = format!(
                    "rank {rank}'s result is {} bytes encoded, more than the {MAX_OUTCOME} the store takes; return less, or write it to a file",
                    v.len()
                );
                self.answer(n, rank, &Outcome::fault(fault::BAD_RESULT, why, true));
            }
            Ok(v) => {
                let _ = self.results.send((self.keys.result(n, rank), v));
            }
            Err(e) => tracing::error!(actor = self.seq, call = n, rank, error = %e, "cannot encode an outcome"),
        }
    }

    fn round_over(&mut self, round: u64, failures: &[Failure], why: &str, gone: bool) {
        if self.round != Some(round) {
            return;
        }
        let root = root_cause(failures);
        let cause = root.map_or_else(|| why.to_string(), |f| format!("rank {} {}", f.rank, died(f)));
        let calls = std::mem::take(&mut self.calls);
        for (n, c) in calls {
            for (rank, phase) in c.ranks {
                let own = failures.iter().find(|f| f.rank == rank);
                let init = self.workers.get(&rank).and_then(|w| w.init_failed.clone());
                let o = match (own, init) {
                    (_, Some(mut e)) => {
                        e.message = format!("rank {rank} could not instantiate the actor: {}", e.message);
                        Outcome { ok: false, value: None, error: Some(e) }
                    }
                    (Some(f), None) if phase == Phase::Running => {
                        let mut o = Outcome::fault(
                            fault::WORKER_DIED,
                            format!("rank {rank}'s worker (pid {}) {} during the call", f.pid, died(f)),
                            true,
                        );
                        if let Some(e) = o.error.as_mut() {
                            e.exit_code = f.exit_code;
                            e.signal = f.signal.map(crate::sys::signal_name);
                        }
                        o
                    }
                    _ if gone => Outcome::fault(
                        fault::ACTOR_GONE,
                        format!("the actor was closed or replaced before rank {rank} finished the call"),
                        phase == Phase::Running,
                    ),
                    _ => Outcome::fault(
                        fault::ACTOR_RESTARTED,
                        format!("rank {rank} was stopped: the actor restarts ({cause})"),
                        phase == Phase::Running,
                    ),
                };
                self.answer(n, rank, &o);
            }
        }
        // Survivors mode: the ready workers' connections are kept for their
        // rejoin (those the attempt did not keep are killed, and leave).
        let workers = std::mem::take(&mut self.workers);
        let mut ready = lock(&self.ready);
        ready.clear();
        self.carried.clear();
        if self.survivors {
            for w in workers.into_values().filter(|w| w.ready) {
                ready.insert(w.pid);
                self.carried.insert(w.pid, w);
            }
        }
        drop(ready);
        self.last = Some((round, std::mem::take(&mut self.ranks)));
        self.round = None;
    }
}

/// How a worker ended, in words.
fn died(f: &Failure) -> String {
    match (f.exit_code, f.signal) {
        (_, Some(s)) => format!("was killed by {}", crate::sys::signal_name(s)),
        (Some(c), None) => format!("exited with code {c}"),
        (None, None) => "hung".into(),
    }
}
