//! The Process Management Interface that MPI ranks started without
//! `mpirun` ask their launcher for (issue 29; `trainlet run --framework
//! mpi`): rank and size, a key-value space, fences. Written here from
//! MPICH's `pmi-1.1.txt`, `pmi-2.0.txt` and `pmi_msg.c`, and from what
//! real clients sent (below).
//!
//! - [`wire`]: PMI-1 lines and PMI-2 frames, parsed and written with bounds.
//! - [`node`]: one pod's service as a pure state machine: the commands of
//!   its local ranks in; replies, fences and the job's end out.
//! - [`server`]: the sockets, one per local rank, and the [`server::Note`]s
//!   the supervisor reads (`crate::supervise::mpi`).
//! - [`fence`]: the job-wide fence over the job's store: a pod's puts are
//!   kept until every local rank is at the fence, then published as one
//!   value; one store BARRIER and one MULTI_GET per pod per fence,
//!   whatever the number of keys.
//! - [`round`]: one round's service on this pod: a socket pair per local
//!   rank, whose end the rank finds at fd 3 (`PMI_FD=3`, with `PMI_RANK`,
//!   `PMI_SIZE`, `PMI_ID`, `PMI_JOBID`), a fresh key-value space per round.
//!
//! Facts from real clients (Debian bookworm, 2026-11-26/27):
//! - Debian's MPICH 4.0.2 speaks PMI-1 only (`MPIR_CVAR_PMI_VERSION=2`
//!   changes nothing): `init pmi_version=1 pmi_subversion=1`, `get_maxes`,
//!   `get_appnum`, `get_my_kvsname`, `get key=PMI_process_mapping`,
//!   `barrier_in`, puts of its business cards (`-bcast-1-0`,
//!   `-allgather-shm-1-<rank>`, about 430 hex characters) each followed by
//!   a barrier and gets, a last barrier, `finalize`. Its `MPI_Abort` sends
//!   `abort exitcode=N` and waits to be killed. Its `MPI_Comm_spawn` fails
//!   inside MPICH ("Error in spawn call") and aborts before any spawn
//!   request reaches the server.
//! - Intel MPI 2021.18.1 (PyPI `impi-rt`) has a built-in PMI-1 client
//!   (the same sequence on `PMI_FD`) and no PMI-2 one: it speaks PMI-2
//!   through the library `I_MPI_PMI_LIBRARY` names, Slurm's `libpmi2.so.0`
//!   (Debian's libpmi2-0). That client: `init pmi_version=2` as a PMI-1
//!   line, then frames with a left-justified length (`%-6d`) and `;;` for a
//!   `;` in a value: `fullinit` (`srcid=` from `PMI_ID`, `pmijobid=` from
//!   `PMI_JOBID`; the reply needs `pmi-version`, `pmi-subversion`, `rank`,
//!   `size`, `appnum`, and `debugged`/`pmiverbose` as TRUE/FALSE;
//!   `spawner-jobid` would mean a spawned job), `job-getid`,
//!   `info-getjobattr key=PMI_process_mapping`, `info-putnodeattr`,
//!   `info-getnodeattr wait=TRUE` (held until a rank of the pod puts the
//!   key), `kvs-put`/`kvs-fence`/`kvs-get` (with `jobid`, `srcid=-1`) when
//!   ranks are on several pods, `finalize`. Its abort is `abort
//!   isworld=TRUE msg=...`, after which the library exits 1. It never
//!   sends `thrid`; a reply must not invent one.
//! - Open MPI 5 speaks PMIx only: under a PMI-1/2 server its ranks start
//!   as singletons; Open MPI uses trainlet's SSH path (`trainlet mpi`).

pub mod fence;
pub mod node;
pub mod round;
pub mod server;
pub mod wire;
