//! One simulated agent: the agent's sequence of store operations for a
//! round (`trainlet::rendezvous` and `trainlet::launch::job`), one step per
//! scheduler tick, taking every decision through the protocol's own
//! functions (`round::join`, `round::spare`, `round::host_left`).
//!
//! Joining and forming a round are here; a round's end is in
//! `round_end`, a spare's wait and leaving the job in `leave`, what stands
//! in for the agent's own code (rank assignment, verdicts) in `phase`.

use round::claim::{Claim, on_holder};
use round::join::{ABANDONED, Arrival, arrival, spare_gives_up};
use round::monitor::{self, Beat};

use super::phase::{MemberRecord, Phase, parse_uids};
use super::store::{End, Key, Store, Uid};
use super::world::{
    Code, Env, Exit, HEALTH_CHECK_MAX, HEARTBEAT_TIMEOUT, HOST_LEFT_SETTLE, JOIN_TIMEOUT, LOST_GRACE, STILL_LIMIT,
};

/// One agent (one container of one pod).
#[derive(Debug, Clone)]
pub struct Agent {
    /// Its pod's node rank; pod 0 hosts the store.
    pub pod: u32,
    /// This container's uid.
    pub uid: Uid,
    /// The job generation it belongs to.
    pub generation: u32,
    /// The store it talks to.
    pub store: usize,
    /// Where it is.
    pub phase: Phase,
    /// Paused (a slow machine) until this tick.
    pub paused_until: u64,
    /// The last round it was a member of.
    pub known_round: Option<u64>,
    /// A container restarted in place that ran no round yet.
    pub before_any_round: bool,
    /// It waited as a spare: it lets that round's members join first.
    pub defer_to: Option<u64>,
    /// It got in as a spare.
    pub was_spare: bool,
    /// Its group rank and round, kept across rounds with `--spares`.
    pub last_rank: Option<(u32, u64)>,
    /// When its current join gives up.
    pub deadline: u64,
    /// It lost a store with no word and nothing in hand and has formed no
    /// round since: what became of its job is unknown to it, so a join
    /// deadline it then meets is a truthful 203.
    pub lost_word: bool,
    /// Restarts used, as it knows them (it raises a new store's to them).
    pub restarts: u64,
    /// When it entered its phase: its WAITs were registered then.
    pub since: u64,
}

impl Agent {
    /// A container of pod `pod` that starts now, talking to `store`.
    pub fn new(env: &mut Env, pod: u32, store: usize, restarted: bool) -> Agent {
        let uid = env.uid();
        env.facts.pod_of.insert(uid, (pod, env.generation));
        Agent {
            pod,
            uid,
            generation: env.generation,
            store,
            phase: Phase::Start,
            paused_until: 0,
            known_round: None,
            before_any_round: restarted,
            defer_to: None,
            was_spare: false,
            last_rank: None,
            deadline: env.tick + JOIN_TIMEOUT,
            lost_word: false,
            restarts: 0,
            since: env.tick,
        }
    }

    /// Its name in the trace.
    pub fn name(&self) -> String {
        format!("pod {} (uid {})", self.pod, self.uid)
    }

    /// It can take a step.
    pub fn runnable(&self, tick: u64) -> bool {
        self.phase != Phase::Gone && self.paused_until <= tick
    }

    /// The store host's pod.
    pub fn hosts(&self) -> bool {
        self.pod == 0
    }

    pub(super) fn exit(&mut self, env: &mut Env, code: Code, why: &str, no_word: bool) {
        let name = self.name();
        env.note(&name, format!("exits {code:?}: {why}"));
        env.facts.exits.insert(self.uid, Exit { code, why: why.into(), no_word, generation: self.generation });
        if self.hosts() {
            env.close(self.store);
        }
        self.phase = Phase::Gone;
    }

    pub(super) fn lost(&mut self, env: &mut Env, in_hand: bool) {
        let name = self.name();
        env.note(&name, "lost the store");
        self.phase = Phase::Reconnect { until: env.tick + HOST_LEFT_SETTLE, in_hand };
    }

    /// Move the job past round `from` (the agent's `advance`).
    pub fn advance(s: &mut Store, from: u64, to: u64) {
        let now = s.raise(Key::Round, to);
        Agent::point_next(s, from, now);
    }

    /// `rR/next` of round `from` is `now` (the first writer wins).
    pub fn point_next(s: &mut Store, from: u64, now: u64) {
        s.cas(Key::Next(from), now.to_string());
    }

    /// One step; a new phase's WAITs are registered now.
    pub fn step(&mut self, env: &mut Env) {
        let before = self.phase.clone();
        self.act(env);
        if self.phase != before {
            self.since = env.tick;
        }
    }

    fn act(&mut self, env: &mut Env) {
        let tick = env.tick;
        let open = env.stores[self.store].open;
        match self.phase.clone() {
            Phase::Reconnect { until, in_hand } => return self.reconnect(env, until, in_hand),
            Phase::Rejoin { until, no_word } => return self.rejoin(env, until, no_word),
            Phase::Spare { r, size, wait } => return self.spare(env, (r, size), wait),
            Phase::Leave { m, verdict, stage, until } if stage >= 2 => {
                return self.host_leaves(env, m, &verdict, stage, until);
            }
            Phase::Gone => return,
            _ if !open => return self.lost(env, false),
            _ => {}
        }
        if tick >= self.deadline && self.joining() {
            return self.exit(env, Code::PeerLost, "the join deadline passed", self.lost_word);
        }
        match self.phase.clone() {
            // A container of the next generation that reached the previous
            // containers' store: its job's keys (the next JobSet attempt's)
            // stay empty there until that store closes.
            Phase::Start if env.stores[self.store].generation < self.generation => {}
            Phase::Start => {
                let s = &mut env.stores[self.store];
                self.restarts = s.raise(Key::Restarts, self.restarts);
                self.deadline = tick + JOIN_TIMEOUT;
                self.phase = Phase::Join { want: self.known_round.map_or(0, |r| r + 1) };
                self.health_check(env);
            }
            Phase::Join { want } => self.join(env, want),
            Phase::Claim { holder, until, want } => self.contest(env, holder, until, want),
            Phase::AfterLead { r } => self.after_lead(env, r),
            Phase::Defer { p, r, until } => self.defer(env, p, r, until),
            Phase::Form(f) => self.form(env, f),
            Phase::SpareArrive { r, size, until } => self.spare_arrive(env, r, size, until),
            Phase::Running(m) => self.running(env, m),
            Phase::Stopping(m) => self.stopping(env, m),
            Phase::WaitStopped(m, until) => {
                let s = &env.stores[self.store];
                if s.seen(Key::AllStopped(m.r), self.since) || s.seen(Key::Dead(m.r), self.since) || tick >= until {
                    self.phase = Phase::Decide(m);
                }
            }
            Phase::Decide(m) => self.decide(env, m),
            Phase::Leave { m, verdict, stage, until } => self.host_leaves(env, m, &verdict, stage, until),
            Phase::Reconnect { .. } | Phase::Rejoin { .. } | Phase::Spare { .. } | Phase::Gone => {}
        }
    }

    /// Another agent holds its place: it watched the holder's heartbeat
    /// (gone at once when it said `bye`, after the lost grace when it read
    /// `lost`, after the watch when it stood still), and the protocol says
    /// what to do.
    fn contest(&mut self, env: &mut Env, holder: Uid, until: u64, want: u64) {
        let bye = env.facts.exits.contains_key(&holder);
        let still = self.killed(env, holder);
        let lost = env
            .facts
            .lost_at
            .get(&holder)
            .is_some_and(|at| monitor::dead(Beat::Lost, env.tick.saturating_sub(*at), STILL_LIMIT, LOST_GRACE));
        if !bye && !lost && env.tick < until {
            return;
        }
        match on_holder(bye || lost || still, false) {
            Claim::TakeOver => {
                // COMPARE_SET from the holder's uid: of two claimants, one wins;
                // the other contests the winner.
                let mine = self.uid.to_string().into_bytes();
                let got =
                    env.stores[self.store].cas_from(Key::Claim(self.pod), holder.to_string().as_bytes(), mine.clone());
                self.phase = match std::str::from_utf8(&got).ok().and_then(|h| h.parse().ok()) {
                    _ if got == mine => Phase::Join { want },
                    Some(other) => Phase::Claim { holder: other, until: env.tick + STILL_LIMIT, want },
                    None => Phase::Join { want },
                };
            }
            Claim::Outwait | Claim::Refuse => {
                self.exit(env, Code::Refused, &format!("uid {holder} holds its place and is alive"), false);
            }
        }
    }

    fn killed(&self, env: &Env, uid: Uid) -> bool {
        env.facts.killed_at.contains_key(&uid)
    }

    fn joining(&self) -> bool {
        matches!(self.phase, Phase::Join { .. } | Phase::AfterLead { .. } | Phase::Defer { .. })
    }

    fn join(&mut self, env: &mut Env, want: u64) {
        let s = &mut env.stores[self.store];
        // Its place first (when it connects and before every round).
        let mine = self.uid.to_string().into_bytes();
        let held = s.cas(Key::Claim(self.pod), mine.clone());
        if held != mine {
            let holder = std::str::from_utf8(&held).ok().and_then(|h| h.parse().ok()).unwrap_or(0);
            self.phase = Phase::Claim { holder, until: env.tick + STILL_LIMIT, want };
            return;
        }
        let current = s.raise(Key::Round, 0);
        if current < want {
            Agent::advance(s, current, want);
            return;
        }
        self.phase = if env.cfg.spares_flag && !self.hosts() {
            Phase::AfterLead { r: current }
        } else {
            self.forming(env, current)
        };
    }

    fn after_lead(&mut self, env: &mut Env, r: u64) {
        let s = &env.stores[self.store];
        if s.seen(Key::Next(r), self.since) {
            self.phase = Phase::Join { want: s.next_of(r) };
        } else if s.seen(Key::Lead(r), self.since) {
            self.phase = match self.defer_to.take() {
                Some(p) => Phase::Defer { p, r, until: env.tick + HEARTBEAT_TIMEOUT },
                None => self.forming(env, r),
            };
        }
    }

    /// `defer_to_members`: join once each live member of round `p` joined
    /// `r`, left or was declared dead, once `r` closed or moved on, or at
    /// the heartbeat timeout.
    fn defer(&mut self, env: &mut Env, p: u64, r: u64, until: u64) {
        let s = &env.stores[self.store];
        if s.has(Key::Closed(r)) || s.has(Key::Next(r)) || env.tick >= until {
            self.phase = self.forming(env, r);
            return;
        }
        let members = parse_uids(&s.get(Key::Members(p)));
        let dead = parse_uids(&s.get(Key::Dead(p)));
        let joined: Vec<Uid> = (0..u64::try_from(s.num(Key::Join(r))).unwrap_or(0))
            .filter_map(|slot| MemberRecord::read(&s.get(Key::Member(r, slot))).map(|m| m.uid))
            .collect();
        let gone = |u: &Uid| env.facts.exits.contains_key(u);
        if members.iter().all(|u| dead.contains(u) || joined.contains(u) || gone(u)) {
            self.phase = self.forming(env, r);
        }
    }

    fn spare_arrive(&mut self, env: &mut Env, r: u64, size: u64, until: u64) {
        let s = &mut env.stores[self.store];
        if !s.seen(Key::Members(r), self.since) && env.tick < until {
            return;
        }
        // No members by the bound: the round never formed (its closer or
        // its members went first); give it up as a member would.
        if spare_gives_up(&s.cas(Key::Members(r), ABANDONED)) {
            Agent::advance(s, r, r + 1);
            let name = self.name();
            env.note(&name, format!("gives round {r} up: it never formed"));
            self.phase = Phase::Join { want: r + 1 };
            return;
        }
        let members = parse_uids(&s.get(Key::Members(r)));
        // Its place held by another uid: its previous container.
        let previous = (0..size)
            .filter_map(|slot| MemberRecord::read(&s.get(Key::Member(r, slot))))
            .find(|m| m.pod == self.pod && m.uid != self.uid && members.contains(&m.uid));
        match arrival(previous.is_some(), size, u64::from(env.cfg.max)) {
            Arrival::TakeOver => {
                let old = previous.map_or(0, |m| m.uid);
                s.cas(Key::Dead(r), old.to_string());
                s.cas(Key::End(r), End::Dead(old).value());
            }
            Arrival::Regroup => {
                s.cas(Key::End(r), End::Waiting(self.uid).value());
            }
            Arrival::Wait => {}
        }
        let name = self.name();
        env.note(&name, format!("waits as a spare beside round {r} ({size} pods)"));
        self.phase = self.spare_wait(env, r, size);
    }

    pub(super) fn moved_on(&mut self, env: &mut Env, r: u64) {
        self.defer_to = Some(r);
        self.was_spare = true;
        self.deadline = env.tick + JOIN_TIMEOUT;
        self.phase = Phase::Join { want: r + 1 };
        self.health_check(env);
    }

    /// The health check before a round (`health::before_round`: the GPUs,
    /// the disk), which may take a while: meanwhile the job may move on.
    pub(super) fn health_check(&mut self, env: &mut Env) {
        if env.rng.chance(200) {
            self.paused_until = env.tick + 1 + env.rng.below(HEALTH_CHECK_MAX);
        }
    }
}
