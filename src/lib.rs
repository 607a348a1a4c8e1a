//! trainlet: the per-pod agent of a distributed training job on Kubernetes.
//!
//! One statically linked binary, PID 1 of every training pod: it discovers
//! rank and world from the Trainer/JobSet env, serves PyTorch's c10d TCPStore
//! protocol so real `torch.distributed` workers rendezvous on it, spawns and
//! supervises the workers like `torchrun`, and exits with a documented code.
//!
//! # Layout
//! - [`cli`]: clap definitions, torchrun-compatible; no I/O.
//! - [`config`]: CLI + env -> [`config::Plan`]; every env var name in `env`.
//! - [`store`]: the TCPStore wire protocol, server and client.
//! - [`rendezvous`]: static and elastic rendezvous of the agents over the store, liveness.
//! - [`supervise`]: signals/reaper thread, spawner, output, pure policy core, report.
//! - [`launch`]: the flow of `trainlet run`.
//! - [`gpu`]: the pod's GPUs (sysfs/procfs), visibility, placement planning.
//! - [`ssh`]: keys, embedded SSH server, ssh(1)-compatible client, hostfiles.
//! - [`sshd`]: the flow of `trainlet sshd` (MPI worker role).
//! - [`mpi`]: the flow of `trainlet mpi` (MPI launcher role).
//! - [`exit`]: exit codes (public API) and [`Error`] -> code.
//! - [`sys`]: every unsafe block and raw syscall.
//!
//! Dependency direction: `launch` -> {`config`, `store`, `rendezvous`,
//! `supervise`}; `sshd`, `mpi` -> {`ssh`, `supervise`}; `store`, `supervise`
//! and `ssh` do not import each other.

pub mod cli;
pub mod cmd;
pub mod config;
pub mod env;
pub mod error;
pub mod exit;
pub mod gpu;
pub mod launch;
pub mod metrics;
pub mod mpi;
pub mod process;
pub mod progress;
pub mod ratelimit;
pub mod rendezvous;
pub mod ssh;
pub mod store;
pub mod supervise;
pub mod sys;
