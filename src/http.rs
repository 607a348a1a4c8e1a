//! The small HTTP/1.1 server side trainlet's two endpoints share (the
//! workers' status endpoint, the serve mode's control API): read one
//! request with every part a client sends bounded, compare bearer tokens
//! in constant time, and write a reply.
//!
//! One request per connection (`Connection: close`); no chunked request
//! bodies (411: a length is required); a head or body over its limit is
//! refused with its status before more is read.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

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
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
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
    let mut length = None;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else { continue };
        let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
        match name.as_str() {
            "content-length" => length = Some(value.parse::<usize>().map_err(|_| Status::BAD)?),
            "transfer-encoding" => return Err(Status::LENGTH),
            _ => {}
        }
        req.headers.push((name, value.to_string()));
    }
    let length = match length {
        Some(n) => n,
        None if req.method == "POST" || req.method == "PUT" => return Err(Status::LENGTH),
        None => 0,
    };
    if length > limits.body {
        return Err(Status::TOO_LARGE);
    }
    req.body = buf[head_end..].to_vec();
    req.body.reserve(length.saturating_sub(req.body.len()));
    while req.body.len() < length {
        match conn.read(&mut chunk).await {
            Ok(0) | Err(_) => return Err(Status::BAD),
            Ok(n) => req.body.extend_from_slice(&chunk[..n]),
        }
    }
    req.body.truncate(length);
    Ok(req)
}

/// The next connection of `listener`, or None once `cancel` fires. An
/// accept error (EMFILE, a connection reset before it was taken) is logged
/// at debug level for `what` and retried after a pause.
pub async fn accept(
    listener: &tokio::net::TcpListener,
    cancel: &tokio_util::sync::CancellationToken,
    what: &str,
) -> Option<tokio::net::TcpStream> {
    loop {
        tokio::select! {
            () = cancel.cancelled() => return None,
            accepted = listener.accept() => match accepted {
                Ok((conn, _)) => return Some(conn),
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
}
