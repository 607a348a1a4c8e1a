//! The control API's side of actors: `/v1/actors/{id}/calls`.
//!
//! | request | answer |
//! |---|---|
//! | `POST /v1/actors/{id}/calls[?wait=S]` | `{"method", "args", "kwargs", "ranks"}` or `{"method", "pickle", "ranks"}`: 200 `{"call", "done": true, "ok", "results"}` when it ended within S seconds (default 30, at most 300), else 202 `{"call", "done": false}` |
//! | `GET /v1/actors/{id}/calls/{n}[?wait=S]` | the same, for call `n` |
//! | `DELETE /v1/actors/{id}/calls/{n}` | 202 `cancelling`: the method's thread gets `trainlet_actor.Cancelled` |
//!
//! Each call is driven by a task of its own: it waits until the actor's
//! workers run in a round (the host's started), publishes the call for that
//! round, and gathers one [`Outcome`] per rank. A call that no rank ran
//! (its round ended first) is published again for the next round; a rank
//! that never answers (its pod was lost) is answered for once the round is
//! over on the host and [`SETTLE`] has passed; an actor that is over
//! answers every rank that did not.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::watch;

use super::intake::{Open, Share, Spec};
use super::{Encoding, Keys, OP_KIND, Op, Outcome, What, fault};
use crate::http::{Request, Status, error_body};
use crate::serve::api::{Answer, BoxFuture, Calls};
use crate::serve::board::{Board, Record};
use crate::serve::spec::shown;
use crate::serve::{Link, Scope};
use crate::store::{Client, ClientError, Dial};

/// Calls of one actor not over at once; one more is answered 503.
const MAX_OPEN: usize = 1024;
/// Calls over whose answers are kept, per actor.
const KEEP_DONE: usize = 1024;
/// Most bytes of answers kept once sent, over every actor: the oldest go
/// first (a driver fetches an answer as soon as it is over).
const KEEP_BYTES: usize = 64 * 1024 * 1024;
/// Time the ranks of a round that ended get to answer for themselves.
pub const SETTLE: Duration = Duration::from_secs(5);

/// What the desk needs of the job.
#[derive(Debug, Clone)]
pub struct Conf {
    /// The agents' store.
    pub dial: Dial,
    /// The job's key prefix.
    pub base: String,
    /// The control token's file.
    pub token_file: PathBuf,
    /// The serving session operations are sealed for.
    pub scope: Scope,
}

/// One call: its answer when over, and where it runs.
#[derive(Debug)]
struct Entry {
    done: watch::Receiver<Option<Arc<String>>>,
    /// The operation and round it runs in now (None until published).
    at: Option<(u64, u64)>,
    cancelled: bool,
    /// Woken by a cancel (the call may be waiting for a round).
    wake: Arc<tokio::sync::Notify>,
    /// Bytes of its answer, once over.
    size: usize,
    /// The cancel operations published for it (one per round it ran in),
    /// removed from the store with its own once it is answered.
    cancels: Vec<(u64, u64)>,
}

#[derive(Debug, Default)]
struct Actor {
    next_call: u64,
    calls: BTreeMap<u64, Entry>,
}

/// The control API's record of actor calls.
#[derive(Debug)]
pub struct Desk {
    conf: Conf,
    board: Arc<Board>,
    actors: Mutex<HashMap<u64, Actor>>,
    /// Operations are numbered and published one at a time.
    publisher: tokio::sync::Mutex<Publisher>,
    /// Store connections not in use (each proved the token once).
    idle: Mutex<Vec<Client>>,
    /// The bytes the calls not over hold.
    open: Open,
}

/// Idle store connections kept.
const KEEP_IDLE: usize = 16;

#[derive(Debug)]
struct Publisher {
    link: Link,
    /// Per actor: the next operation number, and the newest round with an
    /// operation (None before the first).
    next: HashMap<u64, (u64, Option<u64>)>,
}

fn fail(status: Status, message: &str) -> Answer {
    (status, error_body(status, message))
}

impl Desk {
    /// A desk for the control API of `board`.
    pub fn new(conf: Conf, board: Arc<Board>) -> Arc<Self> {
        let link = Link::new(conf.dial.clone(), &conf.base);
        Arc::new(Self {
            conf,
            board,
            actors: Mutex::new(HashMap::new()),
            publisher: tokio::sync::Mutex::new(Publisher { link, next: HashMap::new() }),
            idle: Mutex::new(Vec::new()),
            open: Open::new(),
        })
    }

    /// A store connection: an idle one, or a new one.
    async fn client(&self) -> Result<Client, ClientError> {
        let idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner).pop();
        match idle {
            Some(c) => Ok(c),
            None => self.conf.dial.connect().await,
        }
    }

    /// Keep `c` for the next call (its last request was answered).
    fn put_back(&self, c: Client) {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        if idle.len() < KEEP_IDLE {
            idle.push(c);
        }
    }

    /// `names`' values once all are set, on one connection.
    async fn wait_all(&self, names: &[String]) -> Result<Vec<Vec<u8>>, ClientError> {
        let mut c = self.client().await?;
        let got = async {
            c.wait(names).await?;
            c.multi_get(names).await
        }
        .await;
        match got {
            Ok(v) => {
                self.put_back(c);
                Ok(v)
            }
            // An idle connection can be stale (a replaced store): once more, anew.
            Err(_) => {
                let mut c = self.conf.dial.connect().await?;
                c.wait(names).await?;
                let v = c.multi_get(names).await?;
                self.put_back(c);
                Ok(v)
            }
        }
    }

    fn actors(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Actor>> {
        self.actors.lock().unwrap_or_else(PoisonError::into_inner)
    }

    async fn post(self: &Arc<Self>, run: &Record, req: &Request) -> Answer {
        if run.state.is_final() || run.state == crate::serve::board::State::Stopping {
            return fail(Status::CONFLICT, &format!("actor {} is {}; deploy it again", run.id, run.state.word()));
        }
        // Taken before the body is parsed, from its length (what the call
        // holds until it is over is less: its arguments, method and ranks),
        // and given back when it is over.
        let share = match self.open.take(run.seq, super::intake::held_by(&req.body)) {
            Ok(share) => share,
            Err(why) => return fail(Status::UNAVAILABLE, &why),
        };
        let spec = match super::intake::parse(&req.body) {
            Ok(spec) => spec,
            Err((status, why)) => return fail(status, &why),
        };
        let world = self.board.running(run.seq).map(|(_, nnodes, nproc)| nnodes.saturating_mul(nproc));
        if let (Some(w), Some(bad)) =
            (world, spec.ranks.as_ref().and_then(|r| r.iter().find(|r| **r >= world.unwrap_or(0))))
        {
            return fail(
                Status::BAD,
                &format!("ranks: no rank {bad}: the actor has {w} ranks (0-{})", w.saturating_sub(1)),
            );
        }
        let (tx, rx) = watch::channel(None);
        let id = {
            let mut actors = self.actors();
            let a = actors.entry(run.seq).or_default();
            if a.calls.values().filter(|e| e.done.borrow().is_none()).count() >= MAX_OPEN {
                return fail(Status::UNAVAILABLE, &format!("{MAX_OPEN} calls of this actor are not over; try again"));
            }
            a.next_call += 1;
            let id = a.next_call;
            a.calls.insert(
                id,
                Entry {
                    done: rx.clone(),
                    at: None,
                    cancelled: false,
                    wake: Arc::default(),
                    size: 0,
                    cancels: Vec::new(),
                },
            );
            while a.calls.len() > KEEP_DONE + MAX_OPEN {
                let Some(old) = a.calls.iter().find(|(_, e)| e.done.borrow().is_some()).map(|(k, _)| *k) else { break };
                a.calls.remove(&old);
            }
            id
        };
        tracing::debug!(actor = %run.id, call = id, method = %spec.method, "actor call");
        tokio::spawn(Arc::clone(self).drive(run.seq, id, (spec, share), tx));
        wait_answer(id, rx, super::intake::wait_of(req)).await
    }

    async fn get(&self, run: &Record, n: &str, req: &Request) -> Answer {
        let Some(rx) = n.parse::<u64>().ok().and_then(|n| self.entry(run.seq, n, |e| e.done.clone())) else {
            return fail(
                Status::NOT_FOUND,
                &format!("no call {} of actor {} (or it is no longer kept)", shown(n), run.id),
            );
        };
        wait_answer(n.parse().unwrap_or(0), rx, super::intake::wait_of(req)).await
    }

    async fn cancel(&self, run: &Record, n: &str) -> Answer {
        let Some(id) = n.parse::<u64>().ok() else {
            return fail(Status::NOT_FOUND, &format!("no call {}", shown(n)));
        };
        let Some((over, at, sent)) = self.entry(run.seq, id, |e| {
            e.cancelled = true;
            e.wake.notify_one();
            (e.done.borrow().is_some(), e.at, e.cancels.clone())
        }) else {
            return fail(Status::NOT_FOUND, &format!("no call {id} of actor {}", run.id));
        };
        if over {
            return (Status::OK, serde_json::json!({ "call": id, "state": "over" }).to_string());
        }
        // Asking again once its cancel is published adds nothing to the
        // store (two asked at one moment may both publish; both are removed
        // with the call).
        if let Some((op, round)) = at.filter(|(op, _)| !sent.iter().any(|(c, _)| c == op)) {
            match self.publish(run.seq, round, What::Cancel { call: op }).await {
                Ok(n) => {
                    // Answered meanwhile (or no longer kept): its ops are
                    // gone already, so this one goes now.
                    let kept = self.entry(run.seq, id, |e| {
                        let open = e.done.borrow().is_none();
                        if open {
                            e.cancels.push((op, n));
                        }
                        open
                    });
                    if kept != Some(true) {
                        self.forget(run.seq, n, &[]).await;
                    }
                }
                Err(e) => {
                    let why = format!("cannot cancel call {id}: {}", crate::error::error_chain(&e));
                    return fail(Status::UNAVAILABLE, &why);
                }
            }
        }
        tracing::info!(actor = %run.id, call = id, "cancelling an actor call on request");
        (Status(202, "Accepted"), serde_json::json!({ "call": id, "state": "cancelling" }).to_string())
    }

    fn entry<T>(&self, seq: u64, id: u64, f: impl FnOnce(&mut Entry) -> T) -> Option<T> {
        self.actors().get_mut(&seq).and_then(|a| a.calls.get_mut(&id)).map(f)
    }

    /// Publish an operation for `round`; its number.
    async fn publish(&self, seq: u64, round: u64, what: What) -> Result<u64, super::Error> {
        let token = crate::serve::read_token(&self.conf.token_file).map_err(|e| super::Error::Io {
            what: "cannot read the control token",
            path: self.conf.token_file.display().to_string(),
            source: e,
        })?;
        let keys = Keys::new(&self.conf.base, seq);
        let mut p = self.publisher.lock().await;
        let (n, newest) = p.next.get(&seq).copied().unwrap_or((1, None));
        let op = Op { actor: seq, n, round, what };
        let json = serde_json::to_vec(&op).map_err(|e| super::Error::Corrupt(e.to_string()))?;
        if newest.is_none_or(|r| round > r) {
            p.link.set(&keys.first(round), n.to_string().as_bytes()).await?;
        }
        p.link.set(&keys.op(n), &crate::serve::seal(&token, &self.conf.scope, OP_KIND, n, &json)).await?;
        p.link.set(&keys.ops(), n.to_string().as_bytes()).await?;
        p.next.insert(seq, (n + 1, Some(newest.map_or(round, |r| r.max(round)))));
        Ok(n)
    }

    /// The actor's world in its last round (1 when it never ran).
    fn last_world(&self, seq: u64) -> u32 {
        self.board
            .by_seq(seq)
            .and_then(|r| Some(r.nnodes?.saturating_mul(r.nproc_per_node?)))
            .filter(|w| *w > 0)
            .unwrap_or(1)
    }

    /// Wait until the actor's workers run in a round: (round, world), or
    /// None when the actor is over.
    async fn running(&self, seq: u64) -> Option<(u64, u32)> {
        let mut w = self.board.watch();
        loop {
            if let Some((round, nnodes, nproc)) = self.board.running(seq) {
                return Some((round, nnodes.saturating_mul(nproc)));
            }
            if self
                .board
                .by_seq(seq)
                .is_none_or(|r| r.state.is_final() || r.state == crate::serve::board::State::Stopping)
            {
                return None;
            }
            if w.changed().await.is_err() {
                return None;
            }
        }
    }

    /// Run one call to its answer.
    async fn drive(
        self: Arc<Self>,
        seq: u64,
        id: u64,
        (spec, share): (Spec, Share),
        done: watch::Sender<Option<Arc<String>>>,
    ) {
        let mut last: Vec<(u32, Outcome)> = Vec::new();
        // The operations published, removed from the store once answered.
        let mut spent: Vec<(u64, Vec<u32>)> = Vec::new();
        let answer = loop {
            let Some(wake) = self.entry(seq, id, |e| Arc::clone(&e.wake)) else { break Vec::new() };
            let running = tokio::select! {
                r = self.running(seq) => r,
                // A cancel while the actor has no round: answered at once.
                () = wake.notified() => Some((0, 0)),
            };
            let Some((round, world)) = running else {
                break gone_for(&spec, &last, self.last_world(seq));
            };
            if self.entry(seq, id, |e| e.cancelled).unwrap_or(true) {
                let all = ranks_of(&spec, if world == 0 { self.last_world(seq) } else { world });
                break all
                    .into_iter()
                    .map(|r| (r, Outcome::fault(fault::CANCELLED, "cancelled before it started".into(), false)))
                    .collect();
            }
            let ranks = ranks_of(&spec, world);
            let (valid, invalid): (Vec<u32>, Vec<u32>) = ranks.iter().partition(|r| **r < world);
            if world == 0 {
                continue;
            }
            if !invalid.is_empty() || valid.is_empty() {
                let why = format!("no rank {:?}: the actor has {world} ranks; the call ran nowhere", invalid);
                break ranks.into_iter().map(|r| (r, Outcome::fault("ValueError", why.clone(), false))).collect();
            }
            let what = What::Call {
                method: spec.method.clone(),
                encoding: spec.encoding,
                args: spec.args.clone(),
                ranks: spec.ranks.clone(),
            };
            let n = match self.publish(seq, round, what).await {
                Ok(n) => n,
                Err(e) => {
                    let why = format!("cannot publish the call to the pods: {}", crate::error::error_chain(&e));
                    break valid
                        .into_iter()
                        .map(|r| (r, Outcome::fault(fault::ACTOR_GONE, why.clone(), false)))
                        .collect();
                }
            };
            self.entry(seq, id, |e| e.at = Some((n, round)));
            let got = self.gather(seq, n, round, &valid).await;
            spent.push((n, valid));
            let again = got.iter().all(|(_, o)| o.not_run());
            last = got;
            if !again || self.entry(seq, id, |e| e.cancelled).unwrap_or(true) {
                break std::mem::take(&mut last);
            }
            tracing::debug!(call = id, round, "no rank ran the call before its round ended; publishing it again");
        };
        let text = render(id, &spec, &answer);
        // Over: its arguments no longer count against the open calls' bounds.
        drop(share);
        self.entry(seq, id, |e| e.size = text.len());
        let _ = done.send(Some(Arc::new(text)));
        // After the answer: a cancel published from now on removes its own.
        let cancels = self.entry(seq, id, |e| std::mem::take(&mut e.cancels));
        self.trim();
        let cancels = cancels.unwrap_or_default().into_iter().map(|(_, n)| (n, Vec::new()));
        for (n, ranks) in spent.into_iter().chain(cancels) {
            self.forget(seq, n, &ranks).await;
        }
    }

    /// Every rank's outcome of operation `n` of `round`.
    async fn gather(&self, seq: u64, n: u64, round: u64, ranks: &[u32]) -> Vec<(u32, Outcome)> {
        let keys = Keys::new(&self.conf.base, seq);
        let names: Vec<String> = ranks.iter().map(|r| keys.result(n, *r)).collect();
        let mut w = self.board.watch();
        let waited = self.wait_all(&names);
        tokio::pin!(waited);
        let settle = tokio::time::sleep(Duration::from_secs(86_400));
        tokio::pin!(settle);
        let mut armed = false;
        let values = loop {
            tokio::select! {
                v = &mut waited => break v.ok(),
                () = &mut settle, if armed => break None,
                ch = w.changed() => {
                    let moved = self.board.running(seq).is_none_or(|(r, _, _)| r != round);
                    if (ch.is_err() || moved) && !armed {
                        armed = true;
                        settle.as_mut().reset(tokio::time::Instant::now() + SETTLE);
                    }
                }
            }
        };
        let values = match values {
            Some(v) => v,
            None => {
                let mut link = Link::new(self.conf.dial.clone(), &self.conf.base);
                let mut v = Vec::new();
                for k in &names {
                    v.push(link.get(k).await.unwrap_or_default());
                }
                v
            }
        };
        let over = self.board.by_seq(seq).is_none_or(|r| r.state.is_final());
        ranks
            .iter()
            .zip(values)
            .map(|(r, v)| {
                let o = if v.is_empty() {
                    let (kind, why) = if over {
                        (fault::ACTOR_GONE, format!("the actor ended before rank {r} answered"))
                    } else {
                        (fault::ACTOR_RESTARTED, format!("rank {r} did not answer before round {round} ended (its pod left or was lost); the actor restarts"))
                    };
                    Outcome::fault(kind, why, true)
                } else {
                    serde_json::from_slice(&v).unwrap_or_else(|e| {
                        Outcome::fault(fault::BAD_RESULT, format!("rank {r}'s outcome is not trainlet's: {e}"), true)
                    })
                };
                (*r, o)
            })
            .collect()
    }

    /// Forget the oldest answers over [`KEEP_BYTES`] in all (an actor's
    /// call numbers go on, so that none is reused).
    fn trim(&self) {
        let mut actors = self.actors();
        let mut total: usize = actors.values().flat_map(|a| a.calls.values()).map(|e| e.size).sum();
        let mut seqs: Vec<u64> = actors.keys().copied().collect();
        seqs.sort_unstable();
        for seq in seqs {
            let Some(a) = actors.get_mut(&seq) else { continue };
            while total > KEEP_BYTES {
                let Some(old) = a.calls.iter().find(|(_, e)| e.size > 0).map(|(k, _)| *k) else { break };
                total -= a.calls.remove(&old).map_or(0, |e| e.size);
            }
        }
    }

    /// Remove what call `n` left in the store.
    async fn forget(&self, seq: u64, n: u64, ranks: &[u32]) {
        let keys = Keys::new(&self.conf.base, seq);
        let Ok(mut c) = self.client().await else { return };
        let mut gone = true;
        for key in ranks.iter().map(|r| keys.result(n, *r)).chain([keys.op(n)]) {
            gone = gone && c.delete_key(&key).await.is_ok();
        }
        if gone {
            self.put_back(c);
        }
    }
}

fn ranks_of(spec: &Spec, world: u32) -> Vec<u32> {
    spec.ranks.clone().unwrap_or_else(|| (0..world).collect())
}

/// The answer when the actor is over: what ranks said last, and ActorGone.
fn gone_for(spec: &Spec, last: &[(u32, Outcome)], world: u32) -> Vec<(u32, Outcome)> {
    let gone =
        |r| (r, Outcome::fault(fault::ACTOR_GONE, "the actor is over (closed, replaced or failed)".into(), false));
    if last.is_empty() {
        return ranks_of(spec, world).into_iter().map(gone).collect();
    }
    last.iter().map(|(r, o)| if o.not_run() { gone(*r) } else { (*r, o.clone()) }).collect()
}

/// The JSON answer of a call that is over.
fn render(id: u64, spec: &Spec, outcomes: &[(u32, Outcome)]) -> String {
    let results: Vec<serde_json::Value> = outcomes
        .iter()
        .map(|(rank, o)| match (o.ok, &o.value, &o.error) {
            (true, Some(v), _) if spec.encoding == Encoding::Json => match serde_json::from_str::<serde_json::Value>(v) {
                Ok(value) => serde_json::json!({ "rank": rank, "ok": true, "value": value }),
                Err(e) => {
                    let why = format!("rank {rank}'s result is not JSON ({e}): NaN and Infinity are not; return None or a string, or call with pickle");
                    let bad = Outcome::fault(fault::BAD_RESULT, why, true);
                    serde_json::json!({ "rank": rank, "ok": false, "error": bad.error })
                }
            },
            (true, v, _) => serde_json::json!({ "rank": rank, "ok": true, "pickle": v }),
            (false, _, e) => serde_json::json!({ "rank": rank, "ok": false, "error": e }),
        })
        .collect();
    let ok = !results.is_empty() && results.iter().all(|r| r["ok"] == true);
    serde_json::json!({ "call": id, "done": true, "ok": ok, "results": results }).to_string()
}

async fn wait_answer(id: u64, mut rx: watch::Receiver<Option<Arc<String>>>, wait: Duration) -> Answer {
    let done = tokio::time::timeout(wait, async {
        loop {
            if let Some(a) = rx.borrow_and_update().clone() {
                return Some(a);
            }
            if rx.changed().await.is_err() {
                return rx.borrow().clone();
            }
        }
    })
    .await;
    match done {
        Ok(Some(a)) => (Status::OK, a.as_str().to_string()),
        _ => (Status(202, "Accepted"), serde_json::json!({ "call": id, "done": false }).to_string()),
    }
}

impl Calls for Arc<Desk> {
    fn answer<'a>(&'a self, run: Record, rest: Vec<String>, req: &'a Request) -> BoxFuture<'a, Answer> {
        Box::pin(async move {
            if run.actor.is_none() {
                return fail(Status::NOT_FOUND, &format!("{} is a run, not an actor", run.id));
            }
            match (req.method.as_str(), rest.as_slice()) {
                ("POST", []) => self.post(&run, req).await,
                ("GET", [n]) => self.get(&run, n, req).await,
                ("DELETE", [n]) => self.cancel(&run, n).await,
                _ => fail(Status::METHOD, &format!("{} is not allowed on {}", shown(&req.method), shown(&req.path))),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(encoding: Encoding) -> Spec {
        Spec { method: "m".into(), encoding, args: String::new(), ranks: None }
    }

    #[test]
    fn answers_carry_values_in_rank_order_and_refuse_what_is_not_json() {
        let ok = |v: &str| Outcome { ok: true, value: Some(v.into()), error: None };
        let text = render(7, &spec(Encoding::Json), &[(0, ok("{\"a\": 1}")), (1, ok("NaN"))]);
        let v: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert_eq!(v["call"], 7);
        assert_eq!(v["ok"], false, "one rank's result is not JSON: {v}");
        assert_eq!(v["results"][0], serde_json::json!({"rank": 0, "ok": true, "value": {"a": 1}}));
        assert_eq!(v["results"][1]["error"]["type"], fault::BAD_RESULT, "{v}");
        let text = render(8, &spec(Encoding::Pickle), &[(0, ok("gASVAAAA"))]);
        let v: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert_eq!(
            (v["ok"].clone(), v["results"][0]["pickle"].clone()),
            (serde_json::json!(true), serde_json::json!("gASVAAAA"))
        );
    }

    #[test]
    fn answers_kept_are_bounded_in_bytes_oldest_first() {
        let conf = Conf {
            dial: Dial { addr: ([127, 0, 0, 1], 1).into(), guard: None },
            base: "b".into(),
            token_file: "t".into(),
            scope: Scope { job: "b".into(), session: "s".into() },
        };
        let desk = Desk::new(conf, Arc::new(Board::default()));
        {
            let mut actors = desk.actors();
            let a = actors.entry(1).or_default();
            for id in 1..=5 {
                let (_, rx) = watch::channel(None);
                let size = if id == 5 { 0 } else { KEEP_BYTES / 3 + 1 };
                a.calls.insert(
                    id,
                    Entry { done: rx, at: None, cancelled: false, wake: Arc::default(), size, cancels: Vec::new() },
                );
            }
            a.next_call = 5;
        }
        desk.trim();
        let actors = desk.actors();
        let kept: Vec<u64> = actors[&1].calls.keys().copied().collect();
        assert_eq!(kept, [3, 4, 5], "the two oldest answers went; the call not over stays");
        assert_eq!(actors[&1].next_call, 5, "numbers are not reused");
    }

    #[test]
    fn an_actor_that_is_over_keeps_what_ranks_said_and_answers_the_rest() {
        let ran = Outcome::fault("ValueError", "x".into(), true);
        let not = Outcome::fault(fault::ACTOR_RESTARTED, "y".into(), false);
        let got = gone_for(&spec(Encoding::Json), &[(0, ran.clone()), (1, not)], 2);
        assert_eq!(got[0], (0, ran));
        assert_eq!(got[1].1.error.as_ref().map(|e| e.kind.as_str()), Some(fault::ACTOR_GONE));
        assert_eq!(ranks_of(&spec(Encoding::Json), 3), [0, 1, 2]);
        assert_eq!(gone_for(&spec(Encoding::Json), &[], 3).len(), 3, "every rank of its last world");
    }
}
