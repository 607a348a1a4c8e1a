//! Who joins a round first in a job with spares (`--spares`): the store
//! host's agent before everyone (it keeps the board, the control API and
//! the progress relay, so it is a member of every round), then the live
//! members of the last round, then the spares. The round closes as soon as
//! it is full, so the order decides who trains: a restart or a lost pod
//! must not push a healthy member out for a spare.

use std::time::Duration;

use tokio::time::Instant;

use super::Error;
use super::member::Member;
use super::session::{Session, Standing, Try, parse_u64, progress_tick, wait_on};
use crate::waiting::Waiting;

/// How often a spare looks whether the last round's members have joined.
const DEFER_POLL: Duration = Duration::from_millis(50);

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
    async fn defer_to_members(&mut self, p: u64, r: u64) -> Result<(), Error> {
        let members: Vec<Member> =
            serde_json::from_slice(&self.get(&self.keys.round_keys(p).members()).await?).unwrap_or_default();
        let beats: Vec<String> = members.iter().map(|m| self.keys.heartbeat(&m.uid)).collect();
        if beats.is_empty() {
            return Ok(());
        }
        let until = Instant::now() + self.timing.heartbeat_timeout;
        let what = format!("the members of round {p} to join round {r} before this spare");
        let mut waiting = Waiting::new(what, Some(until));
        let mut seen: Vec<Option<Member>> = Vec::new();
        loop {
            let fixed =
                [self.keys.round_keys(p).dead(), self.keys.round_keys(r).closed(), self.keys.round_keys(r).next()];
            let state = self.store.client.multi_get(&fixed).await.map_err(|e| self.lost(e))?;
            if !state[1].is_empty() || !state[2].is_empty() || Instant::now() >= until {
                return Ok(());
            }
            let dead: Vec<String> = serde_json::from_slice(&state[0]).unwrap_or_default();
            let alive = self.store.client.multi_get(&beats).await.map_err(|e| self.lost(e))?;
            self.read_slots(r, &mut seen).await?;
            let missing = members
                .iter()
                .zip(&alive)
                .filter(|(m, beat)| {
                    beat.as_slice() != b"bye"
                        && !dead.contains(&m.uid)
                        && !seen.iter().flatten().any(|j| j.uid == m.uid)
                })
                .count();
            if missing == 0 {
                return Ok(());
            }
            waiting.report(&format!("{missing} of {} still to join", members.len()));
            tokio::time::sleep(DEFER_POLL).await;
        }
    }
}
