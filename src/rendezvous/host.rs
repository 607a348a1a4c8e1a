//! The store host's side of the rendezvous: a fresh worker store for every
//! round, and the liveness monitor.
//!
//! The store host runs this next to its store (whether or not its own agent
//! is a member of the round). Per round it serves a new worker store and
//! publishes its port with a second free port of this host (where JAX's
//! coordinator or XGBoost's tracker listens), then, once the round has members, reads every
//! member's heartbeat key once per heartbeat period with one MULTI_GET and
//! timestamps each change with its own clock (the store's clock: no clock
//! skew between pods matters). A member silent for the heartbeat timeout is
//! declared dead: `rR/dead` lists it and `rR/end` becomes `dead:<uid>`. So
//! is one whose heartbeat reads `lost` (its connection to this store was
//! closed by its end without a `bye`: its process died) for the lost grace
//! (`Timing::lost_grace`, `--lost-grace`):
//! the store tells the monitor of each loss at once ([`Losses`]), so a pod
//! killed by SIGKILL or the OOM killer costs well under a second, not the
//! heartbeat timeout; the heartbeat stays for a machine that vanishes. If
//! every member is dead or gone, nobody is left to move the job on, so the
//! monitor does. Worker stores of rounds older than the previous one are
//! closed, and once a round forms the keys of the rounds before the
//! previous one are deleted ([`forget_rounds`]).

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::Timing;
use super::join::millis;
use super::session::{raise, read_members, wait_on};
use crate::keys::JobKeys;
use crate::store::LOST;
use crate::store::{Client, ClientError, Dial, ServerError, StoreServer};
use crate::supervise::policy::Verdict;
use crate::supervise::round_end::RoundEnd;
use round::monitor::{Beat, Orphaned, VerdictSeen, orphaned};

/// Serves a fresh worker store; called once per round.
pub type ServeFn = Box<dyn Fn() -> Result<StoreServer, ServerError> + Send + Sync>;

/// Makes a fresh worker store that closes on the token it is given.
pub type MakeStore = std::sync::Arc<dyn Fn(CancellationToken) -> Result<StoreServer, ServerError> + Send + Sync>;

/// The store's count of heartbeat connections lost
/// (`crate::store::State::losses`): it changes at every loss.
pub type Losses = tokio::sync::watch::Receiver<u64>;

/// The store host's round service for rendezvous that open later, on the
/// same store (serve mode's lanes, `crate::serve::lane`).
#[derive(Clone)]
pub struct Rounds {
    dial: Dial,
    timing: Timing,
    make: MakeStore,
    losses: Option<Losses>,
}

impl std::fmt::Debug for Rounds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rounds").field("store", &self.dial.addr).finish()
    }
}

impl Rounds {
    /// Round services on the store at `dial`, each round's worker store
    /// made by `make`; `losses`: the store's, when it ties heartbeats to
    /// their connections (`crate::keys::heartbeat_tie`).
    pub fn new(dial: Dial, timing: Timing, make: MakeStore, losses: Option<Losses>) -> Self {
        Self { dial, timing, make, losses }
    }

    /// Serve the rounds of the rendezvous under `base` until `cancel`.
    pub fn serve(&self, base: String, cancel: CancellationToken) {
        let (make, token) = (std::sync::Arc::clone(&self.make), cancel.clone());
        let serve: ServeFn = Box::new(move || make(token.child_token()));
        tokio::spawn(serve_rounds(self.dial.clone(), base, self.timing, serve, self.losses.clone(), cancel));
    }
}

/// Run until `cancel`: worker stores and liveness for every round of the
/// job under `base` (`trainlet/<run_id>/j<attempt>`) on the store at `dial`.
/// `losses`: the store's count of lost heartbeat connections, when it
/// keeps one.
pub async fn serve_rounds(
    dial: Dial,
    base: String,
    timing: Timing,
    serve: ServeFn,
    mut losses: Option<Losses>,
    cancel: CancellationToken,
) {
    tokio::select! {
        () = cancel.cancelled() => {}
        Err(e) = rounds(&dial, &base, timing, &serve, &mut losses) => {
            tracing::debug!(error = %crate::error::error_chain(&e), "round service stopped");
        }
    }
}

/// Serve and watch round after round; returns only when the store is gone.
async fn rounds(
    dial: &Dial,
    base: &str,
    timing: Timing,
    serve: &ServeFn,
    losses: &mut Option<Losses>,
) -> Result<Infallible, ClientError> {
    let keys = JobKeys::under(base);
    let mut c = dial.connect().await?;
    let mut round = raise(&mut c, &keys.round(), 0).await?;
    let mut stores: VecDeque<StoreServer> = VecDeque::new();
    loop {
        match serve() {
            Ok(s) => {
                let port = s.local_addr().port();
                let aux = free_port();
                c.set(&keys.round_keys(round).port(), format!("{port},{aux}").as_bytes()).await?;
                tracing::debug!(round, port, aux, "serving the round's worker store");
                stores.push_back(s);
            }
            Err(e) => tracing::error!(round, error = %crate::error::error_chain(&e), "cannot serve a worker store"),
        }
        while stores.len() > 2 {
            if let Some(old) = stores.pop_front() {
                old.shutdown().await;
            }
        }
        round = monitor(&mut c, dial, &keys, round, timing, losses).await?;
    }
}

/// A port free on this host now, for a service a worker of the round
/// serves (JAX's coordinator, XGBoost's tracker): the kernel's pick, as
/// torchrun picks a free `--master-port`; 0 when none could be had.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind(("0.0.0.0", 0)).and_then(|l| l.local_addr()).map_or(0, |a| a.port())
}

/// A change of the store's count of lost heartbeat connections; never,
/// without one (or once its store is gone).
async fn lost(losses: &mut Option<Losses>) {
    if let Some(rx) = losses
        && rx.changed().await.is_ok()
    {
        return;
    }
    std::future::pending().await
}

/// Watch round `r` until the job moves on; returns the next round.
async fn monitor(
    c: &mut Client,
    dial: &Dial,
    job: &JobKeys,
    r: u64,
    timing: Timing,
    losses: &mut Option<Losses>,
) -> Result<u64, ClientError> {
    let keys = job.round_keys(r);
    let next_key = keys.next();
    let members_key = keys.members();
    let year = Duration::from_secs(86_400 * 365);
    let next = wait_on(dial.clone(), std::slice::from_ref(&next_key), year);
    let formed = wait_on(dial.clone(), std::slice::from_ref(&members_key), year);
    tokio::pin!(next, formed);
    let mut formed_done = false;
    let mut tick = tokio::time::interval(timing.heartbeat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut members: Vec<String> = Vec::new();
    let mut seen: HashMap<String, (Vec<u8>, Instant)> = HashMap::new();
    let mut dead: Vec<String> = Vec::new();
    let mut quiet: Vec<String> = Vec::new();
    // When a member whose connection was lost is due to be declared dead.
    let mut recheck: Option<Instant> = None;
    let (timeout, grace) = (millis(timing.heartbeat_timeout), millis(timing.lost_grace.min(timing.heartbeat_timeout)));
    loop {
        tokio::select! {
            ok = &mut next => {
                if ok? {
                    // A round that never formed (given up, or left before it
                    // closed) forgets the old rounds as one that formed does:
                    // else rounds given up one after another (a loaded
                    // machine's, found by the simulation) pile up keys.
                    if round::monitor::forgets_on_moving_on(!members.is_empty()) {
                        forget_rounds(dial, job, r.saturating_sub(1)).await;
                    }
                    let v = c.get(&next_key).await?;
                    return Ok(std::str::from_utf8(&v).ok().and_then(|s| s.parse().ok()).unwrap_or(r + 1));
                }
                next.set(wait_on(dial.clone(), std::slice::from_ref(&next_key), year));
            }
            ok = &mut formed, if !formed_done => { formed_done = true; ok?; }
            _ = tick.tick() => {}
            () = lost(losses) => {}
            () = tokio::time::sleep_until(recheck.unwrap_or_else(Instant::now)), if recheck.is_some() => {}
        }
        recheck = None;
        if members.is_empty() {
            let v = c.get(&members_key).await?;
            // Given up before its ranks were assigned: the job moves on.
            if v.is_empty() || v == round::join::ABANDONED {
                continue;
            }
            // The roster is the round, ranks and all (a member's group rank
            // is its slot's place in it): members that disagree exit.
            let formed = read_members(c, &keys, &v).await?;
            if !formed.is_empty() {
                let hosts: Vec<&str> = formed.iter().map(|m| m.host.as_str()).collect();
                tracing::info!(round = r, nnodes = formed.len(), members = ?hosts, "round formed");
            }
            members = formed.into_iter().map(|m| m.uid).collect();
            forget_rounds(dial, job, r.saturating_sub(1)).await;
            let now = Instant::now();
            for uid in &members {
                seen.insert(uid.clone(), (Vec::new(), now));
            }
        }
        // After a success the members leave (`bye`); one silent then is
        // not declared dead (it may have left between its verdict and its
        // bye), only counted.
        let succeeded = RoundEnd::from_bytes(&c.get(&keys.end()).await?) == RoundEnd::Success;
        let hb: Vec<String> = members.iter().map(|u| job.heartbeat(u)).collect();
        let values = c.multi_get(&hb).await?;
        let now = Instant::now();
        let mut newly = Vec::new();
        let mut lost_conn = Vec::new();
        let mut gone = 0;
        for (uid, v) in members.iter().zip(values) {
            let Some((last, since)) = seen.get_mut(uid) else { continue };
            let beat = match v.as_slice() {
                b"bye" => Beat::Bye,
                LOST => Beat::Lost,
                _ => Beat::Beating,
            };
            if beat == Beat::Bye || dead.contains(uid) || quiet.contains(uid) {
                gone += 1;
                continue;
            }
            if v != *last {
                *last = v;
                *since = now;
            }
            if round::monitor::dead(beat, millis(now.duration_since(*since)), timeout, grace) {
                newly.push(uid.clone());
                if beat == Beat::Lost {
                    lost_conn.push(uid.clone());
                }
                gone += 1;
            } else if beat == Beat::Lost
                && let Some(due) = since.checked_add(timing.lost_grace.min(timing.heartbeat_timeout))
            {
                recheck = Some(recheck.map_or(due, |t| t.min(due)));
            }
        }
        if !newly.is_empty() && succeeded {
            quiet.extend(newly.iter().cloned());
        } else if !newly.is_empty() {
            let silent: Vec<&String> = newly.iter().filter(|u| !lost_conn.contains(u)).collect();
            if !silent.is_empty() {
                tracing::warn!(round = r, dead = ?silent, timeout_s = timing.heartbeat_timeout.as_secs_f64(), "members stopped heartbeating; declaring them dead");
            }
            if !lost_conn.is_empty() {
                tracing::warn!(round = r, dead = ?lost_conn, grace_s = timing.lost_grace.as_secs_f64(), "members' store connections closed without a bye and did not come back (their agents died); declaring them dead");
            }
            dead.extend(newly.iter().cloned());
            c.set(&keys.dead(), &serde_json::to_vec(&dead).unwrap_or_default()).await?;
            c.compare_set(&keys.end(), b"", RoundEnd::Dead(newly[0].clone()).to_string().as_bytes()).await?;
        }
        // (A round whose members record did not read has none to lose.)
        let all_gone = !members.is_empty() && gone == members.len();
        let verdict = if all_gone { c.get(&keys.verdict()).await? } else { Vec::new() };
        let verdict = match String::from_utf8_lossy(&verdict).parse::<Verdict>() {
            _ if verdict.is_empty() => VerdictSeen::None,
            Ok(Verdict::Success | Verdict::Fail(_)) => VerdictSeen::Final,
            _ => VerdictSeen::MovesOn,
        };
        match orphaned(all_gone, !dead.is_empty() || !quiet.is_empty(), succeeded, verdict) {
            Orphaned::MoveOn => {
                tracing::warn!(round = r, "every member of the round is gone; opening the next round");
                let to = raise(c, &job.round(), r + 1).await?;
                c.compare_set(&next_key, b"", to.to_string().as_bytes()).await?;
            }
            Orphaned::Succeed => {
                tracing::warn!(round = r, "the round succeeded and every member died before its verdict; deciding it");
                c.compare_set(&keys.verdict(), b"", Verdict::Success.to_string().as_bytes()).await?;
            }
            Orphaned::Nothing => {}
        }
    }
}

/// Longest the deletion of old rounds' keys may take (it never holds up a
/// round's liveness watch for longer).
const FORGET_LIMIT: Duration = Duration::from_secs(5);

/// Delete the keys of every round of the job under `base` before round
/// `keep`, on a connection of its own; called as round `keep + 1` forms.
/// Nobody reads them any more: the members of the round that formed have
/// left every round before it (they settled it and joined this one), and
/// the previous round, `keep`, stays for whoever may still read it (a
/// spare that waited beside it and defers to its members, a pod an
/// elastic round formed without, still settling it). Every key under
/// `rN/` goes, whoever wrote it, also one written late after an earlier
/// pass; so the store holds the keys of two rounds whatever the number
/// of rounds. A failure is logged and the next round tries again.
async fn forget_rounds(dial: &Dial, job: &JobKeys, keep: u64) {
    if keep == 0 {
        return;
    }
    let work = async {
        let mut c = dial.connect().await?;
        let old: Vec<String> =
            c.list_keys().await?.into_iter().filter(|k| job.round_of(k).is_some_and(|n| n < keep)).collect();
        c.delete_keys(&old).await
    };
    match tokio::time::timeout(FORGET_LIMIT, work).await {
        Ok(Ok(0)) => {}
        Ok(Ok(n)) => tracing::debug!(before = keep, keys = n, "deleted the keys of past rounds"),
        Ok(Err(e)) => {
            tracing::warn!(before = keep, error = %crate::error::error_chain(&e), "cannot delete the keys of past rounds");
        }
        Err(_) => {
            tracing::warn!(before = keep, "deleting the keys of past rounds took too long; the next round tries again")
        }
    }
}
