//! Joining a round: take a slot, wait for MIN/MAX pods and the last call,
//! close the round (first writer wins), assign ranks, or wait as a spare;
//! every wait says what it waits for.

use std::time::Duration;

use tokio::time::Instant;

use super::Error;
use super::member::{Assignment, Member, assign};
use crate::supervise::policy::Verdict;
use crate::supervise::round_end::RoundEnd;
use crate::waiting::Waiting;
use round::join::{
    ABANDONED, Arrival, OnSlot, Place, arrival, at_last_call, closer_forms, first_repeat, forgotten, given_up, on_slot,
    place, spare_gives_up,
};
use round::spare::{Heard, Step, VerdictRead, watches_left};

use super::session::{Joined, Known, Round, Session, Standing, Try, parse_u64, progress_tick, wait_on};

/// Missing node ranks named in a waiting line.
pub(super) const MISSING_SHOWN: usize = 32;

/// How often a spare checks its health while it waits.
const SPARE_CHECK_EVERY: Duration = Duration::from_secs(60);

impl Session {
    /// Join the next round (after `known.round`) and wait until it forms.
    pub async fn next_round(&mut self, known: &mut Known, deadline: Instant) -> Result<Joined, Error> {
        // Still ours (a store host that restarted lost it; an agent taken
        // for gone by a newcomer finds the newcomer holding it).
        self.claim().await?;
        known.restarts =
            u32::try_from(self.raise(&self.keys.restarts(), u64::from(known.restarts)).await?).unwrap_or(u32::MAX);
        let mut want = known.round.map_or(0, |r| r + 1);
        let started = Instant::now();
        loop {
            let current = self.raise(&self.keys.round(), 0).await?;
            if current < want {
                self.advance(current, want).await?;
                continue;
            }
            let tried = match self.standing {
                Standing::Spare { round, size } if round == current => self.wait_as_spare(round, size).await?,
                _ => self.try_round(current, deadline, started).await?,
            };
            match tried {
                Try::Formed(mut round) => {
                    known.round = Some(round.number);
                    round.restarts = known.restarts;
                    self.formed(&round).await?;
                    return Ok(Joined::Round(round));
                }
                Try::Moved(to) => want = to.max(current + 1),
                Try::Ended(v) => return Ok(Joined::JobEnded(v)),
                Try::Recheck => return Ok(Joined::Spare),
            }
        }
    }

    /// We are a member of `round`: a job with spares keeps our rank for
    /// the next, and a spare that got in says it took over.
    /// The job counts takeovers (`takeovers`) for the TrainJob's status.
    async fn formed(&mut self, round: &Round) -> Result<(), Error> {
        let took_over = self.standing.was_spare();
        self.standing = Standing::Member;
        if self.me.spares > 0 {
            self.me.last_rank = Some((round.group_rank, round.number));
        }
        let metrics = crate::metrics::global();
        metrics.spare.set(0);
        if took_over && round.number > 0 {
            metrics.takeovers.inc();
            self.store.client.add(&self.keys.takeovers(), 1).await.map_err(|e| self.lost(e))?;
            tracing::info!(
                round = round.number,
                group_rank = round.group_rank,
                nnodes = round.nnodes,
                "this spare takes over group rank {} in round {}",
                round.group_rank,
                round.number
            );
        }
        Ok(())
    }

    async fn try_round(&mut self, r: u64, deadline: Instant, started: Instant) -> Result<Try, Error> {
        let (min, max) = (u64::from(self.me.min_nodes), u64::from(self.me.max_nodes));
        if let Some(moved) = self.join_order(r, deadline, started).await? {
            return Ok(moved);
        }
        let n = self.store.client.add(&self.keys.round_keys(r).join(), 1).await.map_err(|e| self.lost(e))?;
        let current = self.raise(&self.keys.round(), r).await?;
        if let Some(to) = forgotten(r, current) {
            tracing::info!(round = r, current, "the job moved two rounds on before this pod took its slot; following");
            return Ok(Try::Moved(to));
        }
        if self.roles.leads {
            let spares = self.me.spares.to_string();
            self.store
                .client
                .set(&self.keys.round_keys(r).lead(), spares.as_bytes())
                .await
                .map_err(|e| self.lost(e))?;
        }
        self.standing = Standing::Joining { round: r, was_spare: self.standing.was_spare() };
        let slot = u64::try_from(n - 1).unwrap_or(0);
        let record = serde_json::to_vec(&self.me).unwrap_or_default();
        self.store.client.set(&self.keys.round_keys(r).member(slot), &record).await.map_err(|e| self.lost(e))?;
        let closed = self.keys.round_keys(r).closed();
        match on_slot(u64::try_from(n).unwrap_or(0), min, max) {
            OnSlot::Close(c) => {
                self.store.client.compare_set(&closed, b"", c.value().as_bytes()).await.map_err(|e| self.lost(e))?;
            }
            OnSlot::LastCall => {
                self.store.client.set(&self.keys.round_keys(r).quorum(), b"1").await.map_err(|e| self.lost(e))?;
            }
            OnSlot::Wait => {}
        }
        tracing::debug!(round = r, slot, "joined round");

        // Wait for the round to close, our last call to end, or the job to
        // move on, saying every so often who is still missing.
        let next = self.keys.round_keys(r).next();
        let quorum = self.keys.round_keys(r).quorum();
        let limit = deadline.saturating_duration_since(Instant::now());
        let elastic = min < max;
        let closed_w = wait_on(self.store.dial.clone(), std::slice::from_ref(&closed), limit);
        let next_w = wait_on(self.store.dial.clone(), std::slice::from_ref(&next), limit);
        let quorum_w = wait_on(self.store.dial.clone(), std::slice::from_ref(&quorum), limit);
        tokio::pin!(closed_w, next_w, quorum_w);
        let mut quorum_seen = !elastic;
        let mut last_call: Option<Instant> = None;
        let mut waiting = Waiting::new(format!("pods to join round {r} at {}", self.store.endpoint), Some(deadline));
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
                () = crate::waiting::sleep_until(last_call) => {
                    let count = u64::try_from(self.store.client.add(&self.keys.round_keys(r).join(), 0).await.map_err(|e| self.lost(e))?).unwrap_or(0);
                    let v = at_last_call(count, slot, max).value();
                    self.store.client.compare_set(&closed, b"", v.as_bytes()).await.map_err(|e| self.lost(e))?;
                    break;
                }
                _ = tick.tick() => {
                    let state = self.join_state(r, &mut seen, last_call).await?;
                    waiting.report(&state);
                }
            }
        }
        self.standing = self.standing.out_of_round();
        match place(&self.get(&closed).await?, slot) {
            Place::Spare { size } => {
                self.me.last_rank = None;
                return self.spare(r, size).await;
            }
            Place::Member { size, assigns: true } => self.assign_round(r, size).await?,
            Place::Member { assigns: false, .. } => {}
        }
        let rank_key = self.keys.round_keys(r).rank(slot);
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
            // Give the round up, unless its closer formed it meanwhile (the
            // first to write the members decides for every pod).
            let got = self
                .store
                .client
                .compare_set(&self.keys.round_keys(r).members(), b"", ABANDONED)
                .await
                .map_err(|e| self.lost(e))?;
            if given_up(&got) || !self.wait_for(std::slice::from_ref(&rank_key), bound).await? {
                tracing::warn!(round = r, "the pod that closed the round never assigned ranks; starting a new round");
                self.advance(r, r + 1).await?;
                return Ok(Try::Moved(r + 1));
            }
        }
        let a: Assignment = serde_json::from_slice(&self.get(&rank_key).await?)
            .map_err(|_| Error::Mismatch(format!("unreadable rank assignment in round {r}")))?;
        if let Some(e) = a.error {
            return Err(Error::Mismatch(e));
        }
        let port_key = self.keys.round_keys(r).port();
        let limit = deadline.saturating_duration_since(Instant::now()).max(bound);
        if !self.wait_for(std::slice::from_ref(&port_key), limit).await? {
            return Err(Error::Timeout {
                waited: started.elapsed(),
                round: r,
                detail: "the store host published no worker store".into(),
                endpoint: self.store.endpoint.clone(),
            });
        }
        let (port, aux_port) = parse_ports(&self.get(&port_key).await?)
            .ok_or_else(|| Error::Mismatch("the store host published an unreadable worker port".into()))?;
        Ok(Try::Formed(Round {
            number: r,
            slot: u32::try_from(slot).unwrap_or(u32::MAX),
            group_rank: a.group_rank,
            nnodes: a.nnodes,
            worker_port: port,
            aux_port,
            restarts: 0,
        }))
    }

    /// Read the member records of round `r`'s slots not in `seen` yet (a
    /// slot is written once, so each is read once per round), the first
    /// MAX slots only (those past it are spares); returns the slots taken.
    pub(super) async fn read_slots(&mut self, r: u64, seen: &mut Vec<Option<Member>>) -> Result<usize, Error> {
        let count = self.store.client.add(&self.keys.round_keys(r).join(), 0).await.map_err(|e| self.lost(e))?;
        let count = usize::try_from(count).unwrap_or(0);
        let slots = count.min(usize::try_from(self.me.max_nodes).unwrap_or(usize::MAX));
        if seen.len() < slots {
            seen.resize(slots, None);
        }
        let unread: Vec<usize> = (0..seen.len()).filter(|&s| seen[s].is_none()).collect();
        if !unread.is_empty() {
            let keys: Vec<String> = unread.iter().map(|s| self.keys.round_keys(r).member(s)).collect();
            let values = self.store.client.multi_get(&keys).await.map_err(|e| self.lost(e))?;
            for (&s, v) in unread.iter().zip(values) {
                seen[s] = serde_json::from_slice(&v).ok();
            }
        }
        Ok(count)
    }

    /// Who has joined round `r` so far, for the waiting line.
    /// Member records already read stay in `seen` (a slot is written once),
    /// so each record is read once per round; slots past MAX are spares
    /// and are only counted.
    async fn join_state(
        &mut self,
        r: u64,
        seen: &mut Vec<Option<Member>>,
        last_call: Option<Instant>,
    ) -> Result<String, Error> {
        let count = self.read_slots(r, seen).await?;
        let present: Vec<&Member> = seen.iter().flatten().collect();
        Ok(describe_join(&self.me, &present, count, last_call.map(|t| t.saturating_duration_since(Instant::now()))))
    }

    /// We closed the round: read every member, assign ranks, publish.
    async fn assign_round(&mut self, r: u64, size: u64) -> Result<(), Error> {
        let keys: Vec<String> = (0..size).map(|s| self.keys.round_keys(r).member(s)).collect();
        let bound = self.timing.heartbeat_timeout;
        if !self.wait_for(&keys, bound).await? {
            tracing::warn!(round = r, "a pod took a slot but never announced itself; starting a new round");
            self.advance(r, r + 1).await?;
            return Ok(());
        }
        let values = self.store.client.multi_get(&keys).await.map_err(|e| self.lost(e))?;
        let members: Vec<Member> = values.iter().filter_map(|v| serde_json::from_slice(v).ok()).collect();
        let places: Vec<_> = members.iter().map(Member::place).collect();
        if let Some(m) = first_repeat(&places).map(|i| &members[i]) {
            // A pod left (or died) while the round was open and came back:
            // its old slot is stale (only one live agent holds a place,
            // `super::claim`). The live pods meet again in a new round.
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
        let mut by_rank: Vec<(u32, &Member)> = ranks.iter().copied().zip(members.iter()).collect();
        by_rank.sort_by_key(|(rank, _)| *rank);
        let ordered: Vec<&Member> = by_rank.into_iter().map(|(_, m)| m).collect();
        // The members first, by COMPARE_SET: the others may have given the
        // round up while this pod was slow (then it follows them on).
        let record = serde_json::to_vec(&ordered).unwrap_or_default();
        let got = self
            .store
            .client
            .compare_set(&self.keys.round_keys(r).members(), b"", &record)
            .await
            .map_err(|e| self.lost(e))?;
        if !closer_forms(&got) {
            tracing::warn!(
                round = r,
                "the other pods gave this round up before its ranks were assigned; following them"
            );
            self.advance(r, r + 1).await?;
            return Ok(());
        }
        let pairs: Vec<(String, Vec<u8>)> = ranks
            .iter()
            .enumerate()
            .map(|(slot, &group_rank)| {
                let a = Assignment { group_rank, nnodes, error: error.clone() };
                (self.keys.round_keys(r).rank(slot), serde_json::to_vec(&a).unwrap_or_default())
            })
            .collect();
        self.store.client.multi_set(&pairs).await.map_err(|e| self.lost(e))?;
        if error.is_none() {
            let hosts: Vec<&str> = ordered.iter().map(|m| m.host.as_str()).collect();
            tracing::debug!(round = r, nnodes, members = ?hosts, "assigned the round's ranks");
        }
        Ok(())
    }

    /// The round is full or running without us.
    async fn spare(&mut self, r: u64, size: u64) -> Result<Try, Error> {
        let members_key = self.keys.round_keys(r).members();
        let bound = self.timing.heartbeat_timeout + Duration::from_secs(2);
        let members: Vec<Member> = if self.wait_for(std::slice::from_ref(&members_key), bound).await? {
            serde_json::from_slice(&self.get(&members_key).await?).unwrap_or_default()
        } else {
            // No members by the bound: the round never formed (its closer,
            // or its members, went first). Give it up as a member would
            // (the first to write the members decides), and move on.
            let got = self.store.client.compare_set(&members_key, b"", ABANDONED).await.map_err(|e| self.lost(e))?;
            if spare_gives_up(&got) {
                tracing::warn!(round = r, "the round this pod found closed never formed; giving it up");
                self.advance(r, r + 1).await?;
                return Ok(Try::Moved(r + 1));
            }
            serde_json::from_slice(&got).unwrap_or_default()
        };
        let end = self.keys.round_keys(r).end();
        let previous = members.iter().find(|m| m.place() == self.me.place() && m.uid != self.me.uid);
        match (arrival(previous.is_some(), size, u64::from(self.me.max_nodes)), previous) {
            // The pod restarted in place (or was replaced): we hold its
            // place, taken over from the member we replace, which is gone.
            (Arrival::TakeOver, Some(old)) => {
                tracing::warn!(round = r, previous = %old.uid, "this pod restarted while its previous incarnation was a member; declaring it gone");
                let dead = serde_json::to_vec(&[&old.uid]).unwrap_or_default();
                self.store
                    .client
                    .compare_set(&self.keys.round_keys(r).dead(), b"", &dead)
                    .await
                    .map_err(|e| self.lost(e))?;
                self.store
                    .client
                    .compare_set(&end, b"", RoundEnd::Dead(old.uid.clone()).to_string().as_bytes())
                    .await
                    .map_err(|e| self.lost(e))?;
            }
            (Arrival::Regroup, _) => {
                tracing::info!(
                    round = r,
                    running = size,
                    "a smaller round is running; asking it to regroup and admit this pod"
                );
                let v = RoundEnd::Waiting(self.me.uid.clone()).to_string();
                self.store.client.compare_set(&end, b"", v.as_bytes()).await.map_err(|e| self.lost(e))?;
            }
            _ => tracing::info!(round = r, running = size, "the round is full; waiting as a spare"),
        }
        crate::metrics::global().spare.set(1);
        self.standing = Standing::Spare { round: r, size };
        self.wait_as_spare(r, size).await
    }

    /// Wait as a spare in round `r` (of `size` pods) until the job moves
    /// on, ends without us, or it is time for a health check.
    async fn wait_as_spare(&mut self, r: u64, size: u64) -> Result<Try, Error> {
        let next = self.keys.round_keys(r).next();
        let verdict = self.keys.round_keys(r).verdict();
        let day = Duration::from_secs(86_400);
        let next_w = wait_on(self.store.dial.clone(), std::slice::from_ref(&next), day);
        let verdict_w = wait_on(self.store.dial.clone(), std::slice::from_ref(&verdict), day);
        // Serve mode: the members left the job with no verdict for us (the
        // idle timeout's shutdown). Elsewhere every end has a verdict, and
        // `all_left` may be an old store's (a pod restarted in place).
        let all_left = self.keys.round_keys(r).all_left();
        let watch_left = watches_left(self.roles.serving);
        let left_w = watch_if(watch_left, self.store.dial.clone(), all_left.clone(), day);
        tokio::pin!(next_w, verdict_w, left_w);
        let mut waiting = Waiting::new(format!("room in the job at {} (a spare)", self.store.endpoint), None);
        let mut tick = progress_tick();
        let recheck = tokio::time::sleep(SPARE_CHECK_EVERY);
        tokio::pin!(recheck);
        let running = if self.me.spares > 0 {
            format!("round {r} runs with {size} pods; {} wait as spares", self.me.spares)
        } else {
            format!("round {r} runs with {size} of at most {} pods", self.me.max_nodes)
        };
        loop {
            // Biased in the protocol's order (`round::spare::PRIORITY`), the
            // members' leaving first: the store closes right after it, and
            // the other waits then end with a lost store.
            let (heard, v) = tokio::select! {
                biased;
                ok = &mut left_w => {
                    if !ok.map_err(|e| self.lost(e))? {
                        left_w.set(watch_if(watch_left, self.store.dial.clone(), all_left.clone(), day));
                        continue;
                    }
                    tracing::info!(round = r, "the members left the job; this spare leaves too");
                    (Heard::MembersLeft, Verdict::Success)
                }
                ok = &mut next_w => {
                    if !ok.map_err(|e| self.lost(e))? {
                        next_w.set(wait_on(self.store.dial.clone(), std::slice::from_ref(&next), day));
                        continue;
                    }
                    (Heard::Next, Verdict::Regroup)
                }
                ok = &mut verdict_w => {
                    if !ok.map_err(|e| self.lost(e))? {
                        verdict_w.set(wait_on(self.store.dial.clone(), std::slice::from_ref(&verdict), day));
                        continue;
                    }
                    match String::from_utf8_lossy(&self.get(&verdict).await?).parse::<Verdict>() {
                        Ok(v @ Verdict::Success) => (Heard::Verdict(VerdictRead::Final { success: true }), v),
                        Ok(v @ Verdict::Fail(_)) => (Heard::Verdict(VerdictRead::Final { success: false }), v),
                        _ => (Heard::Verdict(VerdictRead::MovesOn), Verdict::Regroup),
                    }
                }
                () = &mut recheck => (Heard::Recheck, Verdict::Regroup),
                _ = tick.tick() => { waiting.report(&running); continue; }
            };
            return match round::spare::step(heard, self.roles.serving) {
                Step::Leave { say_read, .. } => {
                    if say_read {
                        // The store host waits for this before it closes the store.
                        let _ = self.store.client.add(&self.keys.round_keys(r).spare_left(), 1).await;
                    }
                    Ok(Try::Ended(v))
                }
                // Members move the job on right after a regroup or restart verdict.
                Step::AwaitNext => {
                    let bound = self.timing.heartbeat_timeout * 2;
                    if !self.wait_for(std::slice::from_ref(&next), bound).await? {
                        self.advance(r, r + 1).await?;
                    }
                    Ok(self.moved_on(r))
                }
                Step::MovedOn => Ok(self.moved_on(r)),
                Step::Recheck => Ok(Try::Recheck),
                // A lost store surfaces as the waits' errors above; the
                // caller reconnects.
                Step::Reconnect => Err(self.lost(std::io::Error::from(std::io::ErrorKind::ConnectionAborted).into())),
            };
        }
    }

    /// The job moved on past the round we waited in as a spare: check our
    /// health before we join the next one.
    fn moved_on(&mut self, r: u64) -> Try {
        self.standing = Standing::WasSpare { defer_to: Some(r) };
        Try::Recheck
    }

    pub(super) async fn timeout(&mut self, r: u64, started: Instant) -> Error {
        let count = self.store.client.add(&self.keys.round_keys(r).join(), 0).await.unwrap_or(0);
        let keys: Vec<String> = (0..count).map(|s| self.keys.round_keys(r).member(s)).collect();
        let present: Vec<Member> = self
            .store
            .client
            .multi_get(&keys)
            .await
            .unwrap_or_default()
            .iter()
            .filter_map(|v| serde_json::from_slice(v).ok())
            .collect();
        let detail = if !self.me.ranked_by_env() {
            format!("{} of at least {} pods joined", present.len(), self.me.min_nodes)
        } else {
            let missing: Vec<u32> =
                (0..self.me.max_nodes).filter(|n| !present.iter().any(|m| m.node_rank == *n)).collect();
            format!("node ranks {missing:?} did not join")
        };
        Error::Timeout { waited: started.elapsed(), round: r, detail, endpoint: self.store.endpoint.clone() }
    }
}

/// The waiting line of a round that has not formed: how many pods are
/// in and, for static jobs, which node ranks are missing (the first
/// [`MISSING_SHOWN`] of them).
fn describe_join(me: &Member, present: &[&Member], joined: usize, last_call: Option<Duration>) -> String {
    if me.spares > 0 && !me.elastic() {
        return format!(
            "{joined} of {} joined; no spare is waiting (the job has {}), so the round waits for another pod",
            me.max_nodes, me.spares
        );
    }
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

/// WAIT for `key` when `on`, else never.
async fn watch_if(
    on: bool,
    dial: crate::store::Dial,
    key: String,
    limit: Duration,
) -> Result<bool, crate::store::ClientError> {
    if on { wait_on(dial, std::slice::from_ref(&key), limit).await } else { std::future::pending().await }
}

/// `PORT` or `PORT,AUX` as the store host publishes them.
fn parse_ports(v: &[u8]) -> Option<(u16, u16)> {
    let text = std::str::from_utf8(v).ok()?;
    let (port, aux) = text.split_once(',').unwrap_or((text, "0"));
    Some((port.trim().parse().ok()?, aux.trim().parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::parse_ports;

    #[test]
    fn ports_are_read_with_or_without_the_second() {
        assert_eq!(parse_ports(b"4100,4101"), Some((4100, 4101)));
        assert_eq!(parse_ports(b"4100"), Some((4100, 0)));
        assert_eq!(parse_ports(b"x,1"), None);
        assert_eq!(parse_ports(b"1,99999"), None);
    }
}
