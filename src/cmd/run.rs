//! `trainlet run` (and `torchrun`): resolve the plan, then the launch flow
//! (`crate::launch`) inside the process frame every supervising mode
//! shares (`crate::process::supervised`).

use super::Error;
use crate::cli::RunArgs;
use crate::config::{Env, Plan};

/// The plan of `args` from the process environment.
pub fn plan(args: &RunArgs, need_command: bool) -> Result<Plan, Error> {
    Ok(Plan::resolve(args, &Env::from_process(), need_command)?)
}

/// Run the job; its code is the workers' (or a launch failure's).
pub fn main(args: &RunArgs) -> Result<u8, Error> {
    let plan = plan(args, true)?;
    // A lane agent's lines say which lane they are of (`crate::serve::lane`).
    let span = match plan.serve.as_ref().and_then(|s| s.lane.as_ref()) {
        Some(lane) => tracing::info_span!("lane", run = lane.seq),
        None => tracing::Span::none(),
    };
    let outcome = crate::process::supervised(|events, cancel| {
        let job = async move {
            match crate::launch::run(plan, events, cancel).await {
                Ok(code) => code,
                Err(e) => super::finish("trainlet", Err(Error::from(e))),
            }
        };
        tracing::Instrument::instrument(job, span)
    })?;
    Ok(outcome)
}
