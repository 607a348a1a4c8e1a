//! A run's files by content: the control API puts each distinct content
//! into the store once (in chunks under `serve/blob/<sha256>/`, skipped
//! when already there), and every pod copies them from its own cache
//! (`<serve dir>/blobs/<sha256>`), fetching only what it lacks and
//! checking each fetched blob's hash, into a fresh `<serve dir>/runs/<id>/`.
//! Only the current run's directory and the blobs it uses are kept.
//!
//! # A run can write the cache
//!
//! Workers run as the agent's uid with `<serve dir>/runs/<id>/` as their
//! working directory, so a run can change anything under the serve dir,
//! `../../blobs` included. There is no place the agent can write and its
//! workers cannot: keeping the cache out of their reach would need another
//! uid (or privileges the pods do not have). A cached blob is therefore
//! never trusted by its name or size. Each use reads it into memory,
//! hashes it, and writes the run's copies from that same buffer, so nothing
//! can change it between the check and the copy; a blob that does not
//! match is logged and fetched again from the store. That check is the
//! defence; the rest only keeps a run from turning the agent's own writes
//! against files elsewhere:
//!
//! - `blobs`, `runs` and the run's directory are checked with
//!   `symlink_metadata` and replaced when they are not plain directories
//!   (a symlink is removed, never what it points to);
//! - every file is created with `O_CREAT|O_EXCL|O_NOFOLLOW` after removing
//!   what was at its name, and cached blobs are opened with `O_NOFOLLOW`
//!   and `O_NONBLOCK` (a planted FIFO cannot stall the agent);
//! - pruning removes links and directories by name without following them.
//!
//! These checks run between runs, when no process of the last run is left:
//! the end of every round sweeps the agent's descendants
//! (`crate::process::sweep`), so nothing can swap a directory between a
//! check and its use. The serve dir itself is the operator's and may be a
//! symlink; that a run could replace it too is covered by the hash check.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::spec::{FileRef, Run, check_path, sha256_hex, shown};
use super::{Error, Link};

/// Bytes per chunk (under the store's 8 MiB value limit).
pub const CHUNK: usize = 4 * 1024 * 1024;

fn chunks(size: u64) -> u64 {
    size.div_ceil(CHUNK as u64)
}

/// Put `blobs` (sha256 -> content) into the store; those already there
/// are not sent again. Returns how many bytes were sent.
pub async fn put(link: &mut Link, blobs: &BTreeMap<String, Vec<u8>>) -> Result<u64, Error> {
    let mut sent = 0u64;
    for (sha, data) in blobs {
        let n = chunks(data.len() as u64);
        if n == 0 {
            continue;
        }
        // The last chunk is written last: its presence means the blob is whole.
        if link.exists(&link.keys.blob(sha, n - 1)).await? {
            continue;
        }
        for (i, part) in data.chunks(CHUNK).enumerate() {
            link.set(&link.keys.blob(sha, i as u64), part).await?;
        }
        sent += data.len() as u64;
    }
    Ok(sent)
}

/// Remove from the store the blobs of `old` that `keep` does not use.
pub async fn forget(link: &mut Link, old: &[FileRef], keep: &[FileRef]) -> Result<(), Error> {
    let kept: BTreeSet<&str> = keep.iter().map(|f| f.sha256.as_str()).collect();
    let mut done = BTreeSet::new();
    for f in old.iter().filter(|f| !kept.contains(f.sha256.as_str())) {
        if done.insert(f.sha256.clone()) {
            for i in 0..chunks(f.size) {
                link.delete(&link.keys.blob(&f.sha256, i)).await?;
            }
        }
    }
    Ok(())
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.display().to_string();
    move |source| Error::Io { what, path, source }
}

/// The run's directory under `dir` with every file in place; fetches what
/// the local cache lacks or holds changed. Other runs' directories and
/// unused cached blobs are removed.
pub async fn materialize(link: &mut Link, dir: &Path, run: &Run) -> Result<(PathBuf, u64), Error> {
    // The store is shared with the workers: trust no name from it.
    check_path(&run.id)
        .ok()
        .filter(|()| !run.id.contains('/'))
        .ok_or_else(|| Error::Corrupt(format!("run {}: its id is not a plain name", shown(&run.id))))?;
    let mut by_content: BTreeMap<&str, Vec<&FileRef>> = BTreeMap::new();
    for f in &run.files {
        check_path(&f.path).map_err(Error::Corrupt)?;
        if f.sha256.len() != 64 || !f.sha256.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(Error::Corrupt(format!("run {}: a file's hash is not lower-case hex SHA-256", run.id)));
        }
        by_content.entry(&f.sha256).or_default().push(f);
    }
    std::fs::create_dir_all(dir).map_err(io("cannot create", dir))?;
    let cache = dir.join("blobs");
    let runs = dir.join("runs");
    plain_dir(&cache)?;
    plain_dir(&runs)?;
    let here = runs.join(&run.id);
    remove(&here).map_err(io("cannot clear", &here))?;
    std::fs::create_dir(&here).map_err(io("cannot create", &here))?;
    let mut fetched = 0u64;
    // One content in memory at a time: checked, then written everywhere it goes.
    for (sha, files) in by_content {
        let size = files[0].size;
        if files.iter().any(|f| f.size != size) {
            return Err(Error::Corrupt(format!("run {}: one content with two sizes", run.id)));
        }
        let cached = cache.join(sha);
        let data = match read_cached(&cached, sha, size) {
            Cached::Valid(data) => data,
            found => {
                if found == Cached::Changed {
                    tracing::warn!(
                        run = %run.id,
                        file = %shown(&files[0].path),
                        sha256 = sha,
                        "the cached copy did not match its hash (changed since it was fetched, by a run or on disk); fetching it again from the store"
                    );
                }
                let data = fetch(link, sha, size, &files[0].path).await?;
                fetched += size;
                keep(&cache, sha, &data);
                data
            }
        };
        for f in files {
            let to = here.join(&f.path);
            if let Some(parent) = to.parent() {
                std::fs::create_dir_all(parent).map_err(io("cannot create", parent))?;
            }
            write_new(&to, &data).map_err(io("cannot write", &to))?;
        }
    }
    prune(&runs, &cache, run);
    Ok((here, fetched))
}

/// Blob `sha` from the store, checked against its hash.
async fn fetch(link: &mut Link, sha: &str, size: u64, path: &str) -> Result<Vec<u8>, Error> {
    let mut data = Vec::with_capacity(usize::try_from(size).unwrap_or(0).min(super::spec::MAX_FILES_BYTES));
    for i in 0..chunks(size) {
        data.extend_from_slice(&link.get(&link.keys.blob(sha, i)).await?);
    }
    if sha256_hex(&data) != sha {
        return Err(Error::Corrupt(format!(
            "{}: the store's copy does not match its hash (removed or changed in the store)",
            shown(path)
        )));
    }
    Ok(data)
}

/// What the cache holds for one blob.
#[derive(Debug, PartialEq, Eq)]
enum Cached {
    /// Its content, hashed and matching.
    Valid(Vec<u8>),
    /// Nothing.
    Missing,
    /// Something else: another size or content, a link, a directory, a FIFO.
    Changed,
}

/// Read cached blob `path` (never through a link) and check it against
/// `sha` and `size`.
fn read_cached(path: &Path, sha: &str, size: u64) -> Cached {
    use std::io::Read;
    let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(path);
    let file = match file {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Cached::Missing,
        // ELOOP: a symlink; anything unreadable is fetched again too.
        Err(_) => return Cached::Changed,
    };
    if !file.metadata().is_ok_and(|m| m.is_file() && m.len() == size) {
        return Cached::Changed;
    }
    let mut data = Vec::with_capacity(usize::try_from(size).unwrap_or(0).min(super::spec::MAX_FILES_BYTES));
    // One byte more than expected tells a file that grew since its length was read.
    if file.take(size.saturating_add(1)).read_to_end(&mut data).is_err()
        || data.len() as u64 != size
        || sha256_hex(&data) != sha
    {
        return Cached::Changed;
    }
    Cached::Valid(data)
}

/// Put a fetched blob into the cache for the next run; on failure the
/// run goes on (its copy is written from memory) and the next fetches again.
fn keep(cache: &Path, sha: &str, data: &[u8]) {
    let tmp = cache.join(format!("{sha}.part"));
    let cached = cache.join(sha);
    let r = write_new(&tmp, data)
        .and_then(|()| remove(&cached))
        // rename replaces the name itself: a link there is not followed.
        .and_then(|()| std::fs::rename(&tmp, &cached));
    if let Err(e) = r {
        tracing::warn!(path = %cached.display(), error = %e, "cannot cache a run's file; the next run fetches it again");
        let _ = remove(&tmp);
    }
}

/// `path` as a plain directory: whatever else is there (a symlink a run
/// planted, a file) is removed first, never what a link points to.
fn plain_dir(path: &Path) -> Result<(), Error> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => return Ok(()),
        Ok(_) => {
            tracing::warn!(path = %path.display(), "not a directory (replaced by a run?); making it one again");
            std::fs::remove_file(path).map_err(io("cannot remove", path))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("cannot inspect", path)(e)),
    }
    std::fs::create_dir(path).map_err(io("cannot create", path))
}

/// Remove `path` if it is there, without following a link: a directory
/// with what it holds (std's `remove_dir_all` does not follow links
/// inside), anything else by its name.
fn remove(path: &Path) -> std::io::Result<()> {
    let r = match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) => Err(e),
    };
    match r {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

/// Write `data` to a new file at `path`, replacing what was there by name:
/// created with `O_EXCL|O_NOFOLLOW`, so a link made in between is an error,
/// never written through (nor a FIFO opened: it is removed first).
pub fn write_new(path: &Path, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    remove(path)?;
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).custom_flags(libc::O_NOFOLLOW).open(path)?;
    f.write_all(data)
}

/// Remove other runs' directories and the blobs `run` does not use.
fn prune(runs: &Path, cache: &Path, run: &Run) {
    let used: BTreeSet<&str> = run.files.iter().map(|f| f.sha256.as_str()).collect();
    for (dir, keep) in [(runs, None), (cache, Some(&used))] {
        let Ok(entries) = std::fs::read_dir(dir) else { continue };
        for e in entries.flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            let stale = match keep {
                None => name != run.id.as_str(),
                Some(used) => !used.contains(name.as_ref()),
            };
            if !stale {
                continue;
            }
            let p = e.path();
            if let Err(err) = remove(&p) {
                tracing::debug!(path = %p.display(), error = %err, "cannot remove an old run's file");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blob(data: &[u8]) -> (String, u64) {
        (sha256_hex(data), data.len() as u64)
    }

    #[test]
    fn a_cached_blob_is_used_only_when_its_hash_matches() {
        let dir = tempfile::tempdir().expect("tmp");
        let (sha, size) = blob(b"print('mine')\n");
        let path = dir.path().join(&sha);
        assert_eq!(read_cached(&path, &sha, size), Cached::Missing);
        std::fs::write(&path, b"print('mine')\n").expect("write");
        assert_eq!(read_cached(&path, &sha, size), Cached::Valid(b"print('mine')\n".to_vec()));
        // Same size, other content: what a run planted.
        std::fs::write(&path, b"print('evil')\n").expect("write");
        assert_eq!(read_cached(&path, &sha, size), Cached::Changed);
        std::fs::write(&path, b"print('mine')\n and more").expect("write");
        assert_eq!(read_cached(&path, &sha, size), Cached::Changed);
        // A link to the right content is not followed either.
        let real = dir.path().join("real");
        std::fs::write(&real, b"print('mine')\n").expect("write");
        std::fs::remove_file(&path).expect("rm");
        std::os::unix::fs::symlink(&real, &path).expect("link");
        assert_eq!(read_cached(&path, &sha, size), Cached::Changed);
        std::fs::remove_file(&path).expect("rm");
        std::fs::create_dir(&path).expect("dir");
        assert_eq!(read_cached(&path, &sha, size), Cached::Changed);
        std::fs::remove_dir(&path).expect("rmdir");
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600)).expect("fifo");
        assert_eq!(read_cached(&path, &sha, size), Cached::Changed, "a FIFO does not block");
    }

    #[test]
    fn writes_replace_links_and_never_follow_them() {
        let dir = tempfile::tempdir().expect("tmp");
        let victim = dir.path().join("victim");
        std::fs::create_dir(&victim).expect("dir");
        std::fs::write(victim.join("canary"), b"alive").expect("write");
        let cache = dir.path().join("blobs");
        std::os::unix::fs::symlink(&victim, &cache).expect("link");
        plain_dir(&cache).expect("plain");
        assert!(std::fs::symlink_metadata(&cache).expect("meta").is_dir());
        assert_eq!(std::fs::read(victim.join("canary")).expect("canary"), b"alive");
        let part = cache.join("x.part");
        std::os::unix::fs::symlink(victim.join("canary"), &part).expect("link");
        write_new(&part, b"written").expect("write");
        assert_eq!(std::fs::read(&part).expect("part"), b"written");
        assert!(!std::fs::symlink_metadata(&part).expect("meta").file_type().is_symlink());
        assert_eq!(std::fs::read(victim.join("canary")).expect("canary"), b"alive");
        // Pruning removes a link to a directory, not what is in it.
        std::os::unix::fs::symlink(&victim, cache.join("stale")).expect("link");
        let run = Run {
            id: "run-1-a".into(),
            seq: 1,
            command: vec!["true".into()],
            env: Vec::new(),
            nproc: None,
            max_restarts: 0,
            base_restarts: 0,
            files: Vec::new(),
            actor: None,
            first_slot: 0,
            lane: false,
        };
        let runs = dir.path().join("runs");
        plain_dir(&runs).expect("runs");
        std::os::unix::fs::symlink(&victim, runs.join("run-0-old")).expect("link");
        prune(&runs, &cache, &run);
        assert_eq!(std::fs::read_dir(&cache).expect("cache").count(), 0);
        assert_eq!(std::fs::read_dir(&runs).expect("runs").count(), 0);
        assert_eq!(std::fs::read(victim.join("canary")).expect("canary"), b"alive");
    }
}
