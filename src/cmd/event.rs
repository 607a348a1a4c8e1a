//! `trainlet event` (hidden): emit Kubernetes Events through
//! [`crate::events`] exactly as the agent does (its identity from the same
//! env, the same queue, series and rate limit), then write them within
//! [`crate::events::FLUSH_BOUND`] and exit 0, whether the API server took
//! them or not. For the cluster tests, and for an admin checking that a
//! runtime's service account may write Events.

use super::Error;
use crate::cli::EventArgs;
use crate::env::{self, Env};
use crate::events::{Config, Event, Events, FLUSH_BOUND, Type};
use crate::exit;

/// Emit one event per note, in order, then flush.
pub fn main(args: EventArgs) -> Result<u8, Error> {
    let type_ = match args.type_.as_str() {
        "Warning" => Type::Warning,
        "Normal" => Type::Normal,
        other => return Err(Error::Usage(format!("--type {other:?}: expected Warning or Normal"))),
    };
    let env = Env::from_process();
    let on = match args.events.as_deref().or_else(|| env.get(env::TRAINLET_EVENTS)) {
        None | Some("on") => true,
        Some("off") => false,
        Some(v) => return Err(Error::Usage(format!("--events {v:?}: expected on or off"))),
    };
    // The API wants names known at compile time; this short-lived command
    // has two, from its argv, for the life of the process.
    let (reason, action): (&'static str, &'static str) = (args.reason.leak(), args.action.leak());
    let rt = crate::process::event_loop()?;
    rt.block_on(async {
        let cancel = tokio_util::sync::CancellationToken::new();
        let events = Events::start(&Config::new(on, &env), &cancel);
        for note in args.notes {
            events.emit(Event { type_, reason, action, note });
        }
        events.finish(FLUSH_BOUND).await;
        cancel.cancel();
    });
    Ok(exit::SUCCESS)
}
