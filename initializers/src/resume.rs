//! What lets a rerun resume instead of starting over: the state file next
//! to each part file (header, then the ranges written), the split of a
//! file into ranges, preallocation, and the journal of published files.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::InitError;

/// The state file's first line.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) size: u64,
    pub(crate) check: String,
    pub(crate) chunk: u64,
}

/// One journal line.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Journaled {
    pub(crate) path: String,
    pub(crate) size: u64,
    pub(crate) check: String,
}

pub(crate) fn state_name(dest: &Path) -> PathBuf {
    crate::volume::temp_name(dest, crate::volume::STATE)
}

pub(crate) fn split(size: u64, chunk: u64, ranges: bool) -> Vec<Range<u64>> {
    if size == 0 {
        return Vec::new();
    }
    if !ranges {
        return std::iter::once(0..size).collect();
    }
    (0..size.div_ceil(chunk)).map(|i| i * chunk..((i + 1) * chunk).min(size)).collect()
}

/// Ranges already written by an earlier run, if its state matches `header`.
pub(crate) fn resumed(state: &Path, part: &Path, header: &Header) -> Option<Vec<usize>> {
    let text = std::fs::read_to_string(state).ok()?;
    let mut lines = text.split_inclusive('\n');
    let first: Header = serde_json::from_str(lines.next()?.trim()).ok()?;
    if first != *header || std::fs::metadata(part).ok()?.len() != header.size {
        return None;
    }
    // A line cut short by a kill has no newline: not counted.
    Some(lines.filter(|l| l.ends_with('\n')).filter_map(|l| l.trim().parse().ok()).collect())
}

/// Reserve `size` bytes for `f`: a full volume fails now, not mid-way.
pub(crate) fn preallocate(f: &std::fs::File, path: &Path, size: u64) -> Result<(), InitError> {
    use std::os::fd::AsRawFd;
    let len =
        i64::try_from(size).map_err(|_| InitError::Config(format!("{}: size {size} too large", path.display())))?;
    match nix::fcntl::posix_fallocate(f.as_raw_fd(), 0, len) {
        Ok(()) => Ok(()),
        Err(nix::errno::Errno::ENOSPC) => {
            Err(InitError::io("cannot reserve space for", path, std::io::Error::from_raw_os_error(libc::ENOSPC)))
        }
        // NFS and others without fallocate: a sparse file of the right size.
        Err(_) => f.set_len(size).map_err(InitError::at("cannot size", path)),
    }
}

pub(crate) fn read_journal(path: &Path) -> HashMap<String, (u64, String)> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Journaled>(l).ok())
        .map(|j| (j.path, (j.size, j.check)))
        .collect()
}
