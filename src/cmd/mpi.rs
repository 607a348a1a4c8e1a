//! `trainlet mpi -- mpirun ...` (and `mpirun`, `mpiexec`): the launcher
//! role (`crate::mpi::launcher`) inside the process frame every
//! supervising mode shares (`crate::process::supervised`).

use super::Error;
use crate::cli::MpiArgs;

/// `trainlet mpi`: mpirun's code, a signal's, or the hosts' verdict.
pub fn main(args: MpiArgs) -> Result<u8, Error> {
    Ok(crate::process::supervised(|events, cancel| async move {
        super::finish("trainlet", crate::mpi::launcher::run(args, events, cancel).await.map_err(Error::from))
    })?)
}
