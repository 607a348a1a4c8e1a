//! A simulated agent forms a round: it carries out `round::form::Form`'s
//! operations against its simulated store, one per scheduler tick (a
//! WAIT holds the agent until its key is set or its time comes), exactly
//! as `trainlet::rendezvous::join` carries them out against the real one,
//! and checks the round each member found formed (one holder per group
//! rank; the store host in every round of a job with spares).

use round::form::{Bounds, Form, Got, K, Op, Outcome, Records};

use super::agent::Agent;
use super::phase::{Member, MemberRecord, Phase, assign, parse_uids};
use super::store::Key;
use super::world::{Code, Env, HEARTBEAT_TIMEOUT, Kind, LAST_CALL};

/// A member's wait for its rank outlasts the heartbeat timeout by this.
const RANK_GRACE: u64 = 2;

impl Agent {
    /// The phase that forms round `r`: the formation's first operation.
    pub(super) fn forming(&self, env: &Env, r: u64) -> Phase {
        let bounds = Bounds {
            min: u64::from(env.cfg.min),
            max: u64::from(env.cfg.max),
            last_call: LAST_CALL,
            heartbeat: HEARTBEAT_TIMEOUT,
            grace: RANK_GRACE,
            deadline: self.deadline,
        };
        let record = MemberRecord { uid: self.uid, pod: self.pod, last: self.last_rank.map(|(rank, _)| rank) };
        let lead = (self.hosts() && env.cfg.spares_flag).then(|| b"1".to_vec());
        Phase::Form(Box::new(Form::new(r, bounds, record.value().into_bytes(), lead)))
    }

    /// One operation of the formation (or nothing, while a WAIT holds).
    pub(super) fn form(&mut self, env: &mut Env, mut f: Box<Form>) {
        let r = f.round();
        let key = |k: K| match k {
            K::Round => Key::Round,
            K::Join => Key::Join(r),
            K::Lead => Key::Lead(r),
            K::Member(slot) => Key::Member(r, slot),
            K::Closed => Key::Closed(r),
            K::Quorum => Key::Quorum(r),
            K::Next => Key::Next(r),
            K::Members => Key::Members(r),
        };
        let (tick, since, store) = (env.tick, self.since, self.store);
        let op = f.next();
        let got = match op.clone() {
            Op::Add(k, by) => Got::Num(u64::try_from(env.stores[store].add(key(k), by)).unwrap_or(0)),
            Op::Raise(to) => Got::Num(env.stores[store].raise(Key::Round, to)),
            Op::Set(k, v) => {
                env.stores[store].set(key(k), v);
                Got::Done
            }
            Op::Cas(k, v) => Got::Bytes(env.stores[store].cas(key(k), v)),
            Op::Get(k) => Got::Bytes(env.stores[store].get(key(k))),
            Op::WaitAny(keys, until) => match keys.iter().find(|k| env.stores[store].seen(key(**k), since)) {
                Some(k) => Got::Fired(*k),
                None if tick >= until => Got::TimedOut,
                None => return,
            },
            Op::WaitRecords(size, until) => {
                if (0..size).all(|slot| env.stores[store].seen(Key::Member(r, slot), since)) {
                    Got::Done
                } else if tick >= until {
                    Got::TimedOut
                } else {
                    return;
                }
            }
            Op::Records(size) => self.records(env, r, size),
            Op::Advance(to) => {
                Agent::advance(&mut env.stores[store], r, to);
                let name = self.name();
                env.note(&name, format!("gives round {r} up; the job moves on"));
                Got::Done
            }
            Op::Done(outcome) => return self.formed(env, r, outcome),
        };
        if let (Op::Add(K::Join, 1), Got::Num(n)) = (&op, &got) {
            let name = self.name();
            env.note(&name, format!("takes slot {} of round {r}", n.saturating_sub(1)));
        }
        f.answer(got, tick);
        self.phase = Phase::Form(f);
    }

    /// The closer reads the member records and puts them in group-rank
    /// order (the agent's own code; `phase::assign` stands in for it). A
    /// record gone (the round was forgotten meanwhile) is the emptiest
    /// answer: the round starts over.
    fn records(&self, env: &Env, r: u64, size: u64) -> Got {
        let s = &env.stores[self.store];
        let records: Option<Vec<MemberRecord>> =
            (0..size).map(|slot| MemberRecord::read(&s.get(Key::Member(r, slot)))).collect();
        let Some(members) = records else { return Got::TimedOut };
        let ranks = assign(&members, env.cfg.spares_flag, env.cfg.min < env.cfg.max);
        let mut by_rank: Vec<(u32, u32)> = ranks.iter().copied().zip(members.iter().map(|m| m.uid)).collect();
        by_rank.sort_unstable();
        let uids: Vec<String> = by_rank.iter().map(|(_, u)| u.to_string()).collect();
        Got::Records(Records {
            places: members.iter().map(|m| m.pod.to_string()).collect(),
            members: uids.join(",").into_bytes(),
        })
    }

    /// The round a member found formed (`rR/members`, the uids in
    /// group-rank order): each group rank held by one uid in the round, and
    /// with spares the store host's pod among the members.
    fn check_formed(&self, env: &mut Env, r: u64, uids: &[u32]) {
        let pods: Vec<u32> = uids.iter().filter_map(|u| env.facts.pod_of.get(u).map(|p| p.0)).collect();
        let store = self.store;
        for (rank, uid) in (0u32..).zip(uids) {
            if let Some(other) = env.facts.ranks.insert((store, r, rank), *uid).filter(|o| o != uid) {
                env.violate(format!("round {r}: group rank {rank} is held by uid {other} and uid {uid}"));
            }
        }
        env.facts.members.insert((store, r), uids.to_vec());
        if env.cfg.spares_flag && !pods.contains(&0) {
            env.violate(format!("round {r} of a job with spares formed without the store host's pod"));
        }
    }

    /// The formation's outcome.
    fn formed(&mut self, env: &mut Env, r: u64, outcome: Outcome) {
        let tick = env.tick;
        match outcome {
            Outcome::Formed(v) => {
                // Its group rank is its place among the members.
                let uids = parse_uids(&v);
                self.check_formed(env, r, &uids);
                let Some(rank) = uids.iter().position(|u| *u == self.uid).and_then(|p| u32::try_from(p).ok()) else {
                    return env.violate(format!("round {r} formed without its member uid {}", self.uid));
                };
                let size = uids.len() as u64;
                self.known_round = Some(r);
                self.before_any_round = false;
                self.lost_word = false;
                if env.cfg.spares_flag {
                    self.last_rank = Some((rank, r));
                }
                self.was_spare = false;
                let name = self.name();
                env.note(&name, format!("is group rank {rank} of round {r} ({size} pods)"));
                if env.cfg.kind == Kind::Serve {
                    // The run it runs: the one after the runs over (past the
                    // last, the pods are idle).
                    let next = env.facts.served + 1;
                    env.facts.run_of_round.entry((self.store, r)).or_insert(next);
                }
                self.phase = Phase::Running(Member { r, rank, size, done: false });
            }
            Outcome::Spare { size } => {
                self.last_rank = None;
                self.phase = Phase::SpareArrive { r, size, until: tick + HEARTBEAT_TIMEOUT + RANK_GRACE };
            }
            Outcome::Moved(to) => self.phase = Phase::Join { want: to },
            Outcome::TimedOut => self.exit(env, Code::PeerLost, "the join deadline passed", self.lost_word),
        }
    }
}
