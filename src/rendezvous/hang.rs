//! A hang's stacks over the round's keys: each pod puts its workers'
//! stacks (with their Flight Recorder dumps when asked), waits until every
//! member has put its own, and reads them all for the job's view of who
//! waited for whom.

use std::time::Duration;

use super::Error;
use super::session::{Round, Session};
use crate::stacks::stall::RankStacks;

/// Pods' stacks fetched in one request (each is at most 256 KiB).
const STACKS_PER_GET: usize = 16;

impl Session {
    /// This pod's workers' stacks at a hang, for the job's view; `dumped`:
    /// with the Flight Recorder's dumps (they were asked for and waited for).
    pub async fn publish_stacks(&mut self, round: &Round, json: &[u8], dumped: bool) -> Result<(), Error> {
        let key = self.keys.round_keys(round.number).stacks(round.group_rank);
        self.store.client.set(&key, json).await.map_err(|e| self.lost(e))?;
        if dumped {
            let key = self.keys.round_keys(round.number).dumped(round.group_rank);
            self.store.client.set(&key, b"1").await.map_err(|e| self.lost(e))?;
        }
        Ok(())
    }

    /// Wait (at most `limit`) until every member has put its stacks of
    /// round `round` (`dumped`: with its Flight Recorder's dumps); false
    /// when the limit came first.
    pub async fn wait_stacks(&mut self, round: &Round, dumped: bool, limit: Duration) -> Result<bool, Error> {
        let of = self.keys.round_keys(round.number);
        let keys: Vec<String> = (0..round.nnodes).map(|n| if dumped { of.dumped(n) } else { of.stacks(n) }).collect();
        self.wait_for(&keys, limit).await
    }

    /// Every member's stacks of round `round` (members that put none are
    /// left out), fetched a few pods at a time.
    pub async fn stacks(&mut self, round: &Round) -> Result<Vec<RankStacks>, Error> {
        let keys: Vec<String> = (0..round.nnodes).map(|n| self.keys.round_keys(round.number).stacks(n)).collect();
        let mut out = Vec::new();
        for chunk in keys.chunks(STACKS_PER_GET) {
            let values = self.store.client.multi_get(chunk).await.map_err(|e| self.lost(e))?;
            out.extend(values.iter().flat_map(|v| serde_json::from_slice::<Vec<RankStacks>>(v).unwrap_or_default()));
        }
        Ok(out)
    }
}
