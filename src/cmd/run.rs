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
    let plan = plan(args, true).inspect_err(launcher_error_file)?;
    // A lane agent's lines say which lane they are of (`crate::serve::lane`).
    let span = match plan.serve.as_ref().and_then(|s| s.lane.as_ref()) {
        Some(lane) => tracing::info_span!("lane", run = lane.seq),
        None => tracing::Span::none(),
    };
    let outcome = crate::process::supervised(|events, cancel| {
        let job = async move {
            match crate::launch::run(plan, events, cancel).await {
                Ok(code) => code,
                Err(e) => {
                    let e = Error::from(e);
                    launcher_error_file(&e);
                    super::finish("trainlet", Err(e))
                }
            }
        };
        tracing::Instrument::instrument(job, span)
    })?;
    Ok(outcome)
}

/// A launch that failed before its job had an outcome leaves its error in
/// the launcher's `TORCHELASTIC_ERROR_FILE`, when that is set, as torchrun's
/// `@record` records the exception its main raised.
fn launcher_error_file(e: &Error) {
    let Some(path) = std::env::var_os(crate::env::TORCHELASTIC_ERROR_FILE).filter(|v| !v.is_empty()) else {
        return;
    };
    let now_s = crate::clock::now_us() / 1_000_000;
    let record = crate::launch::error_file::for_error(&crate::error::error_chain(e), now_s);
    crate::launch::error_file::write(std::path::Path::new(&path), &record);
}
