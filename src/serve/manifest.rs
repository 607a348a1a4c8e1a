//! What the setup steps left in their directories (`<serve dir>/setup/site`
//! and `.../work`), to find out before each run whether a run wrote there
//! ([`super::setup`]): for every entry, a hash of its path mapped to a
//! hash of its type, mode, size, inode and change time. No write, rename,
//! link or chmod leaves an entry's change time as it was, and a run cannot
//! set it. Both hashes are keyed with this agent's random keys, so that no
//! name can be made to collide with another.
//!
//! The walk is bounded whatever a run put there: depth first, one open
//! directory per level (at most [`MAX_DEPTH`]) and one path, and at most
//! [`MAX_ENTRIES`] entries (16 bytes each); past either bound the
//! directories count as changed. It follows no symbolic link.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::spec::shown;

/// Most entries a manifest holds (a pip install of torch is about 20,000).
pub const MAX_ENTRIES: usize = 250_000;
/// Most levels of directories the walk opens at once.
pub const MAX_DEPTH: usize = 64;
/// Changed paths named in a comparison.
const NAMED: usize = 3;

/// The entries of some directories (see the module doc).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Manifest(HashMap<u64, u64>);

/// This agent's hash keys.
fn keys() -> &'static std::collections::hash_map::RandomState {
    static KEYS: std::sync::OnceLock<std::collections::hash_map::RandomState> = std::sync::OnceLock::new();
    KEYS.get_or_init(std::collections::hash_map::RandomState::new)
}

/// A manifest being taken, compared with the one before as it goes.
struct Taking<'a> {
    now: HashMap<u64, u64>,
    was: Option<&'a Manifest>,
    root: &'a Path,
    named: Vec<String>,
    /// Entries added or changed.
    differ: usize,
}

impl Taking<'_> {
    fn record(&mut self, path: &Path, meta: Option<&std::fs::Metadata>) -> std::io::Result<()> {
        if self.now.len() >= MAX_ENTRIES {
            return Err(std::io::Error::other(format!("over {MAX_ENTRIES} entries")));
        }
        let key = keys().hash_one(path.as_os_str().as_bytes());
        let value = meta.map_or(0, |m| {
            keys().hash_one((m.mode(), m.size(), m.ino(), m.dev(), m.ctime(), m.ctime_nsec(), m.nlink()))
        });
        self.now.insert(key, value);
        if let Some(was) = self.was
            && was.0.get(&key) != Some(&value)
        {
            self.differ += 1;
            if self.named.len() == NAMED {
                return Ok(());
            }
            let what = if was.0.contains_key(&key) { "changed" } else { "added" };
            let rel = path.strip_prefix(self.root).unwrap_or(path);
            self.named.push(format!("{what} {}", shown(&rel.display().to_string())));
        }
        Ok(())
    }

    /// Everything below the directory `top` (recorded already).
    fn below(&mut self, top: &Path) -> std::io::Result<()> {
        let mut open = vec![std::fs::read_dir(top)?];
        let mut path = top.to_path_buf();
        while let Some(level) = open.last_mut() {
            let Some(next) = level.next() else {
                open.pop();
                path.pop();
                continue;
            };
            let e = next?;
            path.push(e.file_name());
            let meta = std::fs::symlink_metadata(&path)?;
            self.record(&path, Some(&meta))?;
            if !meta.is_dir() {
                path.pop();
            } else if open.len() >= MAX_DEPTH {
                return Err(std::io::Error::other(format!("deeper than {MAX_DEPTH} levels")));
            } else {
                open.push(std::fs::read_dir(&path)?);
            }
        }
        Ok(())
    }
}

impl Manifest {
    /// The manifest of `dirs` (each may be missing) under `root`, and what
    /// differs from `was` when given: up to three paths added or changed,
    /// escaped and relative to `root`, and how many are gone. Err when an
    /// entry cannot be read or a bound is passed.
    pub fn take(root: &Path, dirs: &[PathBuf], was: Option<&Manifest>) -> std::io::Result<(Manifest, Vec<String>)> {
        let mut t = Taking { now: HashMap::new(), was, root, named: Vec::new(), differ: 0 };
        for top in dirs {
            match std::fs::symlink_metadata(top) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => t.record(top, None)?,
                Err(e) => return Err(e),
                Ok(meta) => {
                    t.record(top, Some(&meta))?;
                    if meta.is_dir() {
                        t.below(top)?;
                    }
                }
            }
        }
        let mut named = t.named;
        if t.differ > named.len() {
            named.push(format!("{} more added or changed", t.differ - named.len()));
        }
        if let Some(was) = was {
            let gone = was.0.keys().filter(|k| !t.now.contains_key(k)).count();
            if gone > 0 {
                named.push(format!("{gone} removed"));
            }
        }
        Ok((Manifest(t.now), named))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_write_rename_or_chmod_is_seen_and_named() {
        let tmp = tempfile::tempdir().expect("tmp");
        let (site, work) = (tmp.path().join("site"), tmp.path().join("work"));
        let dirs = [site.clone(), work.clone()];
        let take = |was: Option<&Manifest>| Manifest::take(tmp.path(), &dirs, was).expect("manifest");
        let (empty, _) = take(None);
        std::fs::create_dir_all(site.join("pkg")).expect("site");
        std::fs::create_dir_all(&work).expect("work");
        std::fs::write(site.join("pkg/__init__.py"), "x = 1\n").expect("write");
        let (made, named) = take(Some(&empty));
        assert!(!named.is_empty(), "made from nothing");
        let (again, named) = take(Some(&made));
        assert_eq!((&again, named), (&made, Vec::new()), "nothing changed");
        let changes: [(&dyn Fn(), &str); 5] = [
            (
                &|| std::fs::write(site.join("pkg/__init__.py"), "x = 2\n").expect("rewrite"),
                "changed \"site/pkg/__init__.py\"",
            ),
            (&|| std::fs::write(site.join("sitecustomize.py"), "").expect("new"), "added \"site/sitecustomize.py\""),
            (&|| std::fs::write(work.join("helper.sh"), "").expect("work"), "added \"work/helper.sh\""),
            (
                &|| {
                    use std::os::unix::fs::PermissionsExt;
                    let p = std::fs::Permissions::from_mode(0o777);
                    std::fs::set_permissions(site.join("pkg"), p).expect("chmod");
                },
                "changed \"site/pkg\"",
            ),
            (&|| std::fs::remove_file(work.join("helper.sh")).expect("rm"), "1 removed"),
        ];
        let mut last = made;
        for (change, says) in changes {
            // File times tick with the kernel's coarse clock (4 ms at HZ=250):
            // a run's write comes long after the steps' last one; here, wait.
            std::thread::sleep(std::time::Duration::from_millis(15));
            change();
            let (now, named) = take(Some(&last));
            assert!(named.iter().any(|n| n == says), "{says}: {named:?}");
            last = now;
        }
    }

    #[test]
    fn a_tree_past_the_bounds_counts_as_changed() {
        let tmp = tempfile::tempdir().expect("tmp");
        let mut deep = tmp.path().join("site");
        for _ in 0..MAX_DEPTH + 1 {
            deep.push("d");
        }
        std::fs::create_dir_all(&deep).expect("deep");
        let e = Manifest::take(tmp.path(), &[tmp.path().join("site")], None).expect_err("too deep");
        assert!(e.to_string().contains("deeper than 64"), "{e}");
    }
}
