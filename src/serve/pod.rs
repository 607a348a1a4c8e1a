//! Serve mode inside the round loop: at the start of each round, the run
//! the pods run (a published run that is not over: its files unpacked,
//! its lines shipped) or an idle wait for one that ends like a round with
//! no workers (a pod died or joined: regroup; the store went: reconnect;
//! a stop signal: exit; the idle timeout: every pod exits 0). On the
//! store host it also starts the control API and tells its board what
//! the rounds decided.

use std::path::PathBuf;
use std::sync::Arc;

use tokio::sync::mpsc::UnboundedReceiver;

use crate::config::{Plan, Serve};
use crate::process::signals::{Heard, SysEvent};
use crate::process::spawn::Spawner;
use crate::rendezvous::{Round, Session};
use crate::serve::actor::bridge::Bridge;
use crate::serve::board::{Board, RankExit, State, World};
use crate::serve::lane::relay::{self, Note};
use crate::serve::logs::Shipper;
use crate::serve::setup::{Applied, Dirs, Step};
use crate::serve::spec::Run;
use crate::serve::{Go, Link, Scope, wait_go, wait_key};
use crate::store::Dial;
use crate::supervise::carry::Carry;
use crate::supervise::output::LineTap;
use crate::supervise::policy::Outcome;
use crate::supervise::report::{Failure, Report};
use crate::sys;

mod actors;
mod begin;
mod setup;
mod start;
pub(crate) use actors::kept_until;
pub(crate) use start::token_file;

/// How often a pod looks for the real run after a forged go signal.
const POLL_FORGED: std::time::Duration = std::time::Duration::from_millis(500);

/// What a round does in serve mode.
#[derive(Debug)]
pub(crate) enum Work {
    /// Run the current run.
    Run,
    /// The idle round ended this way.
    Idle(Outcome),
    /// The control API ended the job: exit 0.
    Shutdown,
}

/// The run this pod is running.
struct Current {
    run: Run,
    dir: Option<PathBuf>,
    unstartable: Option<String>,
    shipper: Shipper,
    /// Its workers' bridge, when it is an actor.
    bridge: Option<Bridge>,
    /// This pod applied the run's setup steps: its workers can start. Not
    /// yet when a round's end cut a step short: begun again next round.
    ready: bool,
}

/// This pod's part of serve mode.
pub(crate) struct Served {
    conf: Serve,
    base: String,
    link: Link,
    dial: Dial,
    /// The serving session this pod follows (None until published).
    scope: Option<Scope>,
    board: Option<Arc<Board>>,
    current: Option<Current>,
    /// The newest run this pod saw end.
    ended: u64,
    /// The go signal this pod waits for next.
    next_go: u64,
    /// The control token (checked on every run).
    token_file: PathBuf,
    /// A forged run or signal was refused (logged once).
    refusing: bool,
    /// Starts the setup steps' processes.
    spawner: Spawner,
    /// The setup steps this pod applied for the current run.
    steps: Vec<Step>,
    /// What this agent applied, and the manifest of what the steps left.
    applied: Applied,
    /// The run that was not over when this pod's idle round ended (its
    /// workers may have ended the round elsewhere): the round is judged
    /// by its restarts, as the pods that ran it judge it.
    judged: Option<Run>,
    /// Wakes the measure of the cache's use (a round ended).
    cache_poke: Arc<tokio::sync::Notify>,
    /// This is a lane agent: it serves that lane's run, then exits.
    lane: Option<crate::config::Lane>,
    /// A lane agent's notes to the store host's board.
    relay: Option<relay::Sender>,
    /// The pod's lane agents (the pod's own agent).
    lanes: Option<crate::serve::lane::agents::Agents>,
}

impl std::fmt::Debug for Served {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Served").field("run", &self.current.as_ref().map(|c| &c.run.id)).finish()
    }
}

impl Served {
    /// Log a refusal of something in the store once, until a valid run is seen.
    fn refuse(&mut self, what: &str, why: &str) {
        if !std::mem::replace(&mut self.refusing, true) {
            tracing::error!(reason = %why, "refused {what} in the store: not this job's control API's in this session");
        }
    }

    /// What round `round` does: run the current run, or wait for one.
    pub async fn work(
        &mut self,
        (session, round): (&Session, &Round),
        events: &mut UnboundedReceiver<SysEvent>,
        carry: &mut Carry,
        plan: &Plan,
    ) -> Work {
        if self.board.is_some() {
            let pods = self.pods(round.number).await;
            if let Some(b) = &self.board {
                b.set_world(World { round: round.number, nnodes: round.nnodes, pods });
            }
        }
        self.judged = None;
        // The go signal that last woke this pod.
        let mut fired = None;
        loop {
            let token = match crate::serve::read_token(&self.token_file) {
                Ok(t) => t,
                Err(e) => {
                    tracing::error!(file = %self.token_file.display(), error = %e, "cannot read the control token; no run is taken until it is back");
                    String::new()
                }
            };
            let scope = match self.link.scope(&token).await {
                Ok(Some(Ok(scope))) => Some(scope),
                Ok(Some(Err(why))) => {
                    self.refuse("the serving session", &why);
                    None
                }
                Ok(None) => None,
                Err(e) => {
                    tracing::error!(error = %crate::error::error_chain(&e), "cannot read the serving session from the store");
                    return Work::Idle(Outcome::Lost);
                }
            };
            if scope.is_some() && scope != self.scope {
                if self.scope.is_some() {
                    tracing::warn!(
                        "a new serving session (the store host was replaced): runs are numbered from 1 again"
                    );
                }
                self.scope.clone_from(&scope);
                self.ended = 0;
                self.next_go = 1;
                self.current = None;
            }
            let newest = match &scope {
                None => None,
                Some(sc) => match self.link.newest(&token, sc).await {
                    Ok(Some(Ok(run))) => Some(run),
                    Ok(Some(Err(why))) => {
                        self.refuse("the run", &why);
                        None
                    }
                    Ok(None) => None,
                    Err(e) => {
                        tracing::error!(error = %crate::error::error_chain(&e), "cannot read the served run from the store");
                        return Work::Idle(Outcome::Lost);
                    }
                },
            };
            if let Some(r) = &newest {
                self.next_go = self.next_go.max(r.seq + 1);
                self.refusing = false;
            }
            if let (Some(run), Some(sc)) = (newest.filter(|r| r.seq > self.ended), &scope) {
                match self.link.ended(&token, sc, run.seq, &run.id).await {
                    Ok(Some(Ok(_))) => self.over(run.seq, State::Stopped, Vec::new(), None),
                    Err(_) => return Work::Idle(Outcome::Lost),
                    unended => {
                        if let Ok(Some(Err(why))) = unended {
                            // A marker that is not the control API's does not end a run.
                            self.refuse("an end marker", &why);
                        }
                        if self.current.as_ref().is_none_or(|c| c.run.seq != run.seq || !c.ready)
                            && let Some(stopped) = self.begin(run, plan, carry, (events, session, round)).await
                        {
                            return stopped;
                        }
                        return Work::Run;
                    }
                }
            }
            self.current = None;
            if let Some(l) = &self.lane {
                tracing::info!(run = l.seq, "the lane's run is over; its agent exits");
                return Work::Shutdown;
            }
            tracing::info!(
                round = round.number,
                nnodes = round.nnodes,
                "serving: waiting for a run from the control API"
            );
            if let Some(w) = self.wait_idle((session, round), events, plan, (scope, token), &mut fired).await {
                if matches!(w, Work::Idle(Outcome::Regroup)) {
                    self.judged = self.unended().await;
                }
                return w;
            }
        }
    }

    /// Wait, idle, for the next go signal of `scope` (or its publication),
    /// the round's end or a stop signal; None when a go signal came (look
    /// for its run), else what the round does. `fired`: the go signal that
    /// last woke this pod.
    async fn wait_idle(
        &mut self,
        (session, round): (&Session, &Round),
        events: &mut UnboundedReceiver<SysEvent>,
        plan: &Plan,
        (scope, token): (Option<Scope>, String),
        fired: &mut Option<u64>,
    ) -> Option<Work> {
        // A go signal with no valid run behind it (forged in the store):
        // poll for the real one instead of waiting on the same key.
        let poll = *fired == Some(self.next_go);
        let (dial, keys, seq) = (self.dial.clone(), self.link.keys.clone(), self.next_go);
        let go = async move {
            if poll {
                tokio::time::sleep(POLL_FORGED).await;
                return Ok(Go::Run);
            }
            match scope {
                Some(sc) => wait_go(&dial, &keys, seq, &token, &sc).await,
                // Not published yet (the store host is starting serve mode).
                None => wait_key(&dial, &keys.session()).await.map(|_| Go::Run),
            }
        };
        let end = session.watch_end(round.number);
        tokio::pin!(go, end);
        loop {
            tokio::select! {
                g = &mut go => break match g {
                    Ok(Go::Run) => {
                        *fired = Some(seq);
                        None
                    }
                    // Run `seq` is a lane's: the main run's next is later.
                    Ok(Go::Lane) => {
                        self.next_go = self.next_go.max(seq + 1);
                        None
                    }
                    Ok(Go::Forged) => {
                        self.refuse("a go signal", "not `run`, and not a shutdown sealed for this job, session and run");
                        *fired = Some(seq);
                        None
                    }
                    Ok(Go::Shutdown) => Some(Work::Shutdown),
                    Err(e) => {
                        tracing::error!(error = %crate::error::error_chain(&e), "lost the store while waiting for a run");
                        Some(Work::Idle(Outcome::Lost))
                    }
                },
                ended = &mut end => {
                    let Some(ended) = ended else {
                        tracing::info!(round = round.number, "the store was lost in an idle round");
                        break Some(Work::Idle(Outcome::Lost));
                    };
                    tracing::info!(round = round.number, end = %ended, "the idle round ended");
                    break Some(Work::Idle(Outcome::Regroup));
                }
                ev = events.recv() => match Heard::of(ev, &plan.stop_signals) {
                    Heard::Stop { signal, asked } => {
                        if !asked {
                            tracing::warn!(signal = %sys::signal_name(signal), "stop signal while serving; exiting");
                        }
                        break Some(Work::Idle(Outcome::Stopped(signal)));
                    }
                    Heard::Exited { pid, exit, .. } => tracing::debug!(pid, %exit, "reaped orphan"),
                    Heard::Other(_) => {}
                },
            }
        }
    }

    /// The newest run, when it is not over (None when it cannot be read).
    async fn unended(&mut self) -> Option<Run> {
        let token = crate::serve::read_token(&self.token_file).ok()?;
        let scope = self.scope.clone()?;
        let run = self.link.newest(&token, &scope).await.ok()??.ok()?;
        let over = matches!(self.link.ended(&token, &scope, run.seq, &run.id).await, Ok(Some(Ok(_))));
        (run.seq > self.ended && !over).then_some(run)
    }

    /// Pods of round `r` by group rank, from its members record.
    async fn pods(&mut self, r: u64) -> Vec<String> {
        let keys = crate::keys::JobKeys::under(&self.base).round_keys(r);
        let roster = self.link.get(&keys.members()).await.unwrap_or_default();
        let Ok(c) = self.link.client().await else { return Vec::new() };
        let members = super::bounded(crate::rendezvous::read_members(c, &keys, &roster)).await.unwrap_or_default();
        members.into_iter().map(|m| m.host).collect()
    }

    /// The plan of the current run: its command, variables, directory,
    /// workers per pod and restarts over the pod's own plan.
    pub fn plan_for(&self, base: &Plan) -> Plan {
        let mut p = base.clone();
        let Some(c) = &self.current else { return p };
        let (mut program, args) =
            c.run.command.split_first().map_or((String::new(), Vec::new()), |(p, a)| (p.clone(), a.to_vec()));
        p.entry.script = args.first().cloned().unwrap_or_else(|| program.clone());
        // `python` is the pod's interpreter (--python, TRAINLET_PYTHON, PATH).
        if let (true, Some(py)) = (matches!(program.as_str(), "python" | "python3"), &base.entry.python) {
            program.clone_from(py);
        }
        p.entry.program = program;
        p.entry.args = args;
        p.entry.cwd.clone_from(&c.dir);
        // The setup's variables first: the run's own win.
        let (path, pythonpath) =
            (std::env::var("PATH").unwrap_or_default(), std::env::var("PYTHONPATH").unwrap_or_default());
        p.entry.env = Dirs::new(&self.conf.dir).env(&self.steps, &path, &pythonpath);
        p.entry.env.extend(c.run.env.iter().cloned());
        if let Some(b) = &c.bridge {
            let runtime = self.runtime().display().to_string();
            p.entry.program = base.entry.python.clone().unwrap_or_else(|| "python3".into());
            p.entry.args = vec![runtime.clone()];
            p.entry.script = runtime;
            p.entry.env.push((crate::env::TRAINLET_ACTOR_SOCKET.into(), b.socket().display().to_string()));
        }
        p.entry.env.push((crate::env::TRAINLET_CACHE_DIR.into(), self.cache_dir().display().to_string()));
        // Lines reach the control API as they are printed.
        if !p.entry.env.iter().any(|(k, _)| k == "PYTHONUNBUFFERED") {
            p.entry.env.push(("PYTHONUNBUFFERED".into(), "1".into()));
        }
        if self.lane.is_none() {
            // The run's slots' GPUs (a lane agent's plan has its slots' already).
            p.gpu.gpus = crate::config::slots_gpus(&base.gpu.gpus, c.run.first_slot, c.run.nproc.unwrap_or(base.nproc));
            // From slot 0 it sees every GPU, as a run alone always did.
            p.gpu.narrowed = c.run.first_slot > 0 && p.gpu.gpus.len() < base.gpu.gpus.len();
        }
        // A run that names its GPUs (CUDA_VISIBLE_DEVICES in its env)
        // gets those, shared with whoever else uses them: asked for.
        if c.run.env.iter().any(|(k, _)| k == crate::env::CUDA_VISIBLE_DEVICES) {
            p.gpu.narrowed = false;
        }
        if let Some(n) = c.run.nproc {
            p.nproc = n;
            p.omp_default = (n > 1 && std::env::var_os(crate::env::OMP_NUM_THREADS).is_none()).then(|| "1".into());
        }
        p.max_restarts = c.run.max_restarts;
        p.run_id = format!("{}-{}", base.run_id, c.run.id);
        p
    }

    /// The job-wide restarts before the current run.
    pub fn base_restarts(&self) -> u32 {
        self.run().map_or(0, |r| r.base_restarts)
    }

    /// The run this pod's round is judged by: the current one, or after an
    /// idle round the one that was not over.
    fn run(&self) -> Option<&Run> {
        self.current.as_ref().map(|c| &c.run).or(self.judged.as_ref())
    }

    /// The plan an idle round is judged by: the pod's, with the restarts
    /// and workers per pod of the run that was not over (if any).
    pub fn idle_plan(&self, base: &Plan) -> Plan {
        let mut p = base.clone();
        if let Some(r) = self.run() {
            p.max_restarts = r.max_restarts;
            p.nproc = r.nproc.unwrap_or(p.nproc);
        }
        p
    }

    /// Where the current run's lines go.
    pub fn tap(&self) -> Option<LineTap> {
        self.current.as_ref().map(|c| c.shipper.tap())
    }

    /// Why the current run's workers cannot start here.
    pub fn unstartable(&self) -> Option<&str> {
        self.current.as_ref().and_then(|c| c.unstartable.as_deref())
    }

    /// This pod's workers of the current run start in `round`.
    pub fn started(&self, round: &Round, restarts: u32, nproc: u32) {
        let Some(c) = &self.current else { return };
        if let Some(b) = &c.bridge {
            let first = round.group_rank * nproc;
            b.round_started(round.number, (first..first + nproc).collect());
        }
        if let Some(b) = &self.board {
            b.started(c.run.seq, round.number, restarts, round.nnodes, nproc);
        }
        self.note(Note::Started { seq: c.run.seq, round: round.number, restarts, nnodes: round.nnodes, nproc });
    }

    /// The current run's `round` is over on every pod (`failures`: the
    /// workers that died on their own; `why`: how it ended).
    pub fn round_over(&self, round: u64, failures: &[Failure], why: &str, stopped: bool) {
        self.cache_poke.notify_one();
        let Some(c) = &self.current else { return };
        if let Some(b) = &self.board {
            b.round_over(c.run.seq);
        }
        self.note(Note::RoundOver { seq: c.run.seq });
        if let Some(b) = &c.bridge {
            b.round_over(round, failures, why, stopped);
        }
    }

    /// The pod-local directory runs and actors keep their downloads in
    /// (`TRAINLET_CACHE_DIR`), until the serving job ends: the pod's, in
    /// a lane too.
    pub fn cache_dir(&self) -> PathBuf {
        self.lane.as_ref().map_or(&self.conf.dir, |l| &l.main_dir).join("cache")
    }

    /// Tell the store host's board (a lane agent on the store host's pod).
    fn note(&self, note: Note) {
        if let (Some(r), Some(l)) = (&self.relay, &self.lane)
            && l.report
        {
            r.send(note);
        }
    }

    /// The job is leaving this pod: its lane agents begin to stop.
    pub fn leaving(&self) {
        if let Some(lanes) = &self.lanes {
            lanes.begin_stop();
        }
    }

    /// The job leaves this pod: the pod's lane agents stop; a lane
    /// agent's last notes go out.
    pub async fn finish(&mut self) {
        if let Some(lanes) = self.lanes.take() {
            lanes.stop().await;
        }
        if let Some(relay) = self.relay.take() {
            relay.close().await;
        }
    }

    /// Ship every line of the current run so far.
    pub async fn flush(&self) {
        if let Some(c) = &self.current {
            c.shipper.flush().await;
        }
    }

    /// The current run is over everywhere: mark it in the store (every pod
    /// does, so none starts it again) and on the host's board.
    pub async fn run_over(&mut self, state: State, world: u32, failures: &[Failure], report: Option<&Report>) {
        let Some(c) = &self.current else { return };
        let seq = c.run.seq;
        let marked = match (crate::serve::read_token(&self.token_file), &self.scope) {
            (Ok(token), Some(scope)) => {
                let id = c.run.id.clone();
                self.link
                    .set_ended(&token, scope, seq, &id, state.word())
                    .await
                    .map(|_| ())
                    .map_err(|e| crate::error::error_chain(&e))
            }
            (Err(e), _) => Err(format!("cannot read the control token: {e}")),
            (_, None) => Err("no serving session".into()),
        };
        if let Err(e) = marked {
            tracing::warn!(error = %e, "cannot mark the run over in the store");
        } else if self.board.is_some() && self.lane.is_none() && (1..seq).contains(&self.ended) {
            self.forget_markers(self.ended).await;
        }
        let Some(c) = &self.current else { return };
        let ranks = (0..world)
            .map(|rank| match failures.iter().rev().find(|f| f.rank == rank) {
                Some(f) if state == State::Failed => {
                    RankExit { rank, exit_code: f.exit_code, signal: f.signal.map(sys::signal_name), state: "failed" }
                }
                _ if state == State::Succeeded => {
                    RankExit { rank, exit_code: Some(0), signal: None, state: "succeeded" }
                }
                _ => RankExit { rank, exit_code: None, signal: None, state: "stopped" },
            })
            .collect();
        let report = report.and_then(|r| serde_json::to_value(r).ok());
        tracing::info!(run = %c.run.id, state = state.word(), "served run over; the pods stay up for the next");
        self.over(seq, state, ranks, report);
    }

    /// The store host, once a later main run is over: main run `seq`'s
    /// go signal and end marker go, so that the store does not grow by two
    /// keys a run. Nobody reads them any more: every pod reads the newest
    /// run (`serve/run`, a later one) and its end marker, and waits for a
    /// later go signal. A lane's markers are its own (its agents read
    /// them until they exit), and are left alone.
    async fn forget_markers(&mut self, seq: u64) {
        for key in [self.link.keys.go(seq), self.link.keys.ended(seq)] {
            if let Err(e) = self.link.delete(&key).await {
                tracing::warn!(run = seq, error = %crate::error::error_chain(&e), "cannot delete an earlier run's markers");
                return;
            }
        }
    }

    fn over(&mut self, seq: u64, state: State, ranks: Vec<RankExit>, report: Option<serde_json::Value>) {
        let ranks_sent = ranks.iter().map(relay::Rank::from).collect();
        self.note(Note::Ended { seq, state: state.word().into(), ranks: ranks_sent, report: report.clone() });
        if let Some(b) = &self.board {
            b.ended(seq, state, ranks, report);
        }
        self.ended = self.ended.max(seq);
        self.current = None;
    }
}
