//! Who holds a place in the job: one live agent per `claim/<place>` key (a
//! static job's node rank, an elastic job's host and node rank:
//! [`super::Member::place`]). An agent claims its place when it connects
//! and checks it before every round, so a second live claimant (a stale
//! pod back, two pods given the same rank) is refused before it takes a
//! slot in any round: the running job never sees it. A holder that is
//! leaving (it got a stop signal and wrote `leaving/<uid>`: a pod being
//! deleted while its replacement starts) is waited for instead. An agent whose
//! predecessor in the place is gone (it said `bye`, its heartbeat stood
//! still for two periods, or its heartbeat connection closed without a
//! `bye` and stayed closed for the lost grace: its process died) takes the
//! place over, as a pod restarted in place does.

use std::time::Duration;

use tokio::time::Instant;

use round::claim::{Claim, on_holder};
use round::monitor::{Beat, dead};

use super::Error;
use super::join::millis;
use super::session::Session;
use crate::store::LOST;

/// Most holders one claim contests before it gives up (each contest
/// watches a heartbeat, so a claim never loops fast).
const CONTESTS: u32 = 4;

/// Longest a new agent waits for a live holder of its place that is
/// leaving (its stop grace, a checkpoint, then the kernel's kill: a
/// Kubernetes pod's termination grace is 30 s by default).
const LEAVING_LIMIT: Duration = Duration::from_secs(600);

/// How long a holder's heartbeat may stand still before the holder is
/// taken for gone: two periods (one beat may be late or lost to a
/// reconnect) and a second for a loaded machine. The store host declares
/// a member dead only after the whole heartbeat timeout; a claim need not
/// wait that long, because a live holder shows itself within one period.
fn still_limit(heartbeat: Duration) -> Duration {
    heartbeat * 2 + Duration::from_secs(1)
}

/// `node rank N (host pid P)` for an agent uid (`host#pid#nonce`).
pub(super) fn who_holds(node_rank: u32, uid: &str) -> String {
    let mut parts = uid.rsplitn(3, '#');
    match (parts.next(), parts.next(), parts.next()) {
        (Some(_nonce), Some(pid), Some(host)) => format!("node rank {node_rank} ({host} pid {pid})"),
        _ => format!("node rank {node_rank} ({uid})"),
    }
}

impl Session {
    /// Hold this agent's place in the job, taking it over from a holder
    /// that is gone; [`Error::Duplicate`] naming both agents when another
    /// live agent holds it. Called when the agent connects and before
    /// every round (one GET when the place is ours).
    pub(super) async fn claim(&mut self) -> Result<(), Error> {
        let key = self.keys.claim(&self.me.place());
        let mine = self.me.uid.clone().into_bytes();
        let mut held = self.get(&key).await?;
        let mut holder = String::new();
        for _ in 0..CONTESTS {
            if held == mine {
                return Ok(());
            }
            if held.is_empty() {
                held = self.store.client.compare_set(&key, b"", &mine).await.map_err(|e| self.lost(e))?;
                if held.is_empty() {
                    held = self.get(&key).await?;
                }
                continue;
            }
            holder = String::from_utf8_lossy(&held).chars().take(256).collect();
            let gone = self.gone(&holder, true).await?;
            let leaving = gone.is_none() && !self.get(&self.keys.leaving(&holder)).await?.is_empty();
            let why = match (on_holder(gone.is_some(), leaving), gone) {
                (Claim::TakeOver, Some(why)) => why,
                (Claim::TakeOver, None) => "taken over".to_string(),
                (Claim::Outwait, _) => self.outwait(&holder).await?.ok_or_else(|| self.duplicate(&holder))?,
                (Claim::Refuse, _) => return Err(self.duplicate(&holder)),
            };
            tracing::warn!(
                node_rank = self.me.node_rank,
                previous = %holder,
                "the agent that held this pod's place is gone ({why}); this agent takes it over"
            );
            let got = self.store.client.compare_set(&key, &held, &mine).await.map_err(|e| self.lost(e))?;
            // A missing key answers with the expected value: read it again.
            held = if got == held { self.get(&key).await? } else { got };
        }
        if held == mine { Ok(()) } else { Err(self.duplicate(&holder)) }
    }

    /// A live holder that is leaving (it got a stop signal and said so,
    /// `leaving/<uid>`: a pod being deleted while its replacement starts)
    /// is waited for, at most [`LEAVING_LIMIT`]: Some(why) once it is
    /// gone. None at once for a holder that is not leaving (a second live
    /// claimant), or one still alive at the limit.
    async fn outwait(&mut self, holder: &str) -> Result<Option<String>, Error> {
        let leaving = self.keys.leaving(holder);
        if self.get(&leaving).await?.is_empty() {
            return Ok(None);
        }
        tracing::info!(
            node_rank = self.me.node_rank,
            holder = %holder,
            limit_s = LEAVING_LIMIT.as_secs_f64(),
            "the agent that holds this pod's place is leaving (it got a stop signal); waiting for it to go"
        );
        let until = Instant::now() + LEAVING_LIMIT;
        while Instant::now() < until {
            if let Some(why) = self.gone(holder, false).await? {
                return Ok(Some(why));
            }
        }
        Ok(None)
    }

    /// Whether the agent `uid` is gone: Some(why) when it said `bye`, its
    /// heartbeat stood still for [`still_limit`], or read `lost` for the
    /// lost grace (`round::monitor::dead`, as the store host judges a
    /// member); None when it beat.
    async fn gone(&mut self, uid: &str, say: bool) -> Result<Option<String>, Error> {
        let hb = self.keys.heartbeat(uid);
        let first = self.get(&hb).await?;
        if first == b"bye" {
            return Ok(Some("it left the job".into()));
        }
        let limit = still_limit(self.timing.heartbeat);
        if say {
            tracing::info!(
                node_rank = self.me.node_rank,
                holder = %uid,
                limit_s = limit.as_secs_f64(),
                "another agent holds this pod's place; watching its heartbeat"
            );
        }
        let poll = (self.timing.heartbeat / 4).clamp(Duration::from_millis(20), Duration::from_millis(250));
        let grace = self.timing.lost_grace;
        let until = Instant::now() + limit;
        // Since when its heartbeat has read `lost` (its connection closed
        // by its end without a bye: its process died), as this agent saw.
        let mut lost_since = (first == LOST).then(Instant::now);
        while Instant::now() < until {
            tokio::time::sleep(poll).await;
            let now = self.get(&hb).await?;
            if now == b"bye" {
                return Ok(Some("it left the job".into()));
            }
            if now == LOST {
                let since = *lost_since.get_or_insert_with(Instant::now);
                if dead(Beat::Lost, millis(since.elapsed()), millis(limit), millis(grace)) {
                    return Ok(Some(format!(
                        "its store connection closed without a bye and did not come back in {:.1} s: it died",
                        grace.as_secs_f64()
                    )));
                }
            } else if now != first {
                return Ok(None);
            }
        }
        Ok(Some(format!("its heartbeat stood still for {:.1} s", limit.as_secs_f64())))
    }

    fn duplicate(&self, holder: &str) -> Error {
        Error::Duplicate {
            node_rank: self.me.node_rank,
            holder: who_holds(self.me.node_rank, holder),
            ours: format!("{} pid {}", self.me.host, self.me.pid),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holders_are_named_by_host_and_pid() {
        assert_eq!(who_holds(1, "127.0.0.2#4242#0a1b2c3d"), "node rank 1 (127.0.0.2 pid 4242)");
        assert_eq!(who_holds(0, "odd"), "node rank 0 (odd)");
    }

    #[test]
    fn a_holder_may_miss_one_beat_and_stay_alive() {
        assert_eq!(still_limit(Duration::from_secs(1)), Duration::from_secs(3));
        assert!(still_limit(Duration::from_millis(100)) > Duration::from_millis(200));
    }
}
