//! The download engine for remote sources: many files at once and large
//! files in parallel byte ranges, streamed to disk (memory is bounded by
//! `concurrency` x [`FLUSH`], never a whole file), each file verified
//! against what the source publishes before it is renamed into place.
//!
//! On the volume, next to each file being fetched:
//! - `.NAME.trainlet-part`: the data, preallocated to the full size;
//! - `.NAME.trainlet-state`: a header line (size, check, range size), then
//!   the index of each range written, appended once its bytes are in the
//!   part file. A rerun keeps the ranges listed there and fetches the rest.
//!
//! Each published file is appended to the journal
//! ([`crate::volume::JOURNAL`]) with its size and check, so a rerun skips
//! files already verified instead of fetching them again. A transient
//! failure (dropped connection, 5xx, stall) resumes the range from the
//! last byte written, with backoff; a checksum mismatch removes the file's
//! partial state and fails the run (exit 223); a full disk removes every
//! partial file of the run (exit 224).

use std::collections::VecDeque;
use std::io::Write;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio_util::sync::CancellationToken;

use crate::Control;
use crate::config::Config;
use crate::error::InitError;
use crate::progress::Progress;
use crate::remote::{Client, Failure, RemoteFile, check_rel, escaped};
use crate::resume::{Header, Journaled, preallocate, read_journal, resumed, split, state_name};
use crate::sources::Remote;
use crate::verify::{Digest, Hashing, verify};
use crate::volume::{Fetched, FileEntry, JOURNAL, partial_name, saturating_sum};

/// Bytes gathered from the network before one positioned write.
pub const FLUSH: usize = 1 << 20;

/// Tuning, from the command line (`trainlet init --help` has the defaults).
#[derive(Debug, Clone)]
pub struct Options {
    /// Ranged reads in flight at once, over all files.
    pub concurrency: usize,
    /// Bytes per ranged read; smaller files are one read.
    pub chunk: u64,
    /// Retries of one range after transient failures (progress resets it).
    pub retries: u32,
    /// No byte for this long: the connection is dropped and the range retried.
    pub stall: Duration,
    /// How often the progress line is logged.
    pub progress_every: Duration,
    /// Check content hashes where the source publishes them (`true`), or
    /// sizes and version tags only.
    pub verify_content: bool,
}

/// One file being fetched.
#[derive(Debug)]
struct Job {
    file: RemoteFile,
    dest: PathBuf,
    part: PathBuf,
    state_path: PathBuf,
    data: std::fs::File,
    state: Mutex<std::fs::File>,
    ranges: Vec<Range<u64>>,
    left: AtomicUsize,
    /// Which ranges are written (resumed ones included).
    written: Mutex<Vec<bool>>,
    /// The digest, over the part file's bytes `0..upto`.
    hash: Mutex<Hashing>,
    /// A background catch-up of `hash` is running.
    hashing: std::sync::atomic::AtomicBool,
}

impl Job {
    fn open(output: &Path, file: RemoteFile, chunk: u64, content: bool) -> Result<(Job, Vec<usize>), InitError> {
        let dest = output.join(&file.rel);
        if let Some(dir) = dest.parent() {
            std::fs::create_dir_all(dir).map_err(InitError::at("cannot create", dir))?;
        }
        let (part, state_path) = (partial_name(&dest), state_name(&dest));
        let header = Header { size: file.size, check: file.check.label(), chunk: if file.ranges { chunk } else { 0 } };
        // Only a source that identifies the version (a hash or an ETag) can
        // be resumed: else the ranges kept could be of an older file.
        let done = if file.ranges && file.check.identifies() { resumed(&state_path, &part, &header) } else { None };
        let data = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&part)
            .map_err(InitError::at("cannot create", &part))?;
        let state = if let Some(d) = &done {
            let _ = d;
            std::fs::OpenOptions::new()
                .append(true)
                .open(&state_path)
                .map_err(InitError::at("cannot open", &state_path))?
        } else {
            data.set_len(0).map_err(InitError::at("cannot truncate", &part))?;
            preallocate(&data, &part, file.size)?;
            let mut s = std::fs::File::create(&state_path).map_err(InitError::at("cannot create", &state_path))?;
            let mut line = serde_json::to_vec(&header).map_err(|e| InitError::Config(e.to_string()))?;
            line.push(b'\n');
            s.write_all(&line).map_err(InitError::at("cannot write", &state_path))?;
            s
        };
        let ranges = split(file.size, chunk, file.ranges);
        let done: Vec<usize> = done.unwrap_or_default().into_iter().filter(|i| *i < ranges.len()).collect();
        let mut written = vec![false; ranges.len()];
        for i in &done {
            written[*i] = true;
        }
        let left = written.iter().filter(|w| !**w).count();
        let digest = if content { Digest::new(&file.check, file.size) } else { Digest::None };
        let hash = Hashing { digest, upto: 0 };
        Ok((
            Job {
                file,
                dest,
                part,
                state_path,
                data,
                state: Mutex::new(state),
                ranges,
                left: AtomicUsize::new(left),
                written: Mutex::new(written),
                hash: Mutex::new(hash),
                hashing: std::sync::atomic::AtomicBool::new(false),
            },
            done,
        ))
    }

    fn forget(&self) {
        let _ = std::fs::remove_file(&self.part);
        let _ = std::fs::remove_file(&self.state_path);
    }
}

/// Everything the workers share.
#[derive(Debug)]
struct Shared {
    uri: String,
    remote: Remote,
    jobs: Vec<Job>,
    queue: Mutex<VecDeque<(usize, usize)>>,
    journal: Mutex<std::fs::File>,
    journal_path: PathBuf,
    progress: Arc<Progress>,
    opts: Options,
    cancel: CancellationToken,
}

/// List the source, skip what is already verified in place, fetch the
/// rest, verify and publish each file. Runs on its own tokio runtime.
pub fn remote(
    cfg: &Config,
    opts: &Options,
    ctl: &Control,
    lost: &Arc<std::sync::atomic::AtomicBool>,
) -> Result<Fetched, InitError> {
    let threads = std::thread::available_parallelism().map_or(2, std::num::NonZero::get).clamp(2, 8);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name("trainlet-init")
        .enable_all()
        .build()
        .map_err(InitError::at("cannot start the runtime in", &cfg.output))?;
    rt.block_on(run(cfg, opts, ctl, lost))
}

async fn run(
    cfg: &Config,
    opts: &Options,
    ctl: &Control,
    lost: &Arc<std::sync::atomic::AtomicBool>,
) -> Result<Fetched, InitError> {
    let client = Client::new()?;
    let remote = Remote::new(cfg, &client)?;
    let cancel = CancellationToken::new();
    // Polled, not awaited: the stop request comes from the agent's signal
    // thread (signals are blocked in every thread, reference/gpu-pid1.md),
    // and a takeover from the heartbeat thread.
    let watch = async {
        loop {
            if let Some(signal) = ctl.stopped() {
                tracing::warn!(signal, "stopping; partial files stay for the next run to resume");
                return InitError::Terminated { signal };
            }
            if lost.load(Ordering::SeqCst) {
                return InitError::LockLost { output: cfg.output.clone() };
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let progress = &ctl.progress;
    tokio::select! {
        r = fetch(cfg, opts, progress, remote, cancel.clone()) => r,
        e = watch => {
            cancel.cancel();
            Err(e)
        }
    }
}

async fn fetch(
    cfg: &Config,
    opts: &Options,
    progress: &Arc<Progress>,
    remote: Remote,
    cancel: CancellationToken,
) -> Result<Fetched, InitError> {
    let listing = remote.list().await?;
    let mut files = Vec::new();
    for f in listing.files {
        if let Err(why) = check_rel(&f.rel) {
            tracing::warn!(uri = %cfg.uri, path = %escaped(&f.rel), "skipping a file: {why}");
        } else if cfg.filter.keeps(&f.rel) {
            files.push(f);
        }
    }
    if files.is_empty() {
        return Err(InitError::NoFiles { uri: cfg.uri.clone(), filter: cfg.filter.describe() });
    }
    let entries: Vec<FileEntry> =
        files.iter().map(|f| FileEntry { path: f.rel.clone(), size: f.size, check: Some(f.check.label()) }).collect();

    let journal_path = cfg.output.join(JOURNAL);
    let journal = read_journal(&journal_path);
    let in_place = |f: &RemoteFile| {
        f.check.identifies()
            && journal.get(&f.rel) == Some(&(f.size, f.check.label()))
            && std::fs::metadata(cfg.output.join(&f.rel)).is_ok_and(|m| m.is_file() && m.len() == f.size)
    };
    let (skip, todo): (Vec<RemoteFile>, Vec<RemoteFile>) = files.into_iter().partition(in_place);
    // Sizes come from the source: summed saturating, so sizes that would
    // wrap count as more than any volume holds instead of passing the check.
    let total = saturating_sum(entries.iter().map(|e| e.size));
    // Space the partial files of an earlier run hold already counts as had.
    let need = saturating_sum(todo.iter().map(|f| {
        use std::os::unix::fs::MetadataExt;
        let held = std::fs::metadata(partial_name(&cfg.output.join(&f.rel))).map_or(0, |m| m.blocks() * 512);
        f.size.saturating_sub(held)
    }));
    check_space(&cfg.output, need)?;

    let mut jobs = Vec::with_capacity(todo.len());
    let mut queue = VecDeque::new();
    let mut resumed_bytes = 0;
    let mut todo = todo;
    // Largest first: its ranges start early and the tail is small files.
    todo.sort_by(|a, b| b.size.cmp(&a.size).then_with(|| a.rel.cmp(&b.rel)));
    for f in todo {
        let (job, done) =
            Job::open(&cfg.output, f, opts.chunk.max(1), opts.verify_content).inspect_err(|_| forget_all(&jobs))?;
        for (i, r) in job.ranges.iter().enumerate() {
            if done.contains(&i) {
                resumed_bytes += r.end - r.start;
            } else {
                queue.push_back((jobs.len(), i));
            }
        }
        jobs.push(job);
    }
    let skipped = u64::try_from(skip.len()).unwrap_or(u64::MAX);
    let skip_bytes = saturating_sum(skip.iter().map(|f| f.size));
    progress.plan(u64::try_from(entries.len()).unwrap_or(u64::MAX), total, skipped, skip_bytes + resumed_bytes);
    if skipped > 0 || resumed_bytes > 0 {
        tracing::info!(
            uri = %cfg.uri,
            "resuming: {skipped} files already verified in place, {} of partial files kept",
            crate::progress::bytes(resumed_bytes)
        );
    }
    tracing::info!(uri = %cfg.uri, output = %cfg.output.display(), "fetching {}", progress.snapshot());

    let journal_file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&journal_path)
        .map_err(InitError::at("cannot open", &journal_path))?;
    let shared = Arc::new(Shared {
        uri: cfg.uri.clone(),
        remote,
        jobs,
        queue: Mutex::new(queue),
        journal: Mutex::new(journal_file),
        journal_path,
        progress: Arc::clone(progress),
        opts: opts.clone(),
        cancel: cancel.child_token(),
    });
    // Files whose every range is already written (or that are empty).
    for i in 0..shared.jobs.len() {
        if shared.jobs[i].left.load(Ordering::SeqCst) == 0 {
            finish(&shared, i).await.inspect_err(|e| fail(&shared, e))?;
        }
    }
    let ticker = tokio::spawn(report(Arc::clone(progress), opts.progress_every, shared.cancel.clone()));
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..opts.concurrency.max(1) {
        workers.spawn(worker(Arc::clone(&shared)));
    }
    let mut first: Option<InitError> = None;
    while let Some(r) = workers.join_next().await {
        let r = r.unwrap_or_else(|e| {
            Err(InitError::Source { uri: shared.uri.clone(), what: format!("a download task failed: {e}") })
        });
        if let Err(e) = r
            && first.is_none()
        {
            fail(&shared, &e);
            first = Some(e);
        }
    }
    shared.cancel.cancel();
    let _ = ticker.await;
    if let Some(e) = first {
        return Err(e);
    }
    let done = progress.snapshot();
    tracing::info!(uri = %cfg.uri, received = done.bytes_fetched, "fetched: {done}");
    Ok(Fetched { files: entries, commit: listing.commit, verified: (!opts.verify_content).then(|| "size".into()) })
}

/// Stop the others after `e`; a full disk also removes every partial file.
fn fail(shared: &Shared, e: &InitError) {
    shared.cancel.cancel();
    if matches!(e, InitError::NoSpace { .. }) {
        forget_all(&shared.jobs);
    }
}

fn forget_all(jobs: &[Job]) {
    for j in jobs {
        j.forget();
    }
}

/// Refuse up front when the volume cannot hold what is left to fetch.
fn check_space(output: &Path, need: u64) -> Result<(), InitError> {
    let Ok(st) = nix::sys::statvfs::statvfs(output) else { return Ok(()) };
    #[expect(clippy::useless_conversion, reason = "the type differs between targets")]
    let free = u64::from(st.blocks_available()).saturating_mul(u64::from(st.fragment_size()));
    if need > free {
        return Err(InitError::TooBig { output: output.to_path_buf(), need, free });
    }
    Ok(())
}

async fn report(progress: Arc<Progress>, every: Duration, stop: CancellationToken) {
    let mut tick = tokio::time::interval(every.max(Duration::from_millis(100)));
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => tracing::info!("progress: {}", progress.snapshot()),
            () = stop.cancelled() => return,
        }
    }
}

async fn worker(shared: Arc<Shared>) -> Result<(), InitError> {
    loop {
        if shared.cancel.is_cancelled() {
            return Ok(());
        }
        let next = shared.queue.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pop_front();
        let Some((j, i)) = next else { return Ok(()) };
        let got = tokio::select! {
            r = range(&shared, j, i) => r,
            () = shared.cancel.cancelled() => return Ok(()),
        };
        got?;
        let job = &shared.jobs[j];
        {
            let mut s = job.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            s.write_all(format!("{i}\n").as_bytes()).map_err(InitError::at("cannot write", &job.state_path))?;
        }
        let prefix = {
            let mut w = job.written.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            w[i] = true;
            w.iter().position(|d| !*d).map_or(job.file.size, |k| job.ranges[k].start)
        };
        if job.left.fetch_sub(1, Ordering::SeqCst) == 1 {
            finish(&shared, j).await?;
        } else if !job.hashing.swap(true, Ordering::SeqCst) {
            // Hash the newly contiguous bytes now, beside the downloads.
            let sh = Arc::clone(&shared);
            tokio::task::spawn_blocking(move || {
                let job = &sh.jobs[j];
                let r = job
                    .hash
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .advance(&job.data, &job.part, prefix);
                job.hashing.store(false, Ordering::SeqCst);
                r
            });
        }
    }
}

/// Fetch range `i` of job `j` into its part file, resuming after
/// transient failures from the last byte written.
async fn range(shared: &Shared, j: usize, i: usize) -> Result<(), InitError> {
    let job = &shared.jobs[j];
    let want = job.ranges[i].clone();
    let mut at = want.start;
    let mut tries = 0u32;
    tracing::debug!(file = %escaped(&job.file.rel), start = want.start, end = want.end, "reading range");
    loop {
        let failure = match shared.remote.open(&job.file, at..want.end).await {
            Ok(mut body) => {
                let since = at;
                match stream(shared, job, &mut body, &mut at, want.end).await {
                    Ok(()) => return Ok(()),
                    Err(f) => {
                        if at - since >= FLUSH as u64 {
                            tries = 0;
                        }
                        f
                    }
                }
            }
            Err(f) => f,
        };
        let why = match failure {
            Failure::Fatal(e) => return Err(e),
            Failure::Retry(why) => why,
        };
        tries += 1;
        if tries > shared.opts.retries {
            return Err(InitError::Source {
                uri: shared.uri.clone(),
                what: format!("{}: {why} ({} tries)", job.file.rel, tries),
            });
        }
        shared.progress.retried();
        if !job.file.ranges {
            shared.progress.discarded(at - want.start);
            at = want.start;
        }
        let wait = Duration::from_millis(200u64 << tries.min(6));
        tracing::warn!(uri = %shared.uri, file = %escaped(&job.file.rel), offset = at, %why, "read failed; retrying in {wait:?}");
        tokio::time::sleep(wait).await;
    }
}

/// Copy `body` to the part file at `*at` until `end`.
async fn stream(
    shared: &Shared,
    job: &Job,
    body: &mut crate::remote::Body,
    at: &mut u64,
    end: u64,
) -> Result<(), Failure> {
    let mut pending: Vec<Bytes> = Vec::new();
    let mut pending_len = 0usize;
    let flush = |pending: &mut Vec<Bytes>, pending_len: &mut usize, at: &mut u64| -> Result<(), Failure> {
        let mut off = *at;
        let r = tokio::task::block_in_place(|| {
            for b in pending.iter() {
                job.data.write_all_at(b, off)?;
                off += b.len() as u64;
            }
            // Bytes that continue the hashed prefix are hashed from memory
            // (no read-back); others wait for the catch-up.
            if let Ok(mut h) = job.hash.try_lock()
                && h.upto == *at
            {
                for b in pending.iter() {
                    h.digest.update(b);
                }
                h.upto = off;
            }
            Ok::<_, std::io::Error>(())
        });
        r.map_err(|e| Failure::Fatal(InitError::io("cannot write", &job.part, e)))?;
        shared.progress.received(off - *at);
        *at = off;
        pending.clear();
        *pending_len = 0;
        Ok(())
    };
    loop {
        let next = body.chunk(shared.opts.stall).await;
        let chunk = match next {
            Ok(c) => c,
            Err(f) => {
                flush(&mut pending, &mut pending_len, at)?;
                return Err(f);
            }
        };
        let Some(mut chunk) = chunk else {
            flush(&mut pending, &mut pending_len, at)?;
            return if *at == end {
                Ok(())
            } else {
                Err(Failure::Retry(format!("connection closed at byte {at} of {end}")))
            };
        };
        let room = end - *at - pending_len as u64;
        if chunk.len() as u64 > room {
            // More than asked for (a server ignoring the range's end).
            chunk.truncate(usize::try_from(room).unwrap_or(usize::MAX));
        }
        pending_len += chunk.len();
        pending.push(chunk);
        if pending_len >= FLUSH || *at + pending_len as u64 == end {
            flush(&mut pending, &mut pending_len, at)?;
            if *at == end {
                return Ok(());
            }
        }
    }
}

/// Every range of job `j` is written: verify, sync, rename into place,
/// journal it.
async fn finish(shared: &Shared, j: usize) -> Result<(), InitError> {
    let job = &shared.jobs[j];
    let (data, part, size, check) = (
        job.data.try_clone().map_err(InitError::at("cannot reopen", &job.part))?,
        job.part.clone(),
        job.file.size,
        job.file.check.clone(),
    );
    // The digest so far (a background catch-up may still hold it: wait).
    let hashing = {
        let mut h = job.hash.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        std::mem::replace(&mut *h, Hashing { digest: Digest::None, upto: 0 })
    };
    let got = tokio::task::spawn_blocking(move || verify(&data, &part, size, &check, hashing))
        .await
        .map_err(|e| InitError::Source { uri: shared.uri.clone(), what: format!("verification task failed: {e}") })??;
    if let Some((want, got)) = got {
        job.forget();
        return Err(InitError::Checksum { uri: shared.uri.clone(), path: job.file.rel.clone(), want, got });
    }
    std::fs::rename(&job.part, &job.dest).map_err(InitError::at("cannot publish", &job.dest))?;
    let _ = std::fs::remove_file(&job.state_path);
    let mut line = serde_json::to_vec(&Journaled {
        path: job.file.rel.clone(),
        size: job.file.size,
        check: job.file.check.label(),
    })
    .map_err(|e| InitError::Config(e.to_string()))?;
    line.push(b'\n');
    shared
        .journal
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .write_all(&line)
        .map_err(InitError::at("cannot write", &shared.journal_path))?;
    shared.progress.file_done();
    tracing::debug!(file = %escaped(&job.file.rel), "verified and published");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::remote::Check;

    #[test]
    fn listed_sizes_that_would_wrap_fail_the_space_check() {
        // Three files of 0x5555555555555556 bytes wrapped a plain sum to 2.
        let sizes = [0x5555_5555_5555_5556u64; 3];
        assert_eq!(sizes.iter().fold(0u64, |a, b| a.wrapping_add(*b)), 2);
        assert_eq!(saturating_sum(sizes), u64::MAX);
        let dir = tempfile::tempdir().expect("tmp");
        assert!(matches!(check_space(dir.path(), saturating_sum(sizes)), Err(InitError::TooBig { .. })));
        assert_eq!(saturating_sum([1, 2, 3]), 6);
    }

    #[test]
    fn files_split_into_ranges() {
        assert_eq!(split(0, 10, true), Vec::<Range<u64>>::new());
        assert_eq!(split(25, 10, true), vec![0..10, 10..20, 20..25]);
        assert_eq!(split(20, 10, true), vec![0..10, 10..20]);
        assert_eq!(split(25, 10, false), vec![0..25]);
    }

    #[test]
    fn state_files_resume_only_what_they_describe() {
        let d = tempfile::tempdir().expect("tmp");
        let (state, part) = (d.path().join("s"), d.path().join("p"));
        std::fs::write(&part, vec![0u8; 30]).expect("part");
        let h = Header { size: 30, check: "sha256:ab".into(), chunk: 10 };
        std::fs::write(&state, format!("{}\n0\n2\n1", serde_json::to_string(&h).expect("json"))).expect("state");
        assert_eq!(resumed(&state, &part, &h), Some(vec![0, 2]), "a line without its newline is not counted");
        let other = Header { check: "sha256:cd".into(), ..h };
        assert_eq!(resumed(&state, &part, &other), None, "another version of the file starts over");
        std::fs::write(&part, vec![0u8; 10]).expect("part");
        let h = Header { size: 30, check: "sha256:ab".into(), chunk: 10 };
        assert_eq!(resumed(&state, &part, &h), None, "a part file of the wrong size starts over");
    }

    #[test]
    fn verification_computes_what_sources_publish() {
        let d = tempfile::tempdir().expect("tmp");
        let p = d.path().join("f");
        std::fs::write(&p, b"hello\n").expect("write");
        let f = std::fs::File::open(&p).expect("open");
        // `git hash-object`, `sha256sum`, `md5sum` of "hello\n".
        let cases = [
            Check::GitSha1("ce013625030ba8dba906f756967f9e9ca394464a".into()),
            Check::Sha256("5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03".into()),
            Check::Md5("b1946ac92492d2347c6235b4d2611184".into()),
            Check::Size(None),
        ];
        let fresh = |c: &Check| Hashing { digest: Digest::new(c, 6), upto: 0 };
        for c in &cases {
            assert_eq!(verify(&f, &p, 6, c, fresh(c)).expect("verify"), None, "{c:?}");
            // Hashed in two steps (a prefix while downloading, the rest at
            // the end): the same digest.
            let mut h = fresh(c);
            h.advance(&f, &p, 2).expect("advance");
            assert_eq!(h.upto, 2);
            assert_eq!(verify(&f, &p, 6, c, h).expect("verify"), None, "{c:?} in steps");
        }
        let md5 = Check::Md5("00".into());
        let bad = verify(&f, &p, 6, &md5, fresh(&md5)).expect("verify").expect("mismatch");
        assert_eq!(bad, ("md5 00".to_string(), "b1946ac92492d2347c6235b4d2611184".to_string()));
        let size = Check::Size(None);
        assert!(verify(&f, &p, 7, &size, fresh(&size)).expect("verify").is_some(), "a short file fails");
    }
}
