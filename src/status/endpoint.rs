//! The pod's loopback status endpoint: what transformers'
//! `KubeflowTrainerCallback` and the Kubeflow SDK's
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

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::report::{Status, parse};

/// Most connections served at once.
const MAX_CONNECTIONS: usize = 64;
/// Longest request head.
const MAX_HEAD: usize = 8 * 1024;
/// Longest body (a full 256-metric status is about 40 KiB).
const MAX_BODY: usize = 64 * 1024;
/// Time a client gets to send its request.
const REQUEST_TIME: Duration = Duration::from_secs(10);

/// What this pod's workers reported: the newest status and when each
/// local rank last reported (the no-progress check reads that).
#[derive(Debug, Default)]
pub struct Board {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    latest: Option<Status>,
    /// Bumped by every accepted report.
    seq: u64,
    last: HashMap<u32, Instant>,
}

impl Board {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A report from `local_rank`.
    pub fn record(&self, local_rank: u32, status: Status) {
        let mut b = self.lock();
        b.latest = Some(status);
        b.seq += 1;
        b.last.insert(local_rank, Instant::now());
        super::gauges().reports.inc();
        if let Some(s) = &b.latest {
            super::gauges().observe(s);
        }
    }

    /// The newest status and its sequence number (0: none yet).
    pub fn latest(&self) -> (Option<Status>, u64) {
        let b = self.lock();
        (b.latest.clone(), b.seq)
    }

    /// When `local_rank` last reported in this attempt.
    pub fn last_report(&self, local_rank: u32) -> Option<Instant> {
        self.lock().last.get(&local_rank).copied()
    }

    /// A new attempt: no rank has reported in it yet.
    pub fn new_attempt(&self) {
        self.lock().last.clear();
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
            let (conn, _) = tokio::select! {
                () = cancel.cancelled() => return,
                accepted = listener.accept() => match accepted {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::debug!(error = %e, "status endpoint accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            // Over the limit, a connection is closed at once.
            let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else { continue };
            let (board, token) = (Arc::clone(&board), Arc::clone(&token));
            tokio::spawn(async move {
                let _slot = slot;
                let mut conn = conn;
                let reply = match tokio::time::timeout(REQUEST_TIME, request(&mut conn)).await {
                    Ok(Ok(req)) => handle(&board, &token, &req),
                    Ok(Err(status)) => status,
                    Err(_) => Reply::TIMEOUT,
                };
                let _ = tokio::time::timeout(REQUEST_TIME, respond(&mut conn, reply)).await;
            });
        }
    });
    Ok(port)
}

/// An HTTP status line and a short JSON body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Reply(u16, &'static str);

impl Reply {
    const OK: Reply = Reply(200, "OK");
    const BAD: Reply = Reply(400, "Bad Request");
    const UNAUTHORIZED: Reply = Reply(401, "Unauthorized");
    const NOT_FOUND: Reply = Reply(404, "Not Found");
    const METHOD: Reply = Reply(405, "Method Not Allowed");
    const TIMEOUT: Reply = Reply(408, "Request Timeout");
    const LENGTH: Reply = Reply(411, "Length Required");
    const TOO_LARGE: Reply = Reply(413, "Content Too Large");
    const HEAD_TOO_LARGE: Reply = Reply(431, "Request Header Fields Too Large");
}

/// A request as far as the endpoint reads it.
#[derive(Debug, Default)]
struct Request {
    method: String,
    path: String,
    authorization: Option<String>,
    body: Vec<u8>,
}

/// Read one request: the head, then `Content-Length` bytes of body.
async fn request(conn: &mut TcpStream) -> Result<Request, Reply> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if buf.len() > MAX_HEAD {
            return Err(Reply::HEAD_TOO_LARGE);
        }
        match conn.read(&mut chunk).await {
            Ok(0) | Err(_) => return Err(Reply::BAD),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    if head_end > MAX_HEAD {
        return Err(Reply::HEAD_TOO_LARGE);
    }
    let head = std::str::from_utf8(&buf[..head_end]).map_err(|_| Reply::BAD)?;
    let mut lines = head.split("\r\n");
    let mut first = lines.next().unwrap_or_default().split(' ');
    let mut req = Request {
        method: first.next().unwrap_or_default().to_string(),
        path: first.next().unwrap_or_default().to_string(),
        ..Request::default()
    };
    let mut length = None;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else { continue };
        let value = value.trim();
        match name.trim().to_ascii_lowercase().as_str() {
            "content-length" => length = Some(value.parse::<usize>().map_err(|_| Reply::BAD)?),
            "authorization" => req.authorization = Some(value.to_string()),
            "transfer-encoding" => return Err(Reply::LENGTH),
            _ => {}
        }
    }
    if req.method != "POST" {
        return Ok(req);
    }
    let length = length.ok_or(Reply::LENGTH)?;
    if length > MAX_BODY {
        return Err(Reply::TOO_LARGE);
    }
    req.body = buf[head_end..].to_vec();
    while req.body.len() < length {
        match conn.read(&mut chunk).await {
            Ok(0) | Err(_) => return Err(Reply::BAD),
            Ok(n) => req.body.extend_from_slice(&chunk[..n]),
        }
    }
    req.body.truncate(length);
    Ok(req)
}

/// The local rank in `/ranks/<n>/status` (a query string is ignored).
fn rank_of(path: &str) -> Option<u32> {
    let path = path.split('?').next().unwrap_or_default();
    path.strip_prefix("/ranks/")?.strip_suffix("/status")?.parse().ok()
}

/// Equal without an early exit on the first differing byte.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn handle(board: &Board, token: &str, req: &Request) -> Reply {
    let Some(rank) = rank_of(&req.path) else { return Reply::NOT_FOUND };
    if req.method != "POST" {
        return Reply::METHOD;
    }
    let given = req.authorization.as_deref().and_then(|a| a.strip_prefix("Bearer ")).unwrap_or_default();
    if !same(given.trim().as_bytes(), token.as_bytes()) {
        return Reply::UNAUTHORIZED;
    }
    match parse(&req.body) {
        Ok(status) => {
            board.record(rank, status);
            Reply::OK
        }
        Err(why) => {
            tracing::debug!(local_rank = rank, error = %why, "refused a status report");
            Reply::BAD
        }
    }
}

async fn respond(conn: &mut TcpStream, Reply(code, reason): Reply) -> std::io::Result<()> {
    let body = if code == 200 { "{}".to_string() } else { format!("{{\"error\": \"{reason}\"}}") };
    let text = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(text.as_bytes()).await?;
    conn.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[tokio::test]
    async fn reports_are_taken_from_this_pods_workers_only() {
        let board = Arc::new(Board::default());
        let cancel = CancellationToken::new();
        let port = serve(Arc::clone(&board), "s3cret".into(), cancel.clone()).await.expect("serve");
        let ok = r#"{"trainerStatus": {"progressPercentage": 30}}"#;
        assert!(send(port, &post("/ranks/1/status", "s3cret", ok)).await.starts_with("HTTP/1.1 200"));
        assert_eq!(board.latest().0.and_then(|s| s.progress), Some(30));
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
        assert_eq!(board.latest().1, 1, "only the good report counted");
        board.new_attempt();
        assert!(board.last_report(1).is_none());
        cancel.cancel();
    }
}
