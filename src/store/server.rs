//! Accept loop and per-connection tasks of the store server.
//!
//! Nothing on the accept or request path resolves names: peers are logged by
//! their numeric socket address. (torch's own server does reverse lookups for
//! log strings and stalls about 5 s per connect when the resolver is
//! unreachable; reference/torch.md 1.5.)

use std::net::{Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::mpsc::unbounded_channel;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::guard::{AGENT, Guard, Key, NONCE_LEN, STORE, nonce};
use super::state::{Budget, ExecError, FREE_REPLY, State};
use super::wire::{Command, DecodeError, MAGIC, Scanner};
use crate::lobby::{Lobby, Ticket};
use crate::ratelimit::RateLimit;

/// Errors from binding the store.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// Could not bind or listen.
    #[error("cannot listen on port {port}")]
    Bind {
        /// The port asked for (0 = any).
        port: u16,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
}

fn somaxconn() -> u32 {
    std::fs::read_to_string("/proc/sys/net/core/somaxconn").ok().and_then(|s| s.trim().parse().ok()).unwrap_or(4096)
}

/// Bind a listener as torch does: `[::]` (dual stack) falling back to
/// `0.0.0.0`, or exactly `host` when one is given; backlog = somaxconn.
pub fn bind_listener(host: Option<std::net::IpAddr>, port: u16) -> Result<TcpListener, ServerError> {
    let err = |source| ServerError::Bind { port, source };
    let try_bind = |addr: SocketAddr| -> std::io::Result<TcpListener> {
        let sock = if addr.is_ipv6() { TcpSocket::new_v6()? } else { TcpSocket::new_v4()? };
        sock.set_reuseaddr(true)?;
        sock.bind(addr)?;
        let listener = sock.listen(somaxconn())?;
        crate::sys::tune_listener(std::os::fd::AsFd::as_fd(&listener))?;
        Ok(listener)
    };
    match host {
        Some(ip) => try_bind(SocketAddr::new(ip, port)).map_err(err),
        None => try_bind(SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), port))
            .or_else(|_| try_bind(SocketAddr::new(std::net::Ipv4Addr::UNSPECIFIED.into(), port)))
            .map_err(err),
    }
}

/// A dedicated single-threaded event loop for store servers, like torch's
/// libuv loop: round trips never pay a cross-thread wake-up, and a stalled
/// console write in the supervisor cannot delay a worker's store request.
#[derive(Debug)]
pub struct StoreLoop {
    handle: tokio::runtime::Handle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl StoreLoop {
    /// Start the loop on its own thread.
    pub fn start() -> std::io::Result<Self> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let handle = rt.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new().name("trainlet-store".into()).spawn(move || {
            rt.block_on(async {
                let _ = stopped.await;
            });
        })?;
        Ok(Self { handle, stop: Some(stop), thread: Some(thread) })
    }

    /// Bind a listener (see [`bind_listener`]) and serve a fresh store on it
    /// from this loop.
    pub fn serve(
        &self,
        host: Option<std::net::IpAddr>,
        port: u16,
        budget: Arc<Budget>,
        cancel: CancellationToken,
    ) -> Result<StoreServer, ServerError> {
        self.serve_guarded(host, port, budget, None, cancel)
    }

    /// [`StoreLoop::serve`], asking every connection for `guard`'s token when there is one.
    pub fn serve_guarded(
        &self,
        host: Option<std::net::IpAddr>,
        port: u16,
        budget: Arc<Budget>,
        guard: Option<Guard>,
        cancel: CancellationToken,
    ) -> Result<StoreServer, ServerError> {
        // Inside the loop's context the listener registers with its reactor
        // and `StoreServer::start` spawns the accept loop onto it.
        let _enter = self.handle.enter();
        let listener = bind_listener(host, port)?;
        StoreServer::start_guarded(listener, budget, guard, cancel).map_err(|source| ServerError::Bind { port, source })
    }
}

impl Drop for StoreLoop {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A running store server.
#[derive(Debug)]
pub struct StoreServer {
    state: Arc<State>,
    local: SocketAddr,
    task: JoinHandle<()>,
    cancel: CancellationToken,
}

impl StoreServer {
    /// Serve a fresh, empty store on `listener` until `cancel` fires; what
    /// its clients store counts against `budget`.
    pub fn start(listener: TcpListener, budget: Arc<Budget>, cancel: CancellationToken) -> std::io::Result<Self> {
        Self::start_guarded(listener, budget, None, cancel)
    }

    /// [`StoreServer::start`]; with a `guard`, a connection is served only
    /// once it proved it holds the guard's token (see [`super::guard`]).
    pub fn start_guarded(
        listener: TcpListener,
        budget: Arc<Budget>,
        guard: Option<Guard>,
        cancel: CancellationToken,
    ) -> std::io::Result<Self> {
        let local = listener.local_addr()?;
        let state = Arc::new(State::with_budget(budget));
        let task = tokio::spawn(accept_loop(listener, Arc::clone(&state), guard, cancel.clone()));
        Ok(Self { state, local, task, cancel })
    }

    /// The bound address (port 0 resolved).
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The store's content.
    pub fn state(&self) -> &Arc<State> {
        &self.state
    }

    /// Stop accepting, close every connection and wait for the tasks.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        let _ = self.task.await;
    }
}

async fn accept_loop(listener: TcpListener, state: Arc<State>, guard: Option<Guard>, cancel: CancellationToken) {
    let conns = tokio_util::task::TaskTracker::new();
    // A guarded store's connections that have not proved the token yet.
    let lobby = Lobby::new(MAX_UNPROVED);
    let warnings = Arc::new(warnings());
    let mut backoff = Duration::from_millis(5);
    loop {
        let accepted = tokio::select! {
            () = cancel.cancelled() => break,
            r = listener.accept() => r,
        };
        match accepted {
            Ok((stream, peer)) => {
                backoff = Duration::from_millis(5);
                counters().connections.inc();
                // TCP_NODELAY comes from the listener (see `sys::tune_listener`).
                let gate = guard.clone().map(|g| (Gate::Hello(g), lobby.enter(peer.ip())));
                conns.spawn(serve_conn(stream, peer, Arc::clone(&state), gate, Arc::clone(&warnings), cancel.clone()));
            }
            Err(e) => {
                // EMFILE/ENFILE/ENOBUFS: back off instead of spinning.
                tracing::warn!(error = %e, "store accept failed; backing off");
                tokio::select! {
                    () = cancel.cancelled() => break,
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
    drop(listener);
    conns.close();
    conns.wait().await;
}

struct Registration<'a> {
    state: &'a State,
    id: u64,
    /// The peer closed the connection (EOF, a reset): its tied keys are lost.
    peer_closed: bool,
    /// Budget bytes this connection holds for its buffered partial frame.
    buffered: u64,
}

impl Registration<'_> {
    /// Hold budget for `len` buffered bytes beyond [`FREE_BUFFER`].
    fn buffer(&mut self, len: usize) -> Result<(), ExecError> {
        let want = (len as u64).saturating_sub(FREE_BUFFER);
        if want == self.buffered {
            return Ok(());
        }
        if want > self.buffered {
            self.state.budget().reserve(want - self.buffered)?;
        } else {
            self.state.budget().release(self.buffered - want);
        }
        self.buffered = want;
        Ok(())
    }
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        self.state.budget().release(self.buffered);
        self.state.disconnect(self.id, self.peer_closed);
    }
}

/// Partial frames up to this size are not charged to the budget.
const FREE_BUFFER: u64 = 64 * 1024;

/// Warnings about misbehaving clients: at most 10 per 10 s per store (one
/// bad client can open thousands of connections).
fn warnings() -> RateLimit {
    RateLimit::new(10, Duration::from_secs(10))
}

/// Log a warning about one connection, rate limited.
macro_rules! conn_warn {
    ($warnings:expr, $($arg:tt)+) => {
        $crate::limited!($warnings, warn, $($arg)+)
    };
}

/// Write `out` and give back the budget its large replies held.
async fn flush(wr: &mut tokio::net::tcp::OwnedWriteHalf, out: &mut Vec<u8>, charge: &mut u64, state: &State) -> bool {
    let ok = out.is_empty() || wr.write_all(out).await.is_ok();
    out.clear();
    if out.capacity() as u64 > FREE_BUFFER {
        out.shrink_to(64);
    }
    state.budget().release(std::mem::take(charge));
    ok
}

/// Where a connection to a guarded store is in its handshake.
#[derive(Debug)]
enum Gate {
    /// Waiting for the client's nonce.
    Hello(Guard),
    /// Waiting for the client's proof.
    Proof { key: Box<Key>, cn: Vec<u8>, sn: [u8; NONCE_LEN] },
}

/// Longest a connection to a guarded store may take to prove its token.
const HANDSHAKE_TIME: Duration = Duration::from_secs(10);
/// Most connections to a guarded store that have not proved the token:
/// a new one evicts the oldest (see [`Lobby`]). The agents' own prove it
/// within a round trip or two.
const MAX_UNPROVED: usize = 256;
/// Most bytes a connection may send before it is admitted.
const HANDSHAKE_BYTES: usize = 1024;

/// One step of the handshake of a guarded store: the next gate (None:
/// admitted), or why the connection is closed. Replies go to `out`.
fn handshake(gate: Gate, cmd: Command, out: &mut Vec<u8>) -> Result<Option<Gate>, String> {
    let step = match cmd {
        Command::Auth(step) => step,
        other => {
            return Err(format!(
                "{} before the control token was proved (this store is serve mode's: it asks every client for the token)",
                short(&other)
            ));
        }
    };
    match gate {
        Gate::Hello(guard) => {
            if step.len() != NONCE_LEN {
                return Err("a handshake nonce of the wrong length".into());
            }
            let key = guard.key().map_err(|e| {
                format!("{} (no client is admitted until it can be read)", crate::error::error_chain(&e))
            })?;
            let sn = nonce().map_err(|e| e.to_string())?;
            super::wire::put_bytes(out, &sn);
            super::wire::put_bytes(out, &key.proof(STORE, &step, &sn));
            Ok(Some(Gate::Proof { key: Box::new(key), cn: step, sn }))
        }
        Gate::Proof { key, cn, sn } => {
            if key.verify(AGENT, &cn, &sn, &step) {
                out.push(1);
                Ok(None)
            } else {
                out.push(0);
                Err("a wrong control token".into())
            }
        }
    }
}

/// Returns once `ticket` is evicted from the lobby; never without one.
async fn evicted(ticket: Option<&Ticket>) {
    match ticket {
        Some(t) => t.evicted().await,
        None => std::future::pending().await,
    }
}

async fn serve_conn(
    stream: TcpStream,
    peer: SocketAddr,
    state: Arc<State>,
    gate: Option<(Gate, Ticket)>,
    warnings: Arc<RateLimit>,
    cancel: CancellationToken,
) {
    let (mut gate, ticket) = gate.map_or((None, None), |(g, t)| (Some(g), Some(t)));
    let mut ticket = ticket;
    let (wake_tx, mut wake_rx) = unbounded_channel();
    let id = state.connect(wake_tx);
    let mut registration = Registration { state: &state, id, peer_closed: false, buffered: 0 };
    let (mut rd, mut wr) = stream.into_split();
    // Small to start: almost every frame is tens of bytes, and 9k idle
    // connections should not pin 36 MiB of buffers. `read_buf` grows it.
    let mut buf = BytesMut::with_capacity(256);
    let mut out = Vec::with_capacity(64);
    // Budget held by large replies in `out` until they are written.
    let mut charge = 0u64;
    let mut scanner = Scanner::default();
    let mut validated = false;
    let handshake_over = tokio::time::sleep(HANDSHAKE_TIME);
    tokio::pin!(handshake_over);
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            () = &mut handshake_over, if gate.is_some() => {
                conn_warn!(warnings, %peer, "store client did not prove the control token in time; closing");
                return;
            }
            () = evicted(ticket.as_ref()) => {
                conn_warn!(warnings, %peer, max = MAX_UNPROVED, "store client evicted before proving the control token (too many connections without it); closing");
                return;
            }
            Some(b) = wake_rx.recv() => {
                out.push(b);
                while let Ok(b) = wake_rx.try_recv() {
                    out.push(b);
                }
            }
            read = rd.read_buf(&mut buf) => {
                match read {
                    Ok(0) => {
                        if !buf.is_empty() {
                            conn_warn!(warnings, %peer, pending = buf.len(), "store client closed mid-frame");
                        }
                        registration.peer_closed = true;
                        return;
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::debug!(%peer, error = %e, "store connection read failed");
                        registration.peer_closed = true;
                        return;
                    }
                }
                // Replies to parked waits first: they were due before this batch.
                while let Ok(b) = wake_rx.try_recv() {
                    out.push(b);
                }
                loop {
                    let len = match scanner.scan(&buf) {
                        Ok(Some(len)) => len,
                        Ok(None) => break,
                        Err(why) => {
                            conn_warn!(warnings, %peer, error = %why, "invalid store frame; closing connection");
                            let _ = flush(&mut wr, &mut out, &mut charge, &state).await;
                            return;
                        }
                    };
                    let cmd = match Command::decode(&buf[..len]) {
                        Ok((cmd, _)) => cmd,
                        Err(DecodeError::Incomplete) => {
                            conn_warn!(warnings, %peer, "store frame shorter than its fields; closing connection");
                            return;
                        }
                        Err(DecodeError::Invalid(why)) => {
                            conn_warn!(warnings, %peer, error = %why, "invalid store frame; closing connection");
                            let _ = flush(&mut wr, &mut out, &mut charge, &state).await;
                            return;
                        }
                    };
                    buf.advance(len);
                    if !validated {
                        if cmd == Command::Validate(MAGIC) {
                            validated = true;
                            continue;
                        }
                        conn_warn!(warnings, %peer, first = ?short(&cmd), "store connection did not start with VALIDATE; closing");
                        return;
                    }
                    if let Some(g) = gate.take() {
                        match handshake(g, cmd, &mut out) {
                            Ok(next) => {
                                if next.is_none() {
                                    // Proved: out of the lobby for good.
                                    ticket = None;
                                }
                                gate = next;
                            }
                            Err(why) => {
                                conn_warn!(warnings, %peer, reason = %why, "store client refused; closing");
                                let _ = flush(&mut wr, &mut out, &mut charge, &state).await;
                                return;
                            }
                        }
                        continue;
                    }
                    counters().op(command_index(&cmd));
                    match state.apply(id, cmd, &mut out) {
                        Ok(reply) => charge += reply,
                        Err(e @ ExecError::Full { .. }) => {
                            // Not rate limited: it is about the store, not one client.
                            tracing::warn!(%peer, error = %e, "store memory budget reached (--store-memory); closing the connection that asked for more");
                            let _ = flush(&mut wr, &mut out, &mut charge, &state).await;
                            return;
                        }
                        Err(e) => {
                            conn_warn!(warnings, %peer, error = %e, "store request failed; closing connection");
                            let _ = flush(&mut wr, &mut out, &mut charge, &state).await;
                            return;
                        }
                    }
                    // Pipelined requests do not pile up replies: write them
                    // out before decoding more.
                    if out.len() as u64 > FREE_REPLY && !flush(&mut wr, &mut out, &mut charge, &state).await {
                        registration.peer_closed = true;
                        return;
                    }
                }
                if gate.is_some() && buf.len() > HANDSHAKE_BYTES {
                    conn_warn!(warnings, %peer, pending = buf.len(), "store client sent more than a handshake before proving the control token; closing");
                    return;
                }
                if let Err(e) = registration.buffer(buf.len()) {
                    tracing::warn!(%peer, error = %e, scanned = scanner.scanned(), "store memory budget reached by a partial frame (--store-memory); closing connection");
                    return;
                }
                if buf.is_empty() && buf.capacity() as u64 > FREE_BUFFER {
                    buf = BytesMut::with_capacity(256);
                }
            }
        }
        if !flush(&mut wr, &mut out, &mut charge, &state).await {
            registration.peer_closed = true;
            return;
        }
    }
}

/// The store's counters, kept here and registered by `crate::metrics`
/// (which serves them): `trainlet_store_connections_total` and
/// `trainlet_store_operations_total{op}`, one per [`COMMAND_NAMES`] entry.
#[derive(Debug)]
pub struct Counters {
    /// Connections accepted.
    pub connections: prometheus::IntCounter,
    /// Requests served, by command (the family).
    pub operations: prometheus::IntCounterVec,
    /// Its members, by position in [`COMMAND_NAMES`].
    by_command: Vec<prometheus::IntCounter>,
}

impl Counters {
    fn build() -> Result<Self, prometheus::Error> {
        let operations = prometheus::IntCounterVec::new(
            prometheus::Opts::new("trainlet_store_operations_total", "Store requests served, by command."),
            &["op"],
        )?;
        let by_command =
            COMMAND_NAMES.iter().map(|op| operations.get_metric_with_label_values(&[op])).collect::<Result<_, _>>()?;
        Ok(Self {
            connections: prometheus::IntCounter::new(
                "trainlet_store_connections_total",
                "Store connections accepted.",
            )?,
            operations,
            by_command,
        })
    }

    /// Count one request, by its position in [`COMMAND_NAMES`].
    pub fn op(&self, index: usize) {
        if let Some(c) = self.by_command.get(index) {
            c.inc();
        }
    }
}

/// The process's store counters (created on first use).
pub fn counters() -> &'static Counters {
    static C: std::sync::OnceLock<Counters> = std::sync::OnceLock::new();
    // Constant names and labels that prometheus accepts; a failure here is
    // a programming error caught by every test.
    C.get_or_init(|| Counters::build().expect("valid store metric definitions"))
}

/// Every name [`short`] gives, in one place (metrics label by them).
pub const COMMAND_NAMES: [&str; 20] = [
    "VALIDATE(wrong magic)",
    "SET",
    "COMPARE_SET",
    "GET",
    "ADD",
    "CHECK",
    "WAIT",
    "GETNUMKEYS",
    "DELETE_KEY",
    "APPEND",
    "MULTI_GET",
    "MULTI_SET",
    "CANCEL_WAIT",
    "PING",
    "QUEUE_PUSH",
    "QUEUE_POP",
    "QUEUE_LEN",
    "LIST_KEYS",
    "BARRIER",
    "AUTH",
];

/// A log-friendly name for a command (never its payload).
fn short(cmd: &Command) -> &'static str {
    COMMAND_NAMES[command_index(cmd)]
}

/// The command's position in [`COMMAND_NAMES`].
fn command_index(cmd: &Command) -> usize {
    match cmd {
        Command::Validate(_) => 0,
        Command::Set { .. } => 1,
        Command::CompareSet { .. } => 2,
        Command::Get(_) => 3,
        Command::Add { .. } => 4,
        Command::Check(_) => 5,
        Command::Wait(_) => 6,
        Command::GetNumKeys => 7,
        Command::DeleteKey(_) => 8,
        Command::Append { .. } => 9,
        Command::MultiGet(_) => 10,
        Command::MultiSet(_) => 11,
        Command::CancelWait => 12,
        Command::Ping(_) => 13,
        Command::QueuePush { .. } => 14,
        Command::QueuePop(_) => 15,
        Command::QueueLen(_) => 16,
        Command::ListKeys => 17,
        Command::Barrier { .. } => 18,
        Command::Auth(_) => 19,
    }
}
