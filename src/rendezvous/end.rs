//! How a round ends: publishing a failure, an abort or this pod's done,
//! watching for the end, reporting stopped workers and their failures,
//! deciding the verdict once for every pod, and leaving (a hang's stacks
//! go through [`super::hang`]).

use std::time::Duration;

use tokio::time::Instant;

use super::Error;
use super::join::MISSING_SHOWN;
use super::session::{Round, Session, Stopped, progress_tick, wait_get, wait_on};
use crate::supervise::policy::Verdict;
use crate::supervise::report::Failure;
use crate::supervise::round_end::RoundEnd;
use crate::waiting::Waiting;
use round::settle::{Decide, Finish, Got, Op, Settled};

/// How the store host's announcement of the job's end begins; the
/// round's verdict follows (none in serve mode's shutdown).
pub const JOB_ENDED: &str = "the job ended: ";

/// Up to this many pods, every pod waiting for the others to stop their
/// workers names the group ranks that have not; above it only the store
/// host's pod does (reading every rank's key once a second).
const EVERY_POD_NAMES_RUNNING: u32 = 64;

/// Longest the store host waits at the end of the job for the spares of
/// the last round to read its verdict (a spare that died is not waited
/// for longer).
const SPARES_READ_WAIT: Duration = Duration::from_secs(3);

impl Session {
    async fn end(&mut self, r: u64, end: &RoundEnd) -> Result<(), Error> {
        let key = self.keys.round_keys(r).end();
        self.store.client.compare_set(&key, b"", end.to_string().as_bytes()).await.map_err(|e| self.lost(e))?;
        Ok(())
    }

    /// A worker failed here: end the round as failed (first writer wins);
    /// `hang` marks the end so every pod reads its workers' stacks first.
    pub async fn publish_failure(&mut self, r: u64, fatal: bool, hang: bool) -> Result<(), Error> {
        self.end(r, &RoundEnd::Failure { fatal, hang }).await
    }

    /// This agent is leaving because of `signal`: it says so for a pod
    /// that comes to take its place meanwhile (`leaving/<uid>`: a
    /// replacement created while this pod terminates waits for it rather
    /// than being refused as a second live claimant), then ends the round.
    pub async fn publish_abort(&mut self, r: u64, signal: i32) -> Result<(), Error> {
        let leaving = self.keys.leaving(&self.me.uid);
        self.store.client.set(&leaving, signal.to_string().as_bytes()).await.map_err(|e| self.lost(e))?;
        self.end(r, &RoundEnd::Abort { uid: self.me.uid.to_string(), signal }).await
    }

    /// Every worker here is done; the last pod to say so ends the round.
    pub async fn publish_local_done(&mut self, round: &Round) -> Result<(), Error> {
        let n = self.store.client.add(&self.keys.round_keys(round.number).done(), 1).await.map_err(|e| self.lost(e))?;
        if n >= i64::from(round.nnodes) {
            self.end(round.number, &RoundEnd::Success).await?;
        }
        Ok(())
    }

    /// A future that resolves when the round's end is published, on its
    /// own connection; None when that connection broke (the store is lost).
    pub fn watch_end(&self, r: u64) -> impl std::future::Future<Output = Option<RoundEnd>> + Send + 'static {
        let dial = self.store.dial.clone();
        let key = self.keys.round_keys(r).end();
        async move { wait_get(dial, &key).await.ok().map(|v| RoundEnd::from_bytes(&v)) }
    }

    /// Record our failures and that our workers are gone; the last pod
    /// marks the round fully stopped.
    pub async fn report_stopped(&mut self, round: &Round, failures: &[Failure]) -> Result<(), Error> {
        let rk = self.keys.round_keys(round.number);
        let v = serde_json::to_vec(failures).unwrap_or_default();
        self.store.client.set(&rk.failures(round.group_rank), &v).await.map_err(|e| self.lost(e))?;
        if !failures.is_empty() {
            // Readers of every pod's failures read those listed: each pod
            // reads them all, so N keys each would cost the store N^2.
            let listed = format!("{},", round.group_rank);
            self.store.client.append(&rk.failed(), listed.as_bytes()).await.map_err(|e| self.lost(e))?;
        }
        let n =
            self.store.client.add(&self.keys.round_keys(round.number).stopped(), 1).await.map_err(|e| self.lost(e))?;
        if n >= i64::from(round.nnodes) {
            let k = self.keys.round_keys(round.number).all_stopped();
            self.store.client.set(&k, b"1").await.map_err(|e| self.lost(e))?;
        }
        Ok(())
    }

    /// Wait up to `limit` until every member reported stopped or the store
    /// host declared one dead, saying which group ranks are still running.
    pub async fn wait_stopped(&mut self, round: &Round, limit: Duration) -> Result<Stopped, Error> {
        let r = round.number;
        let all = self.keys.round_keys(r).all_stopped();
        let dead = self.keys.round_keys(r).dead();
        let all_w = wait_on(self.store.dial.clone(), std::slice::from_ref(&all), limit);
        let dead_w = wait_on(self.store.dial.clone(), std::slice::from_ref(&dead), limit);
        tokio::pin!(all_w, dead_w);
        let what = format!("the other pods of round {r} to stop their workers");
        let mut waiting = Waiting::new(what, Some(Instant::now() + limit));
        let mut tick = progress_tick();
        // Which ranks have not reported costs reading every rank's key:
        // the store host's pod, and every pod of a small round, says so.
        let names = self.roles.leads || round.nnodes <= EVERY_POD_NAMES_RUNNING;
        let keys: Vec<String> = (0..round.nnodes).map(|n| self.keys.round_keys(r).failures(n)).collect();
        loop {
            tokio::select! {
                ok = &mut all_w => { ok.map_err(|e| self.lost(e))?; break; }
                ok = &mut dead_w => { ok.map_err(|e| self.lost(e))?; break; }
                _ = tick.tick() => {
                    if !names {
                        let n = self.store.client.add(&self.keys.round_keys(r).stopped(), 0).await.map_err(|e| self.lost(e))?;
                        waiting.report(&format!("{n} of {} pods reported (the store host's pod names the others)", round.nnodes));
                        continue;
                    }
                    let reported = self.store.client.multi_get(&keys).await.map_err(|e| self.lost(e))?;
                    let running: Vec<String> = reported
                        .iter()
                        .enumerate()
                        .filter(|(_, v)| v.is_empty())
                        .map(|(n, _)| n.to_string())
                        .take(MISSING_SHOWN)
                        .collect();
                    waiting.report(&format!("group ranks [{}] have not reported", running.join(", ")));
                }
            }
        }
        let present = self.store.client.multi_get(&[all.clone(), dead.clone()]).await.map_err(|e| self.lost(e))?;
        Ok(Stopped { all_stopped: !present[0].is_empty(), dead: !present[1].is_empty() })
    }

    /// The round's published end (None when none is).
    pub async fn round_end(&mut self, r: u64) -> Result<Option<RoundEnd>, Error> {
        let v = self.get(&self.keys.round_keys(r).end()).await?;
        Ok((!v.is_empty()).then(|| RoundEnd::from_bytes(&v)))
    }

    /// Every member's failures in round `round` (members that did not report count as none).
    pub async fn failures(&mut self, round: &Round) -> Result<Vec<Failure>, Error> {
        let rk = self.keys.round_keys(round.number);
        let listed = self.get(&rk.failed()).await?;
        let mut ranks: Vec<u32> = String::from_utf8_lossy(&listed)
            .split(',')
            .filter_map(|n| n.parse().ok())
            .filter(|&n| n < round.nnodes)
            .collect();
        ranks.sort_unstable();
        ranks.dedup();
        if ranks.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = ranks.iter().map(|&n| rk.failures(n)).collect();
        let values = self.store.client.multi_get(&keys).await.map_err(|e| self.lost(e))?;
        Ok(values.iter().flat_map(|v| serde_json::from_slice::<Vec<Failure>>(v).unwrap_or_default()).collect())
    }

    /// Propose `v` as the round's verdict; returns the one every pod follows.
    /// A restart raises the job-wide counter. A round the job has moved two
    /// rounds past is forgotten (its keys are deleted, nobody agrees there
    /// any more): the pod regroups into the current one.
    /// The protocol's operations (`round::settle::Decide`), carried out.
    pub async fn decide(&mut self, r: u64, v: Verdict) -> Result<Verdict, Error> {
        let mut d = Decide::new(r);
        let mut agreed = v;
        loop {
            let got = match d.next() {
                Op::RaiseRound(to) => Got::Num(self.raise(&self.keys.round(), to).await?),
                Op::Propose => {
                    let key = self.keys.round_keys(r).verdict();
                    let got = self
                        .store
                        .client
                        .compare_set(&key, b"", v.to_string().as_bytes())
                        .await
                        .map_err(|e| self.lost(e))?;
                    agreed = String::from_utf8_lossy(&got).parse::<Verdict>().unwrap_or(v);
                    Got::Agreed { restart: if let Verdict::Restart(n) = agreed { Some(n) } else { None } }
                }
                Op::RaiseRestarts(n) => Got::Num(self.raise(&self.keys.restarts(), u64::from(n)).await?),
                Op::PointNext(_) => Got::Done,
                Op::Done(Settled::Forgotten) => {
                    tracing::info!(
                        round = r,
                        "the job moved two rounds on while this pod settled its round; regrouping"
                    );
                    return Ok(Verdict::Regroup);
                }
                Op::Done(_) => return Ok(agreed),
            };
            d.answer(got);
        }
    }

    /// Move the job past round `r` (after a regroup or restart verdict); a
    /// round the job has moved two rounds past needs no `next` (its keys
    /// may be deleted already, [`Session::decide`]).
    pub async fn finish_round(&mut self, r: u64) -> Result<(), Error> {
        let mut f = Finish::new(r);
        loop {
            let got = match f.next() {
                Op::RaiseRound(to) => Got::Num(self.raise(&self.keys.round(), to).await?),
                Op::PointNext(now) => {
                    self.point_next(r, now).await?;
                    Got::Done
                }
                Op::Propose | Op::RaiseRestarts(_) => Got::Done,
                Op::Done(_) => return Ok(()),
            };
            f.answer(got);
        }
    }

    /// Say we are done reading this round's results. The store host then
    /// waits (up to `limit`) for every pod to say so before its store goes
    /// away, so nobody loses the store in the middle of reading the outcome.
    /// It first announces the job's end with its verdict ([`JOB_ENDED`]):
    /// a spare is not counted among the pods, and one that loses the store
    /// before it read the verdict (between two rounds, say) reads it there.
    pub async fn leave(&mut self, round: &Round, host: bool, limit: Duration) -> Result<(), Error> {
        if host {
            let verdict = self.get(&self.keys.round_keys(round.number).verdict()).await.unwrap_or_default();
            self.announce_leaving(&format!("{JOB_ENDED}{}", String::from_utf8_lossy(&verdict))).await;
        }
        let n = self.store.client.add(&self.keys.round_keys(round.number).left(), 1).await.map_err(|e| self.lost(e))?;
        let all = self.keys.round_keys(round.number).all_left();
        if n >= i64::from(round.nnodes) {
            self.store.client.set(&all, b"1").await.map_err(|e| self.lost(e))?;
        }
        if host && !self.wait_for(&[all], limit).await? {
            tracing::warn!(
                round = round.number,
                "not every pod confirmed the end of the job; closing the store anyway"
            );
        }
        // Serve mode's spares leave with the members (`all_left`).
        if host && !self.roles.serving {
            self.spares_read_the_end(round).await?;
        }
        Ok(())
    }

    /// The store host, at the end of the job: wait (at most
    /// [`SPARES_READ_WAIT`]) until every spare that joined the last round
    /// has read its verdict (`rR/spare_left`), so none loses the store
    /// between the verdict's wake-up and its read.
    async fn spares_read_the_end(&mut self, round: &Round) -> Result<(), Error> {
        let joined =
            self.store.client.add(&self.keys.round_keys(round.number).join(), 0).await.map_err(|e| self.lost(e))?;
        let spares = joined.saturating_sub(i64::from(round.nnodes));
        if spares <= 0 {
            return Ok(());
        }
        let key = self.keys.round_keys(round.number).spare_left();
        let until = Instant::now() + SPARES_READ_WAIT;
        tracing::info!(spares, "waiting for the spares to read the end of the job");
        while self.store.client.add(&key, 0).await.map_err(|e| self.lost(e))? < spares {
            if Instant::now() >= until {
                tracing::warn!(spares, "not every spare read the end of the job; closing the store anyway");
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// Stop heartbeating and tell the store host this agent left cleanly:
    /// the heartbeat says `bye` on its own connection, so that its closing
    /// is not taken for a death (`Timing::lost_grace`); when it cannot, the
    /// session's connection says it.
    pub async fn bye(&mut self) {
        // Once: the heartbeat's task is awaited to its end here, and a
        // second await of it would panic.
        if self.watch.leave.is_cancelled() {
            return;
        }
        self.watch.leave.cancel();
        let said = tokio::time::timeout(Duration::from_secs(2), &mut self.watch.heartbeat).await;
        if matches!(said, Ok(Ok(true))) {
            return;
        }
        self.watch.heartbeat.abort();
        let key = self.keys.heartbeat(&self.me.uid);
        let _ = tokio::time::timeout(Duration::from_secs(2), self.store.client.set(&key, b"bye")).await;
    }
}
