//! The small HTTP/1.1 server side trainlet's two endpoints share (the
//! workers' status endpoint, the serve mode's control API): read one
//! request with every part a client sends bounded, compare bearer tokens
//! in constant time, and write a reply.
//!
//! One request per connection (`Connection: close`); no chunked request
//! bodies (411: a length is required); a head or body over its limit is
//! refused with its status before more is read.
//!
//! A server that authorizes requests reads the head alone first
//! ([`read_head`], or [`admit`], which also answers the refusals), and the
//! body ([`read_body`]) only once the head is let through: a client
//! without the token never gets a body buffered. Connections still to show
//! a token are bounded by a [`Lobby`] that evicts its oldest, so that idle
//! or slow clients cannot hold every place; [`closed`] tells a server that
//! streams a reply when its client has hung up. This module holds no
//! policy of its own: deadlines, limits and the token check are the
//! caller's.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

/// What a request may grow to.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Request line and headers.
    pub head: usize,
    /// Body (`Content-Length`).
    pub body: usize,
}

/// An HTTP status: code and reason phrase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Status(pub u16, pub &'static str);

impl Status {
    /// 200.
    pub const OK: Status = Status(200, "OK");
    /// 201.
    pub const CREATED: Status = Status(201, "Created");
    /// 400.
    pub const BAD: Status = Status(400, "Bad Request");
    /// 401.
    pub const UNAUTHORIZED: Status = Status(401, "Unauthorized");
    /// 404.
    pub const NOT_FOUND: Status = Status(404, "Not Found");
    /// 405.
    pub const METHOD: Status = Status(405, "Method Not Allowed");
    /// 408.
    pub const TIMEOUT: Status = Status(408, "Request Timeout");
    /// 409.
    pub const CONFLICT: Status = Status(409, "Conflict");
    /// 411.
    pub const LENGTH: Status = Status(411, "Length Required");
    /// 413.
    pub const TOO_LARGE: Status = Status(413, "Content Too Large");
    /// 415.
    pub const MEDIA: Status = Status(415, "Unsupported Media Type");
    /// 431.
    pub const HEAD_TOO_LARGE: Status = Status(431, "Request Header Fields Too Large");
    /// 503.
    pub const UNAVAILABLE: Status = Status(503, "Service Unavailable");
}

/// A request as far as trainlet reads it.
#[derive(Debug, Default)]
pub struct Request {
    /// `GET`, `POST`, ...
    pub method: String,
    /// The path, without the query.
    pub path: String,
    /// The query string (after `?`), possibly empty.
    pub query: String,
    /// Headers, names lower-cased.
    pub headers: Vec<(String, String)>,
    /// The body (`Content-Length` bytes).
    pub body: Vec<u8>,
}

impl Request {
    /// The first header called `name` (lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    /// The `Authorization: Bearer` token, or "".
    pub fn bearer(&self) -> &str {
        self.header("authorization").and_then(|a| a.strip_prefix("Bearer ")).map_or("", str::trim)
    }

    /// Does the query have `name=value` (or `name` alone when `value` is "")?
    pub fn query_has(&self, name: &str, value: &str) -> bool {
        self.query.split('&').any(|kv| match kv.split_once('=') {
            Some((k, v)) => k == name && v == value,
            None => kv == name && value.is_empty(),
        })
    }
}

/// Read one request: the head, then `Content-Length` bytes of body.
pub async fn read_request<C: AsyncRead + Unpin>(conn: &mut C, limits: Limits) -> Result<Request, Status> {
    let mut req = read_head(conn, limits).await?;
    read_body(conn, &mut req, limits).await?;
    Ok(req)
}

/// Read a request's head (request line and headers), and nothing of its
/// body but what came in the same read as the head's end (under 8 KiB,
/// kept in `body` for [`read_body`]). Nothing about the body is judged
/// here: a caller can authorize from the head before it reads or refuses
/// a body.
pub async fn read_head<C: AsyncRead + Unpin>(conn: &mut C, limits: Limits) -> Result<Request, Status> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 8192];
    let mut scanned = 0;
    let head_end = loop {
        // Only what is new (and the 3 bytes before it) is searched: a head
        // trickled a byte at a time costs its length, not its square.
        if let Some(i) = buf[scanned..].windows(4).position(|w| w == b"\r\n\r\n") {
            break scanned + i + 4;
        }
        scanned = buf.len().saturating_sub(3);
        if buf.len() > limits.head {
            return Err(Status::HEAD_TOO_LARGE);
        }
        match conn.read(&mut chunk).await {
            Ok(0) | Err(_) => return Err(Status::BAD),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    if head_end > limits.head {
        return Err(Status::HEAD_TOO_LARGE);
    }
    let head = std::str::from_utf8(&buf[..head_end]).map_err(|_| Status::BAD)?;
    let mut lines = head.split("\r\n");
    let mut first = lines.next().unwrap_or_default().split(' ');
    let method = first.next().unwrap_or_default().to_string();
    let target = first.next().unwrap_or_default();
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let mut req = Request { method, path: path.to_string(), query: query.to_string(), ..Request::default() };
    for line in lines {
        let Some((name, value)) = line.split_once(':') else { continue };
        req.headers.push((name.trim().to_ascii_lowercase(), value.trim().to_string()));
    }
    req.body = buf.split_off(head_end);
    Ok(req)
}

/// Read the body of a request whose head [`read_head`] read: its
/// `Content-Length` bytes (required for POST and PUT, at most
/// `limits.body`; chunked bodies are refused).
pub async fn read_body<C: AsyncRead + Unpin>(conn: &mut C, req: &mut Request, limits: Limits) -> Result<(), Status> {
    if req.header("transfer-encoding").is_some() {
        return Err(Status::LENGTH);
    }
    let length = match req.header("content-length") {
        Some(n) => n.parse::<usize>().map_err(|_| Status::BAD)?,
        None if req.method == "POST" || req.method == "PUT" => return Err(Status::LENGTH),
        None => 0,
    };
    if length > limits.body {
        return Err(Status::TOO_LARGE);
    }
    req.body.reserve(length.saturating_sub(req.body.len()));
    let mut chunk = [0u8; 8192];
    while req.body.len() < length {
        match conn.read(&mut chunk).await {
            Ok(0) | Err(_) => return Err(Status::BAD),
            Ok(n) => req.body.extend_from_slice(&chunk[..n]),
        }
    }
    req.body.truncate(length);
    Ok(())
}

/// Read a request's head within `deadline` and let it through only when
/// `authorized` says so from the head alone; anything else is answered
/// here (408, 400, 431, 401) and None returned, the connection to be
/// closed. A refused client's body is never read into memory: after the
/// refusal (but a 408) whatever it still sends is dropped for up to
/// [`LINGER`], so that a client busy sending its body sees the 401 rather
/// than a reset.
pub async fn admit<C: AsyncRead + AsyncWrite + Unpin>(
    conn: &mut C,
    limits: Limits,
    deadline: std::time::Duration,
    authorized: impl FnOnce(&Request) -> bool,
) -> Option<Request> {
    let (status, message) = match tokio::time::timeout(deadline, read_head(conn, limits)).await {
        Ok(Ok(req)) => {
            if authorized(&req) {
                return Some(req);
            }
            (Status::UNAUTHORIZED, "missing or wrong bearer token")
        }
        Ok(Err(status)) => (status, "malformed or oversized request head"),
        Err(_) => (Status::TIMEOUT, "request head not sent in time"),
    };
    let refuse = async {
        // A client past the deadline has had its time: no lingering.
        if respond(conn, status, &error_body(status, message)).await.is_ok() && status != Status::TIMEOUT {
            closed(conn).await;
        }
    };
    let _ = tokio::time::timeout(LINGER, refuse).await;
    None
}

/// How long a refused connection's reply may take to go out, and what the
/// client still sends is dropped after it.
pub const LINGER: std::time::Duration = std::time::Duration::from_secs(5);

/// Returns once the peer has closed its side (EOF) or the connection
/// failed (a reset); whatever it sends until then is dropped.
pub async fn closed<R: AsyncRead + Unpin>(conn: &mut R) {
    let mut sink = [0u8; 4096];
    while let Ok(1..) = conn.read(&mut sink).await {}
}

pub use crate::lobby::{Lobby, Ticket};

/// The next connection of `listener` and its peer, or None once `cancel` fires. An
/// accept error (EMFILE, a connection reset before it was taken) is logged
/// at debug level for `what` and retried after a pause.
pub async fn accept(
    listener: &tokio::net::TcpListener,
    cancel: &CancellationToken,
    what: &str,
) -> Option<(tokio::net::TcpStream, std::net::SocketAddr)> {
    loop {
        tokio::select! {
            () = cancel.cancelled() => return None,
            accepted = listener.accept() => match accepted {
                Ok(conn) => return Some(conn),
                Err(e) => {
                    tracing::debug!(error = %e, "{what} accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            },
        }
    }
}

/// Equal without an early exit on the first differing byte.
pub fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Write a complete reply with a JSON body and close.
pub async fn respond<C: AsyncWrite + Unpin>(
    conn: &mut C,
    Status(code, reason): Status,
    body: &str,
) -> std::io::Result<()> {
    let text = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(text.as_bytes()).await?;
    conn.shutdown().await
}

/// A JSON error body: `{"error": "<reason>", "message": "..."}`.
pub fn error_body(status: Status, message: &str) -> String {
    serde_json::json!({ "error": status.1, "message": message }).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn read(raw: &[u8], limits: Limits) -> Result<Request, Status> {
        let mut r = raw;
        read_request(&mut r, limits).await
    }

    #[tokio::test]
    async fn requests_are_read_within_their_limits() {
        let l = Limits { head: 256, body: 16 };
        let r = read(
            b"POST /v1/runs?follow=true&x HTTP/1.1\r\nAuthorization: Bearer  t0k \r\nContent-Length: 4\r\n\r\nbody",
            l,
        )
        .await
        .expect("ok");
        assert_eq!((r.method.as_str(), r.path.as_str(), r.body.as_slice()), ("POST", "/v1/runs", b"body".as_slice()));
        assert!(r.query_has("follow", "true") && r.query_has("x", "") && !r.query_has("follow", "false"));
        assert_eq!(r.bearer(), "t0k");
        let g = read(b"GET / HTTP/1.1\r\n\r\n", l).await.expect("get");
        assert_eq!((g.bearer(), g.body.len()), ("", 0));
        for (raw, want) in [
            (b"POST / HTTP/1.1\r\n\r\n".to_vec(), Status::LENGTH),
            (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec(), Status::LENGTH),
            (b"POST / HTTP/1.1\r\nContent-Length: 17\r\n\r\n".to_vec(), Status::TOO_LARGE),
            (b"POST / HTTP/1.1\r\nContent-Length: x\r\n\r\n".to_vec(), Status::BAD),
            (b"POST / HTTP/1.1\r\nContent-Length: 9\r\n\r\nshort".to_vec(), Status::BAD),
            ([b"GET / HTTP/1.1\r\nX: ".as_slice(), &[b'a'; 300], b"\r\n\r\n"].concat(), Status::HEAD_TOO_LARGE),
        ] {
            assert_eq!(read(&raw, l).await.expect_err("refused"), want);
        }
        assert!(same(b"abc", b"abc") && !same(b"abc", b"abd") && !same(b"abc", b"ab"));
    }

    #[tokio::test]
    async fn a_head_is_read_without_judging_its_body() {
        let l = Limits { head: 256, body: 16 };
        let mut raw: &[u8] = b"POST / HTTP/1.1\r\nContent-Length: 99\r\nTransfer-Encoding: chunked\r\n\r\nab";
        let mut r = read_head(&mut raw, l).await.expect("a head");
        assert_eq!(r.body, b"ab", "what came with the head is kept for the body");
        assert_eq!(read_body(&mut raw, &mut r, l).await, Err(Status::LENGTH), "judged when the body is read");
        let mut raw: &[u8] = b"POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\nab";
        let mut r = read_head(&mut raw, l).await.expect("a head");
        let mut rest: &[u8] = b"cdefg";
        read_body(&mut rest, &mut r, l).await.expect("the body");
        assert_eq!(r.body, b"abcde");
    }

    /// A client, and what `admit` made of its request.
    async fn admit_from(sent: &'static [u8], token: &'static str) -> (Option<Request>, String) {
        let (mut client, mut server) = tokio::io::duplex(64 * 1024);
        let door = tokio::spawn(async move {
            let limits = Limits { head: 256, body: 1 << 20 };
            // As the control API's: an empty token admits nobody.
            let authorized = |r: &Request| !token.is_empty() && same(r.bearer().as_bytes(), token.as_bytes());
            admit(&mut server, limits, std::time::Duration::from_secs(10), authorized).await
        });
        client.write_all(sent).await.expect("write");
        let mut reply = Vec::new();
        // An admitted request gets no reply here: only the refused ones are closed.
        let _ = tokio::time::timeout(std::time::Duration::from_secs(20), client.read_to_end(&mut reply)).await;
        drop(client);
        (door.await.expect("admit"), String::from_utf8_lossy(&reply).to_string())
    }

    #[tokio::test(start_paused = true)]
    async fn only_a_head_with_the_token_is_let_through() {
        let (req, reply) =
            admit_from(b"POST /v1/runs HTTP/1.1\r\nAuthorization: Bearer t\r\nContent-Length: 9\r\n\r\n{", "t").await;
        let req = req.expect("admitted");
        assert_eq!((req.path.as_str(), req.body.as_slice(), reply.as_str()), ("/v1/runs", b"{".as_slice(), ""));
        for (sent, token, status) in [
            // The body is not waited for: refused from the head.
            (b"POST / HTTP/1.1\r\nContent-Length: 999999\r\n\r\nxx".as_slice(), "t", "401"),
            (b"POST / HTTP/1.1\r\nAuthorization: Bearer u\r\nTransfer-Encoding: chunked\r\n\r\n", "t", "401"),
            (b"GET / HTTP/1.1\r\nAuthorization: Bearer \r\n\r\n", "", "401"),
            // A head that never ends is cut off at the deadline.
            (b"GET / HTTP/1.1\r\nAuthorization: Bearer t\r\n", "t", "408"),
            (&[b'a'; 300], "t", "431"),
        ] {
            let (req, reply) = admit_from(sent, token).await;
            assert!(req.is_none() && reply.starts_with(&format!("HTTP/1.1 {status} ")), "{sent:?}: {reply}");
        }
    }
}
