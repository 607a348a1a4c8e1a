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
//! with a saturating sum, and stops after [`MAX_ENTRIES`] entries or below
//! [`MAX_DEPTH`] levels, saying so (`truncated`). Its memory does not grow
//! with what a run put in the cache: it goes depth first, holding one open
//! directory per level and one path, never a queue of the directories
//! still to read (150,000 of them under a 3.8 KB path were 570 MB).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::Link;
use super::board::{Board, Usage};
use crate::store::Dial;

/// How often a pod measures its cache between rounds.
pub const MEASURE_EVERY: Duration = Duration::from_secs(15);
/// How often the control API reads the pods' entries.
pub const GATHER_EVERY: Duration = Duration::from_secs(5);
/// Most entries one walk visits.
pub const MAX_ENTRIES: u64 = 200_000;
/// Most levels of directories one walk opens at once (each an open file).
pub const MAX_DEPTH: usize = 64;
/// Most bytes of an entry the control API takes.
const MAX_ENTRY: usize = 4096;

/// Walk `dir` (see the module doc); `pod` names the result.
pub fn measure(pod: &str, dir: &Path) -> Usage {
    let mut u = Usage { pod: pod.to_string(), dir: dir.display().to_string(), ..Usage::default() };
    let Ok(top) = std::fs::read_dir(dir) else { return u };
    // The open directories, one per level, and the path of the deepest.
    let mut open = vec![top];
    let mut path = dir.to_path_buf();
    let mut seen = 0u64;
    while let Some(level) = open.last_mut() {
        let Some(next) = level.next() else {
            open.pop();
            path.pop();
            continue;
        };
        let Ok(e) = next else { continue };
        seen += 1;
        if seen > MAX_ENTRIES {
            u.truncated = true;
            return u;
        }
        // The kernel's d_type: no stat for a directory, and no link followed.
        let Ok(kind) = e.file_type() else { continue };
        if !kind.is_dir() {
            u.files += 1;
            if kind.is_file() {
                u.bytes = u.bytes.saturating_add(e.metadata().map_or(0, |m| m.len()));
            }
            continue;
        }
        if open.len() >= MAX_DEPTH {
            u.truncated = true;
            continue;
        }
        path.push(e.file_name());
        drop(e);
        match std::fs::read_dir(&path) {
            Ok(d) => open.push(d),
            Err(_) => {
                u.truncated = true;
                path.pop();
            }
        }
    }
    u
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
                match link.set(&crate::keys::serve::cache(&base, &pod), &v).await {
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
                let Ok(raw) = link.get(&crate::keys::serve::cache(&base, &pod)).await else { break };
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
        assert!(!gone.truncated);
        assert_eq!((gone.bytes, gone.files), (0, 0));
        let text = serde_json::to_string(&u).expect("json");
        assert!(!text.contains("truncated"), "{text}");
        assert_eq!(serde_json::from_str::<Usage>(&text).expect("back"), u);
    }

    #[test]
    fn a_deep_or_wide_tree_is_walked_within_its_bounds() {
        let d = tempfile::tempdir().expect("tmp");
        let mut deep = d.path().to_path_buf();
        for _ in 0..MAX_DEPTH + 5 {
            deep.push("d");
        }
        std::fs::create_dir_all(&deep).expect("deep");
        std::fs::write(deep.join("f"), b"1").expect("f");
        let wide = d.path().join("wide");
        for i in 0..300 {
            std::fs::create_dir_all(wide.join(format!("{i}/x"))).expect("wide");
            std::fs::write(wide.join(format!("{i}/x/f")), b"12").expect("f");
        }
        let u = measure("p", d.path());
        assert_eq!((u.files, u.bytes, u.truncated), (300, 600, true), "the wide part whole, the deep cut: {u:?}");
        let u = measure("p", &wide);
        assert_eq!((u.files, u.bytes, u.truncated), (300, 600, false), "{u:?}");
    }
}
