//! What a pod's bridge to an actor's workers hears ([`Event`]: from the
//! round loop, the reader of the actor's operations and the workers'
//! socket), and where it reads and writes the actor's keys ([`Place`]).
//! Apart from the bridge, so that the reader and the socket, which send
//! it events, do not import the bridge that starts them.

use std::collections::BTreeMap;
use std::path::PathBuf;

use tokio::sync::mpsc::UnboundedSender;

use super::wire::ToWorker;
use super::{Fault, Op, Outcome};
use crate::serve::Scope;
use crate::store::Dial;
use crate::supervise::report::Failure;

/// What the round loop tells the bridge.
pub(super) enum Event {
    Op(Op),
    Hello { conn: u64, rank: u32, pid: i32, tx: UnboundedSender<ToWorker> },
    Ready { conn: u64 },
    InitFailed { conn: u64, error: Fault },
    Result { conn: u64, id: u64, outcome: Outcome },
    Gone { conn: u64 },
    RoundStarted { round: u64, ranks: Vec<u32> },
    RoundOver { round: u64, failures: Vec<Failure>, why: String, stopped: bool },
    Rejoin { pid: i32, start: u64, rank: u32, env: BTreeMap<String, String> },
}

/// Where the bridge reads and writes the actor's keys.
#[derive(Debug, Clone)]
pub struct Place {
    /// The agents' store.
    pub dial: Dial,
    /// The job's key prefix.
    pub base: String,
    /// The control token's file (operations are sealed with it).
    pub token_file: PathBuf,
    /// The serving session operations are sealed for.
    pub scope: Scope,
}
