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
//!
//! `--evict-stragglers AFTER` (with spares): once a rank has been named
//! for AFTER without a break, the store host asks its pod to leave
//! (`rR/evict/<group rank>`, [`super::evict`]), at most one pod a round,
//! never its own (the store's host leaving would end the job), and only
//! while a spare waits to take the rank ([`Evictions`]); the pod reads the
//! key after each of its windows.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::evict::Evictor;
use crate::config::Plan;
use crate::keys::{JobKeys, RoundKeys};
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
/// Most bytes of an eviction's reason read.
const MAX_EVICT_NOTE: usize = 2048;

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
    /// `--evict-stragglers`, and what asks this pod to leave.
    evict: Option<(Duration, Evictor)>,
}

impl Stragglers {
    /// As the plan says (`--stragglers`); the store host judges.
    pub(super) fn new(
        plan: &Plan,
        (dial, evictor): (Dial, Option<Evictor>),
        facts: Arc<watch::Sender<Facts>>,
        cancel: &CancellationToken,
    ) -> Self {
        Stragglers {
            on: plan.health.stragglers && plan.serve.is_none(),
            judges: plan.serve_store,
            dial,
            keys: JobKeys::new(&plan.rdzv_id(), plan.jobset_attempt),
            facts,
            round: None,
            cancel: cancel.clone(),
            evict: plan.health.evict_stragglers.zip(evictor),
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
            let (g, nnodes) = (at.round.group_rank, at.round.nnodes);
            let evict = self.evict.as_ref().map(|(_, e)| (rk.evict(g), e.clone()));
            tokio::spawn(sample(self.dial.clone(), (rk.sampled(g), evict), token.clone()));
            if self.judges {
                let evict = self.evict.as_ref().map(|(after, _)| Evicting { after: *after, own: g });
                tokio::spawn(judge(self.dial.clone(), (rk, nnodes), evict, Arc::clone(&self.facts), token.clone()));
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

/// The pod's sampler for one round: passes over the live workers, a
/// window's counts put at `key` as each window ends; with `evict` (its
/// eviction's key and whom to ask), the store host's ask read after each.
async fn sample(dial: Dial, (key, evict): (String, Option<(String, Evictor)>), cancel: CancellationToken) {
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
                let c = dial.reuse(&mut client, STORE_TIME).await?;
                c.set(&key, &body).await.ok()
            };
            if tokio::time::timeout(STORE_TIME, put).await.ok().flatten().is_none() {
                tracing::debug!(
                    key,
                    "cannot put this pod's sampled states in the store; this window's counts are lost"
                );
                client = None;
            }
            if let Some((k, evictor)) = &evict {
                let got =
                    async { dial.reuse(&mut client, STORE_TIME).await?.multi_get(std::slice::from_ref(k)).await.ok() };
                let why = tokio::time::timeout(STORE_TIME, got).await.ok().flatten().and_then(|v| v.into_iter().next());
                if let Some(why) = why.filter(|w| !w.is_empty()) {
                    let why = String::from_utf8_lossy(&why[..why.len().min(MAX_EVICT_NOTE)]).to_string();
                    evictor.ask(crate::stacks::clean(&why));
                    return;
                }
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

/// What the store host's judge needs to evict (`--evict-stragglers`).
#[derive(Debug)]
struct Evicting {
    after: Duration,
    /// The store host's group rank (never evicted).
    own: u32,
}

/// The store host's judge for one round of `nnodes` pods (its keys `rk`):
/// every pod's newest window, judged once every pod sent a new one (or the
/// newest is [`JUDGE_LATE`] old); with `evict`, a straggler named long
/// enough is asked to leave.
async fn judge(
    dial: Dial,
    (rk, nnodes): (RoundKeys, u32),
    evict: Option<Evicting>,
    facts: Arc<watch::Sender<Facts>>,
    cancel: CancellationToken,
) {
    let keys: Vec<String> = (0..nnodes).map(|n| rk.sampled(n)).collect();
    let mut judge = Judge::default();
    let mut evictions = Evictions::default();
    let mut pod_of: HashMap<u32, u32> = HashMap::new();
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
        let got = async { dial.reuse(&mut client, STORE_TIME).await?.multi_get(&keys).await.ok() };
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
        let mut ranks: Vec<RankTally> = Vec::new();
        for (n, f) in (0u32..).zip(fresh.iter_mut()) {
            for t in f.take().into_iter().flatten() {
                pod_of.insert(t.rank, n);
                ranks.push(cleaned(t));
            }
        }
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
        if let Some(e) = &evict {
            evictions.window(&w, Instant::now());
            evict_due(&mut evictions, e, (&rk, nnodes, &pod_of), &mut client, &dial).await;
        }
    }
    // The round is over: its scores no longer speak for the job.
    crate::metrics::global().straggler_score.reset();
}

/// Ask the pod of a straggler named for `e.after` to leave, when one is
/// due and a spare waits (the round's arrivals past its `nnodes` pods).
async fn evict_due(
    evictions: &mut Evictions,
    e: &Evicting,
    (rk, nnodes, pod_of): (&RoundKeys, u32, &HashMap<u32, u32>),
    client: &mut Option<Client>,
    dial: &Dial,
) {
    let Some((rank, host, for_s)) = evictions.ripe(e.after, Instant::now()) else { return };
    let spares = async { dial.reuse(client, STORE_TIME).await?.add(&rk.join(), 0).await.ok() };
    let Some(arrived) = tokio::time::timeout(STORE_TIME, spares).await.ok().flatten() else {
        *client = None;
        return;
    };
    let waiting = u64::try_from(arrived).unwrap_or(0).saturating_sub(u64::from(nnodes));
    match evictions.decide(rank, pod_of.get(&rank).copied(), e.own, waiting) {
        Decision::Ask(pod) => {
            let why = format!(
                "rank {rank} ({host}) has been a straggler for {for_s:.0} s (--evict-stragglers {:.0})",
                e.after.as_secs_f64()
            );
            tracing::warn!(rank, %host, group_rank = pod, "evicting the pod of a straggler: {why}; a spare takes its rank");
            let put = async { dial.reuse(client, STORE_TIME).await?.set(&rk.evict(pod), why.as_bytes()).await.ok() };
            if tokio::time::timeout(STORE_TIME, put).await.ok().flatten().is_none() {
                tracing::warn!(
                    rank,
                    "cannot ask the straggler's pod to leave (the store did not answer); trying again"
                );
                evictions.retry();
                *client = None;
            }
        }
        Decision::Keep(why) => {
            tracing::info!(rank, %host, "rank {rank} ({host}) has been a straggler for {for_s:.0} s but is not evicted: {why}");
        }
        Decision::Quiet => {}
    }
}

/// Whom to evict (pure; the clock comes in): the first rank named for
/// `--evict-stragglers` without a break, once a round.
#[derive(Debug, Default)]
struct Evictions {
    /// Ranks named now: their pod's name and since when.
    named: HashMap<u32, (String, Instant)>,
    /// Ranks already said to be kept, and why (each said once).
    kept: std::collections::HashSet<(u32, &'static str)>,
    /// A pod was asked to leave this round.
    asked: bool,
}

/// What to do about a ripe straggler.
#[derive(Debug, PartialEq, Eq)]
enum Decision {
    /// Ask the pod of this group rank to leave.
    Ask(u32),
    /// Keep it, and say why (once for each reason).
    Keep(&'static str),
    /// Keep it; said already.
    Quiet,
}

impl Evictions {
    /// A judged window: who is named, and since when.
    fn window(&mut self, w: &straggle::Window, now: Instant) {
        for s in &w.named {
            self.named.entry(s.rank).or_insert_with(|| (s.host.clone(), now));
        }
        for (rank, _) in &w.cleared {
            self.named.remove(rank);
            self.kept.retain(|(r, _)| r != rank);
        }
    }

    /// The rank named longest, once named for `after` (none after an ask):
    /// its rank, pod name and seconds named.
    fn ripe(&self, after: Duration, now: Instant) -> Option<(u32, String, f64)> {
        if self.asked {
            return None;
        }
        let (rank, (host, since)) = self.named.iter().min_by_key(|(r, (_, since))| (*since, **r))?;
        let named = now.saturating_duration_since(*since);
        (named >= after).then(|| (*rank, host.clone(), named.as_secs_f64()))
    }

    /// Whether the ripe `rank` (of pod `pod`) leaves, with `waiting` spares.
    fn decide(&mut self, rank: u32, pod: Option<u32>, store_host: u32, waiting: u64) -> Decision {
        let keep = match pod {
            None => "its pod is not known",
            Some(p) if p == store_host => "its pod hosts the job's store (its leaving would end the job)",
            Some(_) if waiting == 0 => "no spare waits to take its rank",
            Some(p) => {
                self.asked = true;
                return Decision::Ask(p);
            }
        };
        if self.kept.insert((rank, keep)) { Decision::Keep(keep) } else { Decision::Quiet }
    }

    /// The ask did not reach the store: ask again at the next window.
    fn retry(&mut self) {
        self.asked = false;
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stacks::straggle::{Straggler, Window};

    fn named(rank: u32) -> Straggler {
        Straggler {
            rank,
            host: format!("pod-{rank}"),
            score: 0.5,
            others_wait: 0.3,
            own_wait: 0.0,
            others: 3,
            at: None,
            gpu: None,
        }
    }

    fn window(named_now: &[u32], cleared: &[u32]) -> Window {
        Window {
            scores: Vec::new(),
            named: named_now.iter().map(|&r| named(r)).collect(),
            cleared: cleared.iter().map(|&r| (r, format!("pod-{r}"))).collect(),
        }
    }

    #[test]
    fn a_straggler_is_ripe_once_named_for_the_whole_time_without_a_break() {
        let t0 = Instant::now();
        let after = Duration::from_secs(60);
        let mut e = Evictions::default();
        e.window(&window(&[3], &[]), t0);
        assert_eq!(e.ripe(after, t0 + Duration::from_secs(59)), None);
        let (rank, host, secs) = e.ripe(after, t0 + Duration::from_secs(60)).expect("ripe");
        assert_eq!((rank, host.as_str(), secs), (3, "pod-3", 60.0));
        // Cleared, then named again: the time starts over.
        e.window(&window(&[], &[3]), t0 + Duration::from_secs(61));
        assert_eq!(e.ripe(after, t0 + Duration::from_secs(62)), None);
        e.window(&window(&[3], &[]), t0 + Duration::from_secs(70));
        assert_eq!(e.ripe(after, t0 + Duration::from_secs(120)), None);
        assert!(e.ripe(after, t0 + Duration::from_secs(130)).is_some());
        // The one named longest comes first.
        e.window(&window(&[1], &[]), t0 + Duration::from_secs(65));
        assert_eq!(e.ripe(after, t0 + Duration::from_secs(200)).map(|r| r.0), Some(1));
    }

    #[test]
    fn only_a_pod_with_a_spare_waiting_and_not_the_store_host_is_asked_once_a_round() {
        let mut e = Evictions::default();
        let t0 = Instant::now();
        e.window(&window(&[3, 5], &[]), t0);
        assert_eq!(e.decide(3, None, 0, 1), Decision::Keep("its pod is not known"));
        assert_eq!(
            e.decide(5, Some(0), 0, 1),
            Decision::Keep("its pod hosts the job's store (its leaving would end the job)")
        );
        assert_eq!(e.decide(5, Some(0), 0, 1), Decision::Quiet, "said once");
        assert_eq!(e.decide(3, Some(1), 0, 0), Decision::Keep("no spare waits to take its rank"));
        assert_eq!(e.decide(3, Some(1), 0, 0), Decision::Quiet);
        assert_eq!(e.decide(3, Some(1), 0, 1), Decision::Ask(1));
        assert_eq!(e.ripe(Duration::ZERO, t0), None, "one pod a round");
        e.retry();
        assert!(e.ripe(Duration::ZERO, t0).is_some(), "an ask the store did not take is made again");
    }
}
