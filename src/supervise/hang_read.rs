//! This pod's workers' stacks at a hang verdict, read before they are
//! stopped: each live worker is read from outside ([`crate::stacks`]) on a
//! blocking thread of its own, as many at once as the pod's read budget
//! has slots for (`stacks::budget`: the others wait for one), and the whole
//! capture is bounded in time (every read stops by itself at the capture's
//! deadline; one that blocks in the kernel, e.g. on a worker in
//! uninterruptible sleep, is left behind, not waited for) and in size
//! (what goes into the store).
//!
//! On demand (`trainlet stacks`), the agent answers on its stacks door: an
//! abstract Unix socket named after its pid, open to its own uid and root
//! only (the peer's credentials are checked), one request at a time. The
//! attempt keeps the registry of its live workers the door reads.

use std::sync::Mutex;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::stacks::stall::RankStacks;
use crate::stacks::{Limits, Process, Unread};
use crate::supervise::crew::Crew;
use crate::supervise::policy::Attempt;
use crate::supervise::worker::WorldView;

/// Longest one worker's read at a hang verdict takes. The verdict's
/// stacks are the record people read, taken once per hang, so they get
/// more time than a read on demand ([`Limits::default`]): on a loaded
/// machine (CI's 2 CPUs with the suite's builds and tests beside it) a full
/// read of a torch worker inside gloo's all_reduce took 234 ms, past the
/// 200 ms default, and the verdict could not tell that rank from the one
/// it waited for. Every pod waits 5 s for the others' stacks.
const HANG_READ_TIME: Duration = Duration::from_millis(1500);
/// Longest the whole capture waits, over the per-worker bound.
const CAPTURE_MARGIN: Duration = Duration::from_millis(800);
/// How much sooner than the capture's end its reads stop by themselves
/// (what is left to hand back what they read).
const READ_MARGIN: Duration = Duration::from_millis(100);
/// Most bytes of one pod's stacks put in the store.
pub(super) const MAX_POD_STACKS: usize = 256 * 1024;
/// Frames per thread kept when a pod's stacks are over [`MAX_POD_STACKS`].
const TRIMMED_FRAMES: usize = 12;

/// Read every live worker's stacks, in rank order.
pub(super) async fn capture(world: &WorldView<'_>, core: &Attempt, crew: &Crew) -> Vec<RankStacks> {
    let mut live: Vec<(u32, u32, i32)> = core
        .alive()
        .filter_map(|lr| {
            let w = crew.workers.get(&lr)?;
            Some((w.rank, lr, w.pid?))
        })
        .collect();
    live.sort_unstable();
    let limits = Limits { time: HANG_READ_TIME, ..Limits::default() };
    let out = read_all(&world.plan.output.host, (world.group_rank, lane_of(world)), live, limits).await;
    let took: f64 = out.iter().map(|r| r.stacks.took_ms).fold(0.0, f64::max);
    tracing::info!(workers = out.len(), slowest_ms = took, "read the workers' stacks before stopping them");
    out
}

/// The stacks of `workers` (`(rank, local rank, pid)`), read in parallel
/// as the pod's read slots allow; every read stops by itself before the
/// capture's end, one still going then (blocked in the kernel) is left
/// behind and said so, and no second read of a worker starts while one is
/// still going (a worker stuck in the kernel, or hostile to the reader,
/// holds one thread, not one per request).
async fn read_all(
    host: &str,
    (node_rank, lane): (u32, Option<u64>),
    workers: Vec<(u32, u32, i32)>,
    limits: Limits,
) -> Vec<RankStacks> {
    let deadline = tokio::time::Instant::now() + limits.time + CAPTURE_MARGIN;
    let end = deadline.into_std().checked_sub(READ_MARGIN);
    let reads: Vec<_> = workers
        .iter()
        .map(|&(_, _, pid)| {
            let held = Reading::start(pid)?;
            Some(tokio::task::spawn_blocking(move || {
                let _held = held;
                crate::stacks::read_before(pid, &limits, end)
            }))
        })
        .collect();
    let mut out = Vec::with_capacity(workers.len());
    for ((rank, local_rank, pid), read) in workers.into_iter().zip(reads) {
        let stacks = match read {
            None => unread(
                pid,
                "an earlier read of this worker is still going (it may be in uninterruptible sleep)",
                Unread::Time,
            ),
            Some(read) => match tokio::time::timeout_at(deadline, read).await {
                Ok(Ok(p)) => p,
                Ok(Err(_)) => unread(pid, "the read failed", Unread::Failed),
                Err(_) => unread(
                    pid,
                    "the read did not finish in time (the worker may be in uninterruptible sleep)",
                    Unread::Time,
                ),
            },
        };
        out.push(RankStacks { rank, local_rank, node_rank, host: host.to_string(), stacks, lane, flight: None });
    }
    out
}

/// The workers being read now.
static READING: Mutex<Vec<i32>> = Mutex::new(Vec::new());

/// A read of one worker, in [`READING`] while it lasts.
#[derive(Debug)]
struct Reading(i32);

impl Reading {
    /// None when `pid` is being read already.
    fn start(pid: i32) -> Option<Reading> {
        let mut now = READING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if now.contains(&pid) {
            return None;
        }
        now.push(pid);
        Some(Reading(pid))
    }
}

impl Drop for Reading {
    fn drop(&mut self) {
        READING.lock().unwrap_or_else(std::sync::PoisonError::into_inner).retain(|p| *p != self.0);
    }
}

/// The workers the door reads: `(rank, local rank, pid, start time)`,
/// with their pod's name and node rank.
#[derive(Debug, Default)]
struct Live {
    host: String,
    node_rank: u32,
    lane: Option<u64>,
    workers: Vec<(u32, u32, i32, u64)>,
}

static LIVE: Mutex<Live> = Mutex::new(Live { host: String::new(), node_rank: 0, lane: None, workers: Vec::new() });

/// The lane this agent serves (a lane agent's run), if any.
fn lane_of(world: &WorldView<'_>) -> Option<u64> {
    world.plan.serve.as_ref().and_then(|s| s.lane.as_ref()).map(|l| l.seq)
}

/// The attempt's workers, for the door (none: the attempt is over).
pub(super) fn register(world: &WorldView<'_>, crew: &Crew) {
    // With its start time a pid names one process: a worker gone and its
    // pid reused by another is not read as the rank.
    let mut workers: Vec<(u32, u32, i32, u64)> = crew
        .workers
        .iter()
        .filter_map(|(lr, w)| {
            let pid = w.pid?;
            Some((w.rank, *lr, pid, crate::sys::proc_start(pid)?))
        })
        .collect();
    workers.sort_unstable();
    let mut live = LIVE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    *live = Live { host: world.plan.output.host.clone(), node_rank: world.group_rank, lane: lane_of(world), workers };
}

/// The attempt's live workers, as the straggler sampler reads them: the
/// pod's name, and each worker's `(rank, pid, start time)` (none between
/// attempts).
pub(crate) fn live() -> (String, Vec<(u32, i32, u64)>) {
    let live = LIVE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    (live.host.clone(), live.workers.iter().map(|&(rank, _, pid, start)| (rank, pid, start)).collect())
}

/// The attempt is over: the door has no worker to read.
pub(super) fn unregister() {
    LIVE.lock().unwrap_or_else(std::sync::PoisonError::into_inner).workers.clear();
}

/// The door's name of the process whose `/proc` directory is `proc`
/// (`/proc/self`, `/proc/PID`): its pid namespace (the inode of `ns/pid`)
/// and its pid there (the last of `NSpid`). Abstract sockets are per
/// network namespace, which containers may share (hostNetwork pods,
/// `podman --network host`), each agent PID 1 of its own: the namespace
/// keeps their names apart. None when /proc does not say.
pub fn door_name(proc: &str) -> Option<String> {
    let ns = std::fs::read_link(format!("{proc}/ns/pid")).ok()?;
    let ns = ns.to_str()?.strip_prefix("pid:[")?.strip_suffix(']')?.parse::<u64>().ok()?;
    let status = std::fs::read_to_string(format!("{proc}/status")).ok()?;
    let pid = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?.split_whitespace().last()?.parse::<u32>().ok()?;
    Some(format!("trainlet-stacks-{ns}-{pid}"))
}

/// What the door sends at most.
pub const MAX_ANSWER: usize = MAX_POD_STACKS;
/// Longest a client may take to send its request, or to take the answer.
const REQUEST_WAIT: Duration = Duration::from_secs(2);

/// Answer `trainlet stacks` on this agent's door until `cancel`: each
/// connection in a task of its own, at most [`DOOR_CONNECTIONS`] at once
/// (more are told so and closed). A door that cannot be opened costs an
/// error in the log, never the job.
pub async fn serve_door(cancel: CancellationToken) {
    let Some(name) = door_name("/proc/self") else {
        tracing::error!(
            "cannot name the stacks door (/proc/self/ns/pid or NSpid unreadable); `trainlet stacks` will not reach this agent"
        );
        return;
    };
    let listener = match bind(&name) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(door = %name, error = %e, "cannot open the stacks door (another process of the pod holds its name?); `trainlet stacks` will not reach this agent, and what answers there is not this agent");
            return;
        }
    };
    let me = nix::unistd::geteuid().as_raw();
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(DOOR_CONNECTIONS));
    loop {
        let accepted = tokio::select! {
            () = cancel.cancelled() => return,
            a = listener.accept() => a,
        };
        let Ok((mut conn, _)) = accepted else { continue };
        let Ok(slot) = std::sync::Arc::clone(&slots).try_acquire_owned() else {
            tokio::spawn(async move {
                let _ = tokio::time::timeout(REQUEST_WAIT, conn.write_all(BUSY)).await;
            });
            continue;
        };
        tokio::spawn(async move {
            let _slot = slot;
            let allowed = conn.peer_cred().is_ok_and(|c| c.uid() == me || c.uid() == 0);
            if !allowed {
                let _ = tokio::time::timeout(REQUEST_WAIT, conn.write_all(REFUSED)).await;
                return;
            }
            let mut req = [0u8; 16];
            let asked = tokio::time::timeout(REQUEST_WAIT, conn.read(&mut req)).await;
            if !matches!(asked, Ok(Ok(n)) if req[..n].starts_with(b"stacks")) {
                return;
            }
            let answer = encode(read_live().await);
            let _ = tokio::time::timeout(REQUEST_WAIT, conn.write_all(&answer)).await;
        });
    }
}

/// Connections the door serves at once.
const DOOR_CONNECTIONS: usize = 4;
const BUSY: &[u8] = b"{\"error\":\"the agent is answering other requests for stacks; try again\"}";
const REFUSED: &[u8] = b"{\"error\":\"only the agent's own uid or root may read its workers' stacks\"}";

fn bind(name: &str) -> std::io::Result<tokio::net::UnixListener> {
    use std::os::linux::net::SocketAddrExt;
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
    let std_listener = std::os::unix::net::UnixListener::bind_addr(&addr)?;
    std_listener.set_nonblocking(true)?;
    tokio::net::UnixListener::from_std(std_listener)
}

/// The registered workers' stacks (those still running).
pub(crate) async fn read_live() -> Vec<RankStacks> {
    let (host, at, workers) = {
        let live = LIVE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        (live.host.clone(), (live.node_rank, live.lane), live.workers.clone())
    };
    let running = workers.into_iter().filter(|w| crate::sys::is_same_process(w.2, w.3));
    read_all(&host, at, running.map(|(rank, lr, pid, _)| (rank, lr, pid)).collect(), Limits::default()).await
}

/// This pod's stacks: its own workers' and those of the lane agents it
/// started (actors beside the main run), each asked on its door.
pub(crate) async fn read_pod() -> Vec<RankStacks> {
    let mut out = read_live().await;
    let me = i32::try_from(std::process::id()).unwrap_or(0);
    let exe = crate::sys::own_exe();
    let lanes: Vec<i32> = crate::sys::children(me)
        .unwrap_or_default()
        .into_iter()
        .filter(|c| exe.is_some() && std::fs::read_link(format!("/proc/{c}/exe")).ok() == exe)
        .take(MAX_LANE_AGENTS)
        .collect();
    let asks: Vec<_> = lanes.into_iter().map(|pid| tokio::task::spawn_blocking(move || ask_door(pid))).collect();
    let deadline = tokio::time::Instant::now() + Limits::default().time + CAPTURE_MARGIN * 2;
    for ask in asks {
        if let Ok(Ok(Ok(stacks))) = tokio::time::timeout_at(deadline, ask).await {
            out.extend(stacks);
        }
    }
    out
}

/// Most lane agents of a pod asked.
const MAX_LANE_AGENTS: usize = 64;
/// Longest one agent may take to answer on its door.
const ANSWER_WAIT: Duration = Duration::from_secs(10);

/// What the agent `pid` sends on its door (blocking): only from the agent
/// itself (a process of the pod that took the door's name first is not
/// believed).
pub fn ask_door(pid: i32) -> Result<Vec<RankStacks>, String> {
    use std::io::{Read, Write};
    use std::os::fd::AsFd;
    use std::os::linux::net::SocketAddrExt;
    let name = door_name(&format!("/proc/{pid}")).ok_or("its pid namespace cannot be read from /proc")?;
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).map_err(|e| e.to_string())?;
    let mut conn = std::os::unix::net::UnixStream::connect_addr(&addr)
        .map_err(|e| format!("cannot reach its stacks door ({e}); is it a trainlet of this version?"))?;
    let me = nix::unistd::geteuid().as_raw();
    match crate::sys::peer_credentials(conn.as_fd()) {
        Some((p, uid)) if p == pid && (uid == me || uid == 0) => {}
        Some((p, uid)) => {
            return Err(format!("its stacks door is held by another process (pid {p}, uid {uid}); not believed"));
        }
        None => return Err("cannot tell who holds its stacks door; not believed".into()),
    }
    conn.set_read_timeout(Some(ANSWER_WAIT)).map_err(|e| e.to_string())?;
    conn.write_all(b"stacks\n").map_err(|e| e.to_string())?;
    let mut answer = Vec::new();
    let limit = u64::try_from(MAX_ANSWER + 1).unwrap_or(u64::MAX);
    if let Err(e) = conn.take(limit).read_to_end(&mut answer) {
        return Err(match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                format!("no answer within {ANSWER_WAIT:?}")
            }
            _ => format!("no answer: {e}"),
        });
    }
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&answer)
        && let Some(e) = v.get("error").and_then(|e| e.as_str())
    {
        return Err(crate::stacks::clean(e));
    }
    serde_json::from_slice(&answer).map_err(|e| format!("an unreadable answer: {e}"))
}

fn unread(pid: i32, why: &str, unread: Unread) -> Process {
    Process { pid, python: None, threads: Vec::new(), note: Some(why.into()), took_ms: 0.0, unread: Some(unread) }
}

/// The pod's stacks as JSON of at most [`MAX_POD_STACKS`] bytes: trimmed
/// to the innermost frames of each thread, then to main threads only,
/// when over.
pub(crate) fn encode(mut stacks: Vec<RankStacks>) -> Vec<u8> {
    let fits = |s: &[RankStacks]| serde_json::to_vec(s).ok().filter(|v| v.len() <= MAX_POD_STACKS);
    if let Some(v) = fits(&stacks) {
        return v;
    }
    for r in &mut stacks {
        for t in &mut r.stacks.threads {
            t.truncated |= t.python.len() > TRIMMED_FRAMES;
            t.python.truncate(TRIMMED_FRAMES);
            t.native.truncate(TRIMMED_FRAMES);
        }
    }
    if let Some(v) = fits(&stacks) {
        return v;
    }
    for r in &mut stacks {
        r.stacks.threads.truncate(1);
        r.stacks.note = Some("cut to the main thread's innermost frames (over the size bound)".into());
    }
    if let Some(v) = fits(&stacks) {
        return v;
    }
    // Still over (names are cut at 512 characters, so only a huge number
    // of ranks gets here): every rank is kept, without its stacks.
    for r in &mut stacks {
        r.stacks.threads.clear();
        r.stacks.note = Some("stacks dropped: over the size bound of one pod's stacks".into());
        if let Some(f) = &mut r.flight {
            f.groups.truncate(2);
        }
    }
    serde_json::to_vec(&stacks).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stacks::{Frame, Thread};

    #[test]
    fn a_door_is_named_by_its_pid_namespace_and_pid() {
        let mine = door_name("/proc/self").expect("own door name");
        let ns = std::fs::read_link("/proc/self/ns/pid").expect("ns");
        let ns = ns.to_string_lossy().trim_start_matches("pid:[").trim_end_matches(']').to_string();
        assert_eq!(mine, format!("trainlet-stacks-{ns}-{}", std::process::id()));
        assert_eq!(door_name(&format!("/proc/{}", std::process::id())), Some(mine));
        assert_eq!(door_name("/proc/2147483647"), None);
    }

    #[test]
    fn a_worker_is_read_once_at_a_time() {
        let first = Reading::start(-7).expect("first");
        assert!(Reading::start(-7).is_none());
        let other = Reading::start(-8);
        assert!(other.is_some());
        drop(first);
        assert!(Reading::start(-7).is_some());
    }

    #[test]
    fn a_pods_stacks_are_cut_to_the_bound() {
        let frame = Frame { function: "f".repeat(400), file: "x".repeat(400), line: Some(1) };
        let thread = |tid| Thread {
            tid,
            name: "t".into(),
            main: tid == 1,
            python: vec![frame.clone(); 64],
            native: Vec::new(),
            kernel: "running".into(),
            truncated: false,
        };
        let rank = |rank| RankStacks {
            rank,
            local_rank: rank,
            node_rank: 0,
            host: "h".into(),
            stacks: Process {
                pid: 1,
                python: None,
                threads: (1..=8).map(thread).collect(),
                note: None,
                took_ms: 1.0,
                unread: None,
            },
            lane: None,
            flight: None,
        };
        let small = encode(vec![rank(0)]);
        assert!(small.len() <= MAX_POD_STACKS);
        let back: Vec<RankStacks> = serde_json::from_slice(&small).expect("json");
        assert_eq!(back[0].stacks.threads[0].python.len(), 12);
        assert!(back[0].stacks.threads[0].truncated);
        let big = encode((0..8).map(rank).collect());
        assert!(big.len() <= MAX_POD_STACKS, "{}", big.len());
        let back: Vec<RankStacks> = serde_json::from_slice(&big).expect("json");
        assert!(back.iter().all(|r| r.stacks.threads.len() == 1));
    }
}
