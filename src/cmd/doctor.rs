//! `trainlet doctor`: print the resolved plan with where every value came
//! from, the GPU placement and the pre-flight verdicts; exit with the
//! first failing check's code.

use super::Error;
use crate::cli::RunArgs;
use crate::exit;
use crate::gpu::{preflight, prepare};

/// Print the plan and the checks; 0, or the first failing check's code.
pub fn main(args: &RunArgs) -> Result<u8, Error> {
    let plan = super::run::plan(args, false)?;
    print!("{}", plan.describe());
    let spawner =
        crate::process::spawn::Spawner::start().map_err(|source| Error::Thread { what: "spawner", source })?;
    let (verdicts, report) = prepare::preflight(&plan.gpu, &spawner);
    let (placed, topo) = prepare::placements(&plan.gpu, plan.nproc);
    print!("{}", prepare::describe(&plan.gpu, &placed, topo.as_ref(), &verdicts, &report));
    Ok(preflight::first_failure(&verdicts).map_or(exit::SUCCESS, |(code, _)| code))
}
