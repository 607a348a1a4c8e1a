//! A run's files by content: the control API puts each distinct content
//! into the store once (in chunks under `serve/blob/<sha256>/`, skipped
//! when already there), and every pod copies them from its own cache
//! (`<serve dir>/blobs/<sha256>`), fetching only what it lacks and
//! checking each fetched blob's hash, into a fresh `<serve dir>/runs/<id>/`.
//! Only the current run's directory and the blobs it uses are kept.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use super::spec::{FileRef, Run, check_path, sha256_hex};
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
/// the local cache lacks. Other runs' directories and unused cached blobs
/// are removed.
pub async fn materialize(link: &mut Link, dir: &Path, run: &Run) -> Result<(PathBuf, u64), Error> {
    let cache = dir.join("blobs");
    let runs = dir.join("runs");
    std::fs::create_dir_all(&cache).map_err(io("cannot create", &cache))?;
    std::fs::create_dir_all(&runs).map_err(io("cannot create", &runs))?;
    let mut fetched = 0u64;
    for f in &run.files {
        // The store is shared with the workers: trust no name from it.
        check_path(&f.path).map_err(Error::Corrupt)?;
        if f.sha256.len() != 64 || !f.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(Error::Corrupt(format!("run {}: a file's hash is not hex SHA-256", run.id)));
        }
        let cached = cache.join(&f.sha256);
        if std::fs::metadata(&cached).is_ok_and(|m| m.len() == f.size) {
            continue;
        }
        let mut data = Vec::with_capacity(usize::try_from(f.size).unwrap_or(0).min(super::spec::MAX_FILES_BYTES));
        for i in 0..chunks(f.size) {
            data.extend_from_slice(&link.get(&link.keys.blob(&f.sha256, i)).await?);
        }
        if sha256_hex(&data) != f.sha256 {
            return Err(Error::Corrupt(format!(
                "{}: the store's copy does not match its hash (removed or changed in the store)",
                super::spec::shown(&f.path)
            )));
        }
        let tmp = cache.join(format!("{}.part", f.sha256));
        std::fs::write(&tmp, &data).map_err(io("cannot write", &tmp))?;
        std::fs::rename(&tmp, &cached).map_err(io("cannot rename", &cached))?;
        fetched += f.size;
    }
    let here = runs.join(&run.id);
    if here.exists() {
        std::fs::remove_dir_all(&here).map_err(io("cannot clear", &here))?;
    }
    std::fs::create_dir_all(&here).map_err(io("cannot create", &here))?;
    for f in &run.files {
        let to = here.join(&f.path);
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent).map_err(io("cannot create", parent))?;
        }
        std::fs::copy(cache.join(&f.sha256), &to).map_err(io("cannot copy into", &to))?;
    }
    prune(&runs, &cache, run);
    Ok((here, fetched))
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
            let r = if p.is_dir() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) };
            if let Err(err) = r {
                tracing::debug!(path = %p.display(), error = %err, "cannot remove an old run's file");
            }
        }
    }
}
