//! Request bodies on the control API, bounded in bytes before a byte of
//! them is read: each endpoint has its own limit (72 MiB only where a
//! run's files come; a call's arguments, a setup, anything else far
//! less), and every body held at once, over all connections, shares one
//! budget ([`BUDGET`]). A body over its endpoint's limit is answered 413,
//! one that does not fit in what is left of the budget 503, each naming
//! the bound; the budget's share is given back once the answer is sent.
//!
//! What a body parses into is bounded by [`super::bounded`] (lists and
//! maps capped while they are read, free-form arguments kept as text), so
//! that the memory of the requests in flight is a small multiple of the
//! budget, whatever they hold.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{Semaphore, SemaphorePermit};

use crate::http::{LINGER, Limits, Request, Status, closed, error_body, read_body, respond};

/// A request's head.
pub const HEAD: usize = 16 * 1024;
/// A run's or an actor's body: its files, base64 (48 MiB of them).
pub const RUN_BODY: usize = 72 * 1024 * 1024;
/// A call's body: its arguments (7 MiB encoded) and ranks.
pub const CALL_BODY: usize = 8 * 1024 * 1024;
/// A setup's body: it is kept as one store value (8 MiB at most).
pub const SETUP_BODY: usize = 8 * 1024 * 1024;
/// Any other request's body (GET and DELETE take none).
pub const OTHER_BODY: usize = 64 * 1024;
/// Bytes of the bodies of all requests held at once.
pub const BUDGET: usize = 256 * 1024 * 1024;

/// The bodies held at once, in bytes.
#[derive(Debug)]
pub struct Bodies(Semaphore);

impl Default for Bodies {
    fn default() -> Self {
        Self(Semaphore::new(BUDGET))
    }
}

impl Bodies {
    /// `n` more bytes of the budget, held until the permit is dropped:
    /// for a body as it is read, and for what a body grows into (an
    /// archive's inflated files, base64 decoded) before that is held; a
    /// refusal names the budget.
    pub fn reserve(&self, n: usize) -> Result<SemaphorePermit<'_>, String> {
        let claimed = u32::try_from(n).unwrap_or(u32::MAX);
        self.0.try_acquire_many(claimed).map_err(|_| {
            let now = BUDGET.saturating_sub(self.0.available_permits());
            format!(
                "the requests being read hold {now} bytes of body (and of what bodies inflate or decode to), \
                 and this one {n} more: at most {BUDGET} at once; try again"
            )
        })
    }
}

/// The limit of a body sent with `method` to `path`, and the endpoint in
/// words.
pub fn limit(method: &str, path: &str) -> (usize, &'static str) {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    match (method, parts.as_slice()) {
        ("POST", ["v1", "runs" | "actors"]) => (RUN_BODY, "a run or an actor"),
        ("POST", ["v1", "actors", _, "calls"]) => (CALL_BODY, "a call"),
        ("POST", ["v1", "setup"]) => (SETUP_BODY, "a setup"),
        _ => (OTHER_BODY, "this request"),
    }
}

/// Read `req`'s body within its endpoint's limit and `time`, holding its
/// share of `bodies` (until the permit is dropped); a refusal is its
/// status and message.
pub async fn read<'a, C: AsyncRead + Unpin>(
    conn: &mut C,
    req: &mut Request,
    bodies: &'a Bodies,
    time: Duration,
) -> Result<SemaphorePermit<'a>, (Status, String)> {
    let (limit, what) = limit(&req.method, &req.path);
    // The length is judged by read_body; here only what it claims counts.
    let claimed = req.header("content-length").and_then(|n| n.parse::<usize>().ok()).unwrap_or(0);
    if claimed > limit {
        return Err((Status::TOO_LARGE, format!("a body of {claimed} bytes; {what} takes at most {limit}")));
    }
    let held = bodies.reserve(claimed).map_err(|why| (Status::UNAVAILABLE, why))?;
    match tokio::time::timeout(time, read_body(conn, req, Limits { head: HEAD, body: limit })).await {
        Ok(Ok(())) => Ok(held),
        Ok(Err(status)) => Err((status, "malformed or oversized request body".into())),
        Err(_) => Err((Status::TIMEOUT, "request body not sent in time".into())),
    }
}

/// Answer a request refused here; what its client still sends is dropped
/// for up to [`LINGER`], so that it sees the answer rather than a reset.
pub async fn refuse<C: AsyncRead + AsyncWrite + Unpin>(conn: &mut C, status: Status, message: &str) {
    let refuse = async {
        if respond(conn, status, &error_body(status, message)).await.is_ok() && status != Status::TIMEOUT {
            closed(conn).await;
        }
    };
    let _ = tokio::time::timeout(LINGER, refuse).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(method: &str, path: &str, length: usize) -> Request {
        Request {
            method: method.into(),
            path: path.into(),
            headers: vec![("content-length".into(), length.to_string())],
            ..Request::default()
        }
    }

    #[tokio::test]
    async fn bodies_are_bounded_per_endpoint_and_together() {
        assert_eq!(limit("POST", "/v1/runs").0, RUN_BODY);
        assert_eq!(limit("POST", "/v1/actors/run-1-a/calls").0, CALL_BODY);
        assert_eq!(limit("POST", "/v1/setup").0, SETUP_BODY);
        assert_eq!(limit("GET", "/v1/runs").0, OTHER_BODY);
        let bodies = Bodies::default();
        let time = Duration::from_secs(1);
        let mut big = request("POST", "/v1/actors/a/calls", CALL_BODY + 1);
        let (status, why) = read(&mut &b""[..], &mut big, &bodies, time).await.expect_err("over its limit");
        assert_eq!((status, why.contains("a call takes at most 8388608")), (Status::TOO_LARGE, true), "{why}");
        let mut held = Vec::new();
        for _ in 0..BUDGET / RUN_BODY {
            let mut req = request("POST", "/v1/runs", RUN_BODY);
            held.push(read(&mut tokio::io::repeat(b'x'), &mut req, &bodies, time).await.expect("within the budget"));
            // The share stays held; the test need not keep the bytes.
            req.body = Vec::new();
        }
        let mut req = request("POST", "/v1/runs", RUN_BODY);
        let (status, why) = read(&mut &b""[..], &mut req, &bodies, time).await.expect_err("over the budget");
        assert_eq!((status, why.contains("at most 268435456 at once")), (Status::UNAVAILABLE, true), "{why}");
        held.pop();
        let mut req = request("POST", "/v1/runs", 2);
        let _given_back = read(&mut &b"{}"[..], &mut req, &bodies, time).await.expect("given back");
    }
}
