//! Forming a round, as operations: from taking an arrival slot in round R
//! to a place in it (a group rank, or a spare's place beside it), to the
//! round the job moved on to, or to the join deadline. [`Form`] says which
//! store operation comes next ([`Op`]); the agent (`trainlet::rendezvous::
//! join`) and the simulation carry it out and answer with what they got
//! ([`Got`]) and the time now, in a unit of their own (milliseconds, the
//! simulation's ticks): the machine compares only the times it is given.
//!
//! The order, and why:
//! 1. `ADD rR/join`: the slot is the count minus one.
//! 2. Raise `round` to R: a pod that stalled while two rounds formed took a
//!    slot in a forgotten round ([`forgotten`]) and follows the job.
//! 3. `SET rR/lead` (the store host's pod of a job with spares: the others
//!    wait for it), then `SET rR/m/<slot>` (the member record), then what
//!    the slot says ([`on_slot`]): close, open the last call, or wait.
//! 4. Wait for `rR/closed`, `rR/next` (the job moved on) or `rR/quorum`
//!    (the last call: at its end the pod closes the round with whoever is
//!    in, [`at_last_call`]), until the join deadline.
//! 5. `GET rR/closed`: its [`place`]. Past the round's size: a spare.
//! 6. The pod that closed it waits for every member record, reads them,
//!    and forms the round with one COMPARE_SET of `rR/members`, the
//!    members in group-rank order ([`closer_forms`]): a member's group
//!    rank is its place in that list, so a round forms, ranks and all, in
//!    one write, and a closer that stalls or dies leaves either a formed
//!    round or none. A pod that joined twice (it restarted while the round
//!    was open) makes the round start over ([`first_repeat`]).
//! 7. Every other member waits for `rR/members` (or `rR/next`) for the
//!    heartbeat timeout and a grace; past it, it gives the round up with
//!    the same COMPARE_SET ([`given_up`]), or finds it formed. A formed
//!    round is never left here: a member that died after it formed is the
//!    round's end to decide (the store host's heartbeat watch).

use crate::join::{
    ABANDONED, OnSlot, Place, at_last_call, closer_forms, first_repeat, forgotten, given_up, on_slot, place,
};
use crate::mutant::{Mutant, on};

/// A key the formation reads or writes: the job's `round`, or round R's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum K {
    /// `round`.
    Round,
    /// `rR/join`.
    Join,
    /// `rR/lead`.
    Lead,
    /// `rR/m/<slot>`.
    Member(u64),
    /// `rR/closed`.
    Closed,
    /// `rR/quorum`.
    Quorum,
    /// `rR/next`.
    Next,
    /// `rR/members`.
    Members,
}

/// The next store operation, and the answer it wants ([`Got`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// ADD to a counter: [`Got::Num`], the value after.
    Add(K, i64),
    /// Raise the job's `round` to at least this: [`Got::Num`], the round now.
    Raise(u64),
    /// SET: [`Got::Done`].
    Set(K, Vec<u8>),
    /// COMPARE_SET from unset: [`Got::Bytes`], the value there afterwards.
    Cas(K, Vec<u8>),
    /// GET: [`Got::Bytes`] (empty when unset).
    Get(K),
    /// WAIT until any of these keys is set, or the time `until`:
    /// [`Got::Fired`] with the key, or [`Got::TimedOut`].
    WaitAny(Vec<K>, u64),
    /// WAIT until every member record of slots `0..size` is set, or the
    /// time `until`: [`Got::Done`] or [`Got::TimedOut`].
    WaitRecords(u64, u64),
    /// Read the member records of slots `0..size` and put them in
    /// group-rank order: [`Got::Records`].
    Records(u64),
    /// Move the job from R to this round (raise `round`, then
    /// COMPARE_SET `rR/next`): [`Got::Done`].
    Advance(u64),
    /// Nothing more: the formation's outcome.
    Done(Outcome),
}

/// What an operation got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Got {
    /// A number ([`Op::Add`], [`Op::Raise`]).
    Num(u64),
    /// A value ([`Op::Cas`], [`Op::Get`]).
    Bytes(Vec<u8>),
    /// This key was set ([`Op::WaitAny`]).
    Fired(K),
    /// The wait's time came first.
    TimedOut,
    /// Done.
    Done,
    /// The member records read ([`Op::Records`]).
    Records(Records),
}

/// The round as its closer read it: the work of the agent's own code (the
/// rank assignment), handed back for the protocol's decisions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Records {
    /// Each member's place (its node rank, or node rank and host), by slot.
    pub places: Vec<String>,
    /// The value of `rR/members`: the members in group-rank order.
    pub members: Vec<u8>,
}

/// How a formation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// A member: the value of `rR/members` (its group rank is its place there).
    Formed(Vec<u8>),
    /// A spare beside a round of `size` members.
    Spare {
        /// The round's members.
        size: u64,
    },
    /// The job moved on to this round (at least R + 1).
    Moved(u64),
    /// The join deadline passed before the round closed.
    TimedOut,
}

/// The formation's bounds, in the caller's unit of time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// MIN pods.
    pub min: u64,
    /// MAX pods.
    pub max: u64,
    /// The last call's length.
    pub last_call: u64,
    /// The heartbeat timeout: how long the closer waits for the records.
    pub heartbeat: u64,
    /// Added to the heartbeat timeout for a member's wait for the members.
    pub grace: u64,
    /// The join deadline: the time the round must close by.
    pub deadline: u64,
}

/// Where the formation is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum At {
    TakeSlot,
    CheckRound { slot: u64 },
    Lead { slot: u64 },
    Announce { slot: u64 },
    OnSlot { slot: u64, close: Option<crate::Closed> },
    WaitClosed { slot: u64 },
    CountAtLastCall { slot: u64 },
    CloseAtLastCall { slot: u64, closed: crate::Closed },
    ReadNext,
    ReadClosed { slot: u64 },
    WaitRecords { size: u64, until: u64 },
    ReadRecords { size: u64 },
    FormMembers { records: Records },
    WaitMembers { until: u64 },
    ReadMembers,
    GiveUp,
    Advance,
    Done(Outcome),
}

/// One pod's formation of round R.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Form {
    r: u64,
    bounds: Bounds,
    /// Its member record.
    record: Vec<u8>,
    /// `rR/lead`'s value when it leads (the store host's pod of a job with spares).
    lead: Option<Vec<u8>>,
    at: At,
    /// Its arrival slot, once it took one.
    slot: Option<u64>,
    /// Elastic: the quorum was not seen yet.
    quorum_unseen: bool,
    /// The end of the last call, once it opened.
    last_call: Option<u64>,
}

impl Form {
    /// A pod about to take a slot in round `r`; `record` is its member
    /// record, `lead` the value of `rR/lead` when it leads (the store host's
    /// pod of a job with spares: the others wait for it).
    pub fn new(r: u64, bounds: Bounds, record: Vec<u8>, lead: Option<Vec<u8>>) -> Form {
        let quorum_unseen = bounds.min < bounds.max;
        Form { r, bounds, record, lead, at: At::TakeSlot, slot: None, quorum_unseen, last_call: None }
    }

    /// The round.
    pub fn round(&self) -> u64 {
        self.r
    }

    /// Its arrival slot, once it took one.
    pub fn slot(&self) -> Option<u64> {
        self.slot
    }

    /// It holds a slot in a round that has not closed (a stop withdraws it).
    pub fn in_open_round(&self) -> bool {
        matches!(
            self.at,
            At::Lead { .. }
                | At::Announce { .. }
                | At::OnSlot { .. }
                | At::WaitClosed { .. }
                | At::CountAtLastCall { .. }
                | At::CloseAtLastCall { .. }
        )
    }

    /// It waits for pods to join (its waiting line says who is in).
    pub fn waits_for_pods(&self) -> bool {
        matches!(self.at, At::WaitClosed { .. })
    }

    /// The join deadline: the time the round must close by.
    pub fn deadline(&self) -> u64 {
        self.bounds.deadline
    }

    /// The end of the last call, once it opened.
    pub fn last_call(&self) -> Option<u64> {
        self.last_call
    }

    /// The next operation (the same until it is answered).
    pub fn next(&self) -> Op {
        match &self.at {
            At::TakeSlot => Op::Add(K::Join, 1),
            At::CheckRound { .. } => Op::Raise(self.r),
            At::Lead { .. } => Op::Set(K::Lead, self.lead.clone().unwrap_or_default()),
            At::Announce { slot } => Op::Set(K::Member(*slot), self.record.clone()),
            At::OnSlot { close: Some(c), .. } => Op::Cas(K::Closed, c.value().into_bytes()),
            At::OnSlot { close: None, .. } => Op::Set(K::Quorum, b"1".to_vec()),
            At::WaitClosed { .. } => {
                let mut any = vec![K::Closed, K::Next];
                if self.quorum_unseen {
                    any.push(K::Quorum);
                }
                let until = self.last_call.map_or(self.bounds.deadline, |at| at.min(self.bounds.deadline));
                Op::WaitAny(any, until)
            }
            At::CountAtLastCall { .. } => Op::Add(K::Join, 0),
            At::CloseAtLastCall { closed, .. } => Op::Cas(K::Closed, closed.value().into_bytes()),
            At::ReadNext => Op::Get(K::Next),
            At::ReadClosed { .. } => Op::Get(K::Closed),
            At::WaitRecords { size, until, .. } => Op::WaitRecords(*size, *until),
            At::ReadRecords { size, .. } => Op::Records(*size),
            At::FormMembers { records } => Op::Cas(K::Members, records.members.clone()),
            At::WaitMembers { until } => Op::WaitAny(vec![K::Members, K::Next], *until),
            At::ReadMembers => Op::Get(K::Members),
            At::GiveUp => Op::Cas(K::Members, ABANDONED.to_vec()),
            At::Advance => Op::Advance(self.r + 1),
            At::Done(o) => Op::Done(o.clone()),
        }
    }

    /// The answer to [`Form::next`]'s operation, got at time `now`; then
    /// the next operation. An answer of the wrong kind is taken as the
    /// emptiest one of the right kind (0, an empty value, a timeout).
    pub fn answer(&mut self, got: Got, now: u64) -> Op {
        let at = std::mem::replace(&mut self.at, At::Advance);
        self.at = self.after(at, got, now);
        self.next()
    }

    fn after(&mut self, at: At, got: Got, now: u64) -> At {
        let r = self.r;
        match at {
            At::TakeSlot => {
                let slot = num(&got).saturating_sub(1);
                self.slot = Some(slot);
                At::CheckRound { slot }
            }
            At::CheckRound { slot } => match forgotten(r, num(&got)) {
                Some(to) => At::Done(Outcome::Moved(to)),
                None if self.lead.is_some() => At::Lead { slot },
                None => At::Announce { slot },
            },
            At::Lead { slot } => At::Announce { slot },
            At::Announce { slot } => match on_slot(slot + 1, self.bounds.min, self.bounds.max) {
                OnSlot::Close(c) => At::OnSlot { slot, close: Some(c) },
                OnSlot::LastCall => At::OnSlot { slot, close: None },
                OnSlot::Wait => At::WaitClosed { slot },
            },
            At::OnSlot { slot, .. } => At::WaitClosed { slot },
            At::WaitClosed { slot } => match got {
                Got::Fired(K::Closed) => At::ReadClosed { slot },
                Got::Fired(K::Next) => At::ReadNext,
                Got::Fired(K::Quorum) => {
                    self.quorum_unseen = false;
                    self.last_call = Some(now + self.bounds.last_call);
                    At::WaitClosed { slot }
                }
                _ if self.last_call.is_some_and(|at| now >= at) => At::CountAtLastCall { slot },
                _ if now >= self.bounds.deadline => At::Done(Outcome::TimedOut),
                _ => At::WaitClosed { slot },
            },
            At::CountAtLastCall { slot } => {
                At::CloseAtLastCall { slot, closed: at_last_call(num(&got), slot, self.bounds.max) }
            }
            At::CloseAtLastCall { slot, .. } => At::ReadClosed { slot },
            At::ReadNext => {
                let to = text_u64(&bytes(got)).unwrap_or(r + 1).max(r + 1);
                At::Done(Outcome::Moved(to))
            }
            At::ReadClosed { slot } => match place(&bytes(got), slot) {
                Place::Spare { size } => At::Done(Outcome::Spare { size }),
                Place::Member { size, assigns: true } => At::WaitRecords { size, until: now + self.bounds.heartbeat },
                Place::Member { assigns: false, .. } => {
                    At::WaitMembers { until: now + self.bounds.heartbeat + self.bounds.grace }
                }
            },
            At::WaitRecords { size, .. } => match got {
                Got::Done => At::ReadRecords { size },
                // A pod took a slot but never announced itself.
                _ => At::Advance,
            },
            At::ReadRecords { .. } => match got {
                // A pod joined twice (it restarted while the round was
                // open): its old slot is stale; the live pods meet again.
                Got::Records(records) if first_repeat(&records.places).is_none() => At::FormMembers { records },
                _ => At::Advance,
            },
            At::FormMembers { .. } => {
                let members = bytes(got);
                if closer_forms(&members) {
                    At::Done(Outcome::Formed(members))
                } else {
                    // The others gave the round up while this pod was slow.
                    At::Advance
                }
            }
            At::WaitMembers { .. } => match got {
                Got::Fired(K::Members) => At::ReadMembers,
                Got::Fired(K::Next) => At::ReadNext,
                _ => At::GiveUp,
            },
            // Given up by another pod (which moves the job on too): follow.
            At::ReadMembers => formed_or_follow(bytes(got), false),
            At::GiveUp => formed_or_follow(bytes(got), on(Mutant::MemberLeavesFormedRound)),
            At::Advance => At::Done(Outcome::Moved(r + 1)),
            At::Done(o) => At::Done(o),
        }
    }
}

/// What a member that was not the closer found in `rR/members`: the round
/// formed (the closer wrote it, meanwhile), or it was given up: follow the
/// job on. `leaves`: the mutant that leaves a formed round all the same.
fn formed_or_follow(members: Vec<u8>, leaves: bool) -> At {
    if given_up(&members) || members.is_empty() || leaves { At::Advance } else { At::Done(Outcome::Formed(members)) }
}

fn num(got: &Got) -> u64 {
    match got {
        Got::Num(n) => *n,
        _ => 0,
    }
}

fn bytes(got: Got) -> Vec<u8> {
    match got {
        Got::Bytes(b) => b,
        _ => Vec::new(),
    }
}

fn text_u64(v: &[u8]) -> Option<u64> {
    std::str::from_utf8(v).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: Bounds = Bounds { min: 2, max: 2, last_call: 30, heartbeat: 100, grace: 20, deadline: 1_000 };

    fn form(bounds: Bounds, lead: bool) -> Form {
        Form::new(5, bounds, b"me".to_vec(), lead.then(|| b"1".to_vec()))
    }

    #[test]
    fn the_last_of_a_static_round_closes_it_and_forms_it_in_one_write() {
        let mut f = form(B, false);
        assert_eq!(f.next(), Op::Add(K::Join, 1));
        assert_eq!(f.answer(Got::Num(2), 0), Op::Raise(5));
        assert_eq!(f.slot(), Some(1));
        assert_eq!(f.answer(Got::Num(5), 0), Op::Set(K::Member(1), b"me".to_vec()));
        assert!(f.in_open_round());
        assert_eq!(f.answer(Got::Done, 0), Op::Cas(K::Closed, b"2:1".to_vec()));
        assert_eq!(f.answer(Got::Bytes(b"2:1".to_vec()), 0), Op::WaitAny(vec![K::Closed, K::Next], 1_000));
        assert_eq!(f.answer(Got::Fired(K::Closed), 1), Op::Get(K::Closed));
        assert_eq!(f.answer(Got::Bytes(b"2:1".to_vec()), 2), Op::WaitRecords(2, 102));
        assert!(!f.in_open_round());
        assert_eq!(f.answer(Got::Done, 3), Op::Records(2));
        let records = Records { places: vec!["0".into(), "1".into()], members: b"a,b".to_vec() };
        assert_eq!(f.answer(Got::Records(records), 4), Op::Cas(K::Members, b"a,b".to_vec()));
        assert_eq!(f.answer(Got::Bytes(b"a,b".to_vec()), 5), Op::Done(Outcome::Formed(b"a,b".to_vec())));
    }

    #[test]
    fn an_elastic_round_closes_at_the_end_of_its_last_call() {
        let mut f = form(Bounds { min: 2, max: 4, ..B }, true);
        f.answer(Got::Num(2), 0);
        assert_eq!(f.answer(Got::Num(5), 0), Op::Set(K::Lead, b"1".to_vec()));
        assert_eq!(f.answer(Got::Done, 0), Op::Set(K::Member(1), b"me".to_vec()));
        assert_eq!(f.answer(Got::Done, 0), Op::Set(K::Quorum, b"1".to_vec()));
        assert_eq!(f.answer(Got::Done, 0), Op::WaitAny(vec![K::Closed, K::Next, K::Quorum], 1_000));
        assert_eq!(f.answer(Got::Fired(K::Quorum), 10), Op::WaitAny(vec![K::Closed, K::Next], 40));
        assert_eq!(f.last_call(), Some(40));
        assert_eq!(f.answer(Got::TimedOut, 40), Op::Add(K::Join, 0));
        assert_eq!(f.answer(Got::Num(3), 40), Op::Cas(K::Closed, b"3:1".to_vec()));
        assert_eq!(f.answer(Got::Bytes(b"3:0".to_vec()), 41), Op::Get(K::Closed));
        assert_eq!(f.answer(Got::Bytes(b"3:0".to_vec()), 42), Op::WaitAny(vec![K::Members, K::Next], 162));
        assert_eq!(f.answer(Got::Fired(K::Members), 50), Op::Get(K::Members));
        assert_eq!(f.answer(Got::Bytes(b"a,b,c".to_vec()), 51), Op::Done(Outcome::Formed(b"a,b,c".to_vec())));
    }

    #[test]
    fn a_pod_past_the_size_is_a_spare_and_one_in_a_forgotten_round_follows_the_job() {
        let mut f = form(B, false);
        f.answer(Got::Num(3), 0);
        f.answer(Got::Num(5), 0);
        assert_eq!(f.answer(Got::Done, 0), Op::WaitAny(vec![K::Closed, K::Next], 1_000));
        f.answer(Got::Fired(K::Closed), 1);
        assert_eq!(f.answer(Got::Bytes(b"2:1".to_vec()), 1), Op::Done(Outcome::Spare { size: 2 }));

        let mut late = form(B, false);
        late.answer(Got::Num(1), 0);
        assert_eq!(late.answer(Got::Num(7), 0), Op::Done(Outcome::Moved(7)));
    }

    #[test]
    fn waits_end_at_the_deadline_or_the_next_round() {
        let mut f = form(B, false);
        f.answer(Got::Num(1), 0);
        f.answer(Got::Num(5), 0);
        f.answer(Got::Done, 0);
        assert_eq!(f.answer(Got::TimedOut, 1_000), Op::Done(Outcome::TimedOut));

        let mut g = form(B, false);
        g.answer(Got::Num(1), 0);
        g.answer(Got::Num(5), 0);
        g.answer(Got::Done, 0);
        assert_eq!(g.answer(Got::Fired(K::Next), 3), Op::Get(K::Next));
        assert_eq!(g.answer(Got::Bytes(b"9".to_vec()), 3), Op::Done(Outcome::Moved(9)));
    }

    #[test]
    fn a_member_past_the_bound_gives_the_round_up_or_finds_it_formed() {
        let start = |f: &mut Form| {
            f.answer(Got::Num(1), 0);
            f.answer(Got::Num(5), 0);
            f.answer(Got::Done, 0);
            f.answer(Got::Fired(K::Closed), 0);
            f.answer(Got::Bytes(b"2:1".to_vec()), 0)
        };
        let mut f = form(B, false);
        assert_eq!(start(&mut f), Op::WaitAny(vec![K::Members, K::Next], 120));
        assert_eq!(f.answer(Got::TimedOut, 120), Op::Cas(K::Members, ABANDONED.to_vec()));
        assert_eq!(f.answer(Got::Bytes(ABANDONED.to_vec()), 120), Op::Advance(6));
        assert_eq!(f.answer(Got::Done, 121), Op::Done(Outcome::Moved(6)));

        let mut g = form(B, false);
        start(&mut g);
        g.answer(Got::TimedOut, 120);
        let formed = Op::Done(Outcome::Formed(b"a,b".to_vec()));
        assert_eq!(g.answer(Got::Bytes(b"a,b".to_vec()), 120), formed, "a formed round is not left");

        let mut h = form(B, false);
        start(&mut h);
        h.answer(Got::Fired(K::Members), 50);
        assert_eq!(h.answer(Got::Bytes(ABANDONED.to_vec()), 50), Op::Advance(6), "another gave it up");
    }

    #[test]
    fn a_closer_starts_over_on_a_missing_or_repeated_member_or_a_given_up_round() {
        let closer = || {
            let mut f = form(B, false);
            f.answer(Got::Num(2), 0);
            f.answer(Got::Num(5), 0);
            f.answer(Got::Done, 0);
            f.answer(Got::Bytes(b"2:1".to_vec()), 0);
            f.answer(Got::Fired(K::Closed), 0);
            f.answer(Got::Bytes(b"2:1".to_vec()), 0);
            f
        };
        let mut f = closer();
        assert_eq!(f.answer(Got::TimedOut, 100), Op::Advance(6));

        let mut g = closer();
        g.answer(Got::Done, 1);
        let twice = Records { places: vec!["1".into(), "1".into()], members: b"a,b".to_vec() };
        assert_eq!(g.answer(Got::Records(twice), 1), Op::Advance(6));

        let mut h = closer();
        h.answer(Got::Done, 1);
        let ok = Records { places: vec!["0".into(), "1".into()], members: b"a,b".to_vec() };
        h.answer(Got::Records(ok), 1);
        assert_eq!(h.answer(Got::Bytes(ABANDONED.to_vec()), 2), Op::Advance(6));
    }
}
