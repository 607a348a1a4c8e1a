//! The round's protocol, pure: every decision an agent takes about a round
//! (joining and forming one, where a pod stands once it closed, what a
//! spare does with what it heard, what a store host's leaving means, and
//! whether a served run's stop may end a round), as functions of what the
//! agent read, with no I/O, no clock and no task.
//!
//! The agent (`trainlet::rendezvous`, `trainlet::launch`, `trainlet::serve`)
//! reads the store, calls these, and carries out what they say; the seeded
//! simulation (`src/sim`, `bash tests/sim.sh`) calls the very same
//! functions against a simulated store, under schedules that reorder,
//! delay and kill, and checks the job's invariants after every step.
//!
//! Where the order of the store operations is itself the protocol, the
//! crate holds the whole sequence as a machine that says which operation
//! comes next and takes what it got (with the time now, for its bounds):
//! forming a round ([`form::Form`]), a spare's wait ([`spare::SpareWait`]),
//! settling a round ([`settle::Decide`], [`settle::Finish`]) and a served
//! run's stop ([`stop::StopRun`]). The agent and the simulation carry out
//! the same operations in the same order.
//!
//! The historic ordering bugs of the round are kept as [`mutant`]s: with
//! the `sim` feature (the simulation's build only) each can be switched
//! back on, and the simulation must find it.

#![forbid(unsafe_code)]

pub mod claim;
pub mod form;
pub mod groups;
pub mod host_left;
pub mod join;
pub mod monitor;
pub mod mutant;
pub mod settle;
pub mod spare;
pub mod stop;

pub use join::Closed;
