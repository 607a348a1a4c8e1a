//! Every rank's stacks on demand in serve mode (`GET /v1/stacks`): the
//! control API asks through the agents' store, every pod's agent answers
//! with its workers' stacks (read as at a hang, `supervise::hang_read`) and
//! its lane agents' (actors beside the main run, asked on their doors),
//! and the API puts them into one view of the job with who waits for whom
//! (`stacks::stall`), each lane's judged apart.
//!
//! Keys under the job's base: `stacks/ask` counts requests; `stacks/ask/N`
//! is request N; `stacks/answers/N` counts its answers and
//! `stacks/answers/N/K` is answer K (at most 256 KiB each). A new request
//! deletes the previous one's keys, so the store holds one request's
//! answers at most. One request at a time; the answers are awaited for at
//! most [`ANSWER_WAIT`].

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{Link, wait_key};
use crate::keys::serve::StacksKeys;
use crate::stacks::stall::{RankStacks, judge};
use crate::store::Dial;

/// Longest the API waits for every pod's answer.
const ANSWER_WAIT: Duration = Duration::from_secs(3);
/// How often it looks for them.
const POLL: Duration = Duration::from_millis(50);
/// How long a pod's agent waits after a store error before it listens again.
const RETRY: Duration = Duration::from_secs(1);

/// A pod's agent: answer every request with this pod's workers' stacks,
/// until `cancel`.
pub fn answer_requests(dial: Dial, base: String, cancel: CancellationToken) {
    tokio::spawn(async move {
        let mut link = Link::new(dial.clone(), &base);
        let keys = StacksKeys::new(&base);
        let mut last = None;
        loop {
            let done = match last {
                Some(n) => Ok(n),
                None => link.add(&keys.asks(), 0).await,
            };
            let n = match done {
                Ok(n) => n + 1,
                Err(_) => {
                    tokio::select! {
                        () = cancel.cancelled() => return,
                        () = tokio::time::sleep(RETRY) => continue,
                    }
                }
            };
            let key = keys.request(n);
            let asked = tokio::select! {
                () = cancel.cancelled() => return,
                a = wait_key(&dial, &key) => a,
            };
            if asked.is_err() {
                last = None;
                tokio::select! {
                    () = cancel.cancelled() => return,
                    () = tokio::time::sleep(RETRY) => continue,
                }
            }
            last = Some(n);
            // A request the API gave up on and deleted: no answer to leave behind.
            if !link.exists(&key).await.unwrap_or(false) {
                continue;
            }
            let json = crate::supervise::hang_read::encode(crate::supervise::hang_read::read_pod().await);
            let sent = match link.add(&keys.answers(n), 1).await {
                Ok(k) => link.set(&keys.answer(n, k), &json).await,
                Err(e) => Err(e),
            };
            if let Err(e) = sent {
                tracing::warn!(request = n, error = %crate::error::error_chain(&e), "cannot answer a request for this pod's stacks");
            }
        }
    });
}

/// One request at a time.
static ONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The control API's side: ask every pod, wait for `pods` answers (at
/// most [`ANSWER_WAIT`]), and give the job's view as JSON.
pub async fn gather(link: &mut Link, pods: u32) -> Result<serde_json::Value, String> {
    let _one = ONE.lock().await;
    let why = |e: super::Error| format!("the agents' store: {}", crate::error::error_chain(&e));
    let keys = StacksKeys::new(&link.job);
    let n = link.add(&keys.asks(), 1).await.map_err(why)?;
    if n > 1 {
        forget(link, &keys, n - 1).await;
    }
    link.set(&keys.request(n), b"1").await.map_err(why)?;
    let until = tokio::time::Instant::now() + ANSWER_WAIT;
    let answered = loop {
        let c = link.add(&keys.answers(n), 0).await.map_err(why)?;
        if c >= i64::from(pods) || tokio::time::Instant::now() >= until {
            break c;
        }
        tokio::time::sleep(POLL).await;
    };
    let mut ranks: Vec<RankStacks> = Vec::new();
    for k in 1..=answered {
        let raw = link.get(&keys.answer(n, k)).await.map_err(why)?;
        ranks.extend(serde_json::from_slice::<Vec<RankStacks>>(&raw).unwrap_or_default());
    }
    ranks.sort_by_key(|r| (r.lane, r.rank));
    // Actors beside the main run are jobs of their own: judged apart.
    let (main, beside): (Vec<RankStacks>, Vec<RankStacks>) = ranks.into_iter().partition(|r| r.lane.is_none());
    let mut lanes: Vec<serde_json::Value> = Vec::new();
    for lane in beside.iter().filter_map(|r| r.lane).collect::<std::collections::BTreeSet<u64>>() {
        let of: Vec<RankStacks> = beside.iter().filter(|r| r.lane == Some(lane)).cloned().collect();
        lanes.push(serde_json::json!({ "run": lane, "stall": judge(&of), "ranks": of }));
    }
    let stall = judge(&main);
    Ok(serde_json::json!({ "pods": pods, "answered": answered, "stall": stall, "ranks": main, "lanes": lanes }))
}

/// Delete request `n`'s keys.
async fn forget(link: &mut Link, keys: &StacksKeys, n: i64) {
    let answered = link.add(&keys.answers(n), 0).await.unwrap_or(0);
    for k in 1..=answered {
        let _ = link.delete(&keys.answer(n, k)).await;
    }
    let _ = link.delete(&keys.answers(n)).await;
    let _ = link.delete(&keys.request(n)).await;
}
