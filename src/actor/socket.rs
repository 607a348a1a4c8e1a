//! The agent's ends of an actor's connections: the Unix socket its
//! workers dial (each connection's hello, then its frames as
//! [`Event`]s for the bridge's core), and the writer of outcomes to the
//! agents' store, in order, on a connection of its own.

use std::time::Duration;

use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc::{UnboundedSender, unbounded_channel};
use tokio_util::sync::CancellationToken;

use super::Outcome;
use super::bridge::Event;
use super::wire::{self, FromWorker, ToWorker};
use crate::serve::Link;

/// How long a worker has to say who it is.
const HELLO_TIME: Duration = Duration::from_secs(30);

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
        tokio::spawn(worker(stream, next, tx.clone(), cancel.child_token()));
    }
}

async fn worker(stream: UnixStream, conn: u64, tx: UnboundedSender<Event>, cancel: CancellationToken) {
    let (mut rd, mut wr) = stream.into_split();
    let hello = tokio::time::timeout(HELLO_TIME, wire::read(&mut rd)).await;
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
            let ev = match wire::read(&mut rd).await {
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
