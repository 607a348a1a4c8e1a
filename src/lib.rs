//! trainlet: the per-pod agent of a distributed training job on Kubernetes.
//!
//! One statically linked binary, PID 1 of every training pod: it discovers
//! rank and world from the Trainer/JobSet env, serves PyTorch's c10d TCPStore
//! protocol so real `torch.distributed` workers rendezvous on it, spawns and
//! supervises the workers like `torchrun`, and exits with a documented code.
//!
//! # Layout
//! Layers, bottom first. A module imports only from its own layer or the
//! ones below, and the modules of a layer never import each other in a
//! circle (`tests/it/layout.rs` reads this table and checks both).
//!
//! | layer | modules | what they own |
//! |---|---|---|
//! | 0 | `sys` | every unsafe block and raw syscall, each with its SAFETY note |
//! | 1 | `exit`, `env`, `error`, `ratelimit`, `waiting`, `clock`, `lobby`, `keys` | exit codes (public API), every env var name, every key of the agents' store, error text, log rate limits, "waiting for" lines, UTC time formats, the bounded waiting room of connections without a credential |
//! | 2 | `process` | the one signal/reaper thread, the spawner thread, sweeps of leftovers, the frame of every mode that owns processes |
//! | 3 | `gpu`, `store`, `ssh`, `http`, `stacks`, `events` | the pod's GPUs and placement; the c10d TCPStore wire, server and client; SSH keys, server, client, hostfiles; the bounded HTTP/1.1 requests of trainlet's endpoints; workers' Python and native stacks read from outside them, and who a stalled job waits for; the pod's Kubernetes Events (deduplicated, rate limited, never in the caller's way) |
//! | 4 | `cli`, `config`, `metrics`, `mpi`, `status` | clap definitions; CLI + env -> `config::Plan` (with the failure rules); Prometheus families; MPI in one tree: the launcher role over SSH (hosts, environment, `trainlet mpi`'s flow), the worker role (`trainlet sshd`) and the PMI-1/PMI-2 server of ranks started without mpirun; workers' progress, relayed to Trainer's status endpoint |
//! | 5 | `supervise`, `rendezvous`, `serve`, `inplace` | the pure policy core, worker environment, output and reports; rounds of the agents over the store; serve mode in one tree: served runs, their files and lines, the control API, setup steps, the cache, actors (`serve::actor`: the calls, each pod's bridge to its workers, the worker runtime) and each pod's part of serve mode in the round loop (`serve::pod`); JobSet's in-place restart protocol (watch, attempt, barrier) |
//! | 6 | `launch` | the round loop of `trainlet run` |
//! | 7 | `cmd` | one file per mode and the one error-to-exit-code mapping |
//!
//! `main.rs` sits above them all: `argv[0]` dispatch and the exit code.
//! `config` is above `gpu` and `store` because a `config::Plan` carries
//! their types (`gpu::GpuPlan`, `store::Endpoint`); env var names,
//! which every layer reads, are the foundation `env`.

pub mod cli;
pub(crate) mod clock;
pub mod cmd;
pub(crate) mod config;
pub(crate) mod env;
pub(crate) mod error;
pub mod events;
pub mod exit;
pub mod gpu;
pub(crate) mod http;
pub(crate) mod inplace;
pub(crate) mod keys;
pub(crate) mod launch;
pub(crate) mod lobby;
pub(crate) mod metrics;
pub mod mpi;
pub(crate) mod process;
pub(crate) mod ratelimit;
pub mod rendezvous;
pub(crate) mod serve;
pub mod ssh;
pub mod stacks;
pub(crate) mod status;
pub mod store;
pub mod supervise;
pub mod sys;
pub(crate) mod waiting;
