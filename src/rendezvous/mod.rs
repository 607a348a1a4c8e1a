//! Rendezvous of trainlet agents over the agents' store: rounds, ranks,
//! heartbeats, and how every round ends.
//!
//! Static (`--nnodes N`) and elastic (`--nnodes MIN:MAX`) jobs run the same
//! protocol; static is MIN = MAX with node ranks taken from each pod's env.
//! A round closes at once when MAX pods joined, or at the end of a last-call
//! window that opens when MIN pods are in. Pods beyond MAX wait as spares;
//! a pod that arrives while a smaller round runs asks it to regroup
//! (torchrun's `num_nodes_waiting`). Liveness is one heartbeat key per agent
//! (O(pods) traffic), judged by the store host's clock ([`host`]).
//!
//! Keys, under `trainlet/<run_id>/j<jobset restart attempt>/` (torch's
//! clients prefix their keys with `/`, so they never collide):
//!
//! | key | written by | meaning |
//! |---|---|---|
//! | `../attempt` | every agent, raised to the max | the newest JobSet restart attempt seen |
//! | `round` | raised to the max | the open (or running) round R |
//! | `restarts` | raised to the max | restarts used, job-wide |
//! | `hb/<uid>` | each agent, every interval | heartbeat counter, `bye` on exit |
//! | `rR/join` | ADD per pod | arrival slots |
//! | `rR/m/<slot>` | each pod | its [`Member`] record |
//! | `rR/quorum` | the pod that made MIN | the last call has started |
//! | `rR/closed` | first COMPARE_SET wins | `N:<slot>`: the first N slots are members, slot assigns ranks |
//! | `rR/rank/<slot>`, `rR/members` | the assigning pod | each slot's [`Assignment`]; members by group rank |
//! | `rR/port` | the store host | the round's fresh worker store |
//! | `rR/end` | first COMPARE_SET wins | `success`, `failure`, `fatal`, `waiting:<uid>`, `abort:<uid>:<sig>`, `dead:<uid>` |
//! | `rR/done`, `rR/stopped`, `rR/all_stopped` | ADD per pod, then the last | workers done / gone everywhere |
//! | `rR/failures/<group rank>` | each pod | JSON list of its failures |
//! | `rR/dead` | the store host | uids that stopped heartbeating |
//! | `rR/verdict` | first COMPARE_SET wins | what every pod does next (`policy::Verdict`) |
//! | `rR/next` | whoever moves the job on | the next round number |
//! | `rR/left`, `rR/all_left` | ADD per pod, then the last | the store host may close the store |
//!
//! Every wait is bounded by the join deadline or the heartbeat timeout,
//! except a spare's wait for room (it waits while the job runs). Rounds
//! never share keys or worker stores. Everything job-wide (`round`,
//! `restarts`, `attempt`) is raised to the maximum any agent knows when it
//! joins, so a store host that restarts with an empty store is rebuilt by
//! the agents that reconnect.

pub mod host;

/// How often a pod waiting for a round to form looks at who joined.
const PROGRESS_POLL: Duration = Duration::from_secs(1);
/// Missing node ranks named in a progress line.
const MISSING_SHOWN: usize = 32;

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::exit;
use crate::progress::Progress;
use crate::store::{Client, ClientError, Endpoint, connect_quietly, connect_with_retry};
use crate::supervise::policy::{JobEnd, Verdict};
use crate::supervise::report::Failure;

/// Errors of the rendezvous.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Could not reach the store before the deadline.
    #[error("rendezvous store not reachable")]
    Unreachable(#[source] ClientError),
    /// The store connection broke.
    #[error("lost the connection to the rendezvous store at {endpoint}")]
    Lost {
        /// The store.
        endpoint: Endpoint,
        /// What failed.
        #[source]
        source: ClientError,
    },
    /// Not enough pods joined before the deadline.
    #[error("timed out after {waited:?} in round {round} at {endpoint}: {detail}")]
    Timeout {
        /// How long we waited.
        waited: Duration,
        /// The round.
        round: u64,
        /// Who or what is missing.
        detail: String,
        /// The store.
        endpoint: Endpoint,
    },
    /// Pods disagree on the job.
    #[error("pods disagree on the job: {0}")]
    Mismatch(String),
    /// Two pods claim the same node rank.
    #[error("node rank {node_rank} is already held by {holder}; each pod needs its own node rank")]
    Duplicate {
        /// The contested rank.
        node_rank: u32,
        /// Who holds it.
        holder: String,
    },
    /// This pod belongs to an older JobSet restart attempt than the job.
    #[error(
        "this pod belongs to JobSet restart attempt {ours}, but the job is at attempt {current}; \
         a pod of a previous attempt must not join (it is being replaced)"
    )]
    Stale {
        /// This pod's attempt.
        ours: u64,
        /// The job's newest attempt.
        current: u64,
    },
}

impl Error {
    /// Its exit code ([`crate::exit`]): a deadline is 201, a disagreement
    /// 200, a lost peer 203, a stale pod 204.
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::Unreachable(_) | Error::Timeout { .. } => exit::RENDEZVOUS_TIMEOUT,
            Error::Mismatch(_) | Error::Duplicate { .. } => exit::CONFIG,
            Error::Lost { .. } => exit::PEER_LOST,
            Error::Stale { .. } => exit::STALE_ATTEMPT,
        }
    }
}

/// What an agent announces about itself when it joins a round.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// Unique per agent incarnation: `host#pid#nonce`.
    pub uid: String,
    /// Host name or --local-addr.
    pub host: String,
    /// Agent pid.
    pub pid: u32,
    /// Node rank from the env: the rank in static jobs, an ordering hint in elastic ones.
    pub node_rank: u32,
    /// Workers per node.
    pub nproc: u32,
    /// MIN of --nnodes.
    pub min_nodes: u32,
    /// MAX of --nnodes.
    pub max_nodes: u32,
    /// Restart budget.
    pub max_restarts: u32,
}

impl Member {
    fn who(&self) -> String {
        format!("node rank {} ({} pid {})", self.node_rank, self.host, self.pid)
    }

    fn elastic(&self) -> bool {
        self.min_nodes != self.max_nodes
    }
}

/// One slot's place in a formed round.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    /// Group (node) rank in this round.
    pub group_rank: u32,
    /// Pods in this round.
    pub nnodes: u32,
    /// Why the round cannot run (pods disagree); every member exits.
    pub error: Option<String>,
}

/// Assign group ranks to the members of a round, given in slot order:
/// static jobs use each pod's node rank; elastic jobs order pods by
/// (node rank hint, host, pid, slot), so ranks are deterministic.
pub fn assign(members: &[Member]) -> Result<Vec<u32>, String> {
    let Some(first) = members.first() else { return Err("no members".into()) };
    let mut diffs = Vec::new();
    for m in members {
        let mut d = Vec::new();
        for (what, theirs, ours) in [
            ("nnodes", format!("{}:{}", m.min_nodes, m.max_nodes), format!("{}:{}", first.min_nodes, first.max_nodes)),
            ("nproc-per-node", m.nproc.to_string(), first.nproc.to_string()),
            ("max-restarts", m.max_restarts.to_string(), first.max_restarts.to_string()),
        ] {
            if theirs != ours {
                d.push(format!("{what} {theirs} vs {ours} on {}", first.who()));
            }
        }
        if !d.is_empty() {
            diffs.push(format!("{}: {}", m.who(), d.join(", ")));
        }
    }
    if !diffs.is_empty() {
        return Err(diffs.join("; "));
    }
    if first.elastic() {
        let mut order: Vec<usize> = (0..members.len()).collect();
        order.sort_by(|&a, &b| {
            let (x, y) = (&members[a], &members[b]);
            (x.node_rank, &x.host, x.pid, a).cmp(&(y.node_rank, &y.host, y.pid, b))
        });
        let mut ranks = vec![0; members.len()];
        for (rank, slot) in order.into_iter().enumerate() {
            ranks[slot] = u32::try_from(rank).unwrap_or(u32::MAX);
        }
        return Ok(ranks);
    }
    let mut seen: std::collections::HashMap<u32, &Member> = std::collections::HashMap::new();
    for m in members {
        if m.node_rank >= m.max_nodes {
            return Err(format!("{} is outside 0..{}", m.who(), m.max_nodes));
        }
        if let Some(other) = seen.insert(m.node_rank, m) {
            return Err(format!("{} and {} claim the same node rank", other.who(), m.who()));
        }
    }
    Ok(members.iter().map(|m| m.node_rank).collect())
}

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
}

enum Try {
    Formed(Round),
    Moved(u64),
    Ended(Verdict),
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
    endpoint: Endpoint,
    addr: SocketAddr,
    client: Client,
    base: String,
    me: Member,
    timing: Timing,
    jobset_attempt: u64,
    run_id: String,
    heartbeat: tokio::task::JoinHandle<()>,
    /// Why the store host said it is leaving, if it did (see [`Session::announce_leaving`]).
    host_left: std::sync::Arc<std::sync::Mutex<Option<String>>>,
    /// The task that watches for that announcement on its own connection.
    host_watch: tokio::task::JoinHandle<()>,
    /// A round we joined that has not formed yet.
    open: Option<u64>,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.heartbeat.abort();
        self.host_watch.abort();
    }
}

fn parse_u64(v: &[u8]) -> Option<u64> {
    std::str::from_utf8(v).ok()?.trim().parse().ok()
}

/// A process-unique suffix for agent uids.
fn nonce() -> String {
    format!("{:08x}", crate::sys::random_u64() & 0xffff_ffff)
}

impl Session {
    /// Connect (retrying until `deadline`), check the JobSet attempt and
    /// start heartbeating. `me.uid` is filled in here.
    pub async fn connect(
        endpoint: &Endpoint,
        run_id: &str,
        jobset_attempt: u64,
        mut me: Member,
        timing: Timing,
        deadline: Instant,
        cancel: &CancellationToken,
    ) -> Result<Self, Error> {
        me.uid = format!("{}#{}#{}", me.host, me.pid, nonce());
        let client = connect_with_retry(endpoint, deadline, cancel).await.map_err(Error::Unreachable)?;
        let addr = client.peer_addr().map_err(|e| Error::Unreachable(ClientError::Io(e)))?;
        let base = format!("trainlet/{run_id}/j{jobset_attempt}");
        let heartbeat = tokio::spawn(heartbeat(
            endpoint.clone(),
            format!("{base}/hb/{}", me.uid),
            timing.heartbeat,
            cancel.clone(),
        ));
        let mut s = Self {
            endpoint: endpoint.clone(),
            addr,
            client,
            base,
            me,
            timing,
            jobset_attempt,
            run_id: run_id.to_string(),
            heartbeat,
            open: None,
            host_left: std::sync::Arc::default(),
            host_watch: tokio::spawn(async {}),
        };
        s.watch_host();
        s.check_attempt().await?;
        Ok(s)
    }

    /// Reconnect after losing the store (its host restarted), until `deadline`.
    pub async fn reconnect(&mut self, deadline: Instant, cancel: &CancellationToken) -> Result<(), Error> {
        self.client = connect_with_retry(&self.endpoint, deadline, cancel).await.map_err(Error::Unreachable)?;
        self.addr = self.client.peer_addr().map_err(|e| Error::Unreachable(ClientError::Io(e)))?;
        self.watch_host();
        self.check_attempt().await
    }

    /// (Re)start watching for the store host's announcement that it leaves.
    fn watch_host(&mut self) {
        self.host_watch.abort();
        if let Ok(mut g) = self.host_left.lock() {
            *g = None;
        }
        let (addr, key, slot) = (self.addr, self.key("host_left"), self.host_left.clone());
        self.host_watch = tokio::spawn(async move {
            if let Ok(v) = wait_get(addr, &key).await
                && let Ok(mut g) = slot.lock()
            {
                *g = Some(String::from_utf8_lossy(&v).chars().take(200).collect());
            }
        });
    }

    /// The store host is leaving cleanly (it was told to stop): say so, so
    /// that the pods that lose its store next log why instead of an error.
    pub async fn announce_leaving(&mut self, why: &str) {
        let key = self.key("host_left");
        let _ = tokio::time::timeout(Duration::from_secs(1), self.client.set(&key, why.as_bytes())).await;
    }

    /// Why the store host left, when it announced it.
    pub fn host_left(&self) -> Option<String> {
        self.host_left.lock().ok().and_then(|g| g.clone())
    }

    async fn check_attempt(&mut self) -> Result<(), Error> {
        let key = format!("trainlet/{}/attempt", self.run_id);
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
            let closed = self.rkey(r, "closed");
            let withdraw = async {
                if self.client.check(&[closed]).await.ok() == Some(false) {
                    tracing::info!(round = r, "leaving a round that has not formed; the others meet again");
                    let _ = self.advance(r, r + 1).await;
                }
            };
            let _ = tokio::time::timeout(Duration::from_secs(2), withdraw).await;
        }
    }

    /// Our record.
    pub fn me(&self) -> &Member {
        &self.me
    }

    /// The store's address as resolved.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn lost(&self, source: ClientError) -> Error {
        Error::Lost { endpoint: self.endpoint.clone(), source }
    }

    fn key(&self, rest: &str) -> String {
        format!("{}/{rest}", self.base)
    }

    fn rkey(&self, round: u64, rest: &str) -> String {
        format!("{}/r{round}/{rest}", self.base)
    }

    /// Raise a decimal key to at least `to`; returns the value it holds.
    async fn raise(&mut self, key: &str, to: u64) -> Result<u64, Error> {
        raise(&mut self.client, key, to).await.map_err(|e| self.lost(e))
    }

    /// Move the job from round `from` to round `to` (first mover wins).
    async fn advance(&mut self, from: u64, to: u64) -> Result<(), Error> {
        let now = self.raise(&self.key("round"), to).await?;
        let next = self.rkey(from, "next");
        self.client.compare_set(&next, b"", now.to_string().as_bytes()).await.map_err(|e| self.lost(e))?;
        Ok(())
    }

    /// WAIT for `keys` on a second connection, so that running out of
    /// `limit` leaves this one usable; Ok(false) on timeout.
    async fn wait_for(&self, keys: &[String], limit: Duration) -> Result<bool, Error> {
        wait_on(self.addr, keys, limit).await.map_err(|e| self.lost(e))
    }

    async fn get(&mut self, key: &str) -> Result<Vec<u8>, Error> {
        self.client.get(key).await.map_err(|e| self.lost(e))
    }

    /// Join the next round (after `known.round`) and wait until it forms.
    pub async fn next_round(&mut self, known: &mut Known, deadline: Instant) -> Result<Joined, Error> {
        known.restarts =
            u32::try_from(self.raise(&self.key("restarts"), u64::from(known.restarts)).await?).unwrap_or(u32::MAX);
        let mut want = known.round.map_or(0, |r| r + 1);
        let started = Instant::now();
        loop {
            let current = self.raise(&self.key("round"), 0).await?;
            if current < want {
                self.advance(current, want).await?;
                continue;
            }
            match self.try_round(current, deadline, started).await? {
                Try::Formed(mut round) => {
                    known.round = Some(round.number);
                    round.restarts = known.restarts;
                    return Ok(Joined::Round(round));
                }
                Try::Moved(to) => want = to.max(current + 1),
                Try::Ended(v) => return Ok(Joined::JobEnded(v)),
            }
        }
    }

    async fn try_round(&mut self, r: u64, deadline: Instant, started: Instant) -> Result<Try, Error> {
        let (min, max) = (u64::from(self.me.min_nodes), u64::from(self.me.max_nodes));
        let n = self.client.add(&self.rkey(r, "join"), 1).await.map_err(|e| self.lost(e))?;
        self.open = Some(r);
        let slot = u64::try_from(n - 1).unwrap_or(0);
        let record = serde_json::to_vec(&self.me).unwrap_or_default();
        self.client.set(&self.rkey(r, &format!("m/{slot}")), &record).await.map_err(|e| self.lost(e))?;
        let closed = self.rkey(r, "closed");
        let n = u64::try_from(n).unwrap_or(0);
        if n == max {
            self.client
                .compare_set(&closed, b"", format!("{max}:{slot}").as_bytes())
                .await
                .map_err(|e| self.lost(e))?;
        } else if n == min && min < max {
            self.client.set(&self.rkey(r, "quorum"), b"1").await.map_err(|e| self.lost(e))?;
        }
        tracing::debug!(round = r, slot, "joined round");

        // Wait for the round to close, our last call to end, or the job to
        // move on, saying every so often who is still missing.
        let next = self.rkey(r, "next");
        let quorum = self.rkey(r, "quorum");
        let limit = deadline.saturating_duration_since(Instant::now());
        let elastic = min < max;
        let closed_w = wait_on(self.addr, std::slice::from_ref(&closed), limit);
        let next_w = wait_on(self.addr, std::slice::from_ref(&next), limit);
        let quorum_w = wait_on(self.addr, std::slice::from_ref(&quorum), limit);
        tokio::pin!(closed_w, next_w, quorum_w);
        let mut quorum_seen = !elastic;
        let mut last_call: Option<Instant> = None;
        let mut progress = Progress::new(format!("pods to join round {r} at {}", self.endpoint), Some(deadline));
        let mut seen: Vec<Option<Member>> = Vec::new();
        let mut tick = progress_tick();
        loop {
            tokio::select! {
                ok = &mut closed_w => {
                    if ok.map_err(|e| self.lost(e))? { break }
                    return Err(self.timeout(r, started).await);
                }
                ok = &mut next_w => {
                    if ok.map_err(|e| self.lost(e))? {
                        let to = parse_u64(&self.get(&next).await?).unwrap_or(r + 1);
                        tracing::info!(round = r, next = to, "the job moved on before this round formed; following");
                        return Ok(Try::Moved(to));
                    }
                    return Err(self.timeout(r, started).await);
                }
                ok = &mut quorum_w, if !quorum_seen => {
                    quorum_seen = true;
                    if !ok.map_err(|e| self.lost(e))? {
                        return Err(self.timeout(r, started).await);
                    }
                    tracing::info!(round = r, min, last_call_s = self.timing.last_call.as_secs_f64(), "enough pods for a round; last call");
                    last_call = Some(Instant::now() + self.timing.last_call);
                }
                () = sleep_until_opt(last_call) => {
                    let count = u64::try_from(self.client.add(&self.rkey(r, "join"), 0).await.map_err(|e| self.lost(e))?).unwrap_or(0);
                    let v = format!("{}:{slot}", count.min(max));
                    self.client.compare_set(&closed, b"", v.as_bytes()).await.map_err(|e| self.lost(e))?;
                    break;
                }
                _ = tick.tick() => {
                    let state = self.join_state(r, &mut seen, last_call).await?;
                    progress.report(&state);
                }
            }
        }
        self.open = None;
        let v = self.get(&closed).await?;
        let v = String::from_utf8_lossy(&v).to_string();
        let (size, closer) = v
            .split_once(':')
            .and_then(|(a, b)| Some((a.parse::<u64>().ok()?, b.parse::<u64>().ok()?)))
            .unwrap_or((0, u64::MAX));
        if slot >= size {
            return self.spare(r, size).await;
        }
        if closer == slot {
            self.assign_round(r, size).await?;
        }
        let rank_key = self.rkey(r, &format!("rank/{slot}"));
        let bound = self.timing.heartbeat_timeout + Duration::from_secs(2);
        let assigned = tokio::select! {
            ok = self.wait_for(std::slice::from_ref(&rank_key), bound) => ok?,
            ok = self.wait_for(std::slice::from_ref(&next), bound) => {
                if ok? {
                    return Ok(Try::Moved(parse_u64(&self.get(&next).await?).unwrap_or(r + 1)));
                }
                false
            }
        };
        if !assigned {
            tracing::warn!(round = r, "the pod that closed the round never assigned ranks; starting a new round");
            self.advance(r, r + 1).await?;
            return Ok(Try::Moved(r + 1));
        }
        let a: Assignment = serde_json::from_slice(&self.get(&rank_key).await?)
            .map_err(|_| Error::Mismatch(format!("unreadable rank assignment in round {r}")))?;
        if let Some(e) = a.error {
            return Err(Error::Mismatch(e));
        }
        let port_key = self.rkey(r, "port");
        let limit = deadline.saturating_duration_since(Instant::now()).max(bound);
        if !self.wait_for(std::slice::from_ref(&port_key), limit).await? {
            return Err(Error::Timeout {
                waited: started.elapsed(),
                round: r,
                detail: "the store host published no worker store".into(),
                endpoint: self.endpoint.clone(),
            });
        }
        let port = std::str::from_utf8(&self.get(&port_key).await?)
            .ok()
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| Error::Mismatch("the store host published an unreadable worker port".into()))?;
        Ok(Try::Formed(Round {
            number: r,
            slot: u32::try_from(slot).unwrap_or(u32::MAX),
            group_rank: a.group_rank,
            nnodes: a.nnodes,
            worker_port: port,
            restarts: 0,
        }))
    }

    /// Who has joined round `r` so far, for the wait's progress line.
    /// Member records already read stay in `seen` (a slot is written once),
    /// so each record is read once per round; slots past MAX are spares
    /// and are only counted.
    async fn join_state(
        &mut self,
        r: u64,
        seen: &mut Vec<Option<Member>>,
        last_call: Option<Instant>,
    ) -> Result<String, Error> {
        let count = self.client.add(&self.rkey(r, "join"), 0).await.map_err(|e| self.lost(e))?;
        let count = usize::try_from(count).unwrap_or(0);
        let slots = count.min(self.me.max_nodes as usize);
        if seen.len() < slots {
            seen.resize(slots, None);
        }
        let unread: Vec<usize> = (0..seen.len()).filter(|&s| seen[s].is_none()).collect();
        if !unread.is_empty() {
            let keys: Vec<String> = unread.iter().map(|s| self.rkey(r, &format!("m/{s}"))).collect();
            let values = self.client.multi_get(&keys).await.map_err(|e| self.lost(e))?;
            for (&s, v) in unread.iter().zip(values) {
                seen[s] = serde_json::from_slice(&v).ok();
            }
        }
        let present: Vec<&Member> = seen.iter().flatten().collect();
        Ok(describe_join(&self.me, &present, count, last_call.map(|t| t.saturating_duration_since(Instant::now()))))
    }

    /// We closed the round: read every member, assign ranks, publish.
    async fn assign_round(&mut self, r: u64, size: u64) -> Result<(), Error> {
        let keys: Vec<String> = (0..size).map(|s| self.rkey(r, &format!("m/{s}"))).collect();
        let bound = self.timing.heartbeat_timeout;
        if !self.wait_for(&keys, bound).await? {
            tracing::warn!(round = r, "a pod took a slot but never announced itself; starting a new round");
            self.advance(r, r + 1).await?;
            return Ok(());
        }
        let values = self.client.multi_get(&keys).await.map_err(|e| self.lost(e))?;
        let members: Vec<Member> = values.iter().filter_map(|v| serde_json::from_slice(v).ok()).collect();
        if let Some(m) = members
            .iter()
            .enumerate()
            .find_map(|(i, a)| members[..i].iter().find(|b| b.host == a.host && b.node_rank == a.node_rank).map(|_| a))
        {
            // A pod left (or died) while the round was open and came back:
            // its old slot is stale. The live pods meet again in a new round.
            tracing::warn!(round = r, host = %m.host, node_rank = m.node_rank, "a pod joined this round twice (it restarted while the round was open); starting a new round");
            self.advance(r, r + 1).await?;
            return Ok(());
        }
        let nnodes = u32::try_from(members.len()).unwrap_or(u32::MAX);
        let (ranks, error) = match (members.len() == values.len()).then(|| assign(&members)) {
            Some(Ok(ranks)) => (ranks, None),
            Some(Err(e)) => (vec![0; members.len()], Some(e)),
            None => (vec![0; values.len()], Some("a pod announced unreadable data".to_string())),
        };
        let mut pairs: Vec<(String, Vec<u8>)> = ranks
            .iter()
            .enumerate()
            .map(|(slot, &group_rank)| {
                let a = Assignment { group_rank, nnodes, error: error.clone() };
                (self.rkey(r, &format!("rank/{slot}")), serde_json::to_vec(&a).unwrap_or_default())
            })
            .collect();
        let mut by_rank: Vec<(u32, &Member)> = ranks.iter().copied().zip(members.iter()).collect();
        by_rank.sort_by_key(|(rank, _)| *rank);
        let ordered: Vec<&Member> = by_rank.into_iter().map(|(_, m)| m).collect();
        pairs.push((self.rkey(r, "members"), serde_json::to_vec(&ordered).unwrap_or_default()));
        self.client.multi_set(&pairs).await.map_err(|e| self.lost(e))?;
        if error.is_none() {
            let hosts: Vec<&str> = ordered.iter().map(|m| m.host.as_str()).collect();
            tracing::debug!(round = r, nnodes, members = ?hosts, "assigned the round's ranks");
        }
        Ok(())
    }

    /// The round is full or running without us.
    async fn spare(&mut self, r: u64, size: u64) -> Result<Try, Error> {
        let members_key = self.rkey(r, "members");
        let bound = self.timing.heartbeat_timeout + Duration::from_secs(2);
        let members: Vec<Member> = if self.wait_for(std::slice::from_ref(&members_key), bound).await? {
            serde_json::from_slice(&self.get(&members_key).await?).unwrap_or_default()
        } else {
            Vec::new()
        };
        let end = self.rkey(r, "end");
        if let Some(old) = members.iter().find(|m| m.host == self.me.host && m.node_rank == self.me.node_rank) {
            // The same pod (host and node rank) restarted in place: the
            // member we replace is our previous incarnation, and it is dead.
            tracing::warn!(round = r, previous = %old.uid, "this pod restarted while its previous incarnation was a member; declaring it gone");
            let dead = serde_json::to_vec(&[&old.uid]).unwrap_or_default();
            self.client.compare_set(&self.rkey(r, "dead"), b"", &dead).await.map_err(|e| self.lost(e))?;
            self.client
                .compare_set(&end, b"", format!("dead:{}", old.uid).as_bytes())
                .await
                .map_err(|e| self.lost(e))?;
        } else if let Some(holder) = members.iter().find(|m| !self.me.elastic() && m.node_rank == self.me.node_rank) {
            return Err(Error::Duplicate { node_rank: self.me.node_rank, holder: holder.who() });
        } else if size < u64::from(self.me.max_nodes) {
            tracing::info!(
                round = r,
                running = size,
                "a smaller round is running; asking it to regroup and admit this pod"
            );
            let v = format!("waiting:{}", self.me.uid);
            self.client.compare_set(&end, b"", v.as_bytes()).await.map_err(|e| self.lost(e))?;
        } else {
            tracing::info!(round = r, running = size, "the round is full; waiting as a spare");
        }
        // Wait until the job moves on, or ends without us.
        let next = self.rkey(r, "next");
        let verdict = self.rkey(r, "verdict");
        let day = Duration::from_secs(86_400);
        let next_w = wait_on(self.addr, std::slice::from_ref(&next), day);
        let verdict_w = wait_on(self.addr, std::slice::from_ref(&verdict), day);
        tokio::pin!(next_w, verdict_w);
        let mut progress = Progress::new(format!("room in the job at {} (a spare)", self.endpoint), None);
        let mut tick = progress_tick();
        loop {
            tokio::select! {
                ok = &mut next_w => {
                    if ok.map_err(|e| self.lost(e))? {
                        return Ok(Try::Moved(parse_u64(&self.get(&next).await?).unwrap_or(r + 1)));
                    }
                    next_w.set(wait_on(self.addr, std::slice::from_ref(&next), day));
                }
                ok = &mut verdict_w => {
                    if !ok.map_err(|e| self.lost(e))? {
                        verdict_w.set(wait_on(self.addr, std::slice::from_ref(&verdict), day));
                        continue;
                    }
                    let v = String::from_utf8_lossy(&self.get(&verdict).await?).parse::<Verdict>();
                    match v {
                        Ok(v @ (Verdict::Success | Verdict::Fail(_))) => return Ok(Try::Ended(v)),
                        // Members move the job on right after a regroup or restart verdict.
                        _ => {
                            let bound = self.timing.heartbeat_timeout * 2;
                            if self.wait_for(std::slice::from_ref(&next), bound).await? {
                                return Ok(Try::Moved(parse_u64(&self.get(&next).await?).unwrap_or(r + 1)));
                            }
                            self.advance(r, r + 1).await?;
                            return Ok(Try::Moved(r + 1));
                        }
                    }
                }
                _ = tick.tick() => {
                    progress.report(&format!("round {r} runs with {size} of at most {} pods", self.me.max_nodes));
                }
            }
        }
    }

    async fn timeout(&mut self, r: u64, started: Instant) -> Error {
        let count = self.client.add(&self.rkey(r, "join"), 0).await.unwrap_or(0);
        let keys: Vec<String> = (0..count).map(|s| self.rkey(r, &format!("m/{s}"))).collect();
        let present: Vec<Member> = self
            .client
            .multi_get(&keys)
            .await
            .unwrap_or_default()
            .iter()
            .filter_map(|v| serde_json::from_slice(v).ok())
            .collect();
        let detail = if self.me.elastic() {
            format!("{} of at least {} pods joined", present.len(), self.me.min_nodes)
        } else {
            let missing: Vec<u32> =
                (0..self.me.max_nodes).filter(|n| !present.iter().any(|m| m.node_rank == *n)).collect();
            format!("node ranks {missing:?} did not join")
        };
        Error::Timeout { waited: started.elapsed(), round: r, detail, endpoint: self.endpoint.clone() }
    }

    async fn end(&mut self, r: u64, value: &str) -> Result<(), Error> {
        let key = self.rkey(r, "end");
        self.client.compare_set(&key, b"", value.as_bytes()).await.map_err(|e| self.lost(e))?;
        Ok(())
    }

    /// A worker failed here: end the round as failed (first writer wins).
    pub async fn publish_failure(&mut self, r: u64, fatal: bool) -> Result<(), Error> {
        self.end(r, if fatal { "fatal" } else { "failure" }).await
    }

    /// This agent is leaving because of `signal`.
    pub async fn publish_abort(&mut self, r: u64, signal: i32) -> Result<(), Error> {
        let v = format!("abort:{}:{signal}", self.me.uid);
        self.end(r, &v).await
    }

    /// Every worker here is done; the last pod to say so ends the round.
    pub async fn publish_local_done(&mut self, round: &Round) -> Result<(), Error> {
        let n = self.client.add(&self.rkey(round.number, "done"), 1).await.map_err(|e| self.lost(e))?;
        if n >= i64::from(round.nnodes) {
            self.end(round.number, "success").await?;
        }
        Ok(())
    }

    /// A future that resolves when the round's end is published, on its
    /// own connection. A broken connection reads as [`JobEnd::Lost`].
    pub fn watch_end(&self, r: u64) -> impl std::future::Future<Output = (JobEnd, String)> + Send + 'static {
        let addr = self.addr;
        let key = self.rkey(r, "end");
        async move {
            match wait_get(addr, &key).await {
                Ok(v) => {
                    let v = String::from_utf8_lossy(&v).to_string();
                    (parse_end(&v), v)
                }
                Err(_) => (JobEnd::Lost, String::new()),
            }
        }
    }

    /// Record our failures and that our workers are gone; the last pod
    /// marks the round fully stopped.
    pub async fn report_stopped(&mut self, round: &Round, failures: &[Failure]) -> Result<(), Error> {
        let key = self.rkey(round.number, &format!("failures/{}", round.group_rank));
        let v = serde_json::to_vec(failures).unwrap_or_default();
        self.client.set(&key, &v).await.map_err(|e| self.lost(e))?;
        let n = self.client.add(&self.rkey(round.number, "stopped"), 1).await.map_err(|e| self.lost(e))?;
        if n >= i64::from(round.nnodes) {
            let k = self.rkey(round.number, "all_stopped");
            self.client.set(&k, b"1").await.map_err(|e| self.lost(e))?;
        }
        Ok(())
    }

    /// Wait up to `limit` until every member reported stopped or the store
    /// host declared one dead, saying which group ranks are still running.
    pub async fn wait_stopped(&mut self, round: &Round, limit: Duration) -> Result<Stopped, Error> {
        let r = round.number;
        let all = self.rkey(r, "all_stopped");
        let dead = self.rkey(r, "dead");
        let all_w = wait_on(self.addr, std::slice::from_ref(&all), limit);
        let dead_w = wait_on(self.addr, std::slice::from_ref(&dead), limit);
        tokio::pin!(all_w, dead_w);
        let what = format!("the other pods of round {r} to stop their workers");
        let mut progress = Progress::new(what, Some(Instant::now() + limit));
        let mut tick = progress_tick();
        let keys: Vec<String> = (0..round.nnodes).map(|n| self.rkey(r, &format!("failures/{n}"))).collect();
        loop {
            tokio::select! {
                ok = &mut all_w => { ok.map_err(|e| self.lost(e))?; break; }
                ok = &mut dead_w => { ok.map_err(|e| self.lost(e))?; break; }
                _ = tick.tick() => {
                    let reported = self.client.multi_get(&keys).await.map_err(|e| self.lost(e))?;
                    let running: Vec<String> = reported
                        .iter()
                        .enumerate()
                        .filter(|(_, v)| v.is_empty())
                        .map(|(n, _)| n.to_string())
                        .take(MISSING_SHOWN)
                        .collect();
                    progress.report(&format!("group ranks [{}] have not reported", running.join(", ")));
                }
            }
        }
        let present = self.client.multi_get(&[all.clone(), dead.clone()]).await.map_err(|e| self.lost(e))?;
        Ok(Stopped { all_stopped: !present[0].is_empty(), dead: !present[1].is_empty() })
    }

    /// The round's published end as written (empty when none).
    pub async fn end_text(&mut self, r: u64) -> Result<String, Error> {
        Ok(String::from_utf8_lossy(&self.get(&self.rkey(r, "end")).await?).to_string())
    }

    /// Every member's failures in round `round` (members that did not report count as none).
    pub async fn failures(&mut self, round: &Round) -> Result<Vec<Failure>, Error> {
        let keys: Vec<String> = (0..round.nnodes).map(|n| self.rkey(round.number, &format!("failures/{n}"))).collect();
        let values = self.client.multi_get(&keys).await.map_err(|e| self.lost(e))?;
        Ok(values.iter().flat_map(|v| serde_json::from_slice::<Vec<Failure>>(v).unwrap_or_default()).collect())
    }

    /// Propose `v` as the round's verdict; returns the one every pod follows.
    /// A restart raises the job-wide counter.
    pub async fn decide(&mut self, r: u64, v: Verdict) -> Result<Verdict, Error> {
        let key = self.rkey(r, "verdict");
        let got = self.client.compare_set(&key, b"", v.to_string().as_bytes()).await.map_err(|e| self.lost(e))?;
        let agreed = String::from_utf8_lossy(&got).parse::<Verdict>().unwrap_or(v);
        if let Verdict::Restart(n) = agreed {
            self.raise(&self.key("restarts"), u64::from(n)).await?;
        }
        Ok(agreed)
    }

    /// Move the job past round `r` (after a regroup or restart verdict).
    pub async fn finish_round(&mut self, r: u64) -> Result<(), Error> {
        self.advance(r, r + 1).await
    }

    /// Say we are done reading this round's results. The store host then
    /// waits (up to `limit`) for every pod to say so before its store goes
    /// away, so nobody loses the store in the middle of reading the outcome.
    pub async fn leave(&mut self, round: &Round, host: bool, limit: Duration) -> Result<(), Error> {
        let n = self.client.add(&self.rkey(round.number, "left"), 1).await.map_err(|e| self.lost(e))?;
        let all = self.rkey(round.number, "all_left");
        if n >= i64::from(round.nnodes) {
            self.client.set(&all, b"1").await.map_err(|e| self.lost(e))?;
        }
        if host && !self.wait_for(&[all], limit).await? {
            tracing::warn!(
                round = round.number,
                "not every pod confirmed the end of the job; closing the store anyway"
            );
        }
        Ok(())
    }

    /// Stop heartbeating and tell the store host this agent left cleanly.
    pub async fn bye(&mut self) {
        self.heartbeat.abort();
        let key = self.key(&format!("hb/{}", self.me.uid));
        let _ = tokio::time::timeout(Duration::from_secs(2), self.client.set(&key, b"bye")).await;
    }
}

/// The progress line of a round that has not formed: how many pods are
/// in and, for static jobs, which node ranks are missing (the first
/// [`MISSING_SHOWN`] of them).
fn describe_join(me: &Member, present: &[&Member], joined: usize, last_call: Option<Duration>) -> String {
    if me.elastic() {
        let mut s = format!("{joined} joined, {} to {} wanted", me.min_nodes, me.max_nodes);
        if let Some(left) = last_call {
            s.push_str(&format!("; the last call ends in {}s", left.as_secs()));
        }
        return s;
    }
    let missing: Vec<u32> = (0..me.max_nodes).filter(|n| !present.iter().any(|m| m.node_rank == *n)).collect();
    let shown: Vec<String> = missing.iter().take(MISSING_SHOWN).map(u32::to_string).collect();
    let more = missing.len().saturating_sub(MISSING_SHOWN);
    let tail = if more > 0 { format!(" and {more} more") } else { String::new() };
    format!("{joined} of {} joined; missing node ranks [{}]{tail}", me.max_nodes, shown.join(", "))
}

/// How a published end reads to the supervisor.
pub fn parse_end(v: &str) -> JobEnd {
    match v {
        "success" => JobEnd::Success,
        "failure" | "fatal" => JobEnd::Failure,
        v if v.starts_with("dead:") => JobEnd::Regroup { planned: false },
        _ => JobEnd::Regroup { planned: true },
    }
}

/// WAIT for `key` on a fresh connection to `addr`, then read it.
async fn wait_get(addr: SocketAddr, key: &String) -> Result<Vec<u8>, ClientError> {
    let mut c = Client::connect(addr).await?;
    c.wait(std::slice::from_ref(key)).await?;
    c.get(key).await
}

/// The once-a-second poll of a wait's progress line ([`PROGRESS_POLL`]),
/// first after one period: waits that end at once poll nothing.
fn progress_tick() -> tokio::time::Interval {
    let mut tick = tokio::time::interval_at(Instant::now() + PROGRESS_POLL, PROGRESS_POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick
}

/// WAIT for `keys` on a fresh connection to `addr`; Ok(false) after `limit`.
pub(crate) async fn wait_on(addr: SocketAddr, keys: &[String], limit: Duration) -> Result<bool, ClientError> {
    let mut waiter = Client::connect(addr).await?;
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

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

/// Set `key` to a rising counter every `every`, reconnecting as needed.
async fn heartbeat(endpoint: Endpoint, key: String, every: Duration, cancel: CancellationToken) {
    let mut seq = 0u64;
    loop {
        let far = Instant::now() + Duration::from_secs(86_400);
        let Ok(mut c) = connect_quietly(&endpoint, far, &cancel).await else { return };
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

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    fn m(node_rank: u32, host: &str, nproc: u32, nnodes: (u32, u32)) -> Member {
        Member {
            uid: format!("{host}#1#0"),
            host: host.into(),
            pid: 7,
            node_rank,
            nproc,
            min_nodes: nnodes.0,
            max_nodes: nnodes.1,
            max_restarts: 0,
        }
    }

    #[test]
    fn static_ranks_are_the_node_ranks() {
        let ms = [m(1, "b", 2, (2, 2)), m(0, "a", 2, (2, 2))];
        assert_eq!(assign(&ms), Ok(vec![1, 0]));
    }

    #[test]
    fn elastic_ranks_follow_the_hint_then_the_host() {
        let ms = [m(5, "c", 1, (1, 4)), m(0, "z", 1, (1, 4)), m(5, "a", 1, (1, 4))];
        assert_eq!(assign(&ms), Ok(vec![2, 0, 1]));
    }

    #[test_case(&[m(0, "a", 2, (2, 2)), m(1, "b", 4, (2, 2))], "nproc-per-node 4 vs 2"; "nproc")]
    #[test_case(&[m(0, "a", 1, (2, 2)), m(1, "b", 1, (1, 2))], "nnodes 1:2 vs 2:2"; "nnodes")]
    #[test_case(&[m(1, "a", 1, (2, 2)), m(1, "b", 1, (2, 2))], "claim the same node rank"; "duplicate")]
    #[test_case(&[m(0, "a", 1, (2, 2)), m(2, "b", 1, (2, 2))], "outside 0..2"; "out of range")]
    fn disagreements_are_named(ms: &[Member], needle: &str) {
        let e = assign(ms).expect_err("mismatch");
        assert!(e.contains(needle), "{e}");
    }

    #[test_case("success", JobEnd::Success; "success")]
    #[test_case("failure", JobEnd::Failure; "failure")]
    #[test_case("fatal", JobEnd::Failure; "fatal")]
    #[test_case("dead:h#1#2", JobEnd::Regroup { planned: false }; "dead")]
    #[test_case("waiting:h#1#2", JobEnd::Regroup { planned: true }; "waiting")]
    #[test_case("abort:h#1#2:15", JobEnd::Regroup { planned: true }; "abort")]
    fn ends(v: &str, want: JobEnd) {
        assert_eq!(parse_end(v), want);
    }
}
