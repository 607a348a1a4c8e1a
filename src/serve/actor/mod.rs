//! Actors: a Python class instantiated once in every worker of a served
//! job, whose methods a driver calls through the control API, with state
//! kept between calls and faults answered as errors instead of ending the
//! job.
//!
//! An actor is a served run (`crate::serve::spec::Actor` in its
//! [`crate::serve::spec::Run`]) whose workers run trainlet's actor runtime
//! ([`RUNTIME`], a Python file written next to the served runs) instead of
//! a command. Each worker imports the target, instantiates it, and then
//! runs every call it is given in a thread of its own, so that calls are
//! concurrent. Three parts, one per file:
//!
//! - [`calls`], on the store host, beside the control API: `POST
//!   /v1/actors/{id}/calls` publishes a call in the agents' store and
//!   gathers every rank's result.
//! - [`intake`]: a call's body parsed within bounds, and the bytes the
//!   calls not over may hold.
//! - [`bridge`], in every pod's agent: reads the calls from the store,
//!   hands them to its workers over a Unix socket, writes their results,
//!   and answers for a worker that died with what killed it.
//! - [`reader`]: each pod's reader of the actor's operations in the store.
//! - [`socket`]: the agent's ends of the workers' connections, and the
//!   writer of outcomes to the store.
//! - [`wire`]: the frames between an agent and its workers.
//!
//! # The agents' store
//!
//! Keys under the job's prefix (the store asks every connection for the
//! control token, so only the control API and the agents read or write
//! them):
//!
//! | key | written by | meaning |
//! |---|---|---|
//! | `actor/<seq>/op/<n>` | the control API | operation `n` of the actor of run `seq` ([`Op`], JSON, sealed) |
//! | `actor/<seq>/ops` | the control API | the newest `n` |
//! | `actor/<seq>/first/<round>` | the control API | the first `n` for that round (where a pod that starts it begins to read) |
//! | `actor/<seq>/res/<n>/<rank>` | the agent of `rank` | that rank's [`Outcome`] of call `n` |
//!
//! An operation is bound to the round whose workers must run it: every
//! rank of that round runs it once, a pod whose workers are of a later
//! round answers that it did not run, and a round that ends (a worker
//! died, a pod was lost) answers every call its workers had not finished.
//! A call that no rank ran is sent again to the next round by the control
//! API; a call that some rank ran is an error the driver sees.

pub mod bridge;
pub mod calls;
mod event;
mod intake;
mod reader;
mod socket;
pub mod wire;

use serde::{Deserialize, Serialize};

pub use crate::serve::spec::Encoding;

/// The worker-side runtime: imports the target, instantiates it, serves calls.
pub const RUNTIME: &str = include_str!("runtime.py");

/// Write [`RUNTIME`] at `path`, replacing whatever a run left at that
/// name (a changed copy, a link, a FIFO), never read or written through.
pub fn write_runtime(path: &std::path::Path) -> std::io::Result<()> {
    crate::serve::files::write_new(path, RUNTIME.as_bytes())
}

/// Why an actor operation failed on the trainlet side.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The agents' store.
    #[error(transparent)]
    Serve(#[from] crate::serve::Error),
    /// A value in the store or from a worker is not what trainlet writes.
    #[error("{0}")]
    Corrupt(String),
    /// A local file, socket or directory.
    #[error("{what} {path}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// Where.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

pub use crate::keys::serve::ActorKeys as Keys;

/// The kind a sealed operation carries (`crate::serve::seal`).
pub const OP_KIND: &str = "actor-op";

/// One operation of an actor, as the control API publishes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Op {
    /// The actor's run (its `seq`).
    pub actor: u64,
    /// This operation's number (1, 2, ...).
    pub n: u64,
    /// The round whose workers run it.
    pub round: u64,
    /// What to do.
    #[serde(flatten)]
    pub what: What,
}

/// What an operation does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum What {
    /// Call `method` on `ranks` (every rank when None).
    Call {
        /// The method's name.
        method: String,
        /// How `args` is encoded.
        encoding: Encoding,
        /// `{"args": [...], "kwargs": {...}}` (JSON text), or base64 of the
        /// pickled `(args, kwargs)`.
        args: String,
        /// The ranks that run it, ascending.
        ranks: Option<Vec<u32>>,
    },
    /// Cancel call `call` where it runs.
    Cancel {
        /// The call's operation number.
        call: u64,
    },
}

/// One rank's outcome of a call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcome {
    /// The method returned.
    pub ok: bool,
    /// Its result, encoded as the call asked (when `ok`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// What went wrong (when not `ok`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<Fault>,
}

/// An error of one rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fault {
    /// The exception's type (`ValueError`), or trainlet's: [`fault`].
    #[serde(rename = "type")]
    pub kind: String,
    /// The exception's module (`builtins`), when it came from Python.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub module: Option<String>,
    /// Its message.
    pub message: String,
    /// The remote traceback, when it came from Python.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceback: Option<String>,
    /// Did the method start on this rank? (false: it is safe to send again)
    #[serde(default = "yes")]
    pub ran: bool,
    /// The worker's exit code, when it exited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// The signal that killed the worker (`SIGKILL`), when one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<String>,
}

fn yes() -> bool {
    true
}

/// The error types trainlet itself answers with.
pub mod fault {
    /// The worker process of the rank died during the call.
    pub const WORKER_DIED: &str = "WorkerDied";
    /// The round ended (another rank died, a pod was lost, the actor was
    /// stopped) before the rank finished the call.
    pub const ACTOR_RESTARTED: &str = "ActorRestarted";
    /// The actor is over (closed, replaced, failed for good).
    pub const ACTOR_GONE: &str = "ActorGone";
    /// The call was cancelled.
    pub const CANCELLED: &str = "CallCancelled";
    /// The result could not be sent (too large, not encodable).
    pub const BAD_RESULT: &str = "BadResult";
}

impl Outcome {
    /// A failed outcome of trainlet's own.
    pub fn fault(kind: &str, message: String, ran: bool) -> Self {
        Outcome {
            ok: false,
            value: None,
            error: Some(Fault {
                kind: kind.into(),
                module: None,
                message,
                traceback: None,
                ran,
                exit_code: None,
                signal: None,
            }),
        }
    }

    /// Did the method not start (it is safe to send again)?
    pub fn not_run(&self) -> bool {
        self.error.as_ref().is_some_and(|e| !e.ran)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operations_read_back_as_written() {
        let op = Op {
            actor: 3,
            n: 7,
            round: 2,
            what: What::Call {
                method: "train".into(),
                encoding: Encoding::Json,
                args: r#"{"args":[1],"kwargs":{}}"#.into(),
                ranks: Some(vec![0, 3]),
            },
        };
        let text = serde_json::to_string(&op).expect("json");
        assert!(text.contains(r#""kind":"call""#), "{text}");
        assert_eq!(serde_json::from_str::<Op>(&text).expect("back"), op);
        let cancel: Op =
            serde_json::from_str(r#"{"actor":3,"n":8,"round":2,"kind":"cancel","call":7}"#).expect("cancel");
        assert_eq!(cancel.what, What::Cancel { call: 7 });
    }

    #[test]
    fn a_fault_without_ran_counts_as_run() {
        let o: Outcome =
            serde_json::from_str(r#"{"ok":false,"error":{"type":"ValueError","message":"m"}}"#).expect("json");
        assert!(!o.not_run());
        assert!(Outcome::fault(fault::ACTOR_RESTARTED, "x".into(), false).not_run());
    }
}
