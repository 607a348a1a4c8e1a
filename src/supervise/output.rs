//! Worker output: drained from pipes, prefixed per rank on the console
//! (torchrun's `[default0]:` form by default) and written to per-rank files.
//!
//! Each stream is one task that reads lines until EOF. A line goes to the
//! console unless it is redirected without tee or its rank is filtered out,
//! and to `<attempt dir>/<local_rank>/std{out,err}.log` when files are on.
//! A worker that leaves a grandchild holding its pipe open cannot stall the
//! agent: the attempt waits for the drain only for a bounded time.

use std::io::Write;
use std::os::fd::OwnedFd;
use std::path::PathBuf;

use tokio::io::{AsyncBufReadExt, BufReader};

/// Where one stream of one worker goes.
#[derive(Debug, Clone)]
pub struct Sink {
    /// Prefix for console lines.
    pub prefix: String,
    /// Show on the console.
    pub console: bool,
    /// Also write to this file.
    pub file: Option<PathBuf>,
    /// stderr (true) or stdout (false).
    pub is_err: bool,
    /// Also hand each prefixed line here (a served run's log shipper).
    pub tap: Option<LineTap>,
}

/// Longest line a [`LineTap`] takes; the rest of a longer one is cut.
const TAP_LINE: usize = 64 * 1024;

/// A bounded hand-off of prefixed lines that never blocks a drain: a line
/// that does not fit is counted as dropped.
#[derive(Debug, Clone)]
pub struct LineTap {
    tx: tokio::sync::mpsc::Sender<Vec<u8>>,
    dropped: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl LineTap {
    /// Lines go to `tx`; those that do not fit are counted in `dropped`.
    pub fn new(tx: tokio::sync::mpsc::Sender<Vec<u8>>, dropped: std::sync::Arc<std::sync::atomic::AtomicU64>) -> Self {
        Self { tx, dropped }
    }

    /// Hand over `prefix` + `line` (which ends with a newline).
    pub fn send(&self, prefix: &str, line: &[u8]) {
        let mut buf = Vec::with_capacity(prefix.len() + line.len().min(TAP_LINE + 1));
        buf.extend_from_slice(prefix.as_bytes());
        if line.len() > TAP_LINE {
            buf.extend_from_slice(&line[..TAP_LINE]);
            buf.push(b'\n');
        } else {
            buf.extend_from_slice(line);
        }
        if self.tx.try_send(buf).is_err() {
            self.dropped.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// Expand the prefix template's macros.
pub fn prefix(template: &str, role: &str, local_rank: u32, rank: u32, host: &str) -> String {
    let mut p = template
        .replace("${role_name}", role)
        .replace("${local_rank}", &local_rank.to_string())
        .replace("${rank}", &rank.to_string())
        .replace("${hostname}", host);
    if !p.is_empty() && !p.ends_with(' ') {
        p.push(' ');
    }
    p
}

/// Drain `fd` into `sink` until EOF.
pub async fn drain(fd: OwnedFd, sink: Sink) {
    drain_watching(fd, sink, None).await;
}

/// A line a helper process prints when it is up, and whom to tell.
pub type ReadyLine = (&'static [u8], tokio::sync::oneshot::Sender<()>);

/// [`drain`], and the first line that starts with `ready`'s marker is not
/// shown but told to its receiver.
pub async fn drain_watching(fd: OwnedFd, sink: Sink, mut ready: Option<ReadyLine>) {
    let pipe = match tokio::net::unix::pipe::Receiver::from_owned_fd(fd) {
        Ok(p) => p,
        Err(e) => {
            tracing::error!(error = %e, "cannot read worker output");
            return;
        }
    };
    // A line is never dropped: a stream meant for a file only goes to the
    // console when the file cannot be created or written.
    let mut console = sink.console;
    let mut file = sink.file.as_ref().and_then(|path| match std::fs::File::create(path) {
        Ok(f) => Some(std::io::BufWriter::new(f)),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot create worker log file; this stream goes to the console");
            console = true;
            None
        }
    });
    let mut reader = BufReader::with_capacity(64 * 1024, pipe);
    let mut line = Vec::with_capacity(256);
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        if !line.ends_with(b"\n") {
            line.push(b'\n');
        }
        if ready.as_ref().is_some_and(|(marker, _)| line.starts_with(marker)) {
            if let Some((_, tx)) = ready.take() {
                let _ = tx.send(());
            }
            continue;
        }
        if let Some(tap) = &sink.tap {
            tap.send(&sink.prefix, &line);
        }
        if let Some(f) = file.as_mut()
            && let Err(e) = f.write_all(&line).and_then(|()| f.flush())
        {
            let path = sink.file.as_ref().map(|p| p.display().to_string()).unwrap_or_default();
            tracing::warn!(path, error = %e, "cannot write worker log file; this stream goes to the console from now on");
            file = None;
            console = true;
        }
        if console {
            let mut buf = Vec::with_capacity(sink.prefix.len() + line.len());
            buf.extend_from_slice(sink.prefix.as_bytes());
            buf.extend_from_slice(&line);
            // One write per line keeps lines from different ranks whole.
            let _ = if sink.is_err {
                std::io::stderr().lock().write_all(&buf)
            } else {
                std::io::stdout().lock().write_all(&buf)
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_prefix_matches_torchrun() {
        assert_eq!(prefix("[${role_name}${local_rank}]:", "default", 3, 7, "h"), "[default3]: ");
        assert_eq!(prefix("${hostname}/${rank}", "r", 0, 12, "pod-1"), "pod-1/12 ");
        assert_eq!(prefix("", "r", 0, 0, "h"), "");
    }
}
