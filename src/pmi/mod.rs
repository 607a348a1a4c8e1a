//! The Process Management Interface that MPI ranks started without
//! `mpirun` ask their launcher for (issue 29): rank and size, a key-value
//! space, barriers. This module has its wire formats (`wire`); the server
//! that answers each rank on its pre-connected `PMI_FD` comes next.
//!
//! Plan (work in progress, branch `pmi-wip`; read with
//! `../shared/reference/pmi.md` and MPICH's `src/pmi/src/pmi_v1.c`,
//! `pmi_v2.c`, `pmi_msg.c`):
//! - Each local rank gets one end of a `socketpair` as `PMI_FD`, with
//!   `PMI_RANK`, `PMI_SIZE`, `PMI_ID` (= rank, for `PMI2_Init`'s
//!   `fullinit pmirank=`), `PMI_JOBID`/kvsname `trainlet-<run>-<attempt>`;
//!   no `PMI_PORT` (MPICH would then do its `initack` handshake).
//! - A connection speaks PMI-1 lines until `cmd=init pmi_version=2`, which
//!   `PMI2_Init` sends first as a PMI-1 line; after the
//!   `response_to_init pmi_version=2` it speaks PMI-2 frames.
//! - MPICH's PMI_Init sends `init`, then `get_maxes`; `abort` (exitcode=,
//!   error_msg=) gets no reply; `get` answers `get_result rc= found= value=`.
//!   Intel MPI's built-in client speaks PMI-1 on `PMI_FD` when
//!   `I_MPI_PMI_LIBRARY` is unset (flux-core's experience).
//! - Puts are kept per pod until every local rank is in `barrier_in` /
//!   `kvs-fence`; then the pod publishes them as one value
//!   (`pmi/<run>/<attempt>/<fence>/<node>`), waits at one job-wide store
//!   barrier, and reads the other pods' values once: a few store
//!   operations per pod per fence, whatever the number of keys.
//! - `PMI_process_mapping` is pre-put: `(vector,(0,nnodes,ppn))` for the
//!   block layout the agents use.
//! - A rank that exits, is killed or calls `abort` ends the round on every
//!   pod (the supervisor's usual path: budget, rules, report); ranks left
//!   in a barrier get no reply and are stopped with the rest. Spawn
//!   (`mcmd=spawn`, PMI-2 `spawn`) is answered with an error that says so.
//! - Names, from MPICH's `pmi_msg.c` (query -> reply; PMI-1 / PMI-2):
//!   `init` -> `response_to_init` (pmi_version, pmi_subversion);
//!   `initack pmiid=` / `fullinit pmirank=` -> `initack` / `fullinit-response`
//!   (rank, size, appnum, spawner-jobid, debug / pmiverbose);
//!   `get_maxes` -> `maxes` (kvsname_max, keylen_max, vallen_max; MPICH
//!   shrinks vallen to fit its 1024-byte line); `get_universe_size` ->
//!   `universe_size` (size); `get_appnum` -> `appnum` (appnum);
//!   `get_my_kvsname` / `job-getid` -> `my_kvsname` (kvsname) /
//!   `job-getid-response` (jobid); `put` -> `put_result`; `get` /
//!   `info-getjobattr` -> `get_result` / `info-getjobattr-response` (found
//!   TRUE/FALSE, value; PMI-1's found defaults to true when absent);
//!   `barrier_in` -> `barrier_out`; `kvs-put`, `kvs-get`, `kvs-fence`,
//!   `info-putnodeattr`, `info-getnodeattr` -> `<cmd>-response`;
//!   `finalize` -> `finalize_ack` / `finalize-response`; `abort` (exitcode,
//!   message) -> none; publish/unpublish/lookup -> `*_result` /
//!   `name-*-response`. Check `PMIU_msg_set_response` for how `rc` and a
//!   request's `thrid` are echoed before writing the replies.
//! - Seen (2026-11-26, Debian bookworm's MPICH 4.0.2, an `MPI_Allreduce`
//!   program, a throwaway PMI-1 server on socketpairs): `init
//!   pmi_version=1 pmi_subversion=1`, `get_maxes`, `get_appnum`,
//!   `get_my_kvsname`, `get key=PMI_process_mapping`, `barrier_in`, then
//!   puts (`-bcast-1-0`, `-allgather-shm-1-<rank>`, values of about 430
//!   hex characters) each followed by a barrier and gets, a last barrier
//!   and `finalize`. Replies with `rc=0` first were accepted. 2 and 4
//!   ranks ran to the right sums with `(vector,(0,1,N))`, `(vector,(0,2,1))`
//!   and `(vector,(0,2,2))`. `MPIR_CVAR_PMI_VERSION=2` did not switch this
//!   build to PMI-2: the PMI-2 path needs another client (Intel MPI).
//!   Intel MPI 2021.18.1 (PyPI `impi-rt`, mpi4py 4.1.2) sent the same
//!   PMI-1 sequence on `PMI_FD` and ran, with `(vector,(0,1,2))` and
//!   `(vector,(0,2,1))`; `I_MPI_PMI=pmi2` did not switch it to PMI-2 (find
//!   the setting that does, or an MPI that speaks it, for the PMI-2 tests).
//! - Done on this branch: `wire`, `node` (one pod's state machine),
//!   `server` (the sockets), `fence` (the store); real MPICH ranks on one
//!   and on two pods run against them (ignored tests, `PMI_TEST_PROGRAM`).
//!   The spawner passes a descriptor as the child's fd 3
//!   (`WorkerSpec::pass_fd`, `sys::fork`), so `PMI_FD=3`.
//!   Where it plugs in: a `Framework::Mpi` (`config/framework.rs`, with
//!   Trainer's MPI env where it applies); per-rank env in
//!   `supervise/worker.rs::framework_env` (`PMI_RANK` the global rank,
//!   `PMI_SIZE`, `PMI_ID`, `PMI_FD=3`); per round in
//!   `launch/mod.rs` (beside the XGBoost tracker): a socketpair per local
//!   rank (`WorkerSpec::pass_fd`), `server::serve` on a task with a
//!   `fence::StoreFence` over a new store connection, prefix
//!   `trainlet/<run>/pmi/<round>`, mapping `(vector,(0,nnodes,nproc))`;
//!   its `Ended::Aborted`/`Fence` must end the round like a failed worker
//!   (`supervise/attempt.rs` gets it as an event), naming the rank.
//!   Next: `--framework mpi` without SSH in the
//!   launch flow (the fence's prefix per attempt, the service's end feeding
//!   the round's verdict), the tests in tests/it with mpicc-built programs,
//!   mpi4py's suite, the runtime, the benchmark.

pub mod fence;
pub mod node;
pub mod round;
pub mod server;
pub mod wire;
