//! One agent's session with the rendezvous: connect, heartbeat, watch the
//! store host for a clean leave, and the store reads and writes the round
//! steps share. Joining a round is [`super::join`], ending one [`super::end`].

use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::Error;
use super::member::Member;
use crate::keys::JobKeys;
use crate::store::{Client, ClientError, Dial, Endpoint, Guard, connect_quietly, connect_with_retry};
use crate::supervise::policy::Verdict;

/// Rendezvous timing.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Last-call window once MIN pods are in (elastic).
    pub last_call: Duration,
    /// Heartbeat period.
    pub heartbeat: Duration,
    /// A member silent this long is dead.
    pub heartbeat_timeout: Duration,
}

/// What an agent carries from round to round, so that a restarted store
/// host (empty store) is rebuilt with the job's state.
#[derive(Debug, Clone, Copy, Default)]
pub struct Known {
    /// The last round this agent was in.
    pub round: Option<u64>,
    /// Job-wide restarts used.
    pub restarts: u32,
}

/// A formed round, from this pod's point of view.
#[derive(Debug, Clone)]
pub struct Round {
    /// Round number.
    pub number: u64,
    /// Our slot in it.
    pub slot: u32,
    /// Our group rank.
    pub group_rank: u32,
    /// Pods in the round.
    pub nnodes: u32,
    /// Port of the round's worker store (on the store host).
    pub worker_port: u16,
    /// A second port free on the store host for the round (JAX's
    /// coordinator, XGBoost's tracker); 0 when it had none.
    pub aux_port: u16,
    /// Job-wide restarts used before this round.
    pub restarts: u32,
}

/// The result of [`Session::next_round`].
#[derive(Debug)]
pub enum Joined {
    /// We are a member of this round.
    Round(Round),
    /// We waited as a spare and the job ended without us (success or failure).
    JobEnded(Verdict),
    /// We wait as a spare: the job moved on to a round we may take part
    /// in, or it is time to check the pod's health again. Check it, then
    /// call [`Session::next_round`] again.
    Spare,
}

pub(super) enum Try {
    Formed(Round),
    Moved(u64),
    Ended(Verdict),
    /// A spare checks its health (see [`Joined::Spare`]).
    Recheck,
}

/// What the pods found out while stopping a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stopped {
    /// Every member reported stopped.
    pub all_stopped: bool,
    /// The store host declared a member dead.
    pub dead: bool,
}

/// One agent's connection to the rendezvous.
#[derive(Debug)]
pub struct Session {
    pub(super) endpoint: Endpoint,
    pub(super) dial: Dial,
    pub(super) client: Client,
    pub(super) keys: JobKeys,
    pub(super) me: Member,
    pub(super) timing: Timing,
    pub(super) jobset_attempt: u64,
    pub(super) run_id: String,
    pub(super) heartbeat: tokio::task::JoinHandle<()>,
    /// Why the store host said it is leaving, if it did (see [`Session::announce_leaving`]).
    pub(super) host_left: std::sync::Arc<std::sync::Mutex<Option<String>>>,
    /// The task that watches for that announcement on its own connection.
    pub(super) host_watch: tokio::task::JoinHandle<()>,
    /// A round we joined that has not formed yet.
    pub(super) open: Option<u64>,
    /// The round we wait in as a spare, and its size: the wait goes on
    /// there after a health check, without taking a new slot.
    pub(super) spare_in: Option<(u64, u64)>,
    /// We waited as a spare since our last round: the next round we are
    /// a member of is a takeover.
    pub(super) was_spare: bool,
    /// This agent is on the store host's pod ([`Session::lead`]).
    pub(super) leads: bool,
    /// Serve mode: a success or failure ends a run, not the job.
    pub(super) serving: bool,
    /// We waited as a spare beside this round: its live members join the
    /// next round before us (`super::spares`).
    pub(super) defer_to: Option<u64>,
}

/// How often a pod waiting for a round to form looks at who joined.
const PROGRESS_POLL: Duration = Duration::from_secs(1);

impl Drop for Session {
    fn drop(&mut self) {
        self.heartbeat.abort();
        self.host_watch.abort();
    }
}

pub(super) fn parse_u64(v: &[u8]) -> Option<u64> {
    std::str::from_utf8(v).ok()?.trim().parse().ok()
}

/// A process-unique suffix for agent uids.
fn nonce() -> String {
    format!("{:08x}", crate::sys::random_u64() & 0xffff_ffff)
}

impl Session {
    /// Connect to the store at `endpoint` (proving `guard`'s token when it
    /// asks for one; retrying until `deadline`), check the JobSet attempt
    /// and start heartbeating. `me.uid` is filled in here.
    pub async fn connect(
        (endpoint, guard): (&Endpoint, Option<Guard>),
        run_id: &str,
        jobset_attempt: u64,
        mut me: Member,
        timing: Timing,
        deadline: Instant,
        cancel: &CancellationToken,
    ) -> Result<Self, Error> {
        me.uid = format!("{}#{}#{}", me.host, me.pid, nonce());
        let client =
            connect_with_retry(endpoint, guard.as_ref(), deadline, cancel).await.map_err(Error::Unreachable)?;
        let addr = client.peer_addr().map_err(|e| Error::Unreachable(ClientError::Io(e)))?;
        let dial = Dial { addr, guard };
        let mut s = Self {
            endpoint: endpoint.clone(),
            dial,
            client,
            keys: JobKeys::new(run_id, jobset_attempt),
            me,
            timing,
            jobset_attempt,
            run_id: run_id.to_string(),
            heartbeat: tokio::spawn(async {}),
            open: None,
            spare_in: None,
            was_spare: false,
            leads: false,
            serving: false,
            defer_to: None,
            host_left: std::sync::Arc::default(),
            host_watch: tokio::spawn(async {}),
        };
        s.watch_host();
        s.check_attempt().await?;
        // Refused here, a second claimant of a node rank leaves no trace
        // (its heartbeat starts only once the place is its own).
        s.claim().await?;
        s.heartbeat = tokio::spawn(heartbeat(
            endpoint.clone(),
            s.dial.guard.clone(),
            s.heartbeat_key(),
            timing.heartbeat,
            cancel.clone(),
        ));
        Ok(s)
    }

    /// Reconnect after losing the store (its host restarted), until `deadline`.
    pub async fn reconnect(&mut self, deadline: Instant, cancel: &CancellationToken) -> Result<(), Error> {
        self.client = connect_with_retry(&self.endpoint, self.dial.guard.as_ref(), deadline, cancel)
            .await
            .map_err(Error::Unreachable)?;
        self.dial.addr = self.client.peer_addr().map_err(|e| Error::Unreachable(ClientError::Io(e)))?;
        // The rounds we waited beside went with the old store.
        (self.spare_in, self.defer_to) = (None, None);
        self.watch_host();
        self.check_attempt().await
    }

    /// (Re)start watching for the store host's announcement that it leaves.
    fn watch_host(&mut self) {
        self.host_watch.abort();
        if let Ok(mut g) = self.host_left.lock() {
            *g = None;
        }
        let (dial, key, slot) = (self.dial.clone(), self.keys.host_left(), self.host_left.clone());
        self.host_watch = tokio::spawn(async move {
            let Ok(mut c) = dial.connect().await else { return };
            if c.wait(std::slice::from_ref(&key)).await.is_err() {
                return;
            }
            // The WAIT answered: the key is set. The host may be gone before
            // the GET is (it lingers only until the others stopped).
            let why = match c.get(&key).await {
                Ok(v) => String::from_utf8_lossy(&v).chars().take(200).collect(),
                Err(_) => "it announced it was leaving".to_string(),
            };
            if let Ok(mut g) = slot.lock() {
                *g = Some(why);
            }
        });
    }

    /// Why the store host left, once the watch for its announcement has
    /// settled (up to `limit`): the store closing wakes that watch and the
    /// caller at the same moment, and the caller must not decide first.
    pub async fn host_left_settled(&mut self, limit: Duration) -> Option<String> {
        if !self.host_watch.is_finished() {
            let _ = tokio::time::timeout(limit, &mut self.host_watch).await;
        }
        self.host_left()
    }

    /// The store host is leaving cleanly (it was told to stop): say so, so
    /// that the pods that lose its store next log why instead of an error.
    pub async fn announce_leaving(&mut self, why: &str) {
        let key = self.keys.host_left();
        let _ = tokio::time::timeout(Duration::from_secs(1), self.client.set(&key, why.as_bytes())).await;
    }

    /// Why the store host left, when it announced it.
    pub fn host_left(&self) -> Option<String> {
        self.host_left.lock().ok().and_then(|g| g.clone())
    }

    async fn check_attempt(&mut self) -> Result<(), Error> {
        let key = JobKeys::attempt(&self.run_id);
        let current = self.raise(&key, self.jobset_attempt).await?;
        if current > self.jobset_attempt {
            return Err(Error::Stale { ours: self.jobset_attempt, current });
        }
        Ok(())
    }

    /// Leave a round that has not formed yet (we are stopping), so the
    /// pods still waiting in it meet again without our slot.
    pub async fn withdraw(&mut self) {
        if let Some(r) = self.open.take() {
            let closed = self.keys.round_keys(r).closed();
            let withdraw = async {
                if self.client.check(&[closed]).await.ok() == Some(false) {
                    tracing::info!(round = r, "leaving a round that has not formed; the others meet again");
                    let _ = self.advance(r, r + 1).await;
                }
            };
            let _ = tokio::time::timeout(Duration::from_secs(2), withdraw).await;
        }
    }

    /// `leads`: this agent is on the store host's pod. In a job with spares
    /// it is a member of every round (the others join a round after it):
    /// the store host's agent posts the job's progress, serves the control
    /// API and keeps the board, which a spare could not. `serving`: serve
    /// mode, where a success or failure ends a run, not the job.
    pub fn roles(&mut self, leads: bool, serving: bool) {
        self.leads = leads;
        self.serving = serving;
    }

    /// Our record.
    pub fn me(&self) -> &Member {
        &self.me
    }

    /// The key this agent heartbeats (`bye` once it left).
    pub fn heartbeat_key(&self) -> String {
        self.keys.heartbeat(&self.me.uid)
    }

    /// The store as resolved, and the token it asks for.
    pub fn dial(&self) -> Dial {
        self.dial.clone()
    }

    pub(super) fn lost(&self, source: ClientError) -> Error {
        Error::Lost { endpoint: self.endpoint.clone(), source }
    }

    /// Raise a decimal key to at least `to`; returns the value it holds.
    pub(super) async fn raise(&mut self, key: &str, to: u64) -> Result<u64, Error> {
        raise(&mut self.client, key, to).await.map_err(|e| self.lost(e))
    }

    /// Move the job from round `from` to round `to` (first mover wins).
    pub(super) async fn advance(&mut self, from: u64, to: u64) -> Result<(), Error> {
        let now = self.raise(&self.keys.round(), to).await?;
        let next = self.keys.round_keys(from).next();
        self.client.compare_set(&next, b"", now.to_string().as_bytes()).await.map_err(|e| self.lost(e))?;
        Ok(())
    }

    /// WAIT for `keys` on a second connection, so that running out of
    /// `limit` leaves this one usable; Ok(false) on timeout.
    pub(super) async fn wait_for(&self, keys: &[String], limit: Duration) -> Result<bool, Error> {
        wait_on(self.dial.clone(), keys, limit).await.map_err(|e| self.lost(e))
    }

    pub(super) async fn get(&mut self, key: &str) -> Result<Vec<u8>, Error> {
        self.client.get(key).await.map_err(|e| self.lost(e))
    }
}

/// WAIT for `key` on a fresh connection to `addr`, then read it.
pub(super) async fn wait_get(dial: Dial, key: &String) -> Result<Vec<u8>, ClientError> {
    let mut c = dial.connect().await?;
    c.wait(std::slice::from_ref(key)).await?;
    c.get(key).await
}

/// The once-a-second poll of a wait's progress line ([`PROGRESS_POLL`]),
/// first after one period: waits that end at once poll nothing.
pub(super) fn progress_tick() -> tokio::time::Interval {
    let mut tick = tokio::time::interval_at(Instant::now() + PROGRESS_POLL, PROGRESS_POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick
}

/// WAIT for `keys` on a fresh connection to `addr`; Ok(false) after `limit`.
pub(crate) async fn wait_on(dial: Dial, keys: &[String], limit: Duration) -> Result<bool, ClientError> {
    let mut waiter = dial.connect().await?;
    match tokio::time::timeout(limit, waiter.wait(keys)).await {
        Ok(r) => r.map(|()| true),
        Err(_) => Ok(false),
    }
}

/// Raise a decimal key to at least `to` (COMPARE_SET loop); returns its value.
pub(crate) async fn raise(c: &mut Client, key: &str, to: u64) -> Result<u64, ClientError> {
    let mut cur = c.get(key).await?;
    loop {
        let have = parse_u64(&cur);
        if have.is_some_and(|h| h >= to) {
            return Ok(have.unwrap_or(to));
        }
        let want = to.to_string();
        let got = c.compare_set(key, &cur, want.as_bytes()).await?;
        if got == want.as_bytes() {
            return Ok(to);
        }
        cur = got;
    }
}

/// Set `key` to a rising counter every `every`, reconnecting as needed.
pub(super) async fn heartbeat(
    endpoint: Endpoint,
    guard: Option<Guard>,
    key: String,
    every: Duration,
    cancel: CancellationToken,
) {
    let mut seq = 0u64;
    loop {
        let far = Instant::now() + Duration::from_secs(86_400);
        let Ok(mut c) = connect_quietly(&endpoint, guard.as_ref(), far, &cancel).await else { return };
        loop {
            seq += 1;
            if c.set(&key, seq.to_string().as_bytes()).await.is_err() {
                break;
            }
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(every) => {}
            }
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
    }
}
