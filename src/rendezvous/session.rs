//! One agent's session with the rendezvous: connect, heartbeat, watch the
//! store host for a clean leave, and the store reads and writes the round
//! steps share. Joining a round is [`super::join`], ending one [`super::end`].

use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::Error;
use super::member::{Member, Roster};
use crate::keys::{JobKeys, RoundKeys};
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
    /// A member whose heartbeat connection was closed by its end without a
    /// `bye` (its agent died) and did not beat again for this long is dead
    /// (at most `heartbeat_timeout`): time for a connection that merely
    /// blipped to come back (the heartbeat reconnects at once).
    pub lost_grace: Duration,
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
    /// The agents' store.
    pub(super) store: Store,
    /// The job's keys there.
    pub(super) keys: JobKeys,
    /// The JobSet restart attempt this pod belongs to.
    pub(super) attempt: Attempt,
    /// This agent's record.
    pub(super) me: Member,
    pub(super) timing: Timing,
    /// Its tasks beside the round: the heartbeat, the store host's leaving.
    pub(super) watch: Watch,
    /// Where this agent stands between rounds.
    pub(super) standing: Standing,
    /// What this agent is ([`Session::roles`]).
    pub(super) roles: Roles,
}

/// The agents' store, as given and as resolved, and this agent's connection to it.
#[derive(Debug)]
pub(super) struct Store {
    /// As given (`--rdzv-endpoint`, the env): reconnects resolve it again.
    pub(super) endpoint: Endpoint,
    /// As resolved, with the token it asks for: other connections dial it.
    pub(super) dial: Dial,
    /// The session's own connection.
    pub(super) client: Client,
}

/// The JobSet restart attempt an agent belongs to: a pod of an older one
/// must not join ([`Error::Stale`]).
#[derive(Debug)]
pub(super) struct Attempt {
    /// The job's run id.
    pub(super) run_id: String,
    /// The attempt.
    pub(super) number: u64,
}

/// An agent's tasks beside the round, each on its own connection.
#[derive(Debug)]
pub(super) struct Watch {
    /// Writes the heartbeat key every interval; true once it wrote `bye`.
    pub(super) heartbeat: tokio::task::JoinHandle<bool>,
    /// Tells the heartbeat to say `bye` and end ([`heartbeat`]).
    pub(super) leave: CancellationToken,
    /// Why the store host said it is leaving, if it did (see [`Session::announce_leaving`]).
    pub(super) host_left: std::sync::Arc<std::sync::Mutex<Option<String>>>,
    /// Watches for that announcement.
    pub(super) host_watch: tokio::task::JoinHandle<()>,
}

/// Where an agent stands between rounds: the state its next join starts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Standing {
    /// A member of its last round, or of none yet.
    Member,
    /// In round `round`, which has not formed yet (a stop withdraws it);
    /// `was_spare`: it waited as a spare since its last round.
    Joining {
        /// The round.
        round: u64,
        /// It waited as a spare since its last round.
        was_spare: bool,
    },
    /// Waiting as a spare in round `round` of `size` pods: the wait goes
    /// on there after a health check, without taking a new slot.
    Spare {
        /// The round it waits beside.
        round: u64,
        /// That round's size.
        size: u64,
    },
    /// It waited as a spare and the job moved on (or the store was
    /// replaced): the next round it is a member of is a takeover.
    /// `defer_to`: the round it waited beside, whose live members join the
    /// next round before it (`super::spares`); None once done, or when
    /// the store that held that round is gone.
    WasSpare {
        /// The round it waited beside.
        defer_to: Option<u64>,
    },
}

impl Standing {
    /// It waited as a spare since its last round (a round it gets into
    /// is a takeover).
    pub(super) fn was_spare(self) -> bool {
        !matches!(self, Standing::Member | Standing::Joining { was_spare: false, .. })
    }

    /// Out of a round it joined: the round closed, or it withdrew.
    pub(super) fn out_of_round(self) -> Standing {
        if self.was_spare() { Standing::WasSpare { defer_to: None } } else { Standing::Member }
    }
}

/// What an agent is, for the whole session.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Roles {
    /// On the store host's pod: in a job with spares, a member of every
    /// round (the others join a round after it), since the store host's
    /// agent posts the job's progress, serves the control API and keeps
    /// the board, which a spare could not ([`Session::lead`]).
    pub leads: bool,
    /// Serve mode: a success or failure ends a run, not the job.
    pub serving: bool,
}

/// How often a pod waiting for a round to form looks at who joined.
const PROGRESS_POLL: Duration = Duration::from_secs(1);

impl Drop for Session {
    fn drop(&mut self) {
        self.watch.heartbeat.abort();
        self.watch.host_watch.abort();
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
            store: Store { endpoint: endpoint.clone(), dial, client },
            keys: JobKeys::new(run_id, jobset_attempt),
            attempt: Attempt { run_id: run_id.to_string(), number: jobset_attempt },
            me,
            timing,
            watch: Watch {
                heartbeat: tokio::spawn(async { false }),
                leave: CancellationToken::new(),
                host_left: std::sync::Arc::default(),
                host_watch: tokio::spawn(async {}),
            },
            standing: Standing::Member,
            roles: Roles::default(),
        };
        s.watch_host();
        s.check_attempt().await?;
        // Refused here, a second claimant of a node rank leaves no trace
        // (its heartbeat starts only once the place is its own).
        s.claim().await?;
        s.watch.heartbeat = tokio::spawn(heartbeat(
            endpoint.clone(),
            s.store.dial.guard.clone(),
            s.heartbeat_key(),
            timing.heartbeat,
            cancel.clone(),
            s.watch.leave.clone(),
        ));
        Ok(s)
    }

    /// Reconnect after losing the store (its host restarted), until `deadline`.
    pub async fn reconnect(&mut self, deadline: Instant, cancel: &CancellationToken) -> Result<(), Error> {
        self.store.client = connect_with_retry(&self.store.endpoint, self.store.dial.guard.as_ref(), deadline, cancel)
            .await
            .map_err(Error::Unreachable)?;
        self.store.dial.addr = self.store.client.peer_addr().map_err(|e| Error::Unreachable(ClientError::Io(e)))?;
        // The rounds we waited beside went with the old store.
        if matches!(self.standing, Standing::Spare { .. } | Standing::WasSpare { .. }) {
            self.standing = Standing::WasSpare { defer_to: None };
        }
        self.watch_host();
        self.check_attempt().await
    }

    /// (Re)start watching for the store host's announcement that it leaves.
    fn watch_host(&mut self) {
        self.watch.host_watch.abort();
        if let Ok(mut g) = self.watch.host_left.lock() {
            *g = None;
        }
        let (dial, key, slot) = (self.store.dial.clone(), self.keys.host_left(), self.watch.host_left.clone());
        self.watch.host_watch = tokio::spawn(async move {
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
        if !self.watch.host_watch.is_finished() {
            let _ = tokio::time::timeout(limit, &mut self.watch.host_watch).await;
        }
        self.host_left()
    }

    /// The store host is leaving cleanly (it was told to stop): say so, so
    /// that the pods that lose its store next log why instead of an error.
    pub async fn announce_leaving(&mut self, why: &str) {
        let key = self.keys.host_left();
        let _ = tokio::time::timeout(Duration::from_secs(1), self.store.client.set(&key, why.as_bytes())).await;
    }

    /// Why the store host left, when it announced it.
    pub fn host_left(&self) -> Option<String> {
        self.watch.host_left.lock().ok().and_then(|g| g.clone())
    }

    async fn check_attempt(&mut self) -> Result<(), Error> {
        let key = JobKeys::attempt(&self.attempt.run_id);
        let current = self.raise(&key, self.attempt.number).await?;
        if current > self.attempt.number {
            return Err(Error::Stale { ours: self.attempt.number, current });
        }
        Ok(())
    }

    /// Leave a round that has not formed yet (we are stopping), so the
    /// pods still waiting in it meet again without our slot.
    pub async fn withdraw(&mut self) {
        if let Standing::Joining { round: r, .. } = self.standing {
            self.standing = self.standing.out_of_round();
            let closed = self.keys.round_keys(r).closed();
            let withdraw = async {
                if self.store.client.check(&[closed]).await.ok() == Some(false) {
                    tracing::info!(round = r, "leaving a round that has not formed; the others meet again");
                    let _ = self.advance(r, r + 1).await;
                }
            };
            let _ = tokio::time::timeout(Duration::from_secs(2), withdraw).await;
        }
    }

    /// What this agent is ([`Roles`]).
    pub fn roles(&mut self, roles: Roles) {
        self.roles = roles;
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
        self.store.dial.clone()
    }

    pub(super) fn lost(&self, source: ClientError) -> Error {
        Error::Lost { endpoint: self.store.endpoint.clone(), source }
    }

    /// Raise a decimal key to at least `to`; returns the value it holds.
    pub(super) async fn raise(&mut self, key: &str, to: u64) -> Result<u64, Error> {
        raise(&mut self.store.client, key, to).await.map_err(|e| self.lost(e))
    }

    /// Move the job from round `from` to round `to` (first mover wins).
    pub(super) async fn advance(&mut self, from: u64, to: u64) -> Result<(), Error> {
        let now = self.raise(&self.keys.round(), to).await?;
        self.point_next(from, now).await
    }

    /// `rR/next` of round `from` is `now`, the job's round (the first writer wins).
    pub(super) async fn point_next(&mut self, from: u64, now: u64) -> Result<(), Error> {
        let next = self.keys.round_keys(from).next();
        self.store.client.compare_set(&next, b"", now.to_string().as_bytes()).await.map_err(|e| self.lost(e))?;
        Ok(())
    }

    /// WAIT for `keys` on a second connection, so that running out of
    /// `limit` leaves this one usable; Ok(false) on timeout.
    pub(super) async fn wait_for(&self, keys: &[String], limit: Duration) -> Result<bool, Error> {
        wait_on(self.store.dial.clone(), keys, limit).await.map_err(|e| self.lost(e))
    }

    pub(super) async fn get(&mut self, key: &str) -> Result<Vec<u8>, Error> {
        self.store.client.get(key).await.map_err(|e| self.lost(e))
    }

    /// The member records of round `r` in group-rank order, from its
    /// stored roster (`rR/members`); none for a round that did not form.
    pub(super) async fn members_of(&mut self, r: u64, roster: &[u8]) -> Result<Vec<Member>, Error> {
        let keys = self.keys.round_keys(r);
        read_members(&mut self.store.client, &keys, roster).await.map_err(|e| self.lost(e))
    }
}

/// The member records a stored roster (`rR/members`, [`Roster`]) names,
/// in group-rank order: none for a round given up or one whose records
/// disagree.
pub(crate) async fn read_members(c: &mut Client, keys: &RoundKeys, roster: &[u8]) -> Result<Vec<Member>, ClientError> {
    let slots = Roster::read(roster).map(|r| r.slots().to_vec()).unwrap_or_default();
    if slots.is_empty() {
        return Ok(Vec::new());
    }
    let names: Vec<String> = slots.iter().map(|s| keys.member(s)).collect();
    let values = c.multi_get(&names).await?;
    Ok(values.iter().filter_map(|v| serde_json::from_slice(v).ok()).collect())
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

/// Set `key` to a rising counter every `every` on a connection of its own,
/// until `leave`, when it sets `bye` there and returns true (false: it
/// could not, or `cancel` came first).
///
/// The store ties the key to this connection (`crate::keys::heartbeat_tie`):
/// were it closed without the `bye`, the store host would take this agent
/// for dead after `Timing::lost_grace`. So a connection that closes is
/// replaced at once, and is watched between beats: the store host sees the
/// key beat again well within the grace.
pub(super) async fn heartbeat(
    endpoint: Endpoint,
    guard: Option<Guard>,
    key: String,
    every: Duration,
    cancel: CancellationToken,
    leave: CancellationToken,
) -> bool {
    let mut seq = 0u64;
    // Connections in a row that closed within a period of opening.
    let mut quick = 0u32;
    // The store's address the last connection reached.
    let mut known: Option<std::net::SocketAddr> = None;
    loop {
        // That address first: the grace is survived only by a quick
        // redial, and resolving the name again may not be (one lost DNS
        // packet costs the resolver's 5 s). A store host that moved is
        // found by name after a period at most.
        let direct = match known {
            None => None,
            Some(addr) => tokio::select! {
                () = cancel.cancelled() => return false,
                r = tokio::time::timeout(every, Client::connect_guarded(addr, guard.as_ref())) => r.ok().and_then(Result::ok),
            },
        };
        let mut c = match direct {
            Some(c) => c,
            None => {
                let far = Instant::now() + Duration::from_secs(86_400);
                let Ok(c) = connect_quietly(&endpoint, guard.as_ref(), far, &cancel).await else { return false };
                c
            }
        };
        known = c.peer_addr().ok();
        let opened = Instant::now();
        let mut beat = false;
        loop {
            if leave.is_cancelled() {
                return c.set(&key, b"bye").await.is_ok();
            }
            seq += 1;
            if c.set(&key, seq.to_string().as_bytes()).await.is_err() {
                break;
            }
            beat = true;
            tokio::select! {
                () = cancel.cancelled() => return false,
                () = leave.cancelled() => {}
                () = c.closed() => {
                    tracing::info!(key, "the heartbeat's store connection closed; reconnecting at once");
                    break;
                }
                () = tokio::time::sleep(every) => {}
            }
        }
        quick = if opened.elapsed() < every { quick + 1 } else { 0 };
        // A connection that never took a beat (a store that closes at once),
        // or the second in a row to close within a period (a store that
        // refuses the beat: its memory budget is full), is not retried in a
        // tight loop; a healthy connection that closed is replaced at once.
        if !beat || quick >= 2 {
            tokio::select! {
                () = cancel.cancelled() => return false,
                () = tokio::time::sleep(every) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Standing;

    const MEMBER: Standing = Standing::Member;
    const JOINING: Standing = Standing::Joining { round: 4, was_spare: false };
    const JOINING_AFTER_SPARE: Standing = Standing::Joining { round: 4, was_spare: true };
    const SPARE: Standing = Standing::Spare { round: 3, size: 2 };
    const MOVED_ON: Standing = Standing::WasSpare { defer_to: Some(3) };
    const REPLACED: Standing = Standing::WasSpare { defer_to: None };

    /// A round an agent gets into after a spare's wait is a takeover
    /// (counted once: `formed` makes it a member again), and leaving an
    /// unformed round keeps that, but not the round it deferred to.
    #[test]
    fn a_spares_wait_is_remembered_until_it_gets_in() {
        for (standing, was_spare, out) in [
            (MEMBER, false, MEMBER),
            (JOINING, false, MEMBER),
            (JOINING_AFTER_SPARE, true, REPLACED),
            (SPARE, true, REPLACED),
            (MOVED_ON, true, REPLACED),
            (REPLACED, true, REPLACED),
        ] {
            assert_eq!(standing.was_spare(), was_spare, "{standing:?}");
            assert_eq!(standing.out_of_round(), out, "{standing:?}");
        }
    }
}
