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

use super::state::State;
use super::wire::{Command, DecodeError, MAGIC};

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
        cancel: CancellationToken,
    ) -> Result<StoreServer, ServerError> {
        // Inside the loop's context the listener registers with its reactor
        // and `StoreServer::start` spawns the accept loop onto it.
        let _guard = self.handle.enter();
        let listener = bind_listener(host, port)?;
        StoreServer::start(listener, cancel).map_err(|source| ServerError::Bind { port, source })
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
    /// Serve a fresh, empty store on `listener` until `cancel` fires.
    pub fn start(listener: TcpListener, cancel: CancellationToken) -> std::io::Result<Self> {
        let local = listener.local_addr()?;
        let state = Arc::new(State::new());
        let task = tokio::spawn(accept_loop(listener, Arc::clone(&state), cancel.clone()));
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

async fn accept_loop(listener: TcpListener, state: Arc<State>, cancel: CancellationToken) {
    let conns = tokio_util::task::TaskTracker::new();
    let mut backoff = Duration::from_millis(5);
    loop {
        let accepted = tokio::select! {
            () = cancel.cancelled() => break,
            r = listener.accept() => r,
        };
        match accepted {
            Ok((stream, peer)) => {
                backoff = Duration::from_millis(5);
                crate::metrics::global().store_connections.inc();
                // TCP_NODELAY comes from the listener (see `sys::tune_listener`).
                conns.spawn(serve_conn(stream, peer, Arc::clone(&state), cancel.clone()));
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
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        self.state.disconnect(self.id);
    }
}

async fn serve_conn(stream: TcpStream, peer: SocketAddr, state: Arc<State>, cancel: CancellationToken) {
    let (wake_tx, mut wake_rx) = unbounded_channel();
    let id = state.connect(wake_tx);
    let _registration = Registration { state: &state, id };
    let (mut rd, mut wr) = stream.into_split();
    // Small to start: almost every frame is tens of bytes, and 9k idle
    // connections should not pin 36 MiB of buffers. `read_buf` grows it.
    let mut buf = BytesMut::with_capacity(256);
    let mut out = Vec::with_capacity(64);
    let mut validated = false;
    loop {
        out.clear();
        tokio::select! {
            () = cancel.cancelled() => return,
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
                            tracing::warn!(%peer, pending = buf.len(), "store client closed mid-frame");
                        }
                        return;
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::debug!(%peer, error = %e, "store connection read failed");
                        return;
                    }
                }
                // Replies to parked waits first: they were due before this batch.
                while let Ok(b) = wake_rx.try_recv() {
                    out.push(b);
                }
                loop {
                    match Command::decode(&buf) {
                        Ok((cmd, used)) => {
                            buf.advance(used);
                            if !validated {
                                if cmd == Command::Validate(MAGIC) {
                                    validated = true;
                                    continue;
                                }
                                tracing::warn!(%peer, first = ?short(&cmd), "store connection did not start with VALIDATE; closing");
                                return;
                            }
                            crate::metrics::global().store_op(command_index(&cmd));
                            if let Err(e) = state.apply(id, cmd, &mut out) {
                                tracing::warn!(%peer, error = %e, "store request failed; closing connection");
                                let _ = wr.write_all(&out).await;
                                return;
                            }
                        }
                        Err(DecodeError::Incomplete) => break,
                        Err(DecodeError::Invalid(why)) => {
                            tracing::warn!(%peer, error = %why, "invalid store frame; closing connection");
                            let _ = wr.write_all(&out).await;
                            return;
                        }
                    }
                }
            }
        }
        if !out.is_empty() && wr.write_all(&out).await.is_err() {
            return;
        }
    }
}

/// Every name [`short`] gives, in one place (metrics label by them).
pub const COMMAND_NAMES: [&str; 19] = [
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
    }
}
