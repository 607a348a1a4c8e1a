//! The pod-local cache's use (`TRAINLET_CACHE_DIR`), as `GET /v1/status`
//! shows it for every pod.
//!
//! Each pod measures its cache directory after every round and every
//! [`MEASURE_EVERY`] ([`publish`]), and writes what changed to the agents'
//! store under `cache/<pod>`. The control API's host reads those entries every
//! [`GATHER_EVERY`] ([`gather`]) for the pods of the newest round onto its
//! board, so a status request never waits on the store or on a walk of a
//! large directory.
//!
//! The walk ([`measure`]) follows no symbolic link, skips what it cannot
//! read, counts file sizes (not disk blocks; a hard link once per link)
//! with a saturating sum, and stops after [`MAX_ENTRIES`] entries, saying
//! so (`truncated`).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::Link;
use super::board::Board;
use crate::store::Dial;

/// How often a pod measures its cache between rounds.
pub const MEASURE_EVERY: Duration = Duration::from_secs(15);
/// How often the control API reads the pods' entries.
pub const GATHER_EVERY: Duration = Duration::from_secs(5);
/// Most entries one walk visits.
pub const MAX_ENTRIES: u64 = 200_000;
/// Most bytes of an entry the control API takes.
const MAX_ENTRY: usize = 4096;

/// One pod's cache, as measured.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// The pod (its host name).
    pub pod: String,
    /// The directory.
    pub dir: String,
    /// Bytes in its files.
    pub bytes: u64,
    /// Its files (anything but a directory).
    pub files: u64,
    /// The walk stopped at [`MAX_ENTRIES`]: the counts are lower bounds.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
}

/// Walk `dir` (see the module doc); `pod` names the result.
pub fn measure(pod: &str, dir: &Path) -> Usage {
    let mut u = Usage { pod: pod.to_string(), dir: dir.display().to_string(), ..Usage::default() };
    let mut todo = vec![dir.to_path_buf()];
    let mut seen = 0u64;
    while let Some(d) = todo.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries.flatten() {
            seen += 1;
            if seen > MAX_ENTRIES {
                u.truncated = true;
                return u;
            }
            let Ok(meta) = e.path().symlink_metadata() else { continue };
            if meta.is_dir() {
                todo.push(e.path());
            } else {
                u.files += 1;
                if meta.is_file() {
                    u.bytes = u.bytes.saturating_add(meta.len());
                }
            }
        }
    }
    u
}

/// The store key of `pod`'s entry under the job's keys `base`.
fn key(base: &str, pod: &str) -> String {
    format!("{base}/cache/{pod}")
}

/// A pod's side: measure `dir` now, whenever `poke` is notified (a round
/// ended), and every [`MEASURE_EVERY`]; write the entry when it changed.
pub fn publish(
    dial: Dial,
    base: String,
    (pod, dir): (String, std::path::PathBuf),
    poke: Arc<Notify>,
    cancel: CancellationToken,
) {
    tokio::spawn(async move {
        let mut link = Link::new(dial, &base);
        let mut last: Option<Usage> = None;
        loop {
            let (p, d) = (pod.clone(), dir.clone());
            let now = tokio::task::spawn_blocking(move || measure(&p, &d)).await.unwrap_or_default();
            if last.as_ref() != Some(&now)
                && let Ok(v) = serde_json::to_vec(&now)
            {
                match link.set(&key(&base, &pod), &v).await {
                    Ok(()) => last = Some(now),
                    Err(e) => {
                        tracing::debug!(error = %crate::error::error_chain(&e), "cannot write the cache's use to the store")
                    }
                }
            }
            tokio::select! {
                () = cancel.cancelled() => return,
                () = poke.notified() => {}
                () = tokio::time::sleep(MEASURE_EVERY) => {}
            }
        }
    });
}

/// The control API's side: every [`GATHER_EVERY`], the entries of the
/// newest round's pods onto `board`.
pub fn gather(dial: Dial, base: String, board: Arc<Board>, cancel: CancellationToken) {
    tokio::spawn(async move {
        let mut link = Link::new(dial, &base);
        loop {
            let mut all = Vec::new();
            for pod in board.world().pods {
                let Ok(raw) = link.get(&key(&base, &pod)).await else { break };
                let entry = (raw.len() <= MAX_ENTRY).then(|| serde_json::from_slice::<Usage>(&raw).ok()).flatten();
                if let Some(u) = entry.filter(|u| u.pod == pod) {
                    all.push(u);
                }
            }
            board.set_cache(all);
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(GATHER_EVERY) => {}
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_walk_counts_files_and_bytes_follows_no_link_and_stops_at_its_bound() {
        let d = tempfile::tempdir().expect("tmp");
        std::fs::create_dir_all(d.path().join("a/b")).expect("dirs");
        std::fs::write(d.path().join("a/one"), b"12345").expect("one");
        std::fs::write(d.path().join("a/b/two"), b"123").expect("two");
        std::os::unix::fs::symlink("/", d.path().join("root")).expect("link");
        std::os::unix::fs::symlink(d.path(), d.path().join("a/loop")).expect("loop");
        let u = measure("pod-0", d.path());
        assert_eq!((u.pod.as_str(), u.bytes, u.files, u.truncated), ("pod-0", 8, 4, false), "{u:?}");
        let gone = measure("pod-0", &d.path().join("nothing"));
        assert_eq!((gone.bytes, gone.files), (0, 0));
        let text = serde_json::to_string(&u).expect("json");
        assert!(!text.contains("truncated"), "{text}");
        assert_eq!(serde_json::from_str::<Usage>(&text).expect("back"), u);
    }
}
