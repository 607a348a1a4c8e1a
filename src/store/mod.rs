//! The c10d TCPStore, served by the agent and spoken by its client.
//!
//! PyTorch workers launched by trainlet connect here with their own
//! `torch.distributed.TCPStore` client (`TORCHELASTIC_USE_AGENT_STORE=True`),
//! so the server reproduces the libuv backend's wire protocol, semantics and
//! limits (reference/torch.md section 1). The agents use [`Client`] on the
//! same protocol for their rendezvous.
//!
//! # Design
//! - `wire`: check-then-parse framing; the decoder returns
//!   `Incomplete | Invalid`, never a boxed error, and bounds every length
//!   before reading it.
//! - `state`: keys, queues and parked waiters behind one `std::sync::Mutex`.
//!   A parked WAIT/BARRIER is a per-connection counter; a wake-up travels to
//!   the connection task through its channel, so no lock is held across I/O.
//! - `ties`: keys tied to the connection that last set them (the agents'
//!   heartbeats): `lost` when their connection is closed by its peer.
//! - `server`: accept loop (no reverse DNS anywhere, `TCP_NODELAY`, backlog
//!   = somaxconn, accept backoff) and one task per connection that
//!   `select!`s on the socket, its wake channel and the cancel token.
//! - `client`: the agents' client with connect retry until a deadline.
//! - `guard`: serve mode's agents' store asks every connection for the
//!   control token (a challenge and response after VALIDATE); torch
//!   clients never meet it (workers have stores of their own).
//! - `budget`: the memory a store may hold for its clients (stored data,
//!   parked waits, partial frames, large replies), one limit per store.
//!
//! Must not: spawn processes, know about rendezvous rounds, or panic on any
//! input. A bad peer loses its own connection and nothing else.

mod budget;
mod client;
mod guard;
mod server;
mod state;
mod ties;
mod wire;

pub use budget::{MIN_BUDGET, default_budget, parse_size};
pub use client::{Client, ClientError, Dial, Endpoint, connect_quietly, connect_with_retry};
pub use guard::{Guard, GuardError};
pub use server::{COMMAND_NAMES, Counters, ServerError, StoreLoop, StoreServer, bind_listener, counters};
pub use state::{Budget, ENTRY_OVERHEAD, State};
pub use ties::{LOST, TIES_PER_CONN, TieRule};
pub use wire::{
    Command, DecodeError, Invalid, MAGIC, MAX_FRAME_LEN, MAX_KEY_COUNT, MAX_KEY_LEN, MAX_VALUE_LEN, Scanner,
};
