//! Worker supervision: the worker environment, output, the pure policy
//! core, the attempt shell around it, reports, and the Python zygote
//! workers are forked from with `--preload`. Processes themselves
//! (spawner, signals, reaper) are `crate::process`'s.
//!
//! # Design
//! `attempt::run_attempt` starts the workers (`crew`: each one's
//! environment, placement, output and failure record), then its loop
//! `select!`s over `process::signals::SysEvent`s
//! (signals and reaped pids from the one signals thread), the round's end
//! (through `attempt::Pods`, a [`round_end::RoundEnd`]), the stop timers and the hung-worker check,
//! turns each into a [`policy::Event`], and executes the [`policy::Action`]s
//! that the pure [`policy::Attempt`] returns; the failure rules
//! (`config::rules`) are pure too. Nothing here waits on a child except the
//! signals thread; nothing in `policy` does I/O. The round loop around the
//! attempts is `crate::launch`'s.
//!
//! Synchronisation points: a worker's pid is recorded before the loop reads
//! the next event, so its exit can never be seen as an unknown orphan; the
//! attempt ends only when the policy says no worker is left, after which
//! leftover process groups are killed and output drains get a bounded wait.
//! In an actor's survivors mode, the workers the core keeps at a round's
//! end are held by `carry::Carry` for the next round instead. At a hang
//! verdict (this pod's, or one heard in the round's end), `hang_read` reads
//! the live workers' stacks before the first stop signal goes out.

pub(crate) mod attempt;
pub(crate) mod carry;
pub(crate) mod cause;
mod crew;
mod exiting;
mod flight;
pub(crate) mod hang_read;
pub(crate) mod mpi;
pub(crate) mod output;
pub mod policy;
pub(crate) mod report;
pub mod round_end;
pub(crate) mod worker;
pub(crate) mod zygote;
