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
/// busy one). The wait ends when the last dump is in.
const DUMP_MARGIN: Duration = Duration::from_secs(12);
/// Longest wait for the dumps in all, whatever the interval.
const MAX_WAIT: Duration = Duration::from_secs(15);
/// Longest the ask itself may take (resolve, connect, set).
const ASK_WAIT: Duration = Duration::from_secs(3);
/// Longest the workers' environments are read for (a worker in
/// uninterruptible sleep can hold its memory map's lock).
const TARGETS_WAIT: Duration = Duration::from_secs(1);
/// How often the dumps are looked for.
const POLL: Duration = Duration::from_millis(100);
/// How far a dump's modification time may trail the agent's clock.
const CLOCK_SLACK: Duration = Duration::from_secs(1);

/// Where one worker's dump will be: its index in the stacks read, the
/// files it may be written to (torch's default differs by version), the
/// uid that must own it, and how often its monitor polls.
#[derive(Debug, Clone)]
pub(super) struct Target {
    index: usize,
    paths: Vec<PathBuf>,
    owner: Option<u32>,
    poll: Duration,
}

/// Where the dumps of the workers in `read` that run NCCL's heartbeat
/// monitor will be, read from their environments now, before this pod's
/// stacks go into the store, so before anyone asks: a worker that dumped
/// ends, and a dead one's environment is empty. A worker whose recorder is
/// off is not waited for. Bounded in time; workers not looked at in time
/// are said so and not asked for.
pub(super) async fn targets(read: &mut [RankStacks]) -> Vec<Target> {
    let who: Vec<(usize, i32, u32)> = read.iter().enumerate().map(|(i, r)| (i, r.stacks.pid, r.rank)).collect();
    let found = tokio::time::timeout(
        TARGETS_WAIT,
        tokio::task::spawn_blocking(move || {
            who.into_iter()
                .filter(|&(_, pid, _)| pid > 0 && flight::has_monitor(pid))
                .map(|(index, pid, rank)| {
                    flight::dump_target(pid, rank)
                        .map(|(paths, poll)| Target { index, paths, owner: flight::owner_of(pid), poll })
                        .map_err(|why| (index, why))
                })
                .collect::<Vec<_>>()
        }),
    )
    .await;
    match found {
        Ok(Ok(all)) => all
            .into_iter()
            .filter_map(|t| {
                t.map_err(|(i, why)| read[i].flight = Some(missing(format!("not asked for a dump: {why}")))).ok()
            })
            .collect(),
        _ => {
            tracing::warn!(
                "cannot tell in time which workers run NCCL (their /proc did not answer); no Flight Recorder dump is asked for"
            );
            Vec::new()
        }
    }
}

/// Ask for and read the Flight Recorder dumps at `targets`, and put each
/// in its worker's entry of `read`. A dump older than `started`, when
/// this attempt began, is an earlier round's. Not the time of this pod's
/// ask: the key is the whole job's, so the workers dump at the first
/// pod's ask, and a pod that heard the hang later (its stacks came in the
/// last, or past the others' wait) asks after its workers dumped.
pub(super) async fn gather(world: &WorldView<'_>, read: &mut [RankStacks], targets: Vec<Target>, started: SystemTime) {
    if targets.is_empty() {
        return;
    }
    // The file system's clock may trail, by its granularity or, on a
    // network volume, by the server's clock.
    let since = started.checked_sub(CLOCK_SLACK).unwrap_or(SystemTime::UNIX_EPOCH);
    if let Err(why) = ask(world.master_addr, world.master_port).await {
        tracing::warn!(reason = %why, "cannot ask the workers' Flight Recorders for a dump");
        for t in &targets {
            read[t.index].flight = Some(missing(format!("not asked for a dump: {why}")));
        }
        return;
    }
    let wait = (targets.iter().map(|t| t.poll).max().unwrap_or_default() + DUMP_MARGIN).min(MAX_WAIT);
    let ranks: Vec<u32> = targets.iter().map(|t| read[t.index].rank).collect();
    tracing::info!(
        ?ranks,
        wait_s = wait.as_secs_f64(),
        "waiting for the workers' Flight Recorder dumps (asked through exception_dump in the worker store)"
    );
    let look = targets.clone();
    // A read stuck on a hung file system is left behind at the bound.
    let found = tokio::time::timeout(wait + ASK_WAIT, tokio::task::spawn_blocking(move || collect(&look, since, wait)))
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or_else(|| vec![missing("the dump's read did not finish in time".into()); targets.len()]);
    let mut dumped = 0usize;
    for (t, f) in targets.iter().zip(found) {
        dumped += usize::from(f.note.is_none());
        read[t.index].flight = Some(f);
    }
    tracing::info!(dumped, of = targets.len(), "read the workers' Flight Recorder dumps");
}

/// Set `exception_dump` in the worker store at `host:port` (the value is
/// the asking rank, an i32; -1: trainlet, no rank).
async fn ask(host: &str, port: u16) -> Result<(), String> {
    let store = crate::store::Endpoint { host: host.to_string(), port };
    let go = async {
        let deadline = tokio::time::Instant::now() + ASK_WAIT;
        let never = tokio_util::sync::CancellationToken::new();
        let mut c = crate::store::connect_quietly(&store, None, deadline, &never)
            .await
            .map_err(|e| format!("cannot reach the worker store {store}: {e}"))?;
        c.set_checked(flight::DUMP_KEY, &(-1i32).to_ne_bytes())
            .await
            .map_err(|e| format!("the worker store {store} did not take the key: {e}"))
    };
    tokio::time::timeout(ASK_WAIT, go).await.map_err(|_| format!("the worker store {store} did not answer"))?
}

/// Each target's dump, looked for at each of its paths until all are read
/// or `wait` is over; a target with none says why (no dump in time, or
/// what was wrong with each file found). A file that did not read is read
/// again only once it changed (it was being written); one refused is not
/// looked at again.
fn collect(targets: &[Target], since: SystemTime, wait: Duration) -> Vec<Flight> {
    let deadline = Instant::now() + wait;
    let mut got: Vec<Option<Flight>> = vec![None; targets.len()];
    let none = format!("no dump within {:.1} s", wait.as_secs_f64());
    let mut last: Vec<Option<String>> = vec![None; targets.len()];
    let mut looks: Vec<Vec<Look>> = targets.iter().map(|t| vec![Look::Open(None); t.paths.len()]).collect();
    loop {
        for (i, t) in targets.iter().enumerate() {
            if got[i].is_some() {
                continue;
            }
            let Some(owner) = t.owner else {
                got[i] = Some(missing("the worker is gone".into()));
                continue;
            };
            for (path, look) in t.paths.iter().zip(looks[i].iter_mut()) {
                let Look::Open(tried) = *look else { continue };
                let stamp = flight::stamp(path);
                if stamp.is_some() && stamp == tried {
                    continue;
                }
                match flight::read_dump(path, since, owner) {
                    Ok(f) => {
                        got[i] = Some(f);
                        break;
                    }
                    Err(DumpError::NotYet) => {}
                    Err(e) => {
                        *look = if matches!(e, DumpError::Refused(_)) { Look::Refused } else { Look::Open(stamp) };
                        last[i] = Some(format!("{}: {e}", path.display()));
                    }
                }
            }
            if got[i].is_none() && looks[i].iter().all(|l| *l == Look::Refused) {
                got[i] = Some(missing(last[i].take().unwrap_or_else(|| none.clone())));
            }
        }
        if got.iter().all(Option::is_some) || Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(POLL);
    }
    got.into_iter()
        .zip(last)
        .map(|(g, why)| g.unwrap_or_else(|| missing(why.unwrap_or_else(|| none.clone()))))
        .collect()
}

/// Where `collect` stands with one of a target's paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Look {
    /// Looked for; with the stamp of a file there that did not read (it is
    /// read again only once it changed).
    Open(Option<(u64, SystemTime)>),
    /// Not a file to read: not looked at again.
    Refused,
}

fn missing(why: String) -> Flight {
    Flight { groups: Vec::new(), note: Some(crate::stacks::clean(&why)) }
}
