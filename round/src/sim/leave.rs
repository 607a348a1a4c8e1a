//! A simulated agent's waits outside a round and its leaving: a spare's
//! wait (through `round::spare`'s order and steps), the lost store and the
//! host's word (`round::host_left`), the wait for a store to come back,
//! and the store host's leaving (its word, the members' and the spares'
//! leaving, its store's close).

use round::groups::{gone, host_outlasts};
use round::host_left::{AfterLoss, Announced, after_loss};
use round::spare::{Heard, Step, VerdictRead, first, watches_left};

use super::agent::Agent;
use super::phase::{Member, Phase, read_verdict};
use super::store::{Key, Uid};
use super::world::{Code, Env, HEARTBEAT_TIMEOUT, JOIN_TIMEOUT, Kind, LEAVE_WAIT, SPARES_READ_WAIT};

impl Agent {
    /// A spare's wait: what it heard, through the protocol's order and steps.
    pub(super) fn spare(&mut self, env: &mut Env, r: u64, _size: u64) {
        let serving = env.cfg.kind == Kind::Serve;
        let s = &env.stores[self.store];
        let mut ready = Vec::new();
        if watches_left(serving) && s.seen(Key::AllLeft(r), self.since) {
            ready.push(Heard::MembersLeft);
        }
        if s.seen(Key::Next(r), self.since) {
            ready.push(Heard::Next);
        }
        if s.seen(Key::Verdict(r), self.since) {
            ready.push(Heard::Verdict(VerdictRead::MovesOn));
        }
        if !s.open {
            ready.push(Heard::StoreLost);
        }
        let in_hand = ready.contains(&Heard::MembersLeft);
        let Some(mut heard) = first(&ready) else { return };
        if let Heard::Verdict(_) = heard {
            if !s.open {
                // The value is read after the wake-up: the store is gone.
                return self.lost(env, false);
            }
            heard = Heard::Verdict(read_verdict(&s.get(Key::Verdict(r))));
        }
        let name = self.name();
        env.note(&name, format!("as a spare of round {r} hears {heard:?}"));
        match round::spare::step(heard, serving) {
            Step::Leave { success, say_read } => {
                let s = &mut env.stores[self.store];
                if say_read && s.open {
                    s.add(Key::SpareLeft(r), 1);
                }
                let code = if success { Code::Success } else { Code::Failure };
                self.exit(env, code, "the job ended while it waited as a spare", false);
            }
            Step::AwaitNext => self.phase = Phase::AwaitNext { r, until: env.tick + 2 * HEARTBEAT_TIMEOUT },
            Step::MovedOn => self.moved_on(env, r),
            Step::Reconnect => self.lost(env, in_hand),
            Step::Recheck => {}
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
