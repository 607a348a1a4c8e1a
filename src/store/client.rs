//! The agents' store client: one TCP connection, one request in flight.
//!
//! It speaks the same wire protocol as torch's client (VALIDATE then PING on
//! connect) but does not add torch's `/` key prefix: agent keys live under
//! `trainlet/` and never collide with worker keys, which torch prefixes.
//! [`connect_with_retry`] retries name resolution and connection refusal
//! (Kubernetes headless services publish DNS records late) until a deadline.

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::guard::{AGENT, Guard, STORE, nonce};
use super::wire::{Command, MAGIC, MAX_VALUE_LEN};
use crate::error::error_chain;

/// A store address as the user wrote it: host name or IP, and port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Host name or IP literal (IPv6 without brackets).
    pub host: String,
    /// TCP port.
    pub port: u16,
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// Errors of the store client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The connection failed or closed.
    #[error("store connection failed")]
    Io(#[from] std::io::Error),
    /// The server sent something the protocol does not allow.
    #[error("store protocol violation: {0}")]
    Protocol(&'static str),
    /// Gave up connecting at the deadline.
    #[error("store at {endpoint} not reachable after {tries} attempts over {waited:?} (last error: {last})")]
    Unreachable {
        /// What was dialled.
        endpoint: Endpoint,
        /// Connection attempts made.
        tries: u32,
        /// How long we tried.
        waited: Duration,
        /// The last failure, e.g. a DNS or connect error.
        last: String,
    },
    /// The caller cancelled.
    #[error("cancelled")]
    Cancelled,
    /// A guarded store's handshake failed (see [`super::guard`]).
    #[error("{0}")]
    Refused(String),
    /// This pod's token cannot be used.
    #[error("this pod's control token")]
    Token(#[from] super::guard::GuardError),
}

/// A resolved store address, and the token it asks for (serve mode's
/// agents' store), if any: every connection of an agent to its store is
/// made through one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dial {
    /// Where the store is.
    pub addr: SocketAddr,
    /// The token the store asks for.
    pub guard: Option<Guard>,
}

impl Dial {
    /// A new connection (the handshake done when the store is guarded).
    pub async fn connect(&self) -> Result<Client, ClientError> {
        Client::connect_guarded(self.addr, self.guard.as_ref()).await
    }

    /// `client`, dialled first (within `within`) when there is none: a
    /// background task's one connection, kept across its passes and dropped
    /// by it when a use fails. None when the store cannot be reached.
    pub async fn reuse<'a>(
        &self,
        client: &'a mut Option<Client>,
        within: std::time::Duration,
    ) -> Option<&'a mut Client> {
        if client.is_none() {
            *client = tokio::time::timeout(within, self.connect()).await.ok()?.ok();
        }
        client.as_mut()
    }
}

/// A connected, validated store client.
#[derive(Debug)]
pub struct Client {
    stream: TcpStream,
    buf: BytesMut,
    out: Vec<u8>,
}

impl Client {
    /// Connect to `addr`, then VALIDATE and PING as torch's client does.
    pub async fn connect(addr: SocketAddr) -> Result<Self, ClientError> {
        Self::connect_guarded(addr, None).await
    }

    /// [`Client::connect`]; with a `guard`, prove its token to the store
    /// (and check the store's proof) before anything else.
    pub async fn connect_guarded(addr: SocketAddr, guard: Option<&Guard>) -> Result<Self, ClientError> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let mut c = Self { stream, buf: BytesMut::with_capacity(1024), out: Vec::with_capacity(256) };
        c.queue(&Command::Validate(MAGIC));
        if let Some(guard) = guard {
            c.prove(guard).await?;
        }
        let nonce = std::process::id();
        c.queue(&Command::Ping(nonce));
        c.flush().await?;
        if c.read_u32().await? != nonce {
            return Err(ClientError::Protocol("PING echo does not match"));
        }
        Ok(c)
    }

    /// The client's side of the handshake (after VALIDATE, queued).
    async fn prove(&mut self, guard: &Guard) -> Result<(), ClientError> {
        let key = guard.key()?;
        let cn = nonce()?;
        self.send(&Command::Auth(cn.to_vec())).await?;
        let unguarded = |_| {
            ClientError::Refused(
                "the store closed the connection at the control token's handshake: it asks for no token (is its pod started with --serve?) or it is not trainlet's".into(),
            )
        };
        let sn = self.read_bytes().await.map_err(unguarded)?;
        let theirs = self.read_bytes().await.map_err(unguarded)?;
        if !key.verify(STORE, &cn, &sn, &theirs) {
            return Err(ClientError::Refused(
                "the store could not prove it holds this pod's control token: the pods do not share one token Secret, or this is not the job's store".into(),
            ));
        }
        self.send(&Command::Auth(key.proof(AGENT, &cn, &sn))).await?;
        match self.read_u8().await {
            Ok(1) => Ok(()),
            _ => Err(ClientError::Refused("the store refused this pod's control token".into())),
        }
    }

    fn queue(&mut self, cmd: &Command) {
        cmd.encode(&mut self.out);
    }

    async fn flush(&mut self) -> Result<(), ClientError> {
        self.stream.write_all(&self.out).await?;
        self.out.clear();
        Ok(())
    }

    async fn send(&mut self, cmd: &Command) -> Result<(), ClientError> {
        self.queue(cmd);
        self.flush().await
    }

    async fn fill(&mut self, n: usize) -> Result<(), ClientError> {
        while self.buf.len() < n {
            if self.stream.read_buf(&mut self.buf).await? == 0 {
                return Err(ClientError::Io(std::io::ErrorKind::UnexpectedEof.into()));
            }
        }
        Ok(())
    }

    async fn read_u8(&mut self) -> Result<u8, ClientError> {
        self.fill(1).await?;
        Ok(self.buf.get_u8())
    }

    async fn read_u32(&mut self) -> Result<u32, ClientError> {
        self.fill(4).await?;
        Ok(self.buf.get_u32_le())
    }

    async fn read_i64(&mut self) -> Result<i64, ClientError> {
        self.fill(8).await?;
        Ok(self.buf.get_i64_le())
    }

    async fn read_bytes(&mut self) -> Result<Vec<u8>, ClientError> {
        self.fill(8).await?;
        let len = self.buf.get_u64_le();
        if len > MAX_VALUE_LEN {
            return Err(ClientError::Protocol("reply longer than 8 MiB"));
        }
        let len = usize::try_from(len).map_err(|_| ClientError::Protocol("reply length"))?;
        self.fill(len).await?;
        Ok(self.buf.split_to(len).to_vec())
    }

    /// Until the store closes this idle connection (EOF, a reset), for a
    /// client with no request in flight; cancel-safe. The store sends
    /// nothing unasked, so bytes that come are kept for the next reply, up
    /// to 64 KiB: past that the connection counts as closed.
    pub async fn closed(&mut self) {
        while self.buf.len() < 64 * 1024 {
            match self.stream.read_buf(&mut self.buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    }

    /// SET (no reply).
    pub async fn set(&mut self, key: &str, value: &[u8]) -> Result<(), ClientError> {
        self.send(&Command::Set { key: key.into(), value: value.to_vec() }).await
    }

    /// SET, and know it was stored: SET has no reply, and a store that
    /// refuses it (its memory budget) closes the connection, so a PING
    /// sent behind it comes back only when the SET was applied.
    pub async fn set_checked(&mut self, key: &str, value: &[u8]) -> Result<(), ClientError> {
        self.queue(&Command::Set { key: key.into(), value: value.to_vec() });
        let nonce = 0x5e7;
        self.queue(&Command::Ping(nonce));
        let sent = self.flush().await;
        match sent.and(self.read_u32().await) {
            Ok(n) if n == nonce => Ok(()),
            Ok(_) => Err(ClientError::Protocol("PING echo does not match")),
            Err(_) => Err(ClientError::Refused(format!(
                "the store closed the connection instead of storing {} bytes (its memory budget, --store-memory, may be full: see the store host's log)",
                value.len()
            ))),
        }
    }

    /// APPEND (no reply): `value` goes on the end of `key`'s value.
    pub async fn append(&mut self, key: &str, value: &[u8]) -> Result<(), ClientError> {
        self.send(&Command::Append { key: key.into(), value: value.to_vec() }).await
    }

    /// GET without waiting: a missing key reads as empty.
    pub async fn get(&mut self, key: &str) -> Result<Vec<u8>, ClientError> {
        self.send(&Command::Get(key.into())).await?;
        self.read_bytes().await
    }

    /// ADD; returns the new value.
    pub async fn add(&mut self, key: &str, delta: i64) -> Result<i64, ClientError> {
        self.send(&Command::Add { key: key.into(), delta }).await?;
        self.read_i64().await
    }

    /// COMPARE_SET; returns what the server returned (== `desired` on success).
    pub async fn compare_set(&mut self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>, ClientError> {
        self.send(&Command::CompareSet { key: key.into(), expected: expected.to_vec(), desired: desired.to_vec() })
            .await?;
        self.read_bytes().await
    }

    /// CHECK: are all keys present?
    pub async fn check(&mut self, keys: &[String]) -> Result<bool, ClientError> {
        self.send(&Command::Check(keys.iter().map(|k| k.as_bytes().to_vec()).collect())).await?;
        Ok(self.read_u8().await? == 0)
    }

    /// WAIT until all keys exist. Blocks the connection; callers bound it
    /// with a timeout and drop the client if it fires.
    pub async fn wait(&mut self, keys: &[String]) -> Result<(), ClientError> {
        self.send(&Command::Wait(keys.iter().map(|k| k.as_bytes().to_vec()).collect())).await?;
        match self.read_u8().await? {
            0 => Ok(()),
            _ => Err(ClientError::Protocol("unexpected WAIT reply")),
        }
    }

    /// MULTI_GET (without waiting).
    pub async fn multi_get(&mut self, keys: &[String]) -> Result<Vec<Vec<u8>>, ClientError> {
        self.send(&Command::MultiGet(keys.iter().map(|k| k.as_bytes().to_vec()).collect())).await?;
        let mut values = Vec::with_capacity(keys.len());
        for _ in keys {
            values.push(self.read_bytes().await?);
        }
        Ok(values)
    }

    /// MULTI_SET (no reply).
    pub async fn multi_set(&mut self, pairs: &[(String, Vec<u8>)]) -> Result<(), ClientError> {
        self.send(&Command::MultiSet(pairs.iter().map(|(k, v)| (k.as_bytes().to_vec(), v.clone())).collect())).await
    }

    /// DELETE_KEY; returns whether a key was deleted.
    pub async fn delete_key(&mut self, key: &str) -> Result<bool, ClientError> {
        self.send(&Command::DeleteKey(key.into())).await?;
        Ok(self.read_i64().await? == 1)
    }

    /// DELETE_KEY of every key in `keys`, pipelined a batch at a time (one
    /// round trip per batch, not per key); returns how many were deleted.
    pub async fn delete_keys(&mut self, keys: &[String]) -> Result<u64, ClientError> {
        // A batch's replies (8 bytes each) fit the socket buffers, so the
        // server never blocks writing them while we still write requests.
        const BATCH: usize = 1024;
        let mut deleted = 0;
        for batch in keys.chunks(BATCH) {
            for key in batch {
                self.queue(&Command::DeleteKey(key.as_bytes().to_vec()));
            }
            self.flush().await?;
            for _ in batch {
                deleted += u64::from(self.read_i64().await? == 1);
            }
        }
        Ok(deleted)
    }

    /// LIST_KEYS: every key of the store.
    pub async fn list_keys(&mut self) -> Result<Vec<String>, ClientError> {
        self.send(&Command::ListKeys).await?;
        let n = self.read_i64().await?;
        let n = usize::try_from(n).map_err(|_| ClientError::Protocol("negative key count"))?;
        // Grown as the keys arrive: the count alone reserves nothing.
        let mut keys = Vec::with_capacity(n.min(4096));
        for _ in 0..n {
            keys.push(String::from_utf8_lossy(&self.read_bytes().await?).into_owned());
        }
        Ok(keys)
    }

    /// GETNUMKEYS.
    pub async fn num_keys(&mut self) -> Result<i64, ClientError> {
        self.send(&Command::GetNumKeys).await?;
        self.read_i64().await
    }

    /// PING with a nonce; checks the echo.
    pub async fn ping(&mut self, nonce: u32) -> Result<(), ClientError> {
        self.send(&Command::Ping(nonce)).await?;
        if self.read_u32().await? == nonce { Ok(()) } else { Err(ClientError::Protocol("PING echo does not match")) }
    }

    /// BARRIER on `key` for `world_size` arrivals.
    pub async fn barrier(&mut self, key: &str, world_size: i64) -> Result<(), ClientError> {
        self.send(&Command::Barrier { key: key.into(), world_size }).await?;
        match self.read_u8().await? {
            0 => Ok(()),
            _ => Err(ClientError::Protocol("unexpected BARRIER reply")),
        }
    }
}

/// Resolve and connect to `endpoint`, retrying every failure (DNS not yet
/// published, connection refused, handshake reset) with exponential backoff
/// until `deadline`.
pub async fn connect_with_retry(
    endpoint: &Endpoint,
    guard: Option<&Guard>,
    deadline: Instant,
    cancel: &CancellationToken,
) -> Result<Client, ClientError> {
    connect_retrying(endpoint, guard, deadline, cancel, true).await
}

/// [`connect_with_retry`] that logs its retries at debug level only (for
/// a background connection whose owner reports the outage itself).
pub async fn connect_quietly(
    endpoint: &Endpoint,
    guard: Option<&Guard>,
    deadline: Instant,
    cancel: &CancellationToken,
) -> Result<Client, ClientError> {
    connect_retrying(endpoint, guard, deadline, cancel, false).await
}

async fn connect_retrying(
    endpoint: &Endpoint,
    guard: Option<&Guard>,
    deadline: Instant,
    cancel: &CancellationToken,
    report: bool,
) -> Result<Client, ClientError> {
    let started = Instant::now();
    let mut waiting = crate::waiting::Waiting::new(format!("the rendezvous store at {endpoint}"), Some(deadline));
    let mut backoff = Duration::from_millis(20);
    let mut tries = 0u32;
    loop {
        tries += 1;
        let attempt = async {
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((endpoint.host.as_str(), endpoint.port))
                .await
                .map_err(|e| format!("resolving {}: {e}", endpoint.host))?
                .collect();
            let mut last = format!("{} resolved to no address", endpoint.host);
            for addr in addrs {
                match Client::connect_guarded(addr, guard).await {
                    Ok(c) => return Ok(c),
                    Err(e) => last = format!("{addr}: {}", error_chain(&e)),
                }
            }
            Err(last)
        };
        let remaining = deadline.saturating_duration_since(Instant::now());
        let last = tokio::select! {
            () = cancel.cancelled() => return Err(ClientError::Cancelled),
            r = tokio::time::timeout(remaining.max(Duration::from_millis(1)), attempt) => match r {
                Ok(Ok(c)) => return Ok(c),
                Ok(Err(last)) => last,
                Err(_) => "connect attempt timed out".to_string(),
            },
        };
        if Instant::now() + backoff >= deadline {
            return Err(ClientError::Unreachable {
                endpoint: endpoint.clone(),
                tries,
                waited: started.elapsed(),
                last,
            });
        }
        tracing::debug!(%endpoint, tries, error = %last, "store not reachable yet; retrying");
        if report {
            waiting.report(&format!("not reachable yet; last error: {last}"));
        }
        tokio::select! {
            () = cancel.cancelled() => return Err(ClientError::Cancelled),
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 3 / 2).min(Duration::from_secs(2));
    }
}

impl Client {
    /// The server's address.
    pub fn peer_addr(&self) -> std::io::Result<SocketAddr> {
        self.stream.peer_addr()
    }
}
