//! `file://` sources: a file or a directory tree, hard-linked into the
//! output when it is on the same filesystem (no bytes copied), else
//! streamed through a temporary name and renamed.

use std::path::Path;

use crate::fetch::Fetched;
use crate::volume::{FileEntry, partial_name};
use crate::{Config, InitError};

/// Every regular file under `root` (itself when it is a file), with its
/// `/`-separated path relative to `root`.
fn walk(root: &Path) -> Result<Vec<(String, std::path::PathBuf)>, InitError> {
    let meta = std::fs::metadata(root).map_err(InitError::at("cannot read", root))?;
    if meta.is_file() {
        let name = root.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        return Ok(vec![(name, root.to_path_buf())]);
    }
    let mut out = Vec::new();
    let mut stack = vec![(String::new(), root.to_path_buf())];
    while let Some((rel, dir)) = stack.pop() {
        for e in std::fs::read_dir(&dir).map_err(InitError::at("cannot list", &dir))? {
            let e = e.map_err(InitError::at("cannot list", &dir))?;
            let name = e.file_name().to_string_lossy().into_owned();
            let path = e.path();
            let rel = if rel.is_empty() { name } else { format!("{rel}/{name}") };
            let m = std::fs::metadata(&path).map_err(InitError::at("cannot read", &path))?;
            if m.is_dir() {
                stack.push((rel, path));
            } else if m.is_file() {
                out.push((rel, path));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Fetch `root` into `cfg.output`.
pub fn fetch(cfg: &Config, root: &Path) -> Result<Fetched, InitError> {
    if !root.exists() {
        return Err(InitError::NotFound { uri: cfg.uri.clone(), what: format!("{} does not exist", root.display()) });
    }
    let files: Vec<_> = walk(root)?.into_iter().filter(|(rel, _)| cfg.filter.keeps(rel)).collect();
    if files.is_empty() {
        return Err(InitError::NoFiles { uri: cfg.uri.clone(), filter: cfg.filter.describe() });
    }
    let mut entries = Vec::with_capacity(files.len());
    for (rel, src) in files {
        let dest = cfg.output.join(&rel);
        if let Some(dir) = dest.parent() {
            std::fs::create_dir_all(dir).map_err(InitError::at("cannot create", dir))?;
        }
        let tmp = partial_name(&dest);
        let _ = std::fs::remove_file(&tmp);
        let size = std::fs::metadata(&src).map_err(InitError::at("cannot read", &src))?.len();
        // Same filesystem: a hard link, no bytes copied; else a streamed copy.
        if std::fs::hard_link(&src, &tmp).is_err()
            && let Err(e) = copy(&src, &tmp)
        {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        let got = std::fs::metadata(&tmp).map_err(InitError::at("cannot read", &tmp))?.len();
        if got != size {
            let _ = std::fs::remove_file(&tmp);
            return Err(InitError::Io {
                what: "size changed while copying",
                path: src,
                source: std::io::Error::other(format!("{size} bytes listed, {got} written")),
            });
        }
        std::fs::rename(&tmp, &dest).map_err(InitError::at("cannot publish", &dest))?;
        entries.push(FileEntry { path: rel, size, check: None });
    }
    Ok(Fetched { files: entries, commit: None, verified: None })
}

/// Stream `src` into a new `dst`, synced before it is renamed.
fn copy(src: &Path, dst: &Path) -> Result<(), InitError> {
    let mut r = std::fs::File::open(src).map_err(InitError::at("cannot open", src))?;
    let mut w = std::fs::File::create(dst).map_err(InitError::at("cannot create", dst))?;
    std::io::copy(&mut r, &mut w).map_err(InitError::at("cannot write", dst))?;
    w.sync_all().map_err(InitError::at("cannot sync", dst))
}
