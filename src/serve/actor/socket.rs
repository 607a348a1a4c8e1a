//! The agent's ends of an actor's connections: the Unix socket its
//! workers dial (each connection's hello, then its frames as
//! [`Event`]s for the bridge's core), and the writer of outcomes to the
//! agents' store, in order, on a connection of its own.
//!
//! Whatever runs in a worker can dial the socket (the actor's own code
//! included), so what a connection can make the agent hold is bounded:
//! connections that have not said hello wait in a lobby of
//! [`MAX_WAITING`] (a new one evicts the oldest) and may send a frame of
//! [`HELLO_FRAME`] at most; after its hello a connection lives only while
//! the core keeps it as its rank's worker (one per local rank: a refused
//! or replaced one is closed); and every later frame waits for its share
//! of [`IN_FLIGHT`] bytes, over all the connections, before its bytes are
//! read, which must come within [`FRAME_TIME`].

use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncRead;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;
use tokio::sync::mpsc::{UnboundedSender, unbounded_channel};
use tokio_util::sync::CancellationToken;

use super::Outcome;
use super::event::Event;
use super::wire::{self, FrameError, FromWorker, ToWorker};
use crate::lobby::{Lobby, Ticket};
use crate::serve::Link;

/// How long a worker has to say who it is.
const HELLO_TIME: Duration = Duration::from_secs(30);
/// Connections that have not said hello; a new one evicts the oldest (a
/// worker says hello as soon as it connects, long before 64 newer ones).
const MAX_WAITING: usize = 64;
/// Largest frame before a connection's hello (a hello is under 100 bytes).
const HELLO_FRAME: usize = 64 * 1024;
/// Bytes of frames being read at once, over every connection of the
/// actor on this pod: a frame waits for its share (the largest fits).
const IN_FLIGHT: usize = wire::MAX_FRAME;
/// Time a frame's bytes get to come once its length is in.
const FRAME_TIME: Duration = Duration::from_secs(30);

/// Write outcomes in order, on a connection of their own.
pub(super) fn writer(mut link: Link, cancel: CancellationToken) -> UnboundedSender<(String, Vec<u8>)> {
    let (tx, mut rx) = unbounded_channel::<(String, Vec<u8>)>();
    tokio::spawn(async move {
        loop {
            let (key, value) = tokio::select! {
                () = cancel.cancelled() => return,
                kv = rx.recv() => match kv { Some(kv) => kv, None => return },
            };
            let mut tries = 0;
            while let Err(e) = link.set(&key, &value).await {
                tries += 1;
                if tries >= 3 {
                    tracing::error!(key = %key, error = %crate::error::error_chain(&e), "cannot write an actor call's outcome to the store");
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    });
    tx
}

/// Every worker connection: its hello, then its frames as events.
pub(super) async fn accept(listener: UnixListener, tx: UnboundedSender<Event>, cancel: CancellationToken) {
    let lobby = Lobby::new(MAX_WAITING);
    let flight = Arc::new(Semaphore::new(IN_FLIGHT));
    let mut next = 0u64;
    loop {
        let conn = tokio::select! {
            () = cancel.cancelled() => return,
            c = listener.accept() => c,
        };
        let stream = match conn {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "cannot accept an actor worker's connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        next += 1;
        // Shared by process: a worker flooding the socket evicts its own.
        let peer = stream.peer_cred().ok().and_then(|c| c.pid()).unwrap_or(0);
        let door = (lobby.enter(crate::lobby::Source::process(peer)), Arc::clone(&flight));
        tokio::spawn(worker(stream, next, door, tx.clone(), cancel.child_token()));
    }
}

/// One frame of at most `max` bytes: its length, then its share of
/// `flight` when one is given (held until it is decoded), then its bytes
/// within [`FRAME_TIME`].
async fn frame<R: AsyncRead + Unpin>(
    rd: &mut R,
    max: usize,
    flight: Option<&Semaphore>,
) -> Result<Option<FromWorker>, FrameError> {
    let Some(n) = wire::length(rd, max).await? else { return Ok(None) };
    let _share = match flight {
        // Never closed, and n is at most IN_FLIGHT: the share comes.
        Some(f) => match f.acquire_many(u32::try_from(n).unwrap_or(u32::MAX)).await {
            Ok(share) => Some(share),
            Err(_) => return Ok(None),
        },
        None => None,
    };
    let body = tokio::time::timeout(FRAME_TIME, wire::body(rd, n))
        .await
        .map_err(|_| FrameError::Io(std::io::ErrorKind::TimedOut.into()))??;
    wire::decode(&body)
}

async fn worker(
    stream: UnixStream,
    conn: u64,
    (ticket, flight): (Ticket, Arc<Semaphore>),
    tx: UnboundedSender<Event>,
    cancel: CancellationToken,
) {
    let (mut rd, mut wr) = stream.into_split();
    let hello = tokio::select! {
        biased;
        // No share of the frames in flight: hellos are bounded by the lobby
        // (64 of 64 KiB), and never wait behind a worker's large frame.
        hello = tokio::time::timeout(HELLO_TIME, frame(&mut rd, HELLO_FRAME, None)) => hello,
        () = ticket.evicted() => {
            return tracing::debug!("an actor connection was evicted by newer ones before its hello; closed");
        }
    };
    drop(ticket);
    let (rank, pid) = match hello {
        Ok(Ok(Some(FromWorker::Hello { rank, pid, .. }))) => (rank, pid),
        Ok(Ok(_)) => return tracing::warn!("an actor connection did not begin with hello; closed"),
        Ok(Err(e)) => return tracing::warn!(error = %e, "an actor connection sent what it should not; closed"),
        Err(_) => return tracing::warn!("an actor connection did not say hello in time; closed"),
    };
    let (to, mut frames) = unbounded_channel::<ToWorker>();
    if tx.send(Event::Hello { conn, rank, pid, tx: to }).is_err() {
        return;
    }
    let send = async move {
        while let Some(f) = frames.recv().await {
            if let Err(e) = wire::write(&mut wr, &f).await {
                tracing::debug!(rank, error = %e, "cannot write to an actor worker");
                return;
            }
        }
    };
    let recv = async {
        loop {
            let ev = match frame(&mut rd, wire::MAX_FRAME, Some(&flight)).await {
                Ok(Some(FromWorker::Ready)) => Event::Ready { conn },
                Ok(Some(FromWorker::InitFailed { error })) => Event::InitFailed { conn, error },
                Ok(Some(FromWorker::Result { id, ok, value, error })) => {
                    Event::Result { conn, id, outcome: Outcome { ok, value, error } }
                }
                Ok(Some(FromWorker::Hello { .. })) => continue,
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!(rank, error = %e, "an actor worker sent what it should not; closed");
                    return;
                }
            };
            if tx.send(ev).is_err() {
                return;
            }
        }
    };
    tokio::select! {
        () = cancel.cancelled() => {}
        () = send => {}
        () = recv => {}
    }
    let _ = tx.send(Event::Gone { conn });
}
