//! trainlet's exit codes: a public API that Kubernetes `podFailurePolicy`
//! rules match on. Never renumber; the book carries the same table
//! (`docs/src/exit-codes.md`, kept equal by a test).
//!
//! | code | meaning |
//! |---|---|
//! | 0 | every worker on every pod succeeded |
//! | 1-127, 211-255 | the root-cause worker's own exit code, passed through, once the restart budget is spent (1 for a failure that exited 0: an MPI rank that left without `MPI_Finalize` or called `MPI_Abort` with 0, or a `0=restart` rule) |
//! | 126 / 127 | a worker could not be executed / was not found (exec's errno, reported by the spawner) |
//! | 128+N | the first failing worker was killed by signal N, or trainlet itself was stopped by signal N (143 = SIGTERM) |
//! | 200 | configuration error: a bad flag, env var or world mismatch between pods, or a node rank another live pod holds |
//! | 201 | rendezvous timeout: the store, a peer pod, or an MPI host's SSH server was not reachable before the deadline |
//! | 202 | internal error in trainlet (a bug, or an unexpected OS failure) |
//! | 203 | the store host went away and did not come back before the join deadline, or a pod neither stopped nor died in time |
//! | 204 | this pod belongs to an older JobSet restart attempt than the job; it is refused |
//! | 205 | a worker exit matched a `fail` rule of the failure policy (FailJob) |
//! | 206 | a worker hung: in uninterruptible sleep past `--hung-timeout`, survived SIGKILL, or reported no progress for `--progress-timeout` once the restart budget is spent (a `no-progress=fail` rule gives 205) |
//! | 207 | a GPU pre-flight check found a faulty node: fewer GPUs than `--expect-gpus`, uncorrected ECC errors, remapped rows pending or failed, a pending MIG change, a GPU lost to NVML; or a health check before a round did, or found the checkpoint directory not writable or /dev/shm smaller than `--min-shm`; or the pod was evicted as a straggler's (`--evict-stragglers`) |
//! | 208 | a GPU pre-flight check found the job asking for what the pod lacks: more workers than GPUs, or the wrong MIG mode (`--mig`) |
//! | 209 | a worker exited with a code in trainlet's reserved range 200-210 |
//! | 210 | a worker could not be started because fork failed (EAGAIN/ENOMEM: the pids cgroup limit or memory), after retrying with backoff for the grace period |
//!
//! Kubernetes classes (see `runtimes/`): 205, 208 and 200 are worker/config
//! bugs (FailJob); 143, 130, 129 and 204 are preemption or stale pods
//! (Ignore); everything else, including 201, 203, 206 and 207 (a bad node:
//! the retry should land elsewhere), is a retriable fault (Count).

/// Every worker succeeded.
pub const SUCCESS: u8 = 0;
/// A worker binary could not be executed (permission, format).
pub const WORKER_NOT_EXECUTABLE: u8 = 126;
/// A worker binary was not found.
pub const WORKER_NOT_FOUND: u8 = 127;
/// Bad configuration: flags, env, pods that disagree on the world, or a
/// second live pod of one node rank (it is refused; the first goes on).
pub const CONFIG: u8 = 200;
/// The store, a peer, or an MPI host's SSH server did not answer before the deadline.
pub const RENDEZVOUS_TIMEOUT: u8 = 201;
/// trainlet failed internally.
pub const INTERNAL: u8 = 202;
/// A peer pod or the store host left while the job ran.
pub const PEER_LOST: u8 = 203;
/// This pod is from an older JobSet restart attempt than the job.
pub const STALE_ATTEMPT: u8 = 204;
/// A worker exit matched a `fail` rule.
pub const FAILED_BY_POLICY: u8 = 205;
/// A worker hung in uninterruptible sleep or survived SIGKILL.
pub const WORKER_UNKILLABLE: u8 = 206;
/// A worker hung: 206 again, for one that stopped reporting progress.
pub const WORKER_HUNG: u8 = WORKER_UNKILLABLE;
/// A pre-flight check found a faulty GPU or a missing one: the node is at fault.
pub const GPU_FAULT: u8 = 207;
/// A pre-flight check found the job asking for GPUs or a MIG mode the pod lacks.
pub const GPU_MISMATCH: u8 = 208;
/// A worker's own code fell in 200-210 and was remapped to keep this table unambiguous.
pub const WORKER_RESERVED: u8 = 209;
/// fork failed for a worker (pids limit or memory), retried for the grace period.
pub const FORK_FAILED: u8 = 210;

/// The exit code for a worker that ended with `status`.
pub fn for_worker(status: crate::sys::Exit) -> u8 {
    match status {
        crate::sys::Exit::Code(c) => {
            let c = u8::try_from(c.clamp(0, 255)).unwrap_or(u8::MAX);
            if (CONFIG..=FORK_FAILED).contains(&c) { WORKER_RESERVED } else { c }
        }
        crate::sys::Exit::Signal(s) => for_signal(s),
    }
}

/// 128 + N, as shells and Kubernetes report a death by signal N.
pub fn for_signal(signal: i32) -> u8 {
    u8::try_from(128 + signal.clamp(1, 127)).unwrap_or(u8::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::Exit;
    use test_case::test_case;

    #[test_case(Exit::Code(3), 3; "worker code passes through")]
    #[test_case(Exit::Code(1), 1; "python exception")]
    #[test_case(Exit::Code(255), 255; "top of range")]
    #[test_case(Exit::Code(201), WORKER_RESERVED; "reserved range remapped")]
    #[test_case(Exit::Code(210), WORKER_RESERVED; "fork-failed code remapped")]
    #[test_case(Exit::Code(211), 211; "above the reserved range")]
    #[test_case(Exit::Signal(9), 137; "sigkill")]
    #[test_case(Exit::Signal(15), 143; "sigterm")]
    fn worker_codes(status: Exit, want: u8) {
        assert_eq!(for_worker(status), want);
    }
}
