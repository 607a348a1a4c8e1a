//! The single integration-test binary: starts the real `trainlet` binary with
//! a scrubbed environment, real PyTorch workers (CPU, gloo) and misbehaving
//! fixture workers. Every wait has a generous timeout so a hang fails.
//!
//! PyTorch is found at `$TRAINLET_TEST_PYTHON`, else `.venv/bin/python` in the
//! repository (what `tests/setup.sh` installs).

mod actor_runtime;
mod actors;
mod cli;
mod cluster;
mod containers;
mod docs;
mod fault;
mod frameworks;
mod gpu;
mod hang;
mod hardening;
mod init;
mod init_remote;
mod lanes;
mod layout;
mod liveness;
mod memcg;
mod mpi;
mod pmi;
mod pmi_suite;
mod preload;
mod progress;
mod recipes;
mod rendezvous;
mod rendezvous_time;
mod replicas;
mod round_keys;
mod runtimes;
mod serve;
mod serve_bounds;
mod serve_door;
mod serve_files;
mod serve_setup;
mod serve_store;
mod signals;
mod ssh;
mod sshkit;
mod stacks;
mod store;
mod store_inproc;
mod stragglers;
#[path = "../support/mod.rs"]
mod support;
mod torch;
mod util;
