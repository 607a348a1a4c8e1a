//! The pod's progress relay, one task per `trainlet run`: every pod puts
//! each of its workers' newest status of the current round in the agents'
//! store (`<base>/status/<node rank>`: the round and a status per global
//! rank, at most once a second, and at once when a round ends,
//! [`Relay::flush`]); the store host reads every pod's when a post is due,
//! keeps the reports of its current round only (a failed attempt's never
//! speak for the next), makes one view of the job of them
//! ([`super::report::job_view`]: rank 0's report, else the least advanced
//! rank's), merges trainlet's facts, and posts to Trainer's status endpoint
//! at most once per 5 s per job, with backoff after a failure. Nothing here can stop or slow the workers: a failure
//! is a rate-limited warning, the store is dialled on its own connection,
//! and [`Relay::finish`] is bounded.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::report::{Facts, Status, job_view, merge};
use super::{Board, Poster};
use crate::store::{Client, Dial};

/// Trainer's documented limit: one update per 5 s.
pub const MIN_INTERVAL: Duration = Duration::from_secs(5);
/// Longest pause after failed posts.
const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// How often the relay looks for news.
const TICK: Duration = Duration::from_secs(1);
/// Bound on dialling or using the store.
const STORE_TIME: Duration = Duration::from_secs(3);

/// Where the relay reads and writes.
#[derive(Debug)]
pub struct Setup {
    /// The agents' store.
    pub store: Dial,
    /// `trainlet/<run id>/j<attempt>`.
    pub base: String,
    /// This pod's node rank.
    pub node_rank: u32,
    /// Pods of the job.
    pub nnodes: u32,
    /// The job has spares: its status counts those waiting and the takeovers.
    pub spares: bool,
    /// Trainer's endpoint, on the store host only.
    pub poster: Option<Poster>,
}

/// A running relay.
#[derive(Debug)]
pub struct Relay {
    cancel: CancellationToken,
    flushes: tokio::sync::mpsc::Sender<tokio::sync::oneshot::Sender<()>>,
    done: tokio::task::JoinHandle<()>,
}

impl Relay {
    /// Start relaying `board` and `facts`.
    pub fn start(setup: Setup, board: Arc<Board>, facts: watch::Receiver<Facts>) -> Self {
        let cancel = CancellationToken::new();
        let (flushes, asks) = tokio::sync::mpsc::channel(4);
        let done = tokio::spawn(run(setup, board, facts, asks, cancel.clone()));
        Self { cancel, flushes, done }
    }

    /// Put this pod's newest report in the store now, not at the next
    /// tick, and wait (bounded) until it is there: the workers are gone,
    /// and their last report must reach the store host before the pods
    /// part.
    pub async fn flush(&self) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.flushes.try_send(tx).is_ok() && tokio::time::timeout(STORE_TIME * 2, rx).await.is_err() {
            tracing::debug!("the progress relay did not pass the last report on in time");
        }
    }

    /// Pass on what is not passed on yet (the final report), then stop;
    /// bounded by the 5 s throttle plus one request.
    pub async fn finish(self) {
        self.cancel.cancel();
        let limit = MIN_INTERVAL + Duration::from_secs(12);
        if tokio::time::timeout(limit, self.done).await.is_err() {
            tracing::warn!("the progress relay did not finish in time; the last report may not have reached Trainer");
        }
    }
}

/// What a pod puts in the store: its workers' newest statuses in `round`.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Published {
    round: u64,
    ranks: BTreeMap<u32, Status>,
}

/// The store host's view of every pod's reports.
#[derive(Debug, Default)]
struct Pods {
    seen: HashMap<u32, Vec<u8>>,
    pods: HashMap<u32, Published>,
}

impl Pods {
    /// Take what each pod published now; true when anything changed.
    fn update(&mut self, values: impl IntoIterator<Item = (u32, Vec<u8>)>) -> bool {
        let mut changed = false;
        for (pod, v) in values {
            if v.is_empty() || self.seen.get(&pod) == Some(&v) {
                continue;
            }
            if let Ok(p) = serde_json::from_slice::<Published>(&v) {
                self.pods.insert(pod, p);
                changed = true;
            }
            self.seen.insert(pod, v);
        }
        changed
    }

    /// One view of the job in `round`, from every pod's reports of it.
    fn view(&self, round: u64) -> Option<Status> {
        let ranks: BTreeMap<u32, &Status> = self
            .pods
            .values()
            .filter(|p| p.round == round)
            .flat_map(|p| p.ranks.iter().map(|(r, s)| (*r, s)))
            .collect();
        job_view(ranks).cloned()
    }
}

/// Posting state: throttle and backoff.
#[derive(Debug)]
struct Pace {
    next: Instant,
    failures: u32,
}

impl Pace {
    fn backoff(&self) -> Duration {
        (MIN_INTERVAL * 2u32.saturating_pow(self.failures.min(8))).min(MAX_BACKOFF)
    }
}

async fn run(
    mut setup: Setup,
    board: Arc<Board>,
    mut facts: watch::Receiver<Facts>,
    mut asks: tokio::sync::mpsc::Receiver<tokio::sync::oneshot::Sender<()>>,
    cancel: CancellationToken,
) {
    let mut client: Option<Client> = None;
    let mut published = 0u64;
    let mut pods = Pods::default();
    let mut pending = false;
    let mut pace = Pace { next: Instant::now(), failures: 0 };
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let host = setup.poster.is_some();
    let job = crate::keys::JobKeys::under(&setup.base);
    let key = |rank: u32| job.status(rank);
    loop {
        let mut asked = None;
        let stopping = tokio::select! {
            () = cancel.cancelled() => true,
            _ = tick.tick() => false,
            Some(ack) = asks.recv() => { asked = Some(ack); false }
            Ok(()) = facts.changed() => { pending = host; false }
        };
        // Every pod: our workers' newest statuses into the store.
        if board.seq() != published {
            let snap = board.snapshot();
            let seq = snap.seq;
            let bytes = serde_json::to_vec(&Published { round: snap.round, ranks: snap.ranks }).unwrap_or_default();
            if let Some(c) = setup.store.reuse(&mut client, STORE_TIME).await {
                match tokio::time::timeout(STORE_TIME, c.set(&key(setup.node_rank), &bytes)).await {
                    Ok(Ok(())) => published = seq,
                    _ => client = None,
                }
            }
        }
        if let Some(ack) = asked.take() {
            let _ = ack.send(());
        }
        // The store host: every pod's, then Trainer, when a post is due
        // (one read of every pod's key per 5 s, not per tick).
        if let Some(poster) = setup.poster.as_mut()
            && (stopping || Instant::now() >= pace.next)
        {
            let keys: Vec<String> = (0..setup.nnodes).map(key).collect();
            if let Some(c) = setup.store.reuse(&mut client, STORE_TIME).await {
                match tokio::time::timeout(STORE_TIME, c.multi_get(&keys)).await {
                    Ok(Ok(values)) => pending |= pods.update((0..setup.nnodes).zip(values)),
                    _ => client = None,
                }
            }
            if stopping && pending {
                // The final report waits for the throttle, once.
                tokio::time::sleep_until(pace.next).await;
            }
            if pending && Instant::now() >= pace.next {
                let mut facts = facts.borrow().clone();
                if setup.spares
                    && let Some(c) = setup.store.reuse(&mut client, STORE_TIME).await
                {
                    match tokio::time::timeout(STORE_TIME, spares(c, &setup.base, facts.round)).await {
                        Ok(Ok(counts)) => facts.spares = Some(counts),
                        _ => client = None,
                    }
                }
                let status = merge(pods.view(facts.round).as_ref(), &facts, crate::clock::now_us());
                match poster.post(&status).await {
                    Ok(()) => {
                        if pace.failures > 0 {
                            tracing::info!(url = %poster.url(), "posting progress to Trainer works again");
                        }
                        pace.failures = 0;
                        pace.next = Instant::now() + MIN_INTERVAL;
                        pending = false;
                        super::gauges().posts.inc();
                    }
                    Err(why) => {
                        pace.failures += 1;
                        pace.next = Instant::now() + pace.backoff();
                        super::gauges().post_failures.inc();
                        if pace.failures == 1 || pace.failures.is_power_of_two() {
                            tracing::warn!(url = %poster.url(), error = %why, failures = pace.failures, retry_in_s = pace.backoff().as_secs(), "cannot post progress to Trainer; training goes on");
                        }
                    }
                }
            }
        }
        if stopping {
            return;
        }
    }
}

/// The spares waiting beside round `round` (the pods that joined it past
/// its size) and the job's takeovers so far.
async fn spares(c: &mut Client, base: &str, round: u64) -> Result<(u64, u64), crate::store::ClientError> {
    let job = crate::keys::JobKeys::under(base);
    let keys = job.round_keys(round);
    let joined = u64::try_from(c.add(&keys.join(), 0).await?).unwrap_or(0);
    let closed = crate::keys::Closed::read(&c.get(&keys.closed()).await?);
    let waiting = closed.map_or(0, |c| joined.saturating_sub(c.size));
    let takeovers = u64::try_from(c.add(&job.takeovers(), 0).await?).unwrap_or(0);
    Ok((waiting, takeovers))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn published(round: u64, ranks: &[(u32, u8)]) -> Vec<u8> {
        let ranks = ranks.iter().map(|&(r, p)| (r, Status { progress: Some(p), ..Status::default() })).collect();
        serde_json::to_vec(&Published { round, ranks }).expect("json")
    }

    #[test]
    fn the_job_view_is_rank_0s_of_the_current_round() {
        let mut pods = Pods::default();
        assert!(pods.update([(0, published(0, &[(0, 8), (1, 3)])), (1, Vec::new())]));
        assert!(!pods.update([(0, published(0, &[(0, 8), (1, 3)]))]), "nothing new");
        // Pod 1's ranks report last and less: rank 0 still speaks for the job.
        assert!(pods.update([(1, published(0, &[(2, 4), (3, 4)]))]));
        assert_eq!(pods.view(0).and_then(|s| s.progress), Some(8));
        assert!(!pods.update([(1, b"garbage".to_vec())]));
        assert_eq!(pods.view(0).and_then(|s| s.progress), Some(8));
        // A restart: pod 0 has not reported in round 1 yet, pod 1 has.
        assert!(pods.update([(0, published(1, &[])), (1, published(1, &[(2, 1), (3, 2)]))]));
        assert_eq!(pods.view(1).and_then(|s| s.progress), Some(1), "the least advanced rank without rank 0");
        assert!(pods.update([(1, published(0, &[(2, 60)]))]));
        assert_eq!(pods.view(1), None, "an earlier round's reports are dropped");
    }

    #[test]
    fn backoff_doubles_to_a_minute() {
        let mut p = Pace { next: Instant::now(), failures: 0 };
        let mut seen = Vec::new();
        for _ in 0..6 {
            p.failures += 1;
            seen.push(p.backoff().as_secs());
        }
        assert_eq!(seen, [10, 20, 40, 60, 60, 60]);
    }
}
