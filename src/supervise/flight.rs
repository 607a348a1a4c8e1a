//! PyTorch's Flight Recorder at a hang verdict, after the stacks are read:
//! when a live worker runs NCCL's heartbeat monitor, the agent sets
//! `exception_dump` in the round's worker store (the store every rank's
//! monitor polls), waits a bounded time for this pod's workers' dumps, and
//! puts what each says next to its stacks ([`crate::stacks::flight`]). NCCL
//! ends a worker once it has dumped, which the hang's stop does anyway.
//! Never on demand (`trainlet stacks`): a dump ends the workers.

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use crate::stacks::flight::{self, DumpError, Flight};
use crate::stacks::stall::RankStacks;
use crate::supervise::worker::WorldView;

/// Longest wait for the dumps past the monitors' poll interval: a dump
/// with its C++ stack traces takes seconds to symbolize (2.4 s for two
/// workers of torch 2.15 on an idle 2-core machine, over 5 s for four on a
/// busy one), and NCCL gives the first try 15 s
/// (`TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC`). The wait ends when the last
/// dump is in.
const DUMP_MARGIN: Duration = Duration::from_secs(15);
/// Longest wait for the dumps in all, whatever the interval.
const MAX_WAIT: Duration = Duration::from_secs(20);
/// Longest the ask itself may take (resolve, connect, set).
const ASK_WAIT: Duration = Duration::from_secs(3);
/// How often the dumps are looked for.
const POLL: Duration = Duration::from_millis(100);

/// Ask for and read the Flight Recorder dumps of the workers `asked` (of
/// `read`, those that run NCCL's monitor); the others are left as they are.
pub(super) async fn gather(world: &WorldView<'_>, read: &mut [RankStacks], asked: &[usize]) {
    let asked: Vec<usize> = asked.iter().copied().filter(|&i| i < read.len()).collect();
    if asked.is_empty() {
        return;
    }
    // A dump older than the ask is an earlier hang's (the file system's
    // clock may trail by its granularity).
    let since = SystemTime::now().checked_sub(Duration::from_secs(1)).unwrap_or(SystemTime::UNIX_EPOCH);
    if let Err(why) = ask(world.master_addr, world.master_port).await {
        tracing::warn!(reason = %why, "cannot ask the workers' Flight Recorders for a dump");
        for &i in &asked {
            read[i].flight = Some(missing(format!("not asked for a dump: {why}")));
        }
        return;
    }
    let targets: Vec<(PathBuf, Option<u32>, Duration)> = asked
        .iter()
        .map(|&i| {
            let pid = read[i].stacks.pid;
            let (path, poll) = flight::dump_target(pid, read[i].rank);
            (path, flight::owner_of(pid), poll)
        })
        .collect();
    let wait = (targets.iter().map(|t| t.2).max().unwrap_or_default() + DUMP_MARGIN).min(MAX_WAIT);
    let ranks: Vec<u32> = asked.iter().map(|&i| read[i].rank).collect();
    tracing::info!(
        ?ranks,
        wait_s = wait.as_secs_f64(),
        "waiting for the workers' Flight Recorder dumps (asked through exception_dump in the worker store)"
    );
    let found = tokio::task::spawn_blocking(move || collect(&targets, since, wait)).await.unwrap_or_default();
    let mut dumped = 0usize;
    for (&i, f) in asked.iter().zip(found) {
        dumped += usize::from(f.note.is_none());
        read[i].flight = Some(f);
    }
    tracing::info!(dumped, of = asked.len(), "read the workers' Flight Recorder dumps");
}

/// Set `exception_dump` in the worker store at `host:port` (the value is
/// the asking rank, an i32; -1: trainlet, no rank).
async fn ask(host: &str, port: u16) -> Result<(), String> {
    let go = async {
        let addr = tokio::net::lookup_host((host, port))
            .await
            .map_err(|e| format!("cannot resolve the worker store {host}:{port}: {e}"))?
            .next()
            .ok_or_else(|| format!("the worker store {host}:{port} resolves to no address"))?;
        let mut c = crate::store::Client::connect(addr)
            .await
            .map_err(|e| format!("cannot reach the worker store {addr}: {e}"))?;
        c.set_checked(flight::DUMP_KEY, &(-1i32).to_ne_bytes())
            .await
            .map_err(|e| format!("the worker store {addr} did not take the key: {e}"))
    };
    tokio::time::timeout(ASK_WAIT, go).await.map_err(|_| format!("the worker store {host}:{port} did not answer"))?
}

/// Each target's dump, looked for until all are read or `wait` is over;
/// a target with none says why.
fn collect(targets: &[(PathBuf, Option<u32>, Duration)], since: SystemTime, wait: Duration) -> Vec<Flight> {
    let deadline = Instant::now() + wait;
    let mut got: Vec<Option<Flight>> = vec![None; targets.len()];
    let mut last: Vec<String> = vec![format!("no dump within {:.1} s", wait.as_secs_f64()); targets.len()];
    loop {
        for (i, (path, owner, _)) in targets.iter().enumerate() {
            if got[i].is_some() {
                continue;
            }
            let Some(owner) = owner else {
                got[i] = Some(missing("the worker is gone".into()));
                continue;
            };
            match flight::read_dump(path, since, *owner) {
                Ok(f) => got[i] = Some(f),
                Err(DumpError::NotYet) => {}
                // Cut short: being written; read again until the deadline.
                Err(e @ DumpError::Unreadable(_)) => last[i] = format!("{}: {e}", path.display()),
                Err(e @ DumpError::Refused(_)) => got[i] = Some(missing(format!("{}: {e}", path.display()))),
            }
        }
        if got.iter().all(Option::is_some) || Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(POLL);
    }
    got.into_iter().zip(last).map(|(g, why)| g.unwrap_or_else(|| missing(why))).collect()
}

fn missing(why: String) -> Flight {
    Flight { groups: Vec::new(), note: Some(crate::stacks::clean(&why)) }
}
