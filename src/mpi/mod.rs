//! MPI, in one tree: the launcher role over SSH ([`launcher`], `trainlet
//! mpi -- mpirun ...`, with [`hosts`]: where the hosts are and the
//! environment that points every MPI family at trainlet's ssh client), the
//! worker role ([`worker`], `trainlet sshd`), and
//! MPI without a launcher or SSH ([`pmi`]: the PMI-1/PMI-2 server of the
//! ranks `trainlet run --framework mpi` starts itself). The SSH server and
//! client the launcher role uses are `crate::ssh`; what the round loop and
//! the attempt make of a PMI job are `launch/pmi.rs` and
//! `supervise/mpi.rs`.

pub mod hosts;
pub mod launcher;
pub(crate) mod pmi;
pub mod worker;

pub use launcher::Error;
