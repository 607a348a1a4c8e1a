//! A simulated agent's waits outside a round and its leaving: a spare's
//! wait (through `round::spare`'s order and steps), the lost store and the
//! host's word (`round::host_left`), the wait for a store to come back,
//! and the store host's leaving (its word, the members' and the spares'
//! leaving, its store's close).

use round::groups::{gone, host_outlasts};
use round::host_left::{AfterLoss, Announced, after_loss};
use round::spare::{Got, K, Op, SpareEnd, SpareWait};

use super::agent::Agent;
use super::phase::{Member, Phase, read_verdict};
use super::store::{Key, Uid};
use super::world::{Code, Env, HEARTBEAT_TIMEOUT, JOIN_TIMEOUT, Kind, LEAVE_WAIT, SPARE_RECHECK, SPARES_READ_WAIT};

impl Agent {
    /// A spare's wait beside round `r` (of `size` pods): the protocol's
    /// wait (`round::spare::SpareWait`), from now.
    pub(super) fn spare_wait(&self, env: &Env, r: u64, size: u64) -> Phase {
        let serving = env.cfg.kind == Kind::Serve;
        let wait = SpareWait::new(serving, env.tick + SPARE_RECHECK, 2 * HEARTBEAT_TIMEOUT);
        Phase::Spare { r, size, wait }
    }

    /// One operation of a spare's wait (or nothing, while its WAIT holds),
    /// as the agent's `wait_as_spare` carries them out.
    pub(super) fn spare(&mut self, env: &mut Env, (r, size): (u64, u64), mut w: SpareWait) {
        let (tick, since, store) = (env.tick, self.since, self.store);
        let key = |k: K| match k {
            K::AllLeft => Key::AllLeft(r),
            K::Next => Key::Next(r),
            K::Verdict => Key::Verdict(r),
            K::SpareLeft => Key::SpareLeft(r),
        };
        let s = &mut env.stores[store];
        let got = match w.next() {
            Op::WaitAny(keys, until) => {
                let fired: Vec<K> = keys.into_iter().filter(|k| s.seen(key(*k), since)).collect();
                let lost = !s.open;
                if fired.is_empty() && !lost {
                    if tick < until {
                        return;
                    }
                    Got::TimedOut
                } else {
                    let name = self.name();
                    env.note(&name, format!("as a spare of round {r} hears {fired:?} (the store closed: {lost})"));
                    Got::Ready(fired, lost)
                }
            }
            // The value is read after the wake-up: the store may be gone.
            Op::ReadVerdict if !s.open => return self.lost(env, false),
            Op::ReadVerdict => Got::Verdict(read_verdict(&s.get(Key::Verdict(r)))),
            Op::SayRead => {
                if s.open {
                    s.add(key(K::SpareLeft), 1);
                }
                Got::Done
            }
            Op::Advance if !s.open => return self.lost(env, false),
            Op::Advance => {
                Agent::advance(s, r, r + 1);
                Got::Done
            }
            Op::Done(end) => return self.spare_end(env, (r, size), end),
        };
        w.answer(got, tick);
        self.phase = Phase::Spare { r, size, wait: w };
    }

    fn spare_end(&mut self, env: &mut Env, (r, size): (u64, u64), end: SpareEnd) {
        match end {
            SpareEnd::Leave { success } => {
                let code = if success { Code::Success } else { Code::Failure };
                self.exit(env, code, "the job ended while it waited as a spare", false);
            }
            SpareEnd::MovedOn => self.moved_on(env, r),
            SpareEnd::Reconnect { in_hand } => self.lost(env, in_hand),
            // Its health check, then the wait goes on beside the same round.
            SpareEnd::Recheck => {
                self.health_check(env);
                self.phase = self.spare_wait(env, r, size);
            }
        }
    }

    /// The store went away: after the settle time, the host's word decides.
    pub(super) fn reconnect(&mut self, env: &mut Env, until: u64, in_hand: bool) {
        if env.tick < until {
            return;
        }
        let s = &env.stores[self.store];
        let word = String::from_utf8_lossy(&s.get(Key::HostLeft)).into_owned();
        let old_job = s.generation < self.generation;
        let announced = match word.strip_prefix("ended:") {
            Some(v) => Announced::JobEnded { success: v.is_empty() || v == "success" },
            None if word.is_empty() => Announced::Nothing,
            None => Announced::LeftCleanly,
        };
        match after_loss(announced, self.before_any_round) {
            AfterLoss::Leave { success } => {
                if old_job {
                    env.violate(format!(
                        "{} restarted in place took its previous containers' end ({word}) for its own",
                        self.name()
                    ));
                }
                let code = if success { Code::Success } else { Code::PeerLost };
                self.exit(env, code, &format!("the host said the job ended ({word})"), false);
            }
            AfterLoss::Rejoin(why) => {
                let name = self.name();
                env.note(&name, format!("rejoins ({why:?})"));
                let no_word = announced == Announced::Nothing && !in_hand;
                self.lost_word |= no_word;
                self.phase = Phase::Rejoin { until: env.tick + JOIN_TIMEOUT, no_word };
            }
        }
    }

    pub(super) fn rejoin(&mut self, env: &mut Env, until: u64, no_word: bool) {
        let newest = if env.cfg.groups > 1 { env.newest_of(self.generation) } else { env.newest() };
        // The attempt's fence (`Session::check_attempt`): a store of a
        // newer attempt (the job restarted in place; its store host's
        // agent raised `attempt` as it started) refuses an older container.
        if newest > self.store && env.stores[newest].open && env.stores[newest].generation > self.generation {
            self.exit(env, Code::Stale, "a newer attempt of the job runs", no_word);
        } else if newest > self.store && env.stores[newest].open {
            self.store = newest;
            let name = self.name();
            env.note(&name, format!("reconnects to store {newest}"));
            self.phase = Phase::Start;
        } else if env.tick >= until {
            self.exit(env, Code::PeerLost, "the store host did not come back before the join deadline", no_word);
        }
    }

    /// Leaving; the store host's agent announces the end, waits for the
    /// members and the spares, and closes its store.
    pub(super) fn host_leaves(&mut self, env: &mut Env, m: Member, verdict: &str, stage: u8, until: u64) {
        let code = match verdict {
            "success" | "" => Code::Success,
            _ => Code::Failure,
        };
        let tick = env.tick;
        let word_lost = env.cfg.word_lost;
        let serving = env.cfg.kind == Kind::Serve;
        let s = &mut env.stores[self.store];
        match stage {
            0 => {
                if self.hosts() && !word_lost {
                    s.set(Key::HostLeft, format!("ended:{verdict}"));
                }
                let n = s.add(Key::Left(m.r), 1);
                if n >= i64::try_from(m.size).unwrap_or(i64::MAX) {
                    s.set(Key::AllLeft(m.r), "1");
                }
                if !self.hosts() {
                    return self.exit(env, code, "the job ended", false);
                }
                self.phase = Phase::Leave { m, verdict: verdict.into(), stage: 2, until: tick + LEAVE_WAIT };
            }
            2 => {
                if s.seen(Key::AllLeft(m.r), self.since) || tick >= until {
                    let stage = if serving { 4 } else { 3 };
                    self.phase = Phase::Leave { m, verdict: verdict.into(), stage, until: tick + SPARES_READ_WAIT };
                }
            }
            3 => {
                let spares = s.num(Key::Join(m.r)) - i64::try_from(m.size).unwrap_or(0);
                if s.num(Key::SpareLeft(m.r)) >= spares || tick >= until {
                    self.phase = Phase::Leave { m, verdict: verdict.into(), stage: 4, until };
                }
            }
            _ => {
                if env.cfg.groups > 1 && !self.outlasts_groups(env) {
                    return;
                }
                self.exit(env, code, "the job ended; its store closes", false);
            }
        }
    }

    /// The store host's group is done (`trainlet::launch::replicas`): it
    /// keeps its store up while another group's pod is not gone for it
    /// (`round::groups`); false while it waits. A store closed under a
    /// group that still trains breaks the invariant.
    fn outlasts_groups(&mut self, env: &mut Env) -> bool {
        let tick = env.tick;
        let facts = &env.facts;
        let others: Vec<Uid> =
            facts.pod_of.iter().filter(|(_, (_, g))| *g != self.generation).map(|(u, _)| *u).collect();
        let silent_for = |u: &Uid| facts.killed_at.get(u).map_or(0, |at| tick.saturating_sub(*at));
        let running =
            others.iter().filter(|u| !gone(facts.exits.contains_key(*u), silent_for(u), JOIN_TIMEOUT)).count();
        if host_outlasts(running) {
            return false;
        }
        let alive = others.iter().find(|u| !facts.exits.contains_key(*u) && !facts.killed_at.contains_key(*u));
        if let Some(uid) = alive {
            let group = facts.pod_of.get(uid).map_or(0, |p| p.1);
            env.violate(format!(
                "the store host closed its store while replica group {group} still trains (uid {uid})"
            ));
        }
        true
    }
}
