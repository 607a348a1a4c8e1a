//! Stragglers, named while the job runs, with no option and no user code
//! (`--stragglers`, on by default): each pod samples its live workers'
//! main threads ([`crate::stacks::sampler`]), classifies each sample and
//! counts them per rank over a window ([`crate::stacks::straggle`]), and
//! puts its counts in the store (`rR/sampled/<group rank>`); the store
//! host's agent judges every window of every pod's counts and names the
//! rank the others wait for: a warning line, the
//! `trainlet_straggler_score` metric by rank, and `trainlet.stragglers`
//! in the TrainJob's `trainerStatus`.
//!
//! The sampling's cost is bounded: after a pass over the pod's workers
//! that used t of CPU time (its thread's, measured: on a loaded machine
//! the wait for a CPU is not its cost), the next starts [`COST_FACTOR`] x
//! t after it began, and never sooner than [`MIN_PERIOD`], jittered by up
//! to a fifth either way so that no step period aliases with it: the
//! sampler uses at most 1% of a core.
//! Nothing here can stop or slow the workers: a store that cannot be
//! reached costs a window's counts and a debug line, and the tasks end
//! with the round.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::Plan;
use crate::keys::JobKeys;
use crate::stacks::sampler::Sampler;
use crate::stacks::straggle::{self, Judge, RankTally, Tally};
use crate::status::Facts;
use crate::store::{Client, Dial};

/// Least time between two passes of the sampler.
pub const MIN_PERIOD: Duration = Duration::from_millis(200);
/// The next pass starts this many times the last one's time after it
/// began: at most 1 / COST_FACTOR of a core.
pub const COST_FACTOR: u32 = 100;
/// Least length of a pod's window; it lasts until each of its ranks has
/// [`straggle::MIN_SAMPLES`] samples, or [`MAX_WINDOW`].
pub const WINDOW: Duration = Duration::from_secs(10);
/// Longest window: its counts are sent then with whatever samples it has.
const MAX_WINDOW: Duration = Duration::from_secs(60);
/// How often the store host looks for new windows.
const JUDGE_EVERY: Duration = Duration::from_secs(2);
/// The store host judges the windows it has once the newest is this old,
/// when some pods send none (no Python workers, sampling off there).
const JUDGE_LATE: Duration = Duration::from_secs(30);
/// Most bytes of one pod's counts read (a few hundred bytes per rank).
const MAX_REPORT: usize = 256 * 1024;
/// Bound on dialling or using the store.
const STORE_TIME: Duration = Duration::from_secs(5);

/// One pod's counts, as put in the store.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Report {
    /// The pod's window number, from 1.
    seq: u64,
    /// Its ranks' counts.
    ranks: Vec<RankTally>,
}

/// The feature: the round's sampler, and on the store host its judge.
#[derive(Debug)]
pub(super) struct Stragglers {
    on: bool,
    judges: bool,
    dial: Dial,
    keys: JobKeys,
    facts: Arc<watch::Sender<Facts>>,
    round: Option<CancellationToken>,
    cancel: CancellationToken,
}

impl Stragglers {
    /// As the plan says (`--stragglers`); the store host judges.
    pub(super) fn new(plan: &Plan, dial: Dial, facts: Arc<watch::Sender<Facts>>, cancel: &CancellationToken) -> Self {
        Stragglers {
            on: plan.health.stragglers && plan.serve.is_none(),
            judges: plan.serve_store,
            dial,
            keys: JobKeys::new(&plan.rdzv_id(), plan.jobset_attempt),
            facts,
            round: None,
            cancel: cancel.clone(),
        }
    }

    fn stop(&mut self) {
        if let Some(t) = self.round.take() {
            t.cancel();
        }
    }
}

impl super::feature::Feature for Stragglers {
    fn round_starts<'a>(&'a mut self, at: super::feature::Starting<'a>) -> super::feature::Hook<'a, Result<(), i32>> {
        self.stop();
        if self.on {
            let token = self.cancel.child_token();
            let rk = self.keys.round_keys(at.round.number);
            tokio::spawn(sample(self.dial.clone(), rk.sampled(at.round.group_rank), token.clone()));
            if self.judges {
                let keys: Vec<String> = (0..at.round.nnodes).map(|n| rk.sampled(n)).collect();
                tokio::spawn(judge(self.dial.clone(), keys, Arc::clone(&self.facts), token.clone()));
            }
            self.round = Some(token);
        }
        Box::pin(std::future::ready(Ok(())))
    }

    fn round_ends(&mut self, _succeeded: bool) -> super::feature::Hook<'_, ()> {
        self.stop();
        Box::pin(std::future::ready(()))
    }

    fn leaving<'a>(&'a mut self, _at: super::feature::Leaving<'a>) -> super::feature::Hook<'a, Result<(), i32>> {
        self.stop();
        Box::pin(std::future::ready(Ok(())))
    }
}

/// The store, dialled (again) when there is no connection.
async fn connected<'a>(client: &'a mut Option<Client>, dial: &Dial) -> Option<&'a mut Client> {
    if client.is_none() {
        *client = tokio::time::timeout(STORE_TIME, dial.connect()).await.ok()?.ok();
    }
    client.as_mut()
}

/// The pod's sampler for one round: passes over the live workers, a
/// window's counts put at `key` as each window ends.
async fn sample(dial: Dial, key: String, cancel: CancellationToken) {
    let mut sampler = Some(Sampler::default());
    let mut tally = Tally::default();
    let mut client: Option<Client> = None;
    let mut window = Instant::now();
    let mut seq = 0u64;
    loop {
        let began = Instant::now();
        let (host, live) = crate::supervise::hang_read::live();
        let Some(mut s) = sampler.take() else { return };
        let read = tokio::task::spawn_blocking(move || {
            let cpu = crate::sys::thread_cpu();
            let pids: Vec<(i32, u64)> = live.iter().map(|&(_, pid, start)| (pid, start)).collect();
            s.keep(&pids);
            let got: Vec<_> =
                live.iter().filter_map(|&(rank, pid, start)| Some((rank, s.sample(pid, start)?))).collect();
            (s, got, crate::sys::thread_cpu().saturating_sub(cpu))
        });
        let Ok((s, got, spent)) = read.await else { return };
        sampler = Some(s);
        for (rank, one) in got {
            tally.add(rank, &host, straggle::classify(&one.frames, one.blocked_in));
        }
        let full = tally.fewest().is_some_and(|n| n >= straggle::MIN_SAMPLES);
        if (window.elapsed() >= WINDOW && full) || window.elapsed() >= MAX_WINDOW {
            seq += 1;
            let gpu = crate::metrics::global().gpu_note();
            let ranks = tally.take().into_iter().map(|t| RankTally { gpu: gpu.clone(), ..t }).collect();
            let report = Report { seq, ranks };
            window = Instant::now();
            let body = serde_json::to_vec(&report).unwrap_or_default();
            let put = async {
                let c = connected(&mut client, &dial).await?;
                c.set(&key, &body).await.ok()
            };
            if tokio::time::timeout(STORE_TIME, put).await.ok().flatten().is_none() {
                tracing::debug!(
                    key,
                    "cannot put this pod's sampled states in the store; this window's counts are lost"
                );
                client = None;
            }
        }
        // The pass's own CPU time: on a loaded machine, its wait for a CPU
        // is not the sampler's cost. The jitter only lengthens the least
        // period, so the bound holds.
        let jitter = 0.8 + 0.4 * (crate::sys::random_u64() % 1000) as f64 / 1000.0;
        let pause = spent.saturating_mul(COST_FACTOR).max(MIN_PERIOD.mul_f64(jitter));
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep_until(began + pause) => {}
        }
    }
}

/// The store host's judge for one round: every pod's newest window, judged
/// once every pod sent a new one (or the newest is [`JUDGE_LATE`] old).
async fn judge(dial: Dial, keys: Vec<String>, facts: Arc<watch::Sender<Facts>>, cancel: CancellationToken) {
    let mut judge = Judge::default();
    let mut client: Option<Client> = None;
    let mut judged: Vec<u64> = vec![0; keys.len()];
    let mut fresh: Vec<Option<Vec<RankTally>>> = vec![None; keys.len()];
    let mut since = Instant::now();
    let mut tick = tokio::time::interval(JUDGE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = cancel.cancelled() => break,
            _ = tick.tick() => {}
        }
        let got = async { connected(&mut client, &dial).await?.multi_get(&keys).await.ok() };
        let Some(values) = tokio::time::timeout(STORE_TIME, got).await.ok().flatten() else {
            client = None;
            continue;
        };
        for (n, v) in values.iter().enumerate() {
            if v.is_empty() || v.len() > MAX_REPORT {
                continue;
            }
            let Ok(r) = serde_json::from_slice::<Report>(v) else { continue };
            if r.seq > judged[n] {
                judged[n] = r.seq;
                fresh[n] = Some(r.ranks);
            }
        }
        let have = fresh.iter().filter(|f| f.is_some()).count();
        if have == 0 || (have < keys.len() && since.elapsed() < JUDGE_LATE) {
            continue;
        }
        since = Instant::now();
        let ranks: Vec<RankTally> = fresh.iter_mut().filter_map(Option::take).flatten().map(cleaned).collect();
        let w = judge.window(&ranks);
        let counts: Vec<(u32, u32, u32, u32, u32)> =
            ranks.iter().map(|t| (t.rank, t.wait, t.loader, t.io, t.compute)).collect();
        tracing::debug!(?counts, scores = ?w.scores, "straggler window: (rank, wait, loader, io, compute) samples, and scores");
        let metrics = crate::metrics::global();
        for (rank, score) in &w.scores {
            metrics.straggler_score.with_label_values(&[&rank.to_string()]).set(*score);
        }
        for s in &w.named {
            tracing::warn!(rank = s.rank, host = %s.host, score = s.score, "{}", s.line());
            crate::events::global().emit(crate::events::Event {
                type_: crate::events::Type::Warning,
                reason: "Straggler",
                action: "Report",
                note: s.line(),
            });
        }
        for (rank, host) in &w.cleared {
            tracing::info!(rank, %host, "rank {rank} ({host}) is no longer a straggler: the others wait for it no more than for anyone");
        }
        if !w.named.is_empty() || !w.cleared.is_empty() {
            let now: Vec<String> = judge.named().map(|(r, h)| format!("rank {r} ({h})")).collect();
            let text = (!now.is_empty()).then(|| now.join(", "));
            facts.send_modify(|f| f.stragglers = text);
        }
    }
    // The round is over: its scores no longer speak for the job.
    crate::metrics::global().straggler_score.reset();
}

/// A pod's counts as data: its names cleaned again (they came through the
/// store from another process).
fn cleaned(mut t: RankTally) -> RankTally {
    t.host = crate::stacks::clean(&t.host);
    if let Some((_, at)) = &mut t.at {
        *at = crate::stacks::clean(at);
    }
    t.gpu = t.gpu.map(|g| crate::stacks::clean(&g));
    t
}
