//! Waiting in the launch flow while honouring stop signals ([`until_stop`]).

use tokio::sync::mpsc::UnboundedReceiver;

use crate::config::Plan;
use crate::process::signals::{Heard, SysEvent};
use crate::sys;

/// Drive `fut` while honouring stop signals; Err(signal) if one came first.
pub(super) async fn until_stop<F: std::future::Future>(
    events: &mut UnboundedReceiver<SysEvent>,
    plan: &Plan,
    fut: F,
) -> std::result::Result<F::Output, i32> {
    tokio::pin!(fut);
    loop {
        tokio::select! {
            out = &mut fut => return Ok(out),
            ev = events.recv() => match Heard::of(ev, &plan.stop_signals) {
                Heard::Stop { signal, asked } => {
                    if !asked {
                        tracing::warn!(signal = %sys::signal_name(signal), "stop signal before workers started; exiting");
                    }
                    return Err(signal);
                }
                Heard::Exited { pid, exit, .. } => tracing::debug!(pid, %exit, "reaped orphan"),
                Heard::Other(_) => {}
            },
        }
    }
}
