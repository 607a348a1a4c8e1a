//! Worker supervision: spawn, drain output, reap, signal, decide.
//!
//! # Design
//! The attempt loop in `crate::launch` `select!`s over [`signals::SysEvent`]s
//! (signals and reaped pids from the one signals thread), the store's
//! end-of-round watch, the stop timers and the hung-worker check, turns each
//! into a [`policy::Event`], and executes the [`policy::Action`]s that the
//! pure [`policy::Attempt`] returns; [`rules`] (the failure policy) is pure too. Nothing here waits on a child except the
//! signals thread; nothing in `policy` does I/O.
//!
//! Synchronisation points: a worker's pid is recorded before the loop reads
//! the next event, so its exit can never be seen as an unknown orphan; the
//! attempt ends only when the policy says no worker is left, after which
//! leftover process groups are killed and output drains get a bounded wait.

pub(crate) mod attempt;
pub(crate) mod output;
pub mod policy;
pub(crate) mod report;
pub(crate) mod worker;
