//! `trainlet keygen`: the SSH keys of an MPI job as a Kubernetes Secret
//! manifest on stdout (and files with `--out`).

use super::Error;
use crate::cli::KeygenArgs;
use crate::exit;

/// Generate and print; the files written are named on stderr.
pub fn main(args: &KeygenArgs) -> Result<u8, Error> {
    let g = crate::ssh::keygen::generate(
        &args.name,
        args.namespace.as_deref(),
        args.kind,
        args.split,
        args.out.as_deref(),
    )?;
    print!("{}", g.manifest);
    for f in g.files {
        eprintln!("wrote {}", f.display());
    }
    Ok(exit::SUCCESS)
}
