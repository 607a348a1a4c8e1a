//! Joining a round: take a slot, wait for MIN/MAX pods and the last call,
//! close the round (first writer wins), assign ranks, or wait as a spare;
//! every wait says what it waits for.

use std::time::Duration;

use tokio::time::Instant;

use super::Error;
use super::member::{Member, Roster};
use crate::supervise::round_end::RoundEnd;
use crate::waiting::Waiting;
use round::form::{Bounds, Form, Got, K, Op, Outcome, Records};
use round::join::{ABANDONED, Arrival, arrival, spare_gives_up};

use super::session::{Joined, Known, Round, Session, Standing, Try, progress_tick, wait_on};

/// Missing node ranks named in a waiting line.
pub(super) const MISSING_SHOWN: usize = 32;

/// A member's wait for the round's members outlasts the heartbeat
/// timeout by this (the closer reads every record first).
const MEMBERS_GRACE: Duration = Duration::from_secs(2);

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
            crate::events::global().emit(crate::events::Event {
                type_: crate::events::Type::Normal,
                reason: "SpareTookRank",
                action: "TakeRank",
                note: format!(
                    "this spare pod took group rank {} in round {} of {} pods, in the place of a pod that left",
                    round.group_rank, round.number, round.nnodes
                ),
            });
        }
        Ok(())
    }

    async fn try_round(&mut self, r: u64, deadline: Instant, started: Instant) -> Result<Try, Error> {
        if let Some(moved) = self.join_order(r, deadline, started).await? {
            return Ok(moved);
        }
        // The protocol's formation (`round::form`), its operations carried
        // out here; its times are milliseconds since `epoch`.
        let epoch = Instant::now();
        let bounds = Bounds {
            min: u64::from(self.me.min_nodes),
            max: u64::from(self.me.max_nodes),
            last_call: millis(self.timing.last_call),
            heartbeat: millis(self.timing.heartbeat_timeout),
            grace: millis(MEMBERS_GRACE),
            deadline: millis(deadline.saturating_duration_since(epoch)),
        };
        let record = serde_json::to_vec(&self.me).unwrap_or_default();
        let lead = self.roles.leads.then(|| self.me.spares.to_string().into_bytes());
        let mut form = Form::new(r, bounds, record, lead);
        let was_spare = self.standing.was_spare();
        let mut seen: Vec<Option<Member>> = Vec::new();
        let outcome = loop {
            let got = match form.next() {
                Op::Done(outcome) => break outcome,
                op => self.form_op(&form, op, epoch, &mut seen).await?,
            };
            let before = form.last_call();
            form.answer(got, millis(epoch.elapsed()));
            if before.is_none() && form.last_call().is_some() {
                let (min, last_call_s) = (self.me.min_nodes, self.timing.last_call.as_secs_f64());
                tracing::info!(round = r, min, last_call_s, "enough pods for a round; last call");
            }
            if form.in_open_round() {
                self.standing = Standing::Joining { round: r, was_spare };
            } else if let Standing::Joining { .. } = self.standing {
                self.standing = self.standing.out_of_round();
            }
        };
        match outcome {
            Outcome::Formed(roster) => self.formed_round(r, form.slot(), &roster, deadline, started).await,
            Outcome::Spare { size } => {
                self.me.last_rank = None;
                self.spare(r, size).await
            }
            Outcome::Moved(to) => {
                tracing::info!(round = r, next = to, "the job moved on before this round formed; following");
                Ok(Try::Moved(to))
            }
            Outcome::TimedOut => Err(self.timeout(r, started).await),
        }
    }

    /// One store operation of the formation of round `form.round()`.
    async fn form_op(
        &mut self,
        form: &Form,
        op: Op,
        epoch: Instant,
        seen: &mut Vec<Option<Member>>,
    ) -> Result<Got, Error> {
        let r = form.round();
        let rk = self.keys.round_keys(r);
        let key = |k: K| match k {
            K::Round => self.keys.round(),
            K::Join => rk.join(),
            K::Lead => rk.lead(),
            K::Member(slot) => rk.member(slot),
            K::Closed => rk.closed(),
            K::Quorum => rk.quorum(),
            K::Next => rk.next(),
            K::Members => rk.members(),
        };
        let limit = |until: u64| (epoch + Duration::from_millis(until)).saturating_duration_since(Instant::now());
        Ok(match op {
            Op::Add(k, by) => {
                let n = self.store.client.add(&key(k), by).await.map_err(|e| self.lost(e))?;
                Got::Num(u64::try_from(n).unwrap_or(0))
            }
            Op::Raise(to) => Got::Num(self.raise(&self.keys.round(), to).await?),
            Op::Set(k, v) => {
                self.store.client.set(&key(k), &v).await.map_err(|e| self.lost(e))?;
                Got::Done
            }
            Op::Cas(k, v) => {
                Got::Bytes(self.store.client.compare_set(&key(k), b"", &v).await.map_err(|e| self.lost(e))?)
            }
            Op::Get(k) => Got::Bytes(self.get(&key(k)).await?),
            Op::WaitAny(keys, until) => {
                let names: Vec<String> = keys.iter().map(|k| key(*k)).collect();
                match self.wait_any(&names, limit(until), (form, epoch), seen).await? {
                    Some(i) => Got::Fired(keys[i]),
                    None => Got::TimedOut,
                }
            }
            Op::WaitRecords(size, until) => {
                let keys: Vec<String> = (0..size).map(|slot| rk.member(slot)).collect();
                if self.wait_for(&keys, limit(until)).await? {
                    Got::Done
                } else {
                    tracing::warn!(round = r, "a pod took a slot but never announced itself; starting a new round");
                    Got::TimedOut
                }
            }
            Op::Records(size) => self.order_members(r, size).await?,
            Op::Advance(to) => {
                tracing::warn!(
                    round = r,
                    next = to,
                    "round {r} did not form (given up, or its closer found a pod missing or joined twice); starting round {to}"
                );
                self.advance(r, to).await?;
                Got::Done
            }
            Op::Done(_) => Got::Done,
        })
    }

    /// WAIT until any of `keys` is set (its index) or `limit` passes
    /// (None); while the formation waits for pods, its waiting line says
    /// who is in every so often.
    async fn wait_any(
        &mut self,
        keys: &[String],
        limit: Duration,
        (form, epoch): (&Form, Instant),
        seen: &mut Vec<Option<Member>>,
    ) -> Result<Option<usize>, Error> {
        let r = form.round();
        let at = |t: u64| epoch + Duration::from_millis(t);
        let any = first_set(self.store.dial.clone(), keys, limit);
        tokio::pin!(any);
        let report = form.waits_for_pods();
        let what = format!("pods to join round {r} at {}", self.store.endpoint);
        let mut waiting = Waiting::new(what, Some(at(form.deadline())));
        let mut tick = progress_tick();
        loop {
            tokio::select! {
                set = &mut any => return set.map_err(|e| self.lost(e)),
                _ = tick.tick(), if report => {
                    let state = self.join_state(r, seen, form.last_call().map(at)).await?;
                    waiting.report(&state);
                }
            }
        }
    }

    /// The closer reads the member records of slots `0..size` and puts
    /// them in group-rank order (`assign`); the protocol decides the rest.
    async fn order_members(&mut self, r: u64, size: u64) -> Result<Got, Error> {
        let keys: Vec<String> = (0..size).map(|s| self.keys.round_keys(r).member(s)).collect();
        let values = self.store.client.multi_get(&keys).await.map_err(|e| self.lost(e))?;
        let records: Vec<Option<Member>> = values.iter().map(|v| serde_json::from_slice(v).ok()).collect();
        let places: Vec<String> = records.iter().flatten().map(Member::place).collect();
        if let Some(m) = round::join::first_repeat(&places).and_then(|i| records.iter().flatten().nth(i)) {
            // A pod left (or died) while the round was open and came back:
            // its old slot is stale (only one live agent holds a place,
            // `super::claim`). The live pods meet again in a new round.
            tracing::warn!(round = r, host = %m.host, node_rank = m.node_rank, "a pod joined this round twice (it restarted while the round was open); starting a new round");
        }
        // Members that disagree (or a record unreadable) form a round whose
        // roster says why; every member exits with it (`formed_round`).
        Ok(Got::Records(Records { places, members: Roster::of(r, &records).to_bytes() }))
    }

    /// Round `r` formed with `roster` (`rR/members`: the members' slots in
    /// group-rank order): our group rank is our slot's place there; then
    /// the store host's worker store.
    async fn formed_round(
        &mut self,
        r: u64,
        slot: Option<u64>,
        roster: &[u8],
        deadline: Instant,
        started: Instant,
    ) -> Result<Try, Error> {
        let slots = match Roster::read(roster) {
            Some(Roster::Slots(slots)) => slots,
            Some(Roster::Mismatch(why)) => return Err(Error::Mismatch(why)),
            None => return Err(Error::Mismatch(format!("unreadable members of round {r}"))),
        };
        let closed = round::Closed::read(&self.get(&self.keys.round_keys(r).closed()).await?);
        if closed.is_some_and(|c| c.size != slots.len() as u64) {
            return Err(Error::Mismatch(format!(
                "a pod of round {r} announced data the pod that closed it could not read (a different trainlet version?)"
            )));
        }
        let Some((slot, group_rank)) = slot.and_then(|slot| Some((slot, slots.iter().position(|&s| s == slot)?)))
        else {
            return Err(Error::Mismatch(format!(
                "round {r} formed without this pod (uid {}, slot {slot:?})",
                self.me.uid
            )));
        };
        let port_key = self.keys.round_keys(r).port();
        let bound = self.timing.heartbeat_timeout + MEMBERS_GRACE;
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
            group_rank: u32::try_from(group_rank).unwrap_or(u32::MAX),
            nnodes: u32::try_from(slots.len()).unwrap_or(u32::MAX),
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
        let named = names_missing(&self.me, self.roles.leads);
        let count = if named {
            self.read_slots(r, seen).await?
        } else {
            let joined = self.store.client.add(&self.keys.round_keys(r).join(), 0).await.map_err(|e| self.lost(e))?;
            usize::try_from(joined).unwrap_or(0)
        };
        let present: Vec<&Member> = seen.iter().flatten().collect();
        let left = last_call.map(|t| t.saturating_duration_since(Instant::now()));
        Ok(describe_join(&self.me, named.then_some(present.as_slice()), count, left))
    }

    /// The round is full or running without us.
    async fn spare(&mut self, r: u64, size: u64) -> Result<Try, Error> {
        let members_key = self.keys.round_keys(r).members();
        let bound = self.timing.heartbeat_timeout + Duration::from_secs(2);
        let roster = if self.wait_for(std::slice::from_ref(&members_key), bound).await? {
            self.get(&members_key).await?
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
            got
        };
        let members = self.members_of(r, &roster).await?;
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

/// Up to this many pods, every pod waiting for a static job's round to
/// form names the node ranks still missing (it reads each member record
/// once a round); above it only the store host's pod does, so that the
/// store serves those records once a round, not once a pod (N^2 bytes).
const EVERY_POD_NAMES_MISSING: u32 = 64;

/// Whether this pod's waiting line names the missing node ranks, which
/// costs reading the member records: only a static job's line without
/// spares names them ([`describe_join`]).
fn names_missing(me: &Member, store_host: bool) -> bool {
    !me.elastic() && me.spares == 0 && (store_host || me.max_nodes <= EVERY_POD_NAMES_MISSING)
}

/// The waiting line of a round that has not formed: how many pods are
/// in and, for static jobs, which node ranks are missing (the first
/// [`MISSING_SHOWN`] of them).
/// `present` is None where this pod does not read the records
/// ([`names_missing`]).
fn describe_join(me: &Member, present: Option<&[&Member]>, joined: usize, last_call: Option<Duration>) -> String {
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
    let Some(present) = present else {
        return format!("{joined} of {} joined (the store host's pod names the missing node ranks)", me.max_nodes);
    };
    let have: std::collections::HashSet<u32> = present.iter().map(|m| m.node_rank).collect();
    let missing: Vec<u32> = (0..me.max_nodes).filter(|n| !have.contains(n)).collect();
    let shown: Vec<String> = missing.iter().take(MISSING_SHOWN).map(u32::to_string).collect();
    let more = missing.len().saturating_sub(MISSING_SHOWN);
    let tail = if more > 0 { format!(" and {more} more") } else { String::new() };
    format!("{joined} of {} joined; missing node ranks [{}]{tail}", me.max_nodes, shown.join(", "))
}

/// WAIT on each of `keys` (a connection each): the index of the first one
/// set (the earliest in `keys` when several are), None once `limit` passed.
pub(super) async fn first_set(
    dial: crate::store::Dial,
    keys: &[String],
    limit: Duration,
) -> Result<Option<usize>, crate::store::ClientError> {
    if keys.is_empty() {
        tokio::time::sleep(limit).await;
        return Ok(None);
    }
    let waits = keys.iter().map(|k| Box::pin(wait_on(dial.clone(), std::slice::from_ref(k), limit)));
    let (set, i, _) = futures::future::select_all(waits).await;
    set.map(|set| set.then_some(i))
}

/// A duration in the protocols' unit (milliseconds).
pub(super) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// `PORT` or `PORT,AUX` as the store host publishes them.
fn parse_ports(v: &[u8]) -> Option<(u16, u16)> {
    let text = std::str::from_utf8(v).ok()?;
    let (port, aux) = text.split_once(',').unwrap_or((text, "0"));
    Some((port.trim().parse().ok()?, aux.trim().parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::{EVERY_POD_NAMES_MISSING, describe_join, names_missing, parse_ports};
    use crate::rendezvous::Member;

    fn pod(node_rank: u32, nnodes: (u32, u32), spares: u32) -> Member {
        Member {
            uid: format!("h{node_rank}#1#0"),
            host: format!("h{node_rank}"),
            pid: 1,
            node_rank,
            nproc: 1,
            min_nodes: nnodes.0,
            max_nodes: nnodes.1,
            max_restarts: 0,
            spares,
            last_rank: None,
        }
    }

    #[test]
    fn only_the_store_host_reads_every_record_for_its_waiting_line_in_a_large_job() {
        let small = pod(0, (EVERY_POD_NAMES_MISSING, EVERY_POD_NAMES_MISSING), 0);
        let large = pod(0, (EVERY_POD_NAMES_MISSING + 1, EVERY_POD_NAMES_MISSING + 1), 0);
        assert!(names_missing(&small, false));
        assert!(!names_missing(&large, false));
        assert!(names_missing(&large, true));
        // Lines that name nobody read no records, whatever the size.
        assert!(!names_missing(&pod(0, (2, 8), 0), true), "elastic");
        assert!(!names_missing(&pod(0, (4, 4), 1), true), "spares");

        let (a, c) = (pod(0, (4, 4), 0), pod(2, (4, 4), 0));
        assert_eq!(describe_join(&a, Some(&[&a, &c]), 2, None), "2 of 4 joined; missing node ranks [1, 3]");
        assert_eq!(
            describe_join(&large, None, 7, None),
            format!("7 of {} joined (the store host's pod names the missing node ranks)", EVERY_POD_NAMES_MISSING + 1)
        );
    }

    #[test]
    fn ports_are_read_with_or_without_the_second() {
        assert_eq!(parse_ports(b"4100,4101"), Some((4100, 4101)));
        assert_eq!(parse_ports(b"4100"), Some((4100, 0)));
        assert_eq!(parse_ports(b"x,1"), None);
        assert_eq!(parse_ports(b"1,99999"), None);
    }
}
