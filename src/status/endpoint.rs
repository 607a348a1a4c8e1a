//! The pod's loopback status endpoint: what transformers'
//! `KubeflowCallback` and the Kubeflow SDK's
//! `update_trainjob_status` post to when trainlet gives the workers its
//! address as `KUBEFLOW_TRAINER_SERVER_URL`.
//!
//! Plain HTTP/1.1 on 127.0.0.1 (both clients accept an `http://` URL and
//! then ignore the CA), one request per connection, `POST
//! /ranks/<local rank>/status` with the pod's random bearer token (the file
//! in `KUBEFLOW_TRAINER_SERVER_TOKEN`), so that only this pod's workers can
//! report and each report names its rank. Everything a client sends is
//! bounded: 64 connections at once, an 8 KiB head, a 64 KiB body, 10 s per
//! request; what does not fit is refused with its HTTP status.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::report::parse;
use crate::http::{Limits, Request, Status, read_request, respond, same};

/// Most connections served at once.
const MAX_CONNECTIONS: usize = 64;
/// Longest request head, and longest body (a full 256-metric status is
/// about 40 KiB).
const LIMITS: Limits = Limits { head: 8 * 1024, body: 64 * 1024 };
/// Time a client gets to send its request.
const REQUEST_TIME: Duration = Duration::from_secs(10);
/// Most local ranks whose reports the board keeps (a pod runs at most
/// this many workers, as a served run's `nproc_per_node` is bounded): a
/// report from another rank is refused, so a client holding the token
/// cannot grow the board by inventing ranks.
const MAX_RANKS: usize = 1024;

/// What this pod's workers reported in the current attempt: each local
/// rank's newest status, and when each last reported (the no-progress
/// check reads that). A new attempt starts empty, so a report of a failed
/// attempt never speaks for the next one.
#[derive(Debug, Default)]
pub struct Board {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// The round these reports belong to, and the global rank of local rank 0.
    round: u64,
    first_rank: u32,
    reports: BTreeMap<u32, super::report::Status>,
    /// Bumped by every accepted report and by every new attempt.
    seq: u64,
    last: HashMap<u32, Instant>,
}

/// The board's reports as the relay publishes them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// The round they belong to.
    pub round: u64,
    /// Global rank -> its newest status in that round.
    pub ranks: BTreeMap<u32, super::report::Status>,
    /// Changes whenever the reports do (0: nothing yet).
    pub seq: u64,
}

impl Board {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A report from `local_rank`; false (nothing kept) when the board
    /// already holds [`MAX_RANKS`] other ranks.
    pub fn record(&self, local_rank: u32, status: super::report::Status) -> bool {
        let mut b = self.lock();
        if b.reports.len() >= MAX_RANKS && !b.reports.contains_key(&local_rank) {
            return false;
        }
        super::gauges().reports.inc();
        super::gauges().observe(&status);
        b.reports.insert(local_rank, status);
        b.seq += 1;
        b.last.insert(local_rank, Instant::now());
        true
    }

    /// Changes whenever the reports do (0: nothing yet); cheaper than a
    /// [`Self::snapshot`] when nothing changed.
    pub fn seq(&self) -> u64 {
        self.lock().seq
    }

    /// Every rank's newest status in the current round, by global rank.
    pub fn snapshot(&self) -> Snapshot {
        let b = self.lock();
        let ranks = b.reports.iter().map(|(lr, s)| (b.first_rank.saturating_add(*lr), s.clone())).collect();
        Snapshot { round: b.round, ranks, seq: b.seq }
    }

    /// When `local_rank` last reported in this attempt.
    pub fn last_report(&self, local_rank: u32) -> Option<Instant> {
        self.lock().last.get(&local_rank).copied()
    }

    /// Round `round` starts, this pod's local rank 0 being global rank
    /// `first_rank`: the last round's reports are dropped.
    pub fn begin_round(&self, round: u64, first_rank: u32) {
        let mut b = self.lock();
        (b.round, b.first_rank) = (round, first_rank);
        b.reports.clear();
        b.last.clear();
        b.seq += 1;
    }

    /// A new attempt: no rank has reported in it yet.
    pub fn new_attempt(&self) {
        let mut b = self.lock();
        if !b.reports.is_empty() {
            b.reports.clear();
            b.seq += 1;
        }
        b.last.clear();
    }
}

/// Serve the endpoint on 127.0.0.1 until `cancel`; returns its port.
pub async fn serve(board: Arc<Board>, token: String, cancel: CancellationToken) -> std::io::Result<u16> {
    let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
    let port = listener.local_addr()?.port();
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let token: Arc<str> = token.into();
    tokio::spawn(async move {
        loop {
            let Some((conn, _)) = crate::http::accept(&listener, &cancel, "status endpoint").await else { return };
            // Over the limit, a connection is closed at once.
            let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else { continue };
            let (board, token) = (Arc::clone(&board), Arc::clone(&token));
            tokio::spawn(async move {
                let _slot = slot;
                let mut conn = conn;
                let status = match tokio::time::timeout(REQUEST_TIME, read_request(&mut conn, LIMITS)).await {
                    Ok(Ok(req)) => handle(&board, &token, &req),
                    Ok(Err(status)) => status,
                    Err(_) => Status::TIMEOUT,
                };
                let _ = tokio::time::timeout(REQUEST_TIME, reply(&mut conn, status)).await;
            });
        }
    });
    Ok(port)
}

/// The local rank in `/ranks/<n>/status` (a query string is ignored).
fn rank_of(path: &str) -> Option<u32> {
    let path = path.split('?').next().unwrap_or_default();
    path.strip_prefix("/ranks/")?.strip_suffix("/status")?.parse().ok()
}

fn handle(board: &Board, token: &str, req: &Request) -> Status {
    let Some(rank) = rank_of(&req.path) else { return Status::NOT_FOUND };
    if req.method != "POST" {
        return Status::METHOD;
    }
    if !same(req.bearer().as_bytes(), token.as_bytes()) {
        return Status::UNAUTHORIZED;
    }
    match parse(&req.body) {
        Ok(status) => {
            if board.record(rank, status) {
                Status::OK
            } else {
                tracing::debug!(local_rank = rank, "refused a status report: too many ranks");
                Status::BAD
            }
        }
        Err(why) => {
            tracing::debug!(local_rank = rank, error = %why, "refused a status report");
            Status::BAD
        }
    }
}

async fn reply(conn: &mut TcpStream, status: Status) -> std::io::Result<()> {
    let body = if status == Status::OK { "{}".to_string() } else { format!("{{\"error\": \"{}\"}}", status.1) };
    respond(conn, status, &body).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn send(port: u16, raw: &[u8]) -> String {
        let mut c = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
        c.write_all(raw).await.expect("write");
        let mut out = String::new();
        c.read_to_string(&mut out).await.expect("read");
        out
    }

    fn post(path: &str, token: &str, body: &str) -> Vec<u8> {
        format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .into_bytes()
    }

    #[test]
    fn the_board_keeps_at_most_max_ranks_ranks() {
        let board = Board::default();
        let ranks = u32::try_from(MAX_RANKS).expect("fits");
        for r in 0..ranks {
            assert!(board.record(r, super::super::report::Status::default()), "rank {r}");
        }
        assert!(!board.record(ranks, super::super::report::Status::default()), "one rank too many");
        assert!(board.record(0, super::super::report::Status::default()), "a known rank still reports");
        assert_eq!(board.snapshot().ranks.len(), MAX_RANKS);
    }

    #[tokio::test]
    async fn reports_are_taken_from_this_pods_workers_only() {
        let board = Arc::new(Board::default());
        let cancel = CancellationToken::new();
        let port = serve(Arc::clone(&board), "s3cret".into(), cancel.clone()).await.expect("serve");
        let ok = r#"{"trainerStatus": {"progressPercentage": 30}}"#;
        assert!(send(port, &post("/ranks/1/status", "s3cret", ok)).await.starts_with("HTTP/1.1 200"));
        assert_eq!(board.snapshot().ranks.get(&1).and_then(|s| s.progress), Some(30));
        assert!(board.last_report(1).is_some() && board.last_report(0).is_none());
        for (raw, code) in [
            (post("/ranks/1/status", "wrong", ok), "401"),
            (post("/ranks/x/status", "s3cret", ok), "404"),
            (post("/ranks/1/status", "s3cret", "{"), "400"),
            (b"GET /ranks/1/status HTTP/1.1\r\n\r\n".to_vec(), "405"),
            (b"POST /ranks/1/status HTTP/1.1\r\nAuthorization: Bearer s3cret\r\n\r\n".to_vec(), "411"),
            (b"POST /ranks/1/status HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n".to_vec(), "413"),
            ([b"POST /ranks/1/status HTTP/1.1\r\nX: ".as_slice(), &[b'a'; 9000], b"\r\n\r\n"].concat(), "431"),
        ] {
            let got = send(port, &raw).await;
            assert!(got.starts_with(&format!("HTTP/1.1 {code}")), "{code}: {got}");
        }
        assert_eq!(board.snapshot().seq, 1, "only the good report counted");
        board.new_attempt();
        assert!(board.last_report(1).is_none());
        assert!(board.snapshot().ranks.is_empty(), "a new attempt drops the last one's reports");
        cancel.cancel();
    }
}
