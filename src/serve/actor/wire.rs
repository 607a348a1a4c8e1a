//! The frames between a pod's agent and its actor workers, over the Unix
//! socket in `TRAINLET_ACTOR_SOCKET`: a 4-byte big-endian length, then a
//! JSON object of that many bytes (at most [`MAX_FRAME`], 64 KiB before
//! the hello; either side closes the connection on a larger one).
//!
//! | from | frame | meaning |
//! |---|---|---|
//! | worker | `{"op": "hello", "rank": R, "local_rank": L, "pid": P}` | first frame: who it is |
//! | agent | `{"op": "init", "target": "pkg.mod:Name", "encoding": "json"\|"pickle", "args": "..."}` | import and instantiate (a function is kept as is) |
//! | worker | `{"op": "ready"}` | instantiated; calls may come |
//! | worker | `{"op": "init_failed", "error": {Fault}}` | `__init__` or the import raised; the worker then exits 1 |
//! | agent | `{"op": "call", "id": N, "method": "m", "encoding": ..., "args": "..."}` | run `m` in a new thread (`__call__` of a function actor) |
//! | agent | `{"op": "cancel", "id": N}` | raise `trainlet_actor.Cancelled` in call N's thread |
//! | worker | `{"op": "result", "id": N, "ok": true, "value": "..."}` | call N returned (encoded as it came) |
//! | worker | `{"op": "result", "id": N, "ok": false, "error": {Fault}}` | call N raised |
//! | agent | `{"op": "reconfigure", "env": {"RANK": "2", ...}}` | survivors mode: cancel the calls, leave the process group, take the new round's variables, join the new group, call `reconfigure(rank, world_size)`; then `ready` (or `init_failed` and exit 1) |
//!
//! `args` is `{"args": [...], "kwargs": {...}}` as JSON text, or base64 of
//! the pickled `(args, kwargs)`; `value` is the JSON text of the result, or
//! base64 of its pickle. A `Fault` is `{"type", "module", "message",
//! "traceback"}` ([`super::Fault`]).

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::{Encoding, Fault};

/// Largest frame either side sends or takes.
pub const MAX_FRAME: usize = 64 * 1024 * 1024;

/// A frame from a worker.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum FromWorker {
    /// Its first frame.
    Hello {
        /// Global rank.
        rank: u32,
        /// Local rank.
        local_rank: u32,
        /// Its process id.
        pid: i32,
    },
    /// Instantiated.
    Ready,
    /// The import or `__init__` raised.
    InitFailed {
        /// What it raised.
        error: Fault,
    },
    /// A call ended.
    Result {
        /// The call.
        id: u64,
        /// Returned (else raised).
        ok: bool,
        /// The encoded result.
        #[serde(default)]
        value: Option<String>,
        /// What it raised.
        #[serde(default)]
        error: Option<Fault>,
    },
}

/// A frame to a worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ToWorker {
    /// Import and instantiate.
    Init {
        /// `package.module:Name`.
        target: String,
        /// How `args` is encoded.
        encoding: Encoding,
        /// The init arguments.
        args: String,
    },
    /// Run a method.
    Call {
        /// The call's number.
        id: u64,
        /// The method.
        method: String,
        /// How `args` is (and the result must be) encoded.
        encoding: Encoding,
        /// The arguments.
        args: String,
    },
    /// Interrupt a call.
    Cancel {
        /// The call's number.
        id: u64,
    },
    /// Survivors mode: join the new round as a kept worker (its variables
    /// in `env`), then say `ready` again.
    Reconfigure {
        /// The round's variables, as a fresh worker of the rank gets them.
        env: std::collections::BTreeMap<String, String>,
    },
}

/// Why a frame could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The connection.
    #[error("the worker's connection")]
    Io(#[from] std::io::Error),
    /// Longer than its limit ([`MAX_FRAME`], or less before a hello).
    #[error("a frame of {0} bytes, more than {1}")]
    TooLong(usize, usize),
    /// Not a frame of this protocol.
    #[error("not a frame of the actor protocol: {0}")]
    Bad(String),
}

/// The length of the next frame, refused past `max` before a byte of it
/// is read; None at a clean end of the stream.
pub async fn length<R: AsyncRead + Unpin>(r: &mut R, max: usize) -> Result<Option<usize>, FrameError> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let n = u32::from_be_bytes(len) as usize;
    if n > max.min(MAX_FRAME) {
        return Err(FrameError::TooLong(n, max.min(MAX_FRAME)));
    }
    Ok(Some(n))
}

/// A frame's `n` bytes, once [`length`] has let them through.
pub async fn body<R: AsyncRead + Unpin>(r: &mut R, n: usize) -> Result<Vec<u8>, FrameError> {
    let mut buf = vec![0u8; n];
    r.read_exact(&mut buf).await?;
    Ok(buf)
}

/// A frame's bytes as what it says.
pub fn decode(body: &[u8]) -> Result<Option<FromWorker>, FrameError> {
    serde_json::from_slice(body).map(Some).map_err(|e| FrameError::Bad(e.to_string()))
}

/// Write one frame.
pub async fn write<W: AsyncWrite + Unpin>(w: &mut W, frame: &ToWorker) -> Result<(), FrameError> {
    let body = serde_json::to_vec(frame).map_err(|e| FrameError::Bad(e.to_string()))?;
    if body.len() > MAX_FRAME {
        return Err(FrameError::TooLong(body.len(), MAX_FRAME));
    }
    let len = u32::try_from(body.len()).map_err(|_| FrameError::TooLong(body.len(), MAX_FRAME))?;
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(&body);
    w.write_all(&out).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One frame of at most [`MAX_FRAME`]; None at a clean end.
    async fn read<R: AsyncRead + Unpin>(r: &mut R) -> Result<Option<FromWorker>, FrameError> {
        let Some(n) = length(r, MAX_FRAME).await? else { return Ok(None) };
        decode(&body(r, n).await?)
    }

    #[tokio::test]
    async fn frames_round_trip_and_oversized_ones_are_refused() {
        let f = FromWorker::Result { id: 4, ok: true, value: Some("[1, 2]".into()), error: None };
        let body = serde_json::to_vec(&f).expect("json");
        let mut raw = u32::try_from(body.len()).expect("small").to_be_bytes().to_vec();
        raw.extend_from_slice(&body);
        let mut r = &raw[..];
        assert_eq!(read(&mut r).await.expect("read"), Some(f));
        assert!(read(&mut r).await.expect("eof").is_none());
        let mut big = &(u32::try_from(MAX_FRAME).expect("fits") + 1).to_be_bytes()[..];
        assert!(matches!(read(&mut big).await, Err(FrameError::TooLong(..))));
        let mut hello = &[&1025u32.to_be_bytes()[..], &[b' '; 1025]].concat()[..];
        assert!(matches!(length(&mut hello, 1024).await, Err(FrameError::TooLong(1025, 1024))));
        let hello: FromWorker =
            serde_json::from_str(r#"{"op":"hello","rank":3,"local_rank":1,"pid":42}"#).expect("hello");
        assert_eq!(hello, FromWorker::Hello { rank: 3, local_rank: 1, pid: 42 });
        let mut out = Vec::new();
        write(&mut out, &ToWorker::Cancel { id: 9 }).await.expect("write");
        assert_eq!(&out[4..], br#"{"op":"cancel","id":9}"#);
        let mut out = Vec::new();
        let env = [("RANK".to_string(), "2".to_string())].into_iter().collect();
        write(&mut out, &ToWorker::Reconfigure { env }).await.expect("write");
        assert_eq!(&out[4..], br#"{"op":"reconfigure","env":{"RANK":"2"}}"#);
    }
}
