//! Who joins a round first in a job with spares (`--spares`): the store
//! host's agent before everyone (it keeps the board, the control API and
//! the progress relay, so it is a member of every round), then the live
//! members of the last round, then the spares. The round closes as soon as
//! it is full, so the order decides who trains: a restart or a lost pod
//! must not push a healthy member out for a spare.

use std::collections::HashSet;
use std::time::Duration;

use tokio::time::Instant;

use super::Error;
use super::join::{first_set, millis};
use super::member::Member;
use super::session::{Session, Standing, Try, parse_u64, progress_tick, wait_on};
use crate::supervise::policy::Verdict;
use crate::waiting::Waiting;
use round::spare::{Got, K, Op, SpareEnd, SpareWait, VerdictRead};

/// How often a spare checks its health while it waits.
const SPARE_CHECK_EVERY: Duration = Duration::from_secs(60);

/// How often a spare looks whether the last round's members have joined.
const DEFER_POLL: Duration = Duration::from_millis(50);

/// Up to this many members still missing, a spare reads their heartbeats
/// at every look (a member that left with `bye` is seen at once).
const FEW_MISSING: usize = 16;

impl Session {
    /// Before this pod joins round `r` of a job with spares: wait for the
    /// store host's agent to join it, and a spare also for the live members
    /// of the round it waited beside. Some(moved) when the job moved past
    /// `r` first.
    pub(super) async fn join_order(
        &mut self,
        r: u64,
        deadline: Instant,
        started: Instant,
    ) -> Result<Option<Try>, Error> {
        if self.me.spares == 0 || self.roles.leads {
            return Ok(None);
        }
        if let Some(moved) = self.after_lead(r, deadline, started).await? {
            return Ok(Some(moved));
        }
        if let Standing::WasSpare { defer_to: Some(p) } = self.standing {
            self.standing = Standing::WasSpare { defer_to: None };
            self.defer_to_members(p, r).await?;
        }
        Ok(None)
    }

    /// Wait until the store host's agent joined round `r` (it writes `lead`,
    /// its `--spares`, which must be ours).
    async fn after_lead(&mut self, r: u64, deadline: Instant, started: Instant) -> Result<Option<Try>, Error> {
        let (lead, next) = (self.keys.round_keys(r).lead(), self.keys.round_keys(r).next());
        let limit = deadline.saturating_duration_since(Instant::now());
        let lead_w = wait_on(self.store.dial.clone(), std::slice::from_ref(&lead), limit);
        let next_w = wait_on(self.store.dial.clone(), std::slice::from_ref(&next), limit);
        tokio::pin!(lead_w, next_w);
        let what = format!("the store host's pod to join round {r} at {} first", self.store.endpoint);
        let mut waiting = Waiting::new(what, Some(deadline));
        let mut tick = progress_tick();
        loop {
            tokio::select! {
                ok = &mut lead_w => {
                    if !ok.map_err(|e| self.lost(e))? {
                        return Err(self.timeout(r, started).await);
                    }
                    let theirs = parse_u64(&self.get(&lead).await?);
                    if theirs != Some(u64::from(self.me.spares)) {
                        let theirs = theirs.map_or_else(|| "an unreadable value".to_string(), |k| k.to_string());
                        return Err(Error::Mismatch(format!(
                            "the store host's pod runs with --spares {theirs}, this pod with {}: give every pod the same TRAINLET_SPARES",
                            self.me.spares
                        )));
                    }
                    return Ok(None);
                }
                ok = &mut next_w => {
                    if ok.map_err(|e| self.lost(e))? {
                        return Ok(Some(Try::Moved(parse_u64(&self.get(&next).await?).unwrap_or(r + 1))));
                    }
                    return Err(self.timeout(r, started).await);
                }
                _ = tick.tick() => { waiting.report("it hosts the store and takes part in every round"); }
            }
        }
    }

    /// A spare lets the live members of round `p` (the one it waited
    /// beside) join round `r` first: it joins once each of them joined,
    /// left the job (`bye`, as a pod that failed its health check does) or
    /// was declared dead, once the round closed or moved on, or after the
    /// heartbeat timeout.
    ///
    /// Each look costs the store a few keys and the slots taken since the
    /// last: the members' heartbeats (one key each) are read only for
    /// those still missing, and only when few are ([`FEW_MISSING`]) or no
    /// pod joined since the last look (while they join, the missing ones
    /// are on their way; once joins stop, those left may have said `bye`).
    /// Reading every heartbeat every look cost the store 20 reads of N
    /// keys a second per spare through a regroup.
    async fn defer_to_members(&mut self, p: u64, r: u64) -> Result<(), Error> {
        let roster = self.get(&self.keys.round_keys(p).members()).await?;
        let mut missing = self.members_of(p, &roster).await?;
        if missing.is_empty() {
            return Ok(());
        }
        let all = missing.len();
        let until = Instant::now() + self.timing.heartbeat_timeout;
        let what = format!("the members of round {p} to join round {r} before this spare");
        let mut waiting = Waiting::new(what, Some(until));
        let mut seen: Vec<Option<Member>> = Vec::new();
        let mut joined_before = None;
        loop {
            let fixed =
                [self.keys.round_keys(p).dead(), self.keys.round_keys(r).closed(), self.keys.round_keys(r).next()];
            let state = self.store.client.multi_get(&fixed).await.map_err(|e| self.lost(e))?;
            if !state[1].is_empty() || !state[2].is_empty() || Instant::now() >= until {
                return Ok(());
            }
            let dead: HashSet<String> = serde_json::from_slice(&state[0]).unwrap_or_default();
            let joined = self.read_slots(r, &mut seen).await?;
            let there: HashSet<&str> = seen.iter().flatten().map(|m| m.uid.as_str()).collect();
            missing.retain(|m| !dead.contains(&m.uid) && !there.contains(m.uid.as_str()));
            if !missing.is_empty() && (missing.len() <= FEW_MISSING || joined_before == Some(joined)) {
                let beats: Vec<String> = missing.iter().map(|m| self.keys.heartbeat(&m.uid)).collect();
                let alive = self.store.client.multi_get(&beats).await.map_err(|e| self.lost(e))?;
                let mut beat = alive.iter();
                missing.retain(|_| beat.next().is_none_or(|b| b.as_slice() != b"bye"));
            }
            if missing.is_empty() {
                return Ok(());
            }
            joined_before = Some(joined);
            waiting.report(&format!("{} of {all} still to join", missing.len()));
            tokio::time::sleep(DEFER_POLL).await;
        }
    }

    /// Wait as a spare in round `r` (of `size` pods) until the job moves
    /// on, ends without us, or it is time for a health check: the
    /// protocol's wait (`round::spare::SpareWait`), its operations carried
    /// out here as the simulation carries them out.
    pub(super) async fn wait_as_spare(&mut self, r: u64, size: u64) -> Result<Try, Error> {
        let epoch = Instant::now();
        let mut w =
            SpareWait::new(self.roles.serving, millis(SPARE_CHECK_EVERY), millis(self.timing.heartbeat_timeout * 2));
        let rk = self.keys.round_keys(r);
        let key = |k: K| match k {
            K::AllLeft => rk.all_left(),
            K::Next => rk.next(),
            K::Verdict => rk.verdict(),
            K::SpareLeft => rk.spare_left(),
        };
        let mut waiting = Waiting::new(format!("room in the job at {} (a spare)", self.store.endpoint), None);
        let running = if self.me.spares > 0 {
            format!("round {r} runs with {size} pods; {} wait as spares", self.me.spares)
        } else {
            format!("round {r} runs with {size} of at most {} pods", self.me.max_nodes)
        };
        // A final verdict as read (a failure's details), and how the store was lost.
        let mut verdict = None;
        let mut lost = None;
        let end = loop {
            let got = match w.next() {
                Op::Done(end) => break end,
                Op::WaitAny(keys, until) => {
                    let names: Vec<String> = keys.iter().map(|k| key(*k)).collect();
                    let limit = (epoch + Duration::from_millis(until)).saturating_duration_since(Instant::now());
                    let any = first_set(self.store.dial.clone(), &names, limit);
                    tokio::pin!(any);
                    let mut tick = progress_tick();
                    loop {
                        tokio::select! {
                            set = &mut any => break match set {
                                Ok(Some(i)) => Got::Ready(vec![keys[i]], false),
                                Ok(None) => Got::TimedOut,
                                Err(e) => {
                                    lost = Some(e);
                                    Got::Ready(Vec::new(), true)
                                }
                            },
                            _ = tick.tick() => { waiting.report(&running); }
                        }
                    }
                }
                Op::ReadVerdict => {
                    let read = String::from_utf8_lossy(&self.get(&key(K::Verdict)).await?).parse::<Verdict>();
                    Got::Verdict(match read {
                        Ok(v @ (Verdict::Success | Verdict::Fail(_))) => {
                            verdict = Some(v);
                            VerdictRead::Final { success: v == Verdict::Success }
                        }
                        _ => VerdictRead::MovesOn,
                    })
                }
                Op::SayRead => {
                    // The store host waits for this before it closes the store.
                    let _ = self.store.client.add(&key(K::SpareLeft), 1).await;
                    Got::Done
                }
                Op::Advance => {
                    self.advance(r, r + 1).await?;
                    Got::Done
                }
            };
            w.answer(got, millis(epoch.elapsed()));
        };
        match end {
            // Left with no final verdict read: the members' leaving (serve mode).
            SpareEnd::Leave { .. } if verdict.is_none() => {
                tracing::info!(round = r, "the members left the job; this spare leaves too");
                Ok(Try::Ended(Verdict::Success))
            }
            SpareEnd::Leave { success } => Ok(Try::Ended(verdict.filter(|_| !success).unwrap_or(Verdict::Success))),
            SpareEnd::MovedOn => Ok(self.moved_on(r)),
            SpareEnd::Recheck => Ok(Try::Recheck),
            // A lost store: the caller reconnects.
            SpareEnd::Reconnect { .. } => {
                Err(self
                    .lost(lost.unwrap_or_else(|| std::io::Error::from(std::io::ErrorKind::ConnectionAborted).into())))
            }
        }
    }

    /// The job moved on past the round we waited in as a spare: check our
    /// health before we join the next one.
    fn moved_on(&mut self, r: u64) -> Try {
        self.standing = Standing::WasSpare { defer_to: Some(r) };
        Try::Recheck
    }
}
