//! Waits that say what they wait for.
//!
//! A pod that waits (for the store, for its peers, for a spare's room)
//! must never be silent at info level: [`Waiting`] logs one line when what
//! it waits for changes, and again every [`EVERY`] while nothing changes,
//! with how long it has waited and how long it has left. Waits that
//! usually end at once stay quiet for [`QUIET`] first, so a healthy
//! rendezvous adds no lines. Unbounded waits (a spare waiting for room)
//! double their period up to [`MAX_EVERY`] while nothing changes.

use std::time::Duration;

use tokio::time::Instant;

/// How often an unchanged wait repeats itself.
pub const EVERY: Duration = Duration::from_secs(10);
/// The longest period of an unbounded wait's repeats.
pub const MAX_EVERY: Duration = Duration::from_secs(300);
/// Waits shorter than this log nothing.
pub const QUIET: Duration = Duration::from_secs(1);
/// A line due this close is logged now: waits poll once a second, and a
/// poll a hair early must not push the line to the next poll.
const SLACK: Duration = Duration::from_millis(250);

/// One wait's reporter.
#[derive(Debug)]
pub struct Waiting {
    what: String,
    started: Instant,
    deadline: Option<Instant>,
    every: Duration,
    next: Instant,
    last: Option<String>,
}

impl Waiting {
    /// A wait for `what` that gives up at `deadline` (None: unbounded).
    pub fn new(what: impl Into<String>, deadline: Option<Instant>) -> Self {
        let started = Instant::now();
        Self { what: what.into(), started, deadline, every: EVERY, next: started + QUIET, last: None }
    }

    /// The state of the wait is `state` (who or what is missing, the last
    /// error): log it if it changed since the last line, or if the period
    /// is over. Returns whether a line was logged.
    pub fn report(&mut self, state: &str) -> bool {
        let now = Instant::now();
        let changed = self.last.as_deref().is_some_and(|l| l != state);
        if now + SLACK < self.next && !changed {
            return false;
        }
        let waited_s = now.duration_since(self.started).as_secs();
        match self.deadline {
            Some(d) => {
                let left_s = d.saturating_duration_since(now).as_secs();
                tracing::info!(waited_s, left_s, "waiting for {}: {state}", self.what);
            }
            None => tracing::info!(waited_s, "waiting for {}: {state}", self.what),
        }
        if self.deadline.is_none() && !changed && self.last.is_some() {
            self.every = (self.every * 2).min(MAX_EVERY);
        } else if changed {
            self.every = EVERY;
        }
        self.next = now + self.every;
        self.last = Some(state.to_string());
        true
    }
}

/// Sleep until `at`, or forever when there is no deadline (a `select!`
/// arm for an optional timer).
pub async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn quiet_at_first_then_on_change_and_every_period() {
        let mut p = Waiting::new("pods", Some(Instant::now() + Duration::from_secs(60)));
        assert!(!p.report("1 of 2"), "a wait that ends at once is quiet");
        tokio::time::advance(QUIET).await;
        assert!(p.report("1 of 2"));
        assert!(!p.report("1 of 2"));
        assert!(p.report("2 of 3"), "a change is logged at once");
        tokio::time::advance(EVERY - SLACK * 2).await;
        assert!(!p.report("2 of 3"));
        tokio::time::advance(SLACK).await;
        assert!(p.report("2 of 3"), "an unchanged wait repeats every period");
    }

    #[tokio::test(start_paused = true)]
    async fn unbounded_waits_back_off_until_something_changes() {
        let mut p = Waiting::new("room", None);
        tokio::time::advance(QUIET).await;
        assert!(p.report("full"));
        let mut gaps = Vec::new();
        let mut since = 0u64;
        for _ in 0..3000 {
            tokio::time::advance(Duration::from_secs(1)).await;
            since += 1;
            if p.report("full") {
                gaps.push(since);
                since = 0;
            }
        }
        assert_eq!(&gaps[..6], &[10, 20, 40, 80, 160, 300]);
        assert!(gaps[6..].iter().all(|g| *g == 300), "{gaps:?}");
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(p.report("a smaller round runs"));
        tokio::time::advance(EVERY).await;
        assert!(p.report("a smaller round runs"), "a change restarts the period");
    }
}
