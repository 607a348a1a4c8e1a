//! PyTorch's Flight Recorder at a hang: which collective each rank last
//! entered, per process group, from the dump its NCCL process group writes
//! when asked through the store (the key `exception_dump` in the worker
//! store trainlet serves, which NCCL's heartbeat monitor polls every
//! `TORCH_NCCL_COORD_CHECK_MILSEC`). A worker runs that monitor when it has
//! a thread named `pt_nccl_heartbt`; it then writes a pickle to
//! `TORCH_FR_DUMP_TEMP_FILE` (or `TORCH_NCCL_DEBUG_INFO_TEMP_FILE`)
//! followed by its global rank, or where none is set, to torch's cache
//! directory ([`dump_paths`]).
//!
//! The dump is the worker's file, so hostile input: it is opened without
//! following a link, must be a regular file of the worker's own uid written
//! since the round began, at most [`MAX_DUMP`] bytes, and is read by the bounded
//! [`super::pickle`] reader, which runs no code.

use std::io::Read as _;
use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use super::pickle::{self, Pickle};

/// The name NCCL's heartbeat monitor gives its thread (`c10::setThreadName`).
pub const MONITOR_THREAD: &str = "pt_nccl_heartbt";
/// The key the monitor checks in the store, as a torch client sends it
/// (its keys are prefixed with `/`). Its value is the asking rank, an i32
/// (-1: none; trainlet is not a rank).
pub const DUMP_KEY: &str = "/exception_dump";
/// The dump's file name before the rank in torch's cache directory: torch
/// 2.11's and 2.15's (seen), then earlier versions'.
const DEFAULT_NAMES: [&str; 2] = ["comm_lib_trace_rank_", "nccl_trace_rank_"];
/// Where older versions of torch wrote the dump, the rank after it.
const OLD_DEFAULT: &str = "/tmp/nccl_trace_rank_";
/// Largest dump read (2000 entries with their stack traces fit many times).
pub const MAX_DUMP: u64 = 8 << 20;
/// Most process groups kept from one dump.
const MAX_GROUPS: usize = 16;
/// Entries looked at, the last ones (the recorder keeps 2000 by default).
const MAX_ENTRIES: usize = 4096;
/// Longest group or collective name kept.
const MAX_GROUP_NAME: usize = 128;
/// Most threads of one worker looked at for the monitor.
const MAX_TASKS: usize = 4096;
/// Largest environment read from `/proc/PID/environ`.
const MAX_ENVIRON: u64 = 1 << 20;
/// How often the monitor polls the store when the worker does not say.
const DEFAULT_POLL: Duration = Duration::from_millis(1000);

/// One rank's last collective in one process group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Group {
    /// The group's name (torch numbers them in creation order, the same on
    /// every rank): what tells groups apart.
    pub id: String,
    /// The group's description (`default_pg`), or its name when it has none.
    pub pg: String,
    /// The sequence number of the last collective it entered.
    pub seq: u64,
    /// That collective (`all_reduce`, without the backend's prefix).
    pub op: String,
    /// Whether that collective completed.
    pub done: bool,
}

/// What one rank's Flight Recorder dump says.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Flight {
    /// Its process groups, by name.
    pub groups: Vec<Group>,
    /// Why there is no dump, or what was wrong with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// Why a dump could not be read (yet).
#[derive(Debug, thiserror::Error)]
pub enum DumpError {
    /// Not there, or not written since the round began.
    #[error("no dump yet")]
    NotYet,
    /// There, but not one to read.
    #[error("{0}")]
    Refused(String),
    /// Not a Flight Recorder pickle (or cut short: still being written).
    #[error("unreadable dump: {0}")]
    Unreadable(#[from] pickle::Error),
}

/// Whether process `pid` runs NCCL's heartbeat monitor (give it the
/// process the stacks were read from: a wrapper's Python child).
pub fn has_monitor(pid: i32) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/task")).is_ok_and(|tasks| {
        tasks
            .take(MAX_TASKS)
            .flatten()
            .any(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim_end() == MONITOR_THREAD))
    })
}

/// `pid`'s environment (as it started), at most [`MAX_ENVIRON`] bytes.
fn environ(pid: i32) -> Vec<u8> {
    let mut raw = Vec::new();
    if let Ok(f) = std::fs::File::open(format!("/proc/{pid}/environ")) {
        let _ = f.take(MAX_ENVIRON).read_to_end(&mut raw);
    }
    raw
}

/// Variable `name` of the environment `raw` (NUL-separated `K=V`).
fn var(raw: &[u8], name: &str) -> Option<String> {
    raw.split(|b| *b == 0).find_map(|kv| {
        let v = kv.strip_prefix(name.as_bytes())?.strip_prefix(b"=")?;
        Some(String::from_utf8_lossy(v).into_owned())
    })
}

/// Where rank `rank` (process `pid`) may write its dump, and how often its
/// monitor polls the store; Err says why it will not dump: its
/// environment turned the recorder or its dump at a timeout off.
pub fn dump_target(pid: i32, rank: u32) -> Result<(Vec<PathBuf>, Duration), String> {
    let env = environ(pid);
    for off in ["TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_ON_TIMEOUT"] {
        if var(&env, off)
            .is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "0" | "false" | "off" | "no"))
        {
            return Err(format!("its Flight Recorder does not dump ({off} is off)"));
        }
    }
    for size in ["TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"] {
        if var(&env, size).is_some_and(|v| v.trim() == "0") {
            return Err(format!("its Flight Recorder is off ({size}=0)"));
        }
    }
    let poll = var(&env, "TORCH_NCCL_COORD_CHECK_MILSEC")
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(DEFAULT_POLL, Duration::from_millis);
    // A relative path is the worker's working directory's.
    let cwd = std::fs::read_link(format!("/proc/{pid}/cwd")).unwrap_or_else(|_| PathBuf::from("/"));
    Ok((dump_paths(&env, rank).into_iter().map(|p| cwd.join(p)).collect(), poll))
}

/// The files rank `rank` may write its dump to, given its environment
/// `env`: the prefix `TORCH_FR_DUMP_TEMP_FILE` (else
/// `TORCH_NCCL_DEBUG_INFO_TEMP_FILE`) names, plus the rank; where neither
/// is set, torch's cache directory, which differs by version (the dump is
/// looked for in each, and only one written since the round began is read):
/// torch 2.15 writes `comm_lib_trace_rank_N` in `$XDG_CACHE_HOME/torch`
/// where that is set (even empty), else in `$HOME/.cache/torch` (`/tmp`
/// for an unset HOME), as torch 2.11 does in `$HOME/.cache/torch` (seen
/// with NCCL on a GPU); earlier versions wrote `nccl_trace_rank_N` there,
/// and older ones `/tmp/nccl_trace_rank_N`.
pub fn dump_paths(env: &[u8], rank: u32) -> Vec<PathBuf> {
    if let Some(prefix) = ["TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
        .iter()
        .find_map(|n| var(env, n).filter(|v| !v.is_empty()))
    {
        return vec![PathBuf::from(format!("{prefix}{rank}"))];
    }
    let home = var(env, "HOME").filter(|h| !h.is_empty()).unwrap_or_else(|| "/tmp".into());
    let mut dirs: Vec<String> = var(env, "XDG_CACHE_HOME").map(|x| format!("{x}/torch")).into_iter().collect();
    dirs.push(format!("{home}/.cache/torch"));
    // XDG_CACHE_HOME may be HOME's own .cache.
    dirs.dedup();
    let mut paths: Vec<PathBuf> =
        dirs.iter().flat_map(|d| DEFAULT_NAMES.iter().map(move |n| PathBuf::from(format!("{d}/{n}{rank}")))).collect();
    paths.push(PathBuf::from(format!("{OLD_DEFAULT}{rank}")));
    paths
}

/// The uid process `pid` runs as (the owner of its `/proc` directory).
pub fn owner_of(pid: i32) -> Option<u32> {
    std::fs::metadata(format!("/proc/{pid}")).ok().map(|m| m.uid())
}

/// The size and modification time of the file at `path` (not followed),
/// to tell a dump that changed from one read already.
pub fn stamp(path: &std::path::Path) -> Option<(u64, SystemTime)> {
    let m = std::fs::symlink_metadata(path).ok()?;
    Some((m.len(), m.modified().ok()?))
}

/// Read the dump at `path`: a regular file of uid `owner`, modified at or
/// after `since`, at most [`MAX_DUMP`] bytes. The path is the worker's to
/// choose, so nothing is opened for reading before it is known to be such
/// a file: it is opened as a path only (`O_PATH`, not following a last
/// link), checked on that descriptor, and only then opened for reading
/// through it (a device, FIFO or terminal is never opened).
pub fn read_dump(path: &std::path::Path, since: SystemTime, owner: u32) -> Result<Flight, DumpError> {
    let refused = || DumpError::Refused("not a regular file of the worker's own".into());
    let handle = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(DumpError::NotYet),
        Err(_) => return Err(refused()),
    };
    let meta = handle.metadata().map_err(|_| refused())?;
    if !meta.file_type().is_file() || meta.uid() != owner {
        return Err(refused());
    }
    if meta.modified().is_ok_and(|m| m < since) {
        return Err(DumpError::NotYet);
    }
    if meta.len() > MAX_DUMP {
        return Err(DumpError::Refused(format!("{} bytes, over the {MAX_DUMP} read", meta.len())));
    }
    let fd = std::os::fd::AsRawFd::as_raw_fd(&handle);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOCTTY | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(format!("/proc/self/fd/{fd}"))
        .map_err(|_| refused())?;
    let mut data = Vec::new();
    file.take(MAX_DUMP).read_to_end(&mut data).map_err(|_| refused())?;
    Ok(summarize(&pickle::read(&data)?))
}

/// A name from the dump, as data, cut to [`MAX_GROUP_NAME`] characters.
fn name(s: &str) -> String {
    super::clean(s).chars().take(MAX_GROUP_NAME).collect()
}

/// Each process group's last collective (point-to-point ops apart, which
/// pair two ranks, not the group).
pub fn summarize(p: &Pickle) -> Flight {
    let Some(entries) = p.field(p.top(), "entries") else {
        return Flight { groups: Vec::new(), note: Some("the dump has no entries".into()) };
    };
    let mut groups: Vec<Group> = Vec::new();
    let all = p.items(entries);
    for &e in &all[all.len().saturating_sub(MAX_ENTRIES)..] {
        if p.field(e, "is_p2p").and_then(|v| p.int(v)) == Some(1) {
            continue;
        }
        let Some(seq) = p.field(e, "collective_seq_id").and_then(|v| p.int(v)).and_then(|s| u64::try_from(s).ok())
        else {
            continue;
        };
        // (name, description): the name tells groups apart (DeviceMesh's
        // share descriptions, and new_group's are all "undefined"); the
        // description, when it says something, is shown.
        let (id, desc) = p.field(e, "process_group").map_or((String::new(), String::new()), |g| {
            let part = |k: usize| p.items(g).get(k).and_then(|&i| p.str(i)).map_or_else(String::new, name);
            (part(0), part(1))
        });
        let pg = if desc.is_empty() || desc == "undefined" { id.clone() } else { desc };
        let profiled = p.field(e, "profiling_name").and_then(|v| p.str(v)).unwrap_or("?");
        let op = name(profiled.rsplit(':').next().unwrap_or(profiled));
        let state = p.field(e, "state").and_then(|v| p.str(v));
        let done = state == Some("completed") || p.field(e, "retired").and_then(|v| p.int(v)) == Some(1);
        let full = groups.len() >= MAX_GROUPS;
        match groups.iter_mut().find(|g| g.id == id) {
            Some(g) if g.seq <= seq => *g = Group { id, pg, seq, op, done },
            Some(_) => {}
            None if !full => groups.push(Group { id, pg, seq, op, done }),
            None => {}
        }
    }
    groups.sort_by(|a, b| a.id.cmp(&b.id));
    Flight { groups, note: None }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    /// A dump of torch 2.15's gloo process group (the same format as
    /// NCCL's), taken with `_dump_fr_trace(backend="gloo")` on rank 0 of 2
    /// while it waited alone in its 5th collective (all_reduce) and rank 1
    /// slept after the 4th (barrier): tests/fixtures/flight/gloo_rank0.pkl.
    fn fixture(name: &str) -> Vec<u8> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/flight").join(name);
        std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    #[test]
    fn a_real_dump_gives_each_groups_last_collective() {
        let f = summarize(&pickle::read(&fixture("gloo_rank0.pkl")).expect("a real dump reads"));
        let group = |seq, op: &str, done| Group { id: "0".into(), pg: "default_pg".into(), seq, op: op.into(), done };
        assert_eq!(f.groups, vec![group(5, "all_reduce", false)]);
        let f = summarize(&pickle::read(&fixture("gloo_rank1.pkl")).expect("a real dump reads"));
        assert_eq!(f.groups, vec![group(4, "barrier", true)]);
    }

    /// NCCL's own dumps, as its heartbeat monitor wrote them when trainlet
    /// asked (torch 2.11, NCCL 2.28.9, on an H200: tests/gpu/nccl_flight.sh,
    /// 2 pods x 2 workers): rank 0 waited in all_reduce #4, scheduled,
    /// while rank 2 slept after #3.
    #[test]
    fn a_real_nccl_dump_gives_each_groups_last_collective() {
        let group = |seq, done| Group { id: "0".into(), pg: "default_pg".into(), seq, op: "all_reduce".into(), done };
        let f = summarize(&pickle::read(&fixture("nccl_rank0.pkl")).expect("NCCL's dump reads"));
        assert_eq!(f, Flight { groups: vec![group(4, false)], note: None });
        let f = summarize(&pickle::read(&fixture("nccl_rank2.pkl")).expect("NCCL's dump reads"));
        assert_eq!(f, Flight { groups: vec![group(3, true)], note: None });
    }

    /// A small dump whose entries are one dict of many pairs, referenced
    /// many times through the memo: its summary's work is bounded by the
    /// entries and fields looked at, not by their product.
    #[test]
    fn a_dump_of_shared_huge_entries_costs_little() {
        let (pairs, entries) = (40_000, 80_000);
        let mut p = vec![0x80, 2, b'}', b'q', 0, b'(', b'K', 0];
        p.extend(std::iter::repeat_n(b'2', 2 * pairs - 1));
        p.extend([b'u', b'0', b'}', b'(', 0x8c, 7]);
        p.extend(b"entries");
        p.extend([b']', b'(', b'h', 0]);
        p.extend(std::iter::repeat_n(b'2', entries - 1));
        p.extend([b'e', b'u', b'.']);
        let read = pickle::read(&p).expect("read");
        assert_eq!(read.items(read.field(read.top(), "entries").expect("entries")).len(), entries);
        assert_eq!(summarize(&read), Flight::default(), "no entry has a sequence number");
    }

    #[test]
    fn a_dump_is_read_only_when_it_is_the_workers_and_new() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("nccl_trace_rank_0");
        let me = owner_of(i32::try_from(std::process::id()).expect("pid")).expect("own uid");
        let before = SystemTime::now() - Duration::from_secs(5);
        assert!(matches!(read_dump(&path, before, me), Err(DumpError::NotYet)));
        std::fs::write(&path, fixture("gloo_rank1.pkl")).expect("write");
        assert_eq!(read_dump(&path, before, me).expect("read").groups[0].seq, 4);
        let later = SystemTime::now() + Duration::from_secs(60);
        assert!(matches!(read_dump(&path, later, me), Err(DumpError::NotYet)), "an old dump is not this hang's");
        assert!(matches!(read_dump(&path, before, me + 1), Err(DumpError::Refused(_))));
        let link = dir.path().join("nccl_trace_rank_1");
        std::os::unix::fs::symlink(&path, &link).expect("symlink");
        assert!(matches!(read_dump(&link, before, me), Err(DumpError::Refused(_))), "a link is not followed");
        std::fs::write(&path, &fixture("gloo_rank1.pkl")[..100]).expect("write");
        assert!(matches!(read_dump(&path, before, me), Err(DumpError::Unreadable(_))), "a dump being written");
        assert!(matches!(read_dump(dir.path(), before, me), Err(DumpError::Refused(_))));
        // A device is never opened for reading (only as a path).
        assert!(matches!(read_dump(std::path::Path::new("/dev/null"), before, me), Err(DumpError::Refused(_))));
    }

    #[test]
    fn the_recorder_turned_off_is_not_waited_for() {
        let env = b"A=1\0TORCH_NCCL_DUMP_ON_TIMEOUT=0\0TORCH_FR_BUFFER_SIZE=2000\0";
        assert_eq!(var(env, "TORCH_FR_BUFFER_SIZE").as_deref(), Some("2000"));
        assert_eq!(var(env, "TORCH_FR"), None, "a prefix of a name is not the name");
        let mut child =
            std::process::Command::new("sleep").arg("30").env("TORCH_FR_BUFFER_SIZE", "0").spawn().expect("sleep");
        let pid = i32::try_from(child.id()).expect("pid");
        // The parent may run again before exec has set the child's
        // environment up (/proc/PID/environ reads empty until then).
        let started = std::time::Instant::now();
        while environ(pid).is_empty() && started.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        let why = dump_target(pid, 0).expect_err("off");
        assert_eq!(why, "its Flight Recorder is off (TORCH_FR_BUFFER_SIZE=0)");
        let _ = child.kill();
        let _ = child.wait();
    }

    #[test_case(b"TORCH_FR_DUMP_TEMP_FILE=/d/fr_\0HOME=/h\0".as_slice(), &["/d/fr_3"]; "set")]
    #[test_case(b"TORCH_NCCL_DEBUG_INFO_TEMP_FILE=/d/nccl_\0".as_slice(), &["/d/nccl_3"]; "old_name")]
    #[test_case(b"TORCH_NCCL_DEBUG_INFO_TEMP_FILE=/b_\0TORCH_FR_DUMP_TEMP_FILE=/a_\0".as_slice(), &["/a_3"]; "first_wins")]
    #[test_case(b"TORCH_FR_DUMP_TEMP_FILE=\0HOME=/h\0".as_slice(), &[
        "/h/.cache/torch/comm_lib_trace_rank_3", "/h/.cache/torch/nccl_trace_rank_3", "/tmp/nccl_trace_rank_3"]; "empty_is_unset")]
    #[test_case(b"TORCH_FR_DUMP_TEMP_FILE=fr/x_\0".as_slice(), &["fr/x_3"]; "relative")]
    #[test_case(b"HOME=/home/u\0".as_slice(), &[
        "/home/u/.cache/torch/comm_lib_trace_rank_3", "/home/u/.cache/torch/nccl_trace_rank_3", "/tmp/nccl_trace_rank_3"]; "home")]
    #[test_case(b"A=1\0".as_slice(), &[
        "/tmp/.cache/torch/comm_lib_trace_rank_3", "/tmp/.cache/torch/nccl_trace_rank_3", "/tmp/nccl_trace_rank_3"]; "no_home")]
    #[test_case(b"HOME=/h\0XDG_CACHE_HOME=/x\0".as_slice(), &[
        "/x/torch/comm_lib_trace_rank_3", "/x/torch/nccl_trace_rank_3",
        "/h/.cache/torch/comm_lib_trace_rank_3", "/h/.cache/torch/nccl_trace_rank_3", "/tmp/nccl_trace_rank_3"]; "xdg")]
    #[test_case(b"XDG_CACHE_HOME=\0HOME=/h\0".as_slice(), &[
        "/torch/comm_lib_trace_rank_3", "/torch/nccl_trace_rank_3",
        "/h/.cache/torch/comm_lib_trace_rank_3", "/h/.cache/torch/nccl_trace_rank_3", "/tmp/nccl_trace_rank_3"]; "xdg_empty")]
    #[test_case(b"HOME=/h\0XDG_CACHE_HOME=/h/.cache\0".as_slice(), &[
        "/h/.cache/torch/comm_lib_trace_rank_3", "/h/.cache/torch/nccl_trace_rank_3", "/tmp/nccl_trace_rank_3"]; "xdg_is_homes")]
    fn the_dump_is_looked_for_where_each_torch_writes_it(env: &[u8], want: &[&str]) {
        let got: Vec<String> = dump_paths(env, 3).iter().map(|p| p.display().to_string()).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn the_dump_path_follows_the_workers_environment() {
        let me = i32::try_from(std::process::id()).expect("pid");
        let (paths, _) = dump_target(me, 3).expect("no recorder setting here");
        let cwd = std::env::current_dir().expect("cwd");
        let env = environ(me);
        let want: Vec<PathBuf> = dump_paths(&env, 3).into_iter().map(|p| cwd.join(p)).collect();
        assert_eq!(paths, want);
        assert!(paths.iter().all(|p| p.is_absolute()), "{paths:?}");
        assert!(!has_monitor(me), "this test process runs no NCCL monitor");
    }
}
