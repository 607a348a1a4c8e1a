//! `trainlet sshd` (and `sshd` through a link, with sshd(8)'s argv): the
//! MPI worker role (`crate::mpi::worker`) inside the process frame every
//! supervising mode shares (`crate::process::supervised`).

use super::Error;
use crate::cli::SshdArgs;

pub use crate::mpi::worker::{SshdError, args_from_sshd};

/// Serve until SIGTERM or job done.
pub fn main(args: SshdArgs) -> Result<u8, Error> {
    Ok(crate::process::supervised(|events, cancel| async move {
        super::finish("trainlet", crate::mpi::worker::serve(args, events, cancel).await.map_err(Error::from))
    })?)
}
