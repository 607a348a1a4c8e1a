//! The control API on the store host: HTTP/1.1 + JSON, every endpoint
//! behind the bearer token (its file re-read per request, compared in
//! constant time; an empty or unreadable file admits nobody).
//!
//! | request | answer |
//! |---|---|
//! | `POST /v1/runs` | 201 `{"id", "seq", "state"}`; 409 while a run is not over (unless `"replace": true`); the files base64 in the JSON, or a tar(.gz) body with the JSON in `X-Trainlet-Run` |
//! | `POST /v1/actors` | as a run, with `"actor": {"target", "args", "kwargs"}` and no command (`crate::serve::actor`); beside the main run in a lane of its own when its workers fit in the pods' free slots (`super::lane`), else 409 naming what holds them |
//! | `GET /v1/runs` | every kept run |
//! | `GET /v1/runs/{id}` | its state, per-rank exits, failure report, timings |
//! | `GET /v1/runs/{id}/logs[?follow=true]` | every rank's prefixed lines, chunked; with follow, until the run is over |
//! | `DELETE /v1/runs/{id}` | 202 `stopping` (checkpoint signal and grace, as for preemption), or 200 when it is over |
//! | `GET /v1/status` | the world, the runs, and each pod's cache use ([`super::cache`]) |
//! | `GET`, `DELETE /v1/actors/{id}`, `.../logs` | as for runs |
//! | `/v1/actors/{id}/calls[/{n}]` | answered by [`Calls`] (`crate::serve::actor::calls`) |
//! | `POST /v1/setup`, `GET /v1/setup` | record or show the setup steps every pod applies ([`super::setup`]) |
//!
//! A bad request gets a 4xx whose JSON `message` names what was wrong, and
//! changes nothing.
//!
//! # Bounds
//!
//! What a client without the token can make trainlet hold is small and
//! cannot crowd out one with it:
//!
//! - The token is checked from the head (16 KiB at most, complete within
//!   10 s of the accept) before its body is read: a request without it is
//!   answered 401 and closed, its body never buffered (what it still sends
//!   is dropped for up to 5 s, so that it sees the 401 rather than a reset).
//! - Connections that have not shown the token wait in a lobby of 256
//!   shared by source ([`crate::lobby`]): a flood from one address only
//!   evicts its own connections, never a slow client from another.
//! - With the token, 64 requests at once, and 64 log followers apart: one
//!   more of either is answered 503, so followers never take a request's
//!   place. A body is bounded before it is read ([`super::intake`]): by
//!   its endpoint's limit (72 MiB for a run's files, 8 MiB for a call or a
//!   setup, 64 KiB else; 413 past it), sent within 30 s, and by what all
//!   bodies held at once may take together (256 MiB; 503 past it). A
//!   follower watches its read side and ends as soon as its client hangs
//!   up (EOF or reset), though the run be silent; any reply chunk the
//!   client does not take within 30 s ends its connection.

use round::stop::{Op, StopRun};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use super::board::{Board, Record, State};
use super::lane::host::Lanes;
use super::spec::shown;
use super::{Link, Scope, intake, kind, logs};
use crate::http::{Limits, Lobby, Request, Status, Ticket, admit, error_body, respond, same};
use crate::store::Dial;

pub use super::make_token;

mod submit;

/// Connections the kernel queues before they are accepted.
const BACKLOG: u32 = 1024;
/// Connections that have not yet shown the token (their head is not all
/// in); a new one evicts the oldest.
const MAX_WAITING: usize = 256;
/// Requests with the token being read or answered at once, log followers
/// apart; one more is answered 503.
const MAX_REQUESTS: usize = 64;
/// Log followers (`?follow=true`) at once; one more is answered 503.
const MAX_FOLLOWERS: usize = 64;
/// A request's head (its body's limit is its endpoint's, [`intake::limit`]).
const LIMITS: Limits = Limits { head: intake::HEAD, body: 0 };
/// Time from a connection's accept to the end of its request's head
/// (where the token is): an idle or trickling client is cut off after it.
const HEAD_TIME: Duration = Duration::from_secs(10);
/// Time a client with the token gets to send its body, or to take one
/// chunk of a reply.
const REQUEST_TIME: Duration = Duration::from_secs(30);
/// How often a log follower looks for new lines.
const FOLLOW_EVERY: Duration = Duration::from_millis(100);
/// How often the idle timeout is checked.
const IDLE_CHECK: Duration = Duration::from_millis(500);
/// Runs whose lines stay in the store (older ones are removed once over).
pub const KEEP_LOGS: u64 = 4;

/// What the control API needs to know of the job.
#[derive(Debug, Clone)]
pub struct Conf {
    /// Where to listen.
    pub listen: SocketAddr,
    /// The bearer token's file.
    pub token_file: PathBuf,
    /// The agents' store (loopback) and its token.
    pub dial: Dial,
    /// The job's key prefix.
    pub base: String,
    /// The serving session everything is sealed for.
    pub scope: Scope,
    /// A run's restarts when it does not say.
    pub max_restarts: u32,
    /// How long a stop may take on every pod (grace, kill timeout, margin).
    pub stop_limit: Duration,
    /// Exit 0 after this long without a run or a request.
    pub idle_timeout: Option<Duration>,
    /// Actor calls, when actors are served.
    pub calls: Option<std::sync::Arc<dyn Calls>>,
    /// Worker slots of every pod (its workers per pod).
    pub pod_nproc: u32,
    /// The lanes actors beside the main run take (None: none are opened).
    pub lanes: Option<Arc<Lanes>>,
}

struct Api {
    conf: Conf,
    board: Arc<Board>,
    link: tokio::sync::Mutex<Link>,
    /// One submission or stop at a time.
    submit: Arc<tokio::sync::Mutex<()>>,
}

/// A finished answer: status and JSON body.
pub type Answer = (Status, String);

/// A future an answer comes from.
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// What answers `/v1/actors/{id}/calls[/...]` (the actors' layer, above
/// this one): `run` is the actor's record, `rest` the path after `calls`.
pub trait Calls: Send + Sync + std::fmt::Debug {
    /// The answer to `req`.
    fn answer<'a>(&'a self, run: Record, rest: Vec<String>, req: &'a Request) -> BoxFuture<'a, Answer>;
}

fn fail(status: Status, message: &str) -> Answer {
    (status, error_body(status, message))
}

/// Where a connection stands: waiting to show the token, or holding one of
/// the places for requests or for log followers.
struct Slots {
    lobby: Arc<Lobby>,
    requests: Semaphore,
    followers: Semaphore,
    bodies: intake::Bodies,
}

/// Bind the control API and serve it until `cancel`; the bound address.
pub async fn serve(conf: Conf, board: Arc<Board>, cancel: CancellationToken) -> std::io::Result<SocketAddr> {
    let sock = if conf.listen.is_ipv6() { TcpSocket::new_v6()? } else { TcpSocket::new_v4()? };
    sock.set_reuseaddr(true)?;
    sock.bind(conf.listen)?;
    // Deeper than the default 128: a burst of connections waits here
    // rather than have its SYNs dropped (the client would retry after 1 s).
    let listener = sock.listen(BACKLOG)?;
    let addr = listener.local_addr()?;
    let slots = Arc::new(Slots {
        lobby: Lobby::new(MAX_WAITING),
        requests: Semaphore::new(MAX_REQUESTS),
        followers: Semaphore::new(MAX_FOLLOWERS),
        bodies: intake::Bodies::default(),
    });
    let link = tokio::sync::Mutex::new(Link::new(conf.dial.clone(), &conf.base));
    let api = Arc::new(Api { conf, board, link, submit: Arc::new(tokio::sync::Mutex::new(())) });
    if let Some(lanes) = &api.conf.lanes {
        let c = &api.conf;
        let place = (c.dial.clone(), c.base.clone(), c.token_file.clone(), c.scope.clone());
        let (board, submit) = (Arc::clone(&api.board), Arc::clone(&api.submit));
        tokio::spawn(super::lane::host::keep(Arc::clone(lanes), board, place, submit, cancel.child_token()));
    }
    if let Some(limit) = api.conf.idle_timeout {
        tokio::spawn(idle_watch(Arc::clone(&api), limit, cancel.child_token()));
    }
    tokio::spawn(async move {
        loop {
            let Some((conn, peer)) = crate::http::accept(&listener, &cancel, "control API").await else { return };
            // Every connection is taken; the lobby bounds those without
            // the token, evicting the oldest of the source holding most.
            let ticket = slots.lobby.enter(peer.ip());
            let (api, slots) = (Arc::clone(&api), Arc::clone(&slots));
            let stop = cancel.child_token();
            tokio::spawn(async move {
                tokio::select! {
                    () = stop.cancelled() => {}
                    () = connection(&api, &slots, conn, ticket) => {}
                }
            });
        }
    });
    Ok(addr)
}

/// Whether `req` asks for the status, however its path is spelled
/// (`/v1/status/`, `//v1/status`): the same parse as the routes below.
fn is_status(req: &Request) -> bool {
    req.method == "GET" && req.path.trim_matches('/').split('/').eq(["v1", "status"])
}

/// One request: its head within [`HEAD_TIME`] and authorized before
/// anything else (in the lobby until then), then a place among the
/// requests or the followers, then its body and the answer.
async fn connection(api: &Api, slots: &Slots, mut conn: TcpStream, ticket: Ticket) {
    let admitted = tokio::select! {
        // A head that is in wins over an eviction at the same moment.
        biased;
        req = admit(&mut conn, LIMITS, HEAD_TIME, |req| authorized(&api.conf.token_file, req)) => req,
        () = ticket.evicted() => {
            // Reset, not closed: an evicted connection leaves no
            // TIME_WAIT behind.
            let _ = conn.set_zero_linger();
            return;
        }
    };
    drop(ticket);
    let Some(mut req) = admitted else { return };
    // Status is not use: a monitor or a driver's `ls` polling it does not
    // keep idle pods up.
    if !is_status(&req) {
        api.board.touch();
    }
    let follow = req.query_has("follow", "true") || req.query_has("follow", "1");
    let follower = follow && req.method == "GET" && req.path.ends_with("/logs");
    let (places, what) = if follower { (&slots.followers, "log followers") } else { (&slots.requests, "requests") };
    let Ok(_place) = places.try_acquire() else {
        let message = format!("too many {what} at once; try again");
        let _ = tokio::time::timeout(
            REQUEST_TIME,
            respond(&mut conn, Status::UNAVAILABLE, &error_body(Status::UNAVAILABLE, &message)),
        )
        .await;
        return;
    };
    // Held until the answer is sent: the body lives as long as the request.
    let _body = match intake::read(&mut conn, &mut req, &slots.bodies, REQUEST_TIME).await {
        Ok(held) => held,
        // Its place kept while what it still sends is dropped.
        Err((status, message)) => return intake::refuse(&mut conn, status, &message).await,
    };
    let parts: Vec<&str> = req.path.trim_matches('/').split('/').collect();
    let (status, body) = match (req.method.as_str(), parts.as_slice()) {
        (_, ["v1", "actors", id, "calls", rest @ ..]) => match (api.board.get(id), &api.conf.calls) {
            (Some(r), Some(calls)) if rest.len() <= 1 => {
                calls.answer(r, rest.iter().map(|s| (*s).to_string()).collect(), &req).await
            }
            (Some(_), Some(_)) => fail(Status::NOT_FOUND, &format!("no endpoint {}", shown(&req.path))),
            (_, None) => fail(Status::NOT_FOUND, "this control API serves no actors"),
            (None, _) => fail(Status::NOT_FOUND, &format!("no actor {}", shown(id))),
        },
        ("GET", ["v1", "runs" | "actors", id, "logs"]) => match api.board.get(id) {
            Some(r) if r.logs_forgotten => fail(
                Status(410, "Gone"),
                &format!(
                    "the lines of {} are no longer kept (only those of the last {KEEP_LOGS} runs, and of runs not over)",
                    r.id
                ),
            ),
            Some(r) => {
                let _ = stream_logs(api, &mut conn, &r.id, r.seq, follow).await;
                return;
            }
            None => fail(Status::NOT_FOUND, &format!("no run {}", shown(id))),
        },
        ("POST", ["v1", "runs"]) => submit::submit(api, &req, false, &slots.bodies).await,
        ("POST", ["v1", "actors"]) => submit::submit(api, &req, true, &slots.bodies).await,
        ("GET", ["v1", "runs"]) => (Status::OK, serde_json::json!({ "runs": api.board.list() }).to_string()),
        ("GET", ["v1", "runs" | "actors", id]) => match api.board.get(id) {
            Some(r) => (Status::OK, serde_json::to_string(&r).unwrap_or_default()),
            None => fail(Status::NOT_FOUND, &format!("no run {}", shown(id))),
        },
        ("DELETE", ["v1", "runs" | "actors", id]) => delete(api, id).await,
        ("GET", ["v1", "status"]) => status(api),
        ("GET", ["v1", "stacks"]) => stacks(api).await,
        ("POST", ["v1", "setup"]) => declare_setup(api, &req).await,
        ("GET", ["v1", "setup"]) => show_setup(api).await,
        (
            _,
            ["v1", "runs" | "actors"]
            | ["v1", "runs" | "actors", _]
            | ["v1", "runs" | "actors", _, "logs"]
            | ["v1", "status"],
        ) => fail(Status::METHOD, &format!("{} is not allowed on {}", shown(&req.method), shown(&req.path))),
        _ => fail(Status::NOT_FOUND, &format!("no endpoint {}", shown(&req.path))),
    };
    let _ = tokio::time::timeout(REQUEST_TIME, respond(&mut conn, status, &body)).await;
}

/// The token file's content, trimmed; nobody is admitted when it is
/// empty or cannot be read.
fn authorized(file: &std::path::Path, req: &Request) -> bool {
    match super::read_token(file) {
        Ok(t) => same(req.bearer().as_bytes(), t.as_bytes()),
        Err(e) => {
            tracing::warn!(file = %file.display(), error = %e, "cannot read the control API's token file; refusing every request");
            false
        }
    }
}

fn status(api: &Api) -> Answer {
    let runs: Vec<_> = api
        .board
        .list()
        .into_iter()
        .map(|r| serde_json::json!({ "id": r.id, "seq": r.seq, "state": r.state }))
        .collect();
    let body = serde_json::json!({
        "world": api.board.world(),
        "active": api.board.active().map(|(_, id, _)| id),
        "accepting_runs": !api.board.is_shut(),
        "idle_timeout_seconds": api.conf.idle_timeout.map(|d| d.as_secs_f64()),
        "idle_seconds": api.board.idle_for().map(|d| d.as_secs_f64()),
        "runs": runs,
        "cache": api.board.cache(),
    });
    (Status::OK, body.to_string())
}

/// Every rank's stacks now, from every pod, and who waits for whom.
async fn stacks(api: &Api) -> Answer {
    let pods = api.board.world().nnodes.max(1);
    let mut link = Link::new(api.conf.dial.clone(), &api.conf.base);
    match super::stacks_on_demand::gather(&mut link, pods).await {
        Ok(v) => (Status::OK, v.to_string()),
        Err(why) => fail(Status::UNAVAILABLE, &why),
    }
}

/// Record the setup steps every pod applies before its next run or actor.
async fn declare_setup(api: &Api, req: &Request) -> Answer {
    let _one = api.submit.lock().await;
    let mut link = api.link.lock().await;
    match super::setup::declare(&mut link, &api.conf.token_file, &api.conf.scope, &req.body).await {
        Ok(n) => (Status::OK, serde_json::json!({ "steps": n }).to_string()),
        Err((true, why)) => fail(Status::BAD, &why),
        Err((false, why)) => fail(Status::UNAVAILABLE, &why),
    }
}

/// The setup steps declared.
async fn show_setup(api: &Api) -> Answer {
    match super::setup::declared(&mut *api.link.lock().await, &api.conf.token_file, &api.conf.scope).await {
        Ok(steps) => (Status::OK, serde_json::json!({ "steps": steps }).to_string()),
        Err(why) => fail(Status::UNAVAILABLE, &why),
    }
}

/// Mark run `seq` over in the store and end the round it runs in.
async fn stop(api: &Api, seq: u64) -> Result<(), super::Error> {
    let Some(id) = api.board.list().into_iter().find(|r| r.seq == seq).map(|r| r.id) else { return Ok(()) };
    let token = super::read_token(&api.conf.token_file).map_err(|e| super::Error::Io {
        what: "cannot read the control token",
        path: api.conf.token_file.display().to_string(),
        source: e,
    })?;
    if !api.board.stopping(seq) {
        return Ok(());
    }
    // The rounds it runs in: the main run's, or its lane's.
    let base = match (&api.conf.lanes, api.board.by_seq(seq).is_some_and(|r| r.lane)) {
        (Some(lanes), true) => lanes.base(seq),
        _ => api.conf.base.clone(),
    };
    let mut link = api.link.lock().await;
    let keys = crate::keys::JobKeys::under(&base);
    // The protocol's order (`round::stop`): the round, then the marker,
    // then the round's end when this stop marked the run first.
    let mut s = StopRun::new();
    loop {
        match s.next() {
            Op::ReadRound => s.read(
                std::str::from_utf8(&link.get(&keys.round()).await?)
                    .ok()
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .unwrap_or(0),
            ),
            Op::Mark => s.marked(link.set_ended(&token, &api.conf.scope, seq, &id, State::Stopped.word()).await?),
            Op::EndRound(round) => {
                let stop = crate::supervise::round_end::RoundEnd::Stop(seq).to_string();
                link.compare_set(&keys.round_keys(round).end(), b"", stop.as_bytes()).await?;
                tracing::info!(run = seq, round, "stopping a run on request");
                s.ended();
            }
            // Over already (an earlier stop, or its end): the current round
            // may run the next run, which a `stop:` of this one must not end.
            Op::Done => return Ok(()),
        }
    }
}

/// Wait until run `seq` is over, for at most `limit`.
async fn wait_over(board: &Board, seq: u64, limit: Duration) -> bool {
    let mut w = board.watch();
    let over = || board.active().is_none_or(|(s, _, _)| s != seq);
    tokio::time::timeout(limit, async {
        while !over() {
            if w.changed().await.is_err() {
                return;
            }
        }
    })
    .await
    .is_ok()
        && over()
}

async fn delete(api: &Api, id: &str) -> Answer {
    let Some(r) = api.board.get(id) else { return fail(Status::NOT_FOUND, &format!("no run {}", shown(id))) };
    if r.state.is_final() {
        return (Status::OK, serde_json::json!({ "id": r.id, "state": r.state }).to_string());
    }
    let _one = api.submit.lock().await;
    match stop(api, r.seq).await {
        Ok(()) => (Status(202, "Accepted"), serde_json::json!({ "id": r.id, "state": State::Stopping }).to_string()),
        Err(e) => fail(Status::UNAVAILABLE, &format!("cannot stop run {}: {}", r.id, crate::error::error_chain(&e))),
    }
}

/// Every rank's lines of run `seq`, chunked; with `follow`, until it is
/// over, or until the client hangs up: a follower of a silent run writes
/// nothing for minutes, so it watches its read side (EOF or reset) rather
/// than learn of a closed client at its next write.
async fn stream_logs(api: &Api, conn: &mut TcpStream, id: &str, seq: u64, follow: bool) -> std::io::Result<()> {
    let (mut from, mut to) = conn.split();
    let hung_up = async {
        if follow {
            crate::http::closed(&mut from).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        sent = send_logs(api, &mut to, id, seq, follow) => sent,
        () = hung_up => Err(std::io::ErrorKind::ConnectionAborted.into()),
    }
}

async fn send_logs<W: AsyncWrite + Unpin>(
    api: &Api,
    conn: &mut W,
    id: &str,
    seq: u64,
    follow: bool,
) -> std::io::Result<()> {
    let head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n";
    tokio::time::timeout(REQUEST_TIME, conn.write_all(head))
        .await
        .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))?;
    // A connection of its own: a follower never waits behind a submission.
    let mut link = Link::new(api.conf.dial.clone(), &api.conf.base);
    let mut reader = logs::Reader::new(seq);
    let mut over = !follow;
    loop {
        let data = match reader.read(&mut link).await {
            Ok(d) => d,
            Err(e) => {
                let line = format!(
                    "[trainlet] cannot read the run's lines from the store: {}\n",
                    crate::error::error_chain(&e)
                );
                chunk(conn, line.as_bytes()).await?;
                break;
            }
        };
        if !data.is_empty() {
            chunk(conn, &data).await?;
            continue;
        }
        if over {
            break;
        }
        // Lines are in the store before a run is marked over: read once more.
        over = api.board.get(id).is_none_or(|r| r.state.is_final());
        if !over {
            tokio::time::sleep(FOLLOW_EVERY).await;
        }
    }
    let end = async {
        conn.write_all(b"0\r\n\r\n").await?;
        conn.shutdown().await
    };
    tokio::time::timeout(REQUEST_TIME, end).await.unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
}

/// One chunk of a chunked reply; a client that stops reading for
/// [`REQUEST_TIME`] loses its connection (it holds one of the places).
async fn chunk<W: AsyncWrite + Unpin>(conn: &mut W, data: &[u8]) -> std::io::Result<()> {
    let write = async {
        conn.write_all(format!("{:x}\r\n", data.len()).as_bytes()).await?;
        conn.write_all(data).await?;
        conn.write_all(b"\r\n").await
    };
    tokio::time::timeout(REQUEST_TIME, write).await.unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
}

/// End the job (every pod exits 0) after `limit` without a run or a request.
async fn idle_watch(api: Arc<Api>, limit: Duration, cancel: CancellationToken) {
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(IDLE_CHECK) => {}
        }
        let _one = api.submit.lock().await;
        if !api.board.idle_past(limit) || api.board.is_shut() {
            continue;
        }
        api.board.shut();
        let seq = api.board.next_seq();
        tracing::info!(
            idle_timeout_s = limit.as_secs_f64(),
            "no run and no request for --serve-idle-timeout; the pods exit"
        );
        let mut link = api.link.lock().await;
        let key = link.keys.go(seq);
        let word = match super::read_token(&api.conf.token_file) {
            Ok(token) => super::seal(&token, &api.conf.scope, kind::SHUTDOWN, seq, b"shutdown"),
            Err(e) => {
                tracing::error!(error = %e, "cannot read the control token to sign the shutdown");
                continue;
            }
        };
        if let Err(e) = link.set(&key, &word).await {
            tracing::error!(error = %crate::error::error_chain(&e), "cannot tell the pods to exit");
        }
        return;
    }
}
