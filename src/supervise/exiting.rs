//! Workers that raised an exception of their own and then hang in their
//! exit. A Python rank whose exception nobody caught prints its traceback
//! and starts to exit, and its exit can wait for the peers it just broke:
//! JAX's `jax.distributed` shuts down at exit through a barrier of every
//! process, which the others, blocked in a collective that waits for this
//! one, never reach; a collective library's destructor can do the same.
//! Nothing exits, so nothing fails and the job hangs. Such a worker shows
//! it from outside: its last lines state an exception of its own
//! ([`super::cause::raised`]) at least [`EXIT_GRACE`] ago, and its main
//! thread no longer runs the program (no `<module>` frame: it is in
//! `threading._shutdown`, an `atexit` handler, or a C finalizer). Such a
//! worker is killed (its process group, SIGKILL) and its failure is the
//! exception it raised ([`Crew::exiting`]), so the round fails at once with
//! its root cause.

use std::time::Duration;

use super::crew::Crew;
use super::policy::Attempt;
use crate::process::signals::now_us;

/// How long a worker that raised may take to exit before it is looked at
/// (an exit that saves or flushes takes a few seconds; one that waits for
/// its broken peers, for ever).
pub(super) const EXIT_GRACE: Duration = Duration::from_secs(15);
/// How often the live workers' last lines are looked at.
pub(super) const CHECK_EVERY: Duration = Duration::from_secs(2);

/// Kill each live worker that raised an exception of its own at least
/// [`EXIT_GRACE`] ago and whose main thread is exiting; remember why.
pub(super) async fn stop_stuck(core: &Attempt, crew: &mut Crew) {
    let grace = u64::try_from(EXIT_GRACE.as_micros()).unwrap_or(u64::MAX);
    let until = now_us().saturating_sub(grace);
    let mut found = Vec::new();
    for lr in core.alive() {
        let Some(w) = crew.workers.get(&lr) else { continue };
        let Some(pid) = w.pid else { continue };
        if crew.exiting.contains_key(&lr) {
            continue;
        }
        if let Some(raised) = super::cause::raised(&w.tail.lines(), 0, until) {
            found.push((lr, w.rank, pid, raised));
        }
    }
    for (lr, rank, pid, (at, line)) in found {
        let Some(start) = crate::sys::proc_start(pid) else { continue };
        let read = tokio::task::spawn_blocking(move || crate::stacks::sampler::Sampler::default().sample(pid, start));
        let Ok(Some(sample)) = read.await else { continue };
        if sample.frames.iter().any(|f| f.function == "<module>") {
            // It runs the program still: the exception was caught.
            continue;
        }
        let at_frame =
            sample.frames.first().map_or_else(|| "in C, no Python frame left".to_string(), ToString::to_string);
        tracing::error!(
            local_rank = lr,
            rank,
            error = %line,
            exiting_at = %at_frame,
            grace_s = EXIT_GRACE.as_secs(),
            "worker rank {rank} raised an exception and hangs in its exit (waiting for the peers it broke?); killing it so that the round fails with its error"
        );
        crew.exiting.insert(lr, (at, line));
        crate::sys::signal_group(pid, libc::SIGKILL);
    }
}
