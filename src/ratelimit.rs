//! Log lines a remote peer can trigger, rate limited.
//!
//! One misbehaving client can open thousands of connections; each would
//! otherwise write its own line. [`RateLimit`] admits the first `burst`
//! lines of every `window`, counts the rest, and hands that count to the
//! next admitted line so that nothing is dropped silently.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// A shared budget of log lines per window.
#[derive(Debug)]
pub struct RateLimit {
    burst: u32,
    window: Duration,
    state: Mutex<Window>,
}

#[derive(Debug, Default)]
struct Window {
    start: Option<Instant>,
    count: u32,
    suppressed: u64,
}

impl RateLimit {
    /// `burst` lines per `window`.
    pub const fn new(burst: u32, window: Duration) -> Self {
        Self { burst, window, state: Mutex::new(Window { start: None, count: 0, suppressed: 0 }) }
    }

    /// Whether to log this line now: Some(lines left out since the last
    /// admitted one), or None (counted, to be reported later).
    pub fn admit(&self) -> Option<u64> {
        let mut w = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = Instant::now();
        if w.start.is_none_or(|s| now.duration_since(s) >= self.window) {
            w.start = Some(now);
            w.count = 0;
        }
        if w.count >= self.burst {
            w.suppressed += 1;
            return None;
        }
        w.count += 1;
        Some(std::mem::take(&mut w.suppressed))
    }
}

/// Log at `$level` through the [`RateLimit`] `$limit`; a line that follows
/// suppressed ones says how many were left out (`suppressed=N`).
#[macro_export]
macro_rules! limited {
    ($limit:expr, $level:ident, $($arg:tt)+) => {
        if let Some(suppressed) = $limit.admit() {
            if suppressed > 0 {
                tracing::$level!(suppressed, "similar lines suppressed by the rate limit");
            }
            tracing::$level!($($arg)+);
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_burst_per_window_and_the_rest_counted_for_the_next_line() {
        let l = RateLimit::new(3, Duration::from_secs(10));
        let admitted: Vec<Option<u64>> = (0..5).map(|_| l.admit()).collect();
        assert_eq!(admitted, [Some(0), Some(0), Some(0), None, None]);
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(l.admit(), Some(2), "the next window's first line carries the count");
        assert_eq!(l.admit(), Some(0));
    }
}
