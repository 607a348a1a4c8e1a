//! Progress of one initializer run: atomic counters the workers add to,
//! a plain log line at a fixed interval (files, bytes, rate, ETA: no
//! terminal control codes, one line per interval, suited to pod logs), and
//! a snapshot the agent's Prometheus endpoint reads at scrape time.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Shared counters.
#[derive(Debug, Default)]
pub struct Progress {
    files_total: AtomicU64,
    files_done: AtomicU64,
    bytes_total: AtomicU64,
    bytes_done: AtomicU64,
    bytes_fetched: AtomicU64,
    retries: AtomicU64,
    started: Mutex<Option<Instant>>,
}

/// The figures at one moment.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Snapshot {
    /// Files to have in place.
    pub files_total: u64,
    /// Files verified and published (or found already in place).
    pub files_done: u64,
    /// Bytes of all files.
    pub bytes_total: u64,
    /// Bytes in place: published, resumed from an earlier run, or received.
    pub bytes_done: u64,
    /// Bytes received by this run.
    pub bytes_fetched: u64,
    /// Reads retried after a transient failure.
    pub retries: u64,
    /// Receive rate of this run, bytes per second.
    pub rate: f64,
    /// Seconds left at that rate, if it is known.
    pub eta: Option<f64>,
}

impl Progress {
    /// The plan: `files` files of `bytes` bytes, of which `done_files` and
    /// `done_bytes` are already in place. Starts the rate clock.
    pub fn plan(&self, files: u64, bytes: u64, done_files: u64, done_bytes: u64) {
        self.files_total.store(files, Ordering::Relaxed);
        self.bytes_total.store(bytes, Ordering::Relaxed);
        self.files_done.store(done_files, Ordering::Relaxed);
        self.bytes_done.store(done_bytes, Ordering::Relaxed);
        *self.started.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Instant::now());
    }

    /// `n` bytes received.
    pub fn received(&self, n: u64) {
        self.bytes_done.fetch_add(n, Ordering::Relaxed);
        self.bytes_fetched.fetch_add(n, Ordering::Relaxed);
    }

    /// `n` received bytes thrown away (a stream restarted from the start).
    pub fn discarded(&self, n: u64) {
        self.bytes_done.fetch_sub(n, Ordering::Relaxed);
    }

    /// One file published.
    pub fn file_done(&self) {
        self.files_done.fetch_add(1, Ordering::Relaxed);
    }

    /// One read retried.
    pub fn retried(&self) {
        self.retries.fetch_add(1, Ordering::Relaxed);
    }

    /// The figures now.
    pub fn snapshot(&self) -> Snapshot {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let elapsed = self
            .started
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .map_or(Duration::ZERO, |s| s.elapsed())
            .as_secs_f64();
        let (total, done, fetched) = (get(&self.bytes_total), get(&self.bytes_done), get(&self.bytes_fetched));
        let rate = if elapsed > 0.0 { fetched as f64 / elapsed } else { 0.0 };
        let eta = (rate > 0.0).then(|| total.saturating_sub(done) as f64 / rate);
        Snapshot {
            files_total: get(&self.files_total),
            files_done: get(&self.files_done),
            bytes_total: total,
            bytes_done: done,
            bytes_fetched: fetched,
            retries: get(&self.retries),
            rate,
            eta,
        }
    }
}

impl std::fmt::Display for Snapshot {
    /// `files 3/10, 1.2 GiB/4.0 GiB (30%), 210.0 MiB/s, ETA 14s`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let pct = if self.bytes_total > 0 { 100.0 * self.bytes_done as f64 / self.bytes_total as f64 } else { 100.0 };
        #[expect(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "a finite, non-negative f64 rounded to u64"
        )]
        let rate = bytes(self.rate.max(0.0) as u64);
        write!(
            f,
            "files {}/{}, {}/{} ({pct:.0}%), {rate}/s",
            self.files_done,
            self.files_total,
            bytes(self.bytes_done),
            bytes(self.bytes_total)
        )?;
        match self.eta {
            Some(s) if self.bytes_done < self.bytes_total => write!(f, ", ETA {}", secs(s))?,
            _ => {}
        }
        if self.retries > 0 {
            write!(f, ", {} retries", self.retries)?;
        }
        Ok(())
    }
}

/// `1.5 GiB`, `12.0 MiB`, `512 B`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = UNITS[0];
    for u in &UNITS[1..] {
        if v < 1024.0 {
            break;
        }
        v /= 1024.0;
        unit = u;
    }
    format!("{v:.1} {unit}")
}

fn secs(s: f64) -> String {
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "a finite, non-negative f64 rounded to u64"
    )]
    let s = s.ceil().max(0.0) as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_reads_well_in_a_log() {
        let s = Snapshot {
            files_total: 10,
            files_done: 3,
            bytes_total: 4 << 30,
            bytes_done: 1 << 30,
            bytes_fetched: 1 << 30,
            retries: 2,
            rate: 200.0 * 1048576.0,
            eta: Some(15.4),
        };
        assert_eq!(s.to_string(), "files 3/10, 1.0 GiB/4.0 GiB (25%), 200.0 MiB/s, ETA 16s, 2 retries");
        assert_eq!(bytes(512), "512 B");
        assert_eq!(secs(3725.0), "1h02m");
        assert_eq!(secs(61.0), "1m01s");
    }

    #[test]
    fn counters_add_up() {
        let p = Progress::default();
        p.plan(4, 1000, 1, 100);
        p.received(300);
        p.discarded(50);
        p.file_done();
        let s = p.snapshot();
        assert_eq!((s.files_done, s.bytes_done, s.bytes_fetched), (2, 350, 300));
        assert!(!s.to_string().contains('\x1b'), "no terminal control codes");
    }
}
