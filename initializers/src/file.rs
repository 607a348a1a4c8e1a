//! `file://` sources: a file or a directory tree, hard-linked into the
//! output when it is on the same filesystem (no bytes copied), else
//! streamed through a temporary name and renamed.
//!
//! Symlinks are decided as `rsync --safe-links` / `cp -P` do: one that
//! stays inside the source tree is recreated as a symlink (to the same
//! place, relative); one that points outside it (`shadow -> /etc/shadow`)
//! or nowhere is skipped with a warning, never followed. Copies keep the
//! source's mode without group/world write and set-id bits.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use crate::config::Config;
use crate::error::InitError;
use crate::remote::{check_rel, escaped};
use crate::volume::{Fetched, FileEntry, partial_name};

/// What the walk found under the source root.
#[derive(Debug, Default)]
struct Tree {
    /// Regular files: (`/`-separated path relative to the root, source path).
    files: Vec<(String, PathBuf)>,
    /// Symlinks inside the tree: (relative path, link text to write).
    links: Vec<(String, PathBuf)>,
}

/// Every regular file under `root` (itself when it is a file), and the
/// symlinks that stay inside it.
fn walk(uri: &str, root: &Path) -> Result<Tree, InitError> {
    let meta = std::fs::metadata(root).map_err(InitError::at("cannot read", root))?;
    if meta.is_file() {
        let name = root.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        return Ok(Tree { files: vec![(name, root.to_path_buf())], links: Vec::new() });
    }
    let real_root = std::fs::canonicalize(root).map_err(InitError::at("cannot read", root))?;
    let mut tree = Tree::default();
    let mut stack = vec![(String::new(), root.to_path_buf())];
    while let Some((rel, dir)) = stack.pop() {
        for e in std::fs::read_dir(&dir).map_err(InitError::at("cannot list", &dir))? {
            let e = e.map_err(InitError::at("cannot list", &dir))?;
            let name = e.file_name().to_string_lossy().into_owned();
            let path = e.path();
            let rel = if rel.is_empty() { name } else { format!("{rel}/{name}") };
            if let Err(why) = check_rel(&rel) {
                tracing::warn!(uri, path = %escaped(&rel), "skipping a file: {why}");
                continue;
            }
            let m = std::fs::symlink_metadata(&path).map_err(InitError::at("cannot read", &path))?;
            if m.file_type().is_symlink() {
                match inside_link(&real_root, &path) {
                    Some(text) => tree.links.push((rel, text)),
                    None => tracing::warn!(
                        uri,
                        path = %escaped(&rel),
                        "skipping a symlink that points outside the source tree (or nowhere); it is not followed"
                    ),
                }
            } else if m.is_dir() {
                stack.push((rel, path));
            } else if m.is_file() {
                tree.files.push((rel, path));
            }
        }
    }
    tree.files.sort();
    tree.links.sort();
    Ok(tree)
}

/// The link text to recreate `link` with, when what it points to (after
/// every hop) is inside `real_root`: relative, from the link's directory.
fn inside_link(real_root: &Path, link: &Path) -> Option<PathBuf> {
    let target = std::fs::canonicalize(link).ok()?;
    if !target.starts_with(real_root) {
        return None;
    }
    let dir = std::fs::canonicalize(link.parent()?).ok()?;
    Some(relative(&dir, &target))
}

/// `to` relative to the directory `from` (both absolute and canonical).
fn relative(from: &Path, to: &Path) -> PathBuf {
    let (f, t): (Vec<_>, Vec<_>) = (from.components().collect(), to.components().collect());
    let common = f.iter().zip(&t).take_while(|(a, b)| a == b).count();
    let mut out = PathBuf::new();
    for _ in common..f.len() {
        out.push("..");
    }
    for c in &t[common..] {
        out.push(c);
    }
    if out.as_os_str().is_empty() { PathBuf::from(".") } else { out }
}

/// Fetch `root` into `cfg.output`.
pub fn fetch(cfg: &Config, root: &Path) -> Result<Fetched, InitError> {
    if !root.exists() {
        return Err(InitError::NotFound { uri: cfg.uri.clone(), what: format!("{} does not exist", root.display()) });
    }
    let tree = walk(&cfg.uri, root)?;
    let files: Vec<_> = tree.files.into_iter().filter(|(rel, _)| cfg.filter.keeps(rel)).collect();
    if files.is_empty() {
        return Err(InitError::NoFiles { uri: cfg.uri.clone(), filter: cfg.filter.describe() });
    }
    let mut entries = Vec::with_capacity(files.len());
    for (rel, src) in files {
        let (dest, tmp) = destination(cfg, &rel)?;
        let size = std::fs::metadata(&src).map_err(InitError::at("cannot read", &src))?.len();
        // Same filesystem: a hard link (regular files only: the walk yields
        // nothing else), no bytes copied; else a streamed copy.
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
    for (rel, text) in tree.links.into_iter().filter(|(rel, _)| cfg.filter.keeps(rel)) {
        let (dest, tmp) = destination(cfg, &rel)?;
        std::os::unix::fs::symlink(&text, &tmp).map_err(InitError::at("cannot create", &tmp))?;
        std::fs::rename(&tmp, &dest).map_err(InitError::at("cannot publish", &dest))?;
    }
    Ok(Fetched { files: entries, commit: None, verified: None })
}

/// Where `rel` is published in the output, and the temporary name it is
/// written under first (its directory created, a stale one removed).
fn destination(cfg: &Config, rel: &str) -> Result<(PathBuf, PathBuf), InitError> {
    let dest = cfg.output.join(rel);
    if let Some(dir) = dest.parent() {
        std::fs::create_dir_all(dir).map_err(InitError::at("cannot create", dir))?;
    }
    let tmp = partial_name(&dest);
    let _ = std::fs::remove_file(&tmp);
    Ok((dest, tmp))
}

/// Stream `src` into a new `dst`, synced before it is renamed.
fn copy(src: &Path, dst: &Path) -> Result<(), InitError> {
    let mut r = std::fs::File::open(src).map_err(InitError::at("cannot open", src))?;
    let mut w = std::fs::File::create(dst).map_err(InitError::at("cannot create", dst))?;
    std::io::copy(&mut r, &mut w).map_err(InitError::at("cannot write", dst))?;
    // The source's mode, never wider: no group/world write, no set-id bits.
    let mode = r.metadata().map_err(InitError::at("cannot read", src))?.permissions().mode() & 0o755;
    w.set_permissions(std::fs::Permissions::from_mode(mode)).map_err(InitError::at("cannot write", dst))?;
    w.sync_all().map_err(InitError::at("cannot sync", dst))
}
