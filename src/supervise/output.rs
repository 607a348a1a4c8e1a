//! Worker output: drained from pipes, prefixed per rank on the console
//! (torchrun's `[default0]:` form by default) and written to per-rank files.
//!
//! Each stream is one task that reads lines until EOF. A line goes to the
//! console unless it is redirected without tee or its rank is filtered out,
//! and to `<attempt dir>/<local_rank>/std{out,err}.log` when files are on.
//! A worker that leaves a grandchild holding its pipe open cannot stall the
//! agent: the attempt waits for the drain only for a bounded time.
//!
//! Every buffer on the way is bounded, whatever a worker prints: a stream
//! holds its read buffer and one piece of a line, at most [`LINE`] bytes
//! (plus the prefix). A longer line is shown as several lines of at most
//! [`LINE`] bytes each, every one prefixed, so nothing is lost on the
//! console; the per-rank file gets the bytes as printed, unbroken. A
//! [`LineTap`] holds at most [`TAP_BYTES`] and drops (counting) what does
//! not fit.

use std::io::Write;
use std::os::fd::OwnedFd;
use std::path::PathBuf;

use tokio::io::{AsyncBufRead, AsyncBufReadExt, BufReader};

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
    /// Also keep the last lines here (a worker's stderr: what it said
    /// before it failed, for its failure record).
    pub tail: Option<Tail>,
}

/// Most lines a [`Tail`] keeps.
pub const TAIL_LINES: usize = 40;
/// Most bytes a [`Tail`] keeps, all its lines together.
pub const TAIL_BYTES: usize = 8 * 1024;
/// Most bytes kept of one line in a [`Tail`]; the rest is cut.
const TAIL_LINE: usize = 1024;

/// The last lines of a stream, bounded in lines and bytes, cleaned of
/// control characters (they are a worker's words, shown in a report, a
/// termination message and an Event): what a worker printed just before
/// it failed, read into its failure record once its drain is done.
#[derive(Debug, Clone, Default)]
pub struct Tail(std::sync::Arc<std::sync::Mutex<TailLines>>);

#[derive(Debug, Default)]
struct TailLines {
    /// When each was read (wall-clock microseconds), and the line.
    lines: std::collections::VecDeque<(u64, String)>,
    bytes: usize,
}

impl Tail {
    /// Keep `line` (its newline dropped), forgetting the oldest lines past
    /// the bounds.
    pub fn push(&self, line: &[u8]) {
        let line = line.strip_suffix(b"\n").unwrap_or(line);
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let cut = &line[..line.len().min(TAIL_LINE)];
        let text: String =
            String::from_utf8_lossy(cut).chars().map(|c| if c.is_control() && c != '\t' { '?' } else { c }).collect();
        let at = crate::clock::now_us();
        let mut t = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        t.bytes += text.len();
        t.lines.push_back((at, text));
        while t.lines.len() > TAIL_LINES || t.bytes > TAIL_BYTES {
            let Some((_, old)) = t.lines.pop_front() else { break };
            t.bytes -= old.len();
        }
    }

    /// The lines kept, oldest first, each with when it was read.
    pub fn lines(&self) -> Vec<(u64, String)> {
        let t = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        t.lines.iter().cloned().collect()
    }

    /// The lines kept, oldest first, joined by newlines (None: none).
    pub fn text(&self) -> Option<String> {
        let t = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        (!t.lines.is_empty()).then(|| t.lines.iter().map(|(_, l)| l.as_str()).collect::<Vec<_>>().join("\n"))
    }
}

/// Longest piece of a line, newline not counted: a longer line is shown
/// as several lines of at most this many bytes. The same bound as the
/// control API's relay of a line, so both show the same pieces.
pub const LINE: usize = 64 * 1024;

/// Longest line a [`LineTap`] takes; the rest of a longer one is cut (the
/// drains never hand it one: their pieces are at most [`LINE`] bytes).
const TAP_LINE: usize = LINE;

/// Most bytes waiting in one [`LineTap`] (all its clones together) for its
/// reader. Its channel also bounds the count of lines, but a few thousand
/// lines of [`LINE`] bytes would be hundreds of MiB.
pub const TAP_BYTES: usize = 8 * 1024 * 1024;

/// A bounded hand-off of prefixed lines that never blocks a drain: a line
/// that does not fit (in the channel, or in [`TAP_BYTES`]) is counted as
/// dropped.
#[derive(Debug, Clone)]
pub struct LineTap {
    tx: tokio::sync::mpsc::Sender<Vec<u8>>,
    dropped: std::sync::Arc<std::sync::atomic::AtomicU64>,
    waiting: std::sync::Arc<std::sync::Mutex<Waiting>>,
}

/// The sizes of the lines sent and maybe not yet received, oldest first.
/// The reader is not told (it is `serve::logs`, and any plain receiver
/// will do): the channel's free capacity says how many lines it still
/// holds, and as it takes them in order, the others are the oldest ones.
/// The sum may count a line the reader has just taken, never too few.
#[derive(Debug, Default)]
struct Waiting {
    sizes: std::collections::VecDeque<usize>,
    bytes: usize,
}

impl LineTap {
    /// Lines go to `tx`; those that do not fit are counted in `dropped`.
    /// Every line sent on `tx` must come through this tap (and its clones).
    pub fn new(tx: tokio::sync::mpsc::Sender<Vec<u8>>, dropped: std::sync::Arc<std::sync::atomic::AtomicU64>) -> Self {
        Self { tx, dropped, waiting: std::sync::Arc::default() }
    }

    /// Hand over `prefix` + `line` (which ends with a newline).
    pub fn send(&self, prefix: &str, line: &[u8]) {
        let size = prefix.len() + line.len().min(TAP_LINE + 1);
        let mut w = self.waiting.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let held = self.tx.max_capacity() - self.tx.capacity();
        while w.sizes.len() > held {
            let taken = w.sizes.pop_front().unwrap_or(0);
            w.bytes -= taken;
        }
        if w.bytes + size > TAP_BYTES {
            self.dropped.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return;
        }
        let mut buf = Vec::with_capacity(size);
        buf.extend_from_slice(prefix.as_bytes());
        if line.len() > TAP_LINE {
            buf.extend_from_slice(&line[..TAP_LINE]);
            buf.push(b'\n');
        } else {
            buf.extend_from_slice(line);
        }
        if self.tx.try_send(buf).is_ok() {
            w.sizes.push_back(size);
            w.bytes += size;
        } else {
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
    let mut reader = BufReader::with_capacity(LINE, pipe);
    // The prefix, then one piece of a line: what the console gets in one write.
    let start = sink.prefix.len();
    let mut buf = Vec::with_capacity(start + 256);
    loop {
        buf.clear();
        buf.extend_from_slice(sink.prefix.as_bytes());
        // A read error ends the stream as EOF does, after what was read.
        let whole = read_piece(&mut reader, &mut buf, start).await.unwrap_or(false);
        if buf.len() == start {
            break;
        }
        let printed = buf.len();
        if !whole {
            buf.push(b'\n');
        }
        let line = &buf[start..];
        if ready.as_ref().is_some_and(|(marker, _)| line.starts_with(marker)) {
            if let Some((_, tx)) = ready.take() {
                let _ = tx.send(());
            }
            continue;
        }
        if let Some(tap) = &sink.tap {
            tap.send(&sink.prefix, line);
        }
        if let Some(tail) = &sink.tail {
            tail.push(line);
        }
        // The file gets the bytes as printed: a long line's pieces join up again.
        if let Some(f) = file.as_mut()
            && let Err(e) = f.write_all(&buf[start..printed]).and_then(|()| f.flush())
        {
            let path = sink.file.as_ref().map(|p| p.display().to_string()).unwrap_or_default();
            tracing::warn!(path, error = %e, "cannot write worker log file; this stream goes to the console from now on");
            file = None;
            console = true;
        }
        if console {
            // One write per line keeps lines from different ranks whole.
            let _ = if sink.is_err {
                std::io::stderr().lock().write_all(&buf)
            } else {
                std::io::stdout().lock().write_all(&buf)
            };
        }
    }
}

/// Read the next piece of a line into `buf` after its first `start`
/// bytes: up to and including a newline, or [`LINE`] bytes of a longer
/// line. True when a newline ended it; nothing read means EOF.
///
/// A full piece is handed over once the byte after it is read: a newline
/// there ends the line, so a line of exactly [`LINE`] bytes stays one.
async fn read_piece<R: AsyncBufRead + Unpin>(r: &mut R, buf: &mut Vec<u8>, start: usize) -> std::io::Result<bool> {
    loop {
        let avail = r.fill_buf().await?;
        if avail.is_empty() {
            return Ok(false);
        }
        let room = LINE - (buf.len() - start);
        if let Some(i) = avail.iter().take(room + 1).position(|b| *b == b'\n') {
            buf.extend_from_slice(&avail[..=i]);
            r.consume(i + 1);
            return Ok(true);
        }
        if room == 0 {
            return Ok(false);
        }
        let take = avail.len().min(room);
        buf.extend_from_slice(&avail[..take]);
        r.consume(take);
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

    async fn pieces(input: &[u8]) -> Vec<(Vec<u8>, bool)> {
        let mut r = input;
        let mut out = Vec::new();
        loop {
            let mut buf = b"[p] ".to_vec();
            let whole = read_piece(&mut r, &mut buf, 4).await.expect("read");
            assert!(buf.starts_with(b"[p] "));
            if buf.len() == 4 {
                return out;
            }
            out.push((buf[4..].to_vec(), whole));
        }
    }

    #[tokio::test]
    async fn a_long_line_comes_in_pieces_and_nothing_is_lost() {
        assert_eq!(
            pieces(b"a\n\nbc").await,
            [(b"a\n".to_vec(), true), (b"\n".to_vec(), true), (b"bc".to_vec(), false)]
        );
        // Exactly LINE bytes and a newline: one line.
        let mut exact = vec![b'x'; LINE];
        exact.push(b'\n');
        assert_eq!(pieces(&exact).await, [(exact.clone(), true)]);
        // One more: a full piece, then the rest with its newline.
        let mut over = vec![b'y'; LINE + 1];
        over.push(b'\n');
        assert_eq!(pieces(&over).await, [(vec![b'y'; LINE], false), (b"y\n".to_vec(), true)]);
        // Three and a half pieces, no newline at the end.
        let long = vec![b'z'; LINE * 7 / 2];
        let got = pieces(&long).await;
        assert_eq!(got.len(), 4);
        assert!(got.iter().all(|(p, whole)| p.len() <= LINE && !whole && p.iter().all(|b| *b == b'z')));
        assert_eq!(got.iter().map(|(p, _)| p.len()).sum::<usize>(), long.len());
    }

    #[test]
    fn a_tail_keeps_the_last_lines_within_its_bounds_and_cleans_them() {
        let t = Tail::default();
        assert_eq!(t.text(), None);
        for i in 0..100 {
            t.push(format!("line {i}\n").as_bytes());
        }
        let text = t.text().expect("lines");
        assert_eq!(text.lines().count(), TAIL_LINES);
        assert!(text.starts_with("line 60\nline 61") && text.ends_with("line 99"), "{text}");
        t.push(b"\x1b[31mred\x07\r\n");
        assert!(t.text().expect("lines").ends_with("?[31mred?"), "control characters are data");
        let long = vec![b'x'; 5000];
        for _ in 0..20 {
            t.push(&long);
        }
        let text = t.text().expect("lines");
        assert!(text.len() <= TAIL_BYTES + TAIL_LINES, "{}", text.len());
        assert!(text.lines().all(|l| l.len() <= TAIL_LINE));
    }

    #[tokio::test]
    async fn a_tap_holds_a_bounded_number_of_bytes() {
        let (tx, mut rx) = tokio::sync::mpsc::channel(4096);
        let dropped = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let tap = LineTap::new(tx, std::sync::Arc::clone(&dropped));
        let mut line = vec![b'x'; LINE];
        line.push(b'\n');
        let fit = TAP_BYTES / (4 + line.len());
        for _ in 0..fit + 10 {
            tap.send("[p] ", &line);
        }
        assert_eq!(dropped.load(std::sync::atomic::Ordering::Relaxed), 10, "over the byte bound: dropped, counted");
        let mut got = 0;
        while let Ok(l) = rx.try_recv() {
            assert_eq!(l.len(), 4 + line.len());
            got += 1;
        }
        assert_eq!(got, fit);
        // Taken lines free their bytes.
        tap.clone().send("[p] ", &line);
        assert_eq!(rx.try_recv().map(|l| l.len()), Ok(4 + line.len()));
        assert_eq!(dropped.load(std::sync::atomic::Ordering::Relaxed), 10);
        // Short lines are bounded by the channel's count.
        for _ in 0..5000 {
            tap.send("", b"s\n");
        }
        assert_eq!(dropped.load(std::sync::atomic::Ordering::Relaxed), 10 + 5000 - 4096);
    }
}
