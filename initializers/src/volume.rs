//! Exactly once per volume: the completion marker, the heartbeat lock, and
//! atomic publication of files.
//!
//! The lock is a file created with O_EXCL (atomic on NFS v3+ and local
//! filesystems alike, unlike flock) naming its holder, whose mtime the
//! holder refreshes every [`HEARTBEAT`] (or a quarter of the stale time,
//! if shorter). A holder that finds its name gone from the file was taken
//! over while stalled and stops without writing the marker. A waiter that sees it unchanged for the stale time
//! (`TRAINLET_INIT_STALE_SECS`, default 30 s) renames it away (only one
//! rename of a name can succeed) and takes over; partial files are resumed
//! or replaced, never mistaken for complete, because only the marker says
//! "complete" and it names the URI and revision it is for.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use crate::config::Config;
use crate::error::InitError;

/// The completion marker, in the output directory.
pub const MARKER: &str = ".trainlet-complete.json";
/// The lock file, in the output directory.
pub const LOCK: &str = ".trainlet-init.lock";
/// Files verified and published by runs that have not finished yet (JSON
/// lines: path, size, check), so a rerun skips them; removed with the
/// marker's arrival.
pub const JOURNAL: &str = ".trainlet-init.journal";
/// How often the lock holder proves it is alive.
pub const HEARTBEAT: Duration = Duration::from_secs(2);

/// One published file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Path relative to the output directory, `/`-separated.
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// What it was verified against (`sha256:...`, `md5:...`, `etag:...`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub check: Option<String>,
}

/// What the marker records.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Marker {
    /// The storage URI.
    pub uri: String,
    /// The revision asked for, where the source has one.
    pub revision: Option<String>,
    /// The commit it resolved to (the Hub).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit: Option<String>,
    /// `size` when content hashes were not checked (`--verify size`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verified: Option<String>,
    /// Every file, as published.
    pub files: Vec<FileEntry>,
}

/// The marker of `dir`, if any and readable.
pub fn read_marker(dir: &Path) -> Option<Marker> {
    serde_json::from_slice(&std::fs::read(dir.join(MARKER)).ok()?).ok()
}

fn done(cfg: &Config) -> bool {
    read_marker(&cfg.output).is_some_and(|m| m.uri == cfg.uri && m.revision.as_deref() == cfg.revision())
}

/// Write `path` via a temporary name in the same directory, synced, and a
/// rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), InitError> {
    use std::io::Write;
    let tmp = partial_name(path);
    let mut f = std::fs::File::create(&tmp).map_err(InitError::at("cannot write", &tmp))?;
    f.write_all(bytes).and_then(|()| f.sync_all()).map_err(InitError::at("cannot write", &tmp))?;
    std::fs::rename(&tmp, path).map_err(InitError::at("cannot publish", path))
}

/// Remove partial and state files left under `dir` by runs of other
/// sources: once the marker is written nothing can resume them.
fn sweep(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Ok(kind) = e.file_type() else { continue };
        if kind.is_dir() {
            sweep(&e.path());
        } else if is_temp(&name) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Suffix of the name a file is written under before its rename.
pub const PART: &str = ".trainlet-part";
/// Suffix of a partial file's range list ([`crate::fetch`]).
pub const STATE: &str = ".trainlet-state";

/// `.NAME` + `suffix` beside `path`: hidden, so nothing reading the
/// directory mistakes it for the real file.
pub fn temp_name(path: &Path, suffix: &str) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    path.with_file_name(format!(".{name}{suffix}"))
}

/// The temporary name a file is written under before its rename.
pub fn partial_name(path: &Path) -> PathBuf {
    temp_name(path, PART)
}

/// Whether a file name is one of trainlet's temporary names.
pub fn is_temp(name: &str) -> bool {
    name.starts_with('.') && (name.ends_with(PART) || name.ends_with(STATE))
}

/// The held lock; dropping it stops the heartbeat and removes the file
/// (if it is still this process's).
#[derive(Debug)]
struct Lock {
    path: PathBuf,
    me: String,
    stop: Arc<AtomicBool>,
    lost: Arc<AtomicBool>,
    beat: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Lock {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(b) = self.beat.take() {
            let _ = b.join();
        }
        if owns(&self.path, &self.me) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Whether the lock file at `path` is still `me`'s.
fn owns(path: &Path, me: &str) -> bool {
    std::fs::read_to_string(path).is_ok_and(|s| s == me)
}

/// How often the holder refreshes the lock: at most [`HEARTBEAT`], and
/// several times within the stale time, so a live holder never looks dead.
fn beat_every(stale: Duration) -> Duration {
    (stale / 4).clamp(Duration::from_millis(100), HEARTBEAT)
}

enum Try {
    Got(Lock),
    Held { owner: String, age: Duration },
}

fn try_lock(dir: &Path, host: &str, stale: Duration) -> Result<Try, InitError> {
    let path = dir.join(LOCK);
    let nonce = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_nanos();
    let host = if host.is_empty() { "an unknown host" } else { host };
    let me = format!("pid {} on {host} ({nonce:x})", std::process::id());
    match std::fs::OpenOptions::new().write(true).create_new(true).open(&path) {
        Ok(mut f) => {
            use std::io::Write;
            f.write_all(me.as_bytes()).map_err(InitError::at("cannot write the lock", &path))?;
            let (stop, lost) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
            let (s, l, p, m) = (Arc::clone(&stop), Arc::clone(&lost), path.clone(), me.clone());
            let every = beat_every(stale);
            let beat = std::thread::Builder::new()
                .name("trainlet-init-heartbeat".into())
                .spawn(move || {
                    while !s.load(Ordering::SeqCst) {
                        let tick = std::time::Instant::now();
                        while tick.elapsed() < every && !s.load(Ordering::SeqCst) {
                            std::thread::sleep(Duration::from_millis(20));
                        }
                        // Taken over (this process looked dead): stop
                        // beating on someone else's lock and say so.
                        if !owns(&p, &m) {
                            l.store(true, Ordering::SeqCst);
                            return;
                        }
                        if let Ok(f) = std::fs::File::options().write(true).open(&p) {
                            let _ = f.set_modified(SystemTime::now());
                        }
                    }
                })
                .map_err(InitError::at("cannot start the heartbeat for", &path))?;
            Ok(Try::Got(Lock { path, me, stop, lost, beat: Some(beat) }))
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let owner = std::fs::read_to_string(&path).unwrap_or_default();
            let age = std::fs::metadata(&path)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| SystemTime::now().duration_since(t).ok())
                .unwrap_or_default();
            Ok(Try::Held { owner, age })
        }
        Err(e) => Err(InitError::io("cannot create the lock", &path, e)),
    }
}

/// Run `fetch` once for this volume: skip it when the marker says the URI
/// is already in place, wait while another process holds the lock, take
/// over from a dead one, and write the marker only after `fetch` succeeds.
/// `fetch` gets a flag that turns true if another process takes the lock
/// over (this one stalled past the stale time); it must stop then.
pub fn exactly_once(
    cfg: &Config,
    ctl: &crate::Control,
    fetch: impl FnOnce(&Arc<AtomicBool>) -> Result<Fetched, InitError>,
) -> Result<Outcome, InitError> {
    std::fs::create_dir_all(&cfg.output).map_err(InitError::at("cannot create the output directory", &cfg.output))?;
    let stale = cfg.stale_after;
    let mut told = false;
    let lock = loop {
        if done(cfg) {
            return Ok(Outcome::AlreadyDone);
        }
        if let Some(signal) = ctl.stopped() {
            return Err(InitError::Terminated { signal });
        }
        match try_lock(&cfg.output, &cfg.host, stale)? {
            Try::Got(l) => break l,
            Try::Held { owner, age } if age > stale => {
                tracing::warn!(%owner, silent = ?age, "the initializer holding this volume stopped; taking over");
                // Only one rename of the name can succeed: one waiter takes over.
                let aside = cfg.output.join(format!("{LOCK}.stale.{}", std::process::id()));
                let _ = std::fs::rename(cfg.output.join(LOCK), &aside).and_then(|()| std::fs::remove_file(&aside));
            }
            Try::Held { owner, .. } => {
                if !told {
                    tracing::info!(%owner, output = %cfg.output.display(), "another initializer is filling this volume; waiting for it");
                    told = true;
                }
                std::thread::sleep(Duration::from_millis(500));
            }
        }
    };
    if done(cfg) {
        return Ok(Outcome::AlreadyDone);
    }
    // A marker for another URI or revision: this run replaces it.
    let _ = std::fs::remove_file(cfg.output.join(MARKER));
    let Fetched { files, commit, verified } = fetch(&lock.lost)?;
    if lock.lost.load(Ordering::SeqCst) || !owns(&lock.path, &lock.me) {
        return Err(InitError::LockLost { output: cfg.output.clone() });
    }
    let bytes = saturating_sum(files.iter().map(|f| f.size));
    let marker = Marker { uri: cfg.uri.clone(), revision: cfg.revision().map(str::to_string), commit, verified, files };
    let text = serde_json::to_vec_pretty(&marker).map_err(|e| InitError::Config(e.to_string()))?;
    write_atomic(&cfg.output.join(MARKER), &text)?;
    let _ = std::fs::remove_file(cfg.output.join(JOURNAL));
    sweep(&cfg.output);
    drop(lock);
    Ok(Outcome::Fetched { files: marker.files.len(), bytes })
}

/// What a remote fetch published.
#[derive(Debug)]
pub struct Fetched {
    /// Every file, as in the marker.
    pub files: Vec<FileEntry>,
    /// The commit, for the Hub.
    pub commit: Option<String>,
    /// `size` when content hashes were not checked (`--verify size`).
    pub verified: Option<String>,
}

/// What a finished run did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// This process fetched and published the files.
    Fetched {
        /// Files written.
        files: usize,
        /// Bytes written.
        bytes: u64,
    },
    /// The marker was already there, for this URI.
    AlreadyDone,
}

/// Sum of sizes a source listed, u64::MAX when it would wrap.
pub(crate) fn saturating_sum(sizes: impl IntoIterator<Item = u64>) -> u64 {
    sizes.into_iter().fold(0u64, u64::saturating_add)
}
