//! What a simulated agent's state is made of ([`Phase`], [`Member`]), the
//! member records it writes, and what stands in for the agent's own code
//! where that is not the protocol's: the rank assignment ([`assign`],
//! `rendezvous::member::assign`'s rules for the cases simulated) and the
//! verdict ([`verdict_for`], the worker policy's for the ends simulated).

use round::spare::VerdictRead;

use super::store::{End, Uid};
use super::world::STOP_WAIT;

/// Where an agent is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    /// A container starts: it joins the round after the last it knows.
    Start,
    /// Find the open round (at least `want`) and join it.
    Join {
        /// The round it wants.
        want: u64,
    },
    /// `--spares`: wait for the store host's pod to join round `r` first.
    AfterLead {
        /// The round.
        r: u64,
    },
    /// A former spare lets round `p`'s live members join `r` first.
    Defer {
        /// The round it waited beside.
        p: u64,
        /// The round to join.
        r: u64,
        /// When it stops waiting.
        until: u64,
    },
    /// Form round R: the protocol's formation, one operation a step.
    Form(Box<round::form::Form>),
    /// Its workers run.
    Running(Member),
    /// Report its workers stopped.
    Stopping(Member),
    /// Wait for the others to stop.
    WaitStopped(Member, u64),
    /// Propose the verdict and follow the agreed one.
    Decide(Member),
    /// Leave the job (the store host last, closing its store).
    Leave {
        /// Its round.
        m: Member,
        /// The verdict.
        verdict: String,
        /// How far it got.
        stage: u8,
        /// The bound of the current wait.
        until: u64,
    },
    /// Past the round's size: see who holds the round.
    SpareArrive {
        /// The round.
        r: u64,
        /// Its size.
        size: u64,
        /// The bound.
        until: u64,
    },
    /// Wait as a spare.
    Spare {
        /// The round.
        r: u64,
        /// Its size.
        size: u64,
        /// The protocol's wait, one operation a step.
        wait: round::spare::SpareWait,
    },
    /// The store went away: wait for the host's word.
    Reconnect {
        /// The end of the settle time.
        until: u64,
        /// The job's end was in hand when the store went.
        in_hand: bool,
    },
    /// Wait for a store to come back.
    Rejoin {
        /// The join deadline.
        until: u64,
        /// The host said nothing.
        no_word: bool,
    },
    /// Another agent holds its place: watch its heartbeat.
    Claim {
        /// The holder's uid.
        holder: Uid,
        /// When the watch ends.
        until: u64,
        /// The round it wants next.
        want: u64,
    },
    /// Gone.
    Gone,
}

/// A member's place in a formed round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    /// The round.
    pub r: u64,
    /// Its group rank.
    pub rank: u32,
    /// The round's members.
    pub size: u64,
    /// Its workers finished.
    pub done: bool,
}

/// A member record in the simulated store: `uid:pod:last rank`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemberRecord {
    /// Its uid.
    pub uid: Uid,
    /// Its pod (its place).
    pub pod: u32,
    /// Its last group rank (`--spares`).
    pub last: Option<u32>,
}

impl MemberRecord {
    /// The value written.
    pub fn value(&self) -> String {
        format!("{}:{}:{}", self.uid, self.pod, self.last.map_or_else(|| "-".into(), |r| r.to_string()))
    }

    /// The record read; None when unset.
    pub fn read(v: &[u8]) -> Option<MemberRecord> {
        let text = std::str::from_utf8(v).ok()?;
        let mut it = text.split(':');
        Some(MemberRecord {
            uid: it.next()?.parse().ok()?,
            pod: it.next()?.parse().ok()?,
            last: it.next()?.parse().ok(),
        })
    }
}

/// Group ranks by slot, as `rendezvous::member::assign` gives them for the
/// cases simulated: a static job's by node rank; with `--spares` members
/// keep theirs and the rest take the lowest free; an elastic one's by
/// arrival.
pub fn assign(members: &[MemberRecord], spares: bool, elastic: bool) -> Vec<u32> {
    let n = u32::try_from(members.len()).unwrap_or(u32::MAX);
    if !spares && !elastic {
        return members.iter().map(|m| m.pod).collect();
    }
    if !spares {
        return (0..n).collect();
    }
    let mut taken: Vec<u32> = Vec::new();
    let mut ranks: Vec<Option<u32>> =
        members.iter().map(|m| m.last.filter(|r| *r < n && !taken.contains(r)).inspect(|r| taken.push(*r))).collect();
    let mut free = (0..n).filter(|r| !taken.contains(r));
    for r in &mut ranks {
        if r.is_none() {
            *r = free.next();
        }
    }
    ranks.into_iter().map(|r| r.unwrap_or(u32::MAX)).collect()
}

/// A verdict as a spare reads it.
pub fn read_verdict(v: &[u8]) -> VerdictRead {
    match v {
        b"success" => VerdictRead::Final { success: true },
        b"fail" => VerdictRead::Final { success: false },
        _ => VerdictRead::MovesOn,
    }
}

/// What the pods decide after an end (the worker policy's, for the ends
/// simulated): a failure restarts while restarts are left, a change of
/// members regroups, a served run's end lets the pods serve on.
pub fn verdict_for(end: Option<End>, restarts: u32, max_restarts: u32, serving: bool) -> String {
    match end {
        Some(End::Success) => "success".into(),
        Some(End::Failure) if serving || restarts >= max_restarts => "fail".into(),
        Some(End::Failure) => format!("restart:{}", restarts + 1),
        _ => "regroup".into(),
    }
}

/// A comma-separated list of uids.
pub fn parse_uids(v: &[u8]) -> Vec<Uid> {
    String::from_utf8_lossy(v).split(',').filter_map(|u| u.trim().parse().ok()).collect()
}

/// The bound of the wait for the other pods to stop.
pub fn stop_wait(tick: u64) -> u64 {
    tick + STOP_WAIT
}
