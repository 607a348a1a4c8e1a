//! A simulated member's round from its workers' start to the verdict it
//! follows: its workers finish or fail, the pods report them stopped,
//! propose the verdict (the first COMPARE_SET wins) and follow it; a
//! served run's end is marked (`set_ended`) by every pod before the job
//! moves on.

use round::settle::{Decide, Finish, Got, Op, Settled};
use round::stop::over_already;

use super::agent::Agent;
use super::phase::{Member, Phase, stop_wait, verdict_for};
use super::store::{End, Key, Store};
use super::world::{Env, JOIN_TIMEOUT, Kind, STOP_WAIT, WORKER_INIT_TIMEOUT};

impl Agent {
    /// Its workers run: they finish (the last pod's done ends the round),
    /// fail, or the round ends elsewhere; a served job's idle round after its
    /// last run is its shutdown.
    pub fn running(&mut self, env: &mut Env, m: Member) {
        let a = self;
        let serving = env.cfg.kind == Kind::Serve;
        let run = env.facts.run_of_round.get(&(a.store, m.r)).copied().unwrap_or(0);
        if serving && run > env.cfg.runs {
            // Idle after the last run: the idle timeout shuts the pods down.
            env.facts.outcome.entry(a.generation).or_insert(true);
            env.facts.decided_at.get_or_insert(env.tick);
            a.phase = Phase::Leave { m, verdict: String::new(), stage: 0, until: 0 };
            return;
        }
        let fail_rate = env.cfg.fail_rate;
        let fails = env.rng.chance(fail_rate);
        let finishes = env.rng.chance(150);
        let formed_at = *env.facts.formed_at.entry((a.store, m.r)).or_insert(env.tick);
        // Workers slow to stop (their grace period, a checkpoint): the
        // others settle the round without this pod once they waited.
        let slow = env.cfg.slow_stop && env.rng.chance(300);
        let stop_time = if slow { 1 + env.rng.below(STOP_WAIT + 200) } else { 0 };
        let s = &mut env.stores[a.store];
        if s.seen(Key::End(m.r), a.since) {
            a.phase = Phase::Stopping(m);
            if slow {
                a.paused_until = env.tick + stop_time;
            }
        } else if env.tick >= formed_at + WORKER_INIT_TIMEOUT {
            // A member never started its workers (it left after the round
            // closed): the others' workers give up on their rendezvous.
            s.cas(Key::End(m.r), End::Failure.value());
        } else if fails {
            s.cas(Key::End(m.r), End::Failure.value());
        } else if finishes && !m.done {
            let n = s.add(Key::Done(m.r), 1);
            if n >= i64::try_from(m.size).unwrap_or(i64::MAX) {
                s.cas(Key::End(m.r), End::Success.value());
            }
            a.phase = Phase::Running(Member { done: true, ..m });
        }
    }

    /// Report its workers gone; the last pod marks the round stopped.
    pub fn stopping(&mut self, env: &mut Env, m: Member) {
        let a = self;
        let s = &mut env.stores[a.store];
        let n = s.add(Key::Stopped(m.r), 1);
        if n >= i64::try_from(m.size).unwrap_or(i64::MAX) {
            s.set(Key::AllStopped(m.r), "1");
        }
        a.phase = Phase::WaitStopped(m, stop_wait(env.tick));
    }

    /// Propose the verdict, take the agreed one, follow it.
    pub fn decide(&mut self, env: &mut Env, m: Member) {
        let a = self;
        let serving = env.cfg.kind == Kind::Serve;
        let store = a.store;
        let s = &mut env.stores[store];
        let end = End::read(&s.get(Key::End(m.r)));
        let restarts = u32::try_from(s.num(Key::Restarts)).unwrap_or(0);
        let proposed = verdict_for(end, restarts, env.cfg.max_restarts, serving);
        // The protocol's operations (`round::settle::Decide`), all in this
        // step (a stall between them is the agent's, in a later tick).
        let mut d = Decide::new(m.r);
        let mut agreed = proposed.clone();
        loop {
            let got = match d.next() {
                Op::RaiseRound(to) => Got::Num(s.raise(Key::Round, to)),
                Op::Propose => {
                    agreed = String::from_utf8_lossy(&s.cas(Key::Verdict(m.r), proposed.clone())).into_owned();
                    let restart = agreed.strip_prefix("restart:").and_then(|n| n.parse().ok());
                    Got::Agreed { restart }
                }
                Op::RaiseRestarts(n) => {
                    a.restarts = s.raise(Key::Restarts, u64::from(n));
                    Got::Num(a.restarts)
                }
                Op::PointNext(_) => Got::Done,
                Op::Done(Settled::Forgotten) => {
                    // The job moved two rounds on while it settled this one.
                    a.deadline = env.tick + JOIN_TIMEOUT;
                    next_round(a, s, m.r);
                    let name = a.name();
                    return env.note(&name, format!("finds round {} forgotten; regroups", m.r));
                }
                Op::Done(_) => break,
            };
            d.answer(got);
        }
        let name = a.name();
        env.note(&name, format!("round {} ended ({end:?}); the verdict is {agreed}", m.r));
        match env.facts.verdicts.get(&(store, m.r)) {
            Some(v) if *v != agreed => {
                env.violate(format!("round {}: {name} follows verdict {agreed}, another pod {v}", m.r));
            }
            Some(_) => {}
            None => {
                record_first(env, (a.generation, store), &agreed);
                env.facts.verdicts.insert((store, m.r), agreed.clone());
            }
        }
        a.deadline = env.tick + JOIN_TIMEOUT;
        match (agreed.as_str(), serving) {
            ("success" | "fail", false) => a.phase = Phase::Leave { m, verdict: agreed, stage: 0, until: 0 },
            (_, true) => {
                // Every pod marks the run over, then the job moves on.
                let state = match agreed.as_str() {
                    "success" => "succeeded",
                    "fail" => "failed",
                    _ => "stopped",
                };
                let run = env.facts.run_of_round.get(&(store, m.r)).copied().unwrap_or(0);
                env.facts.served = env.facts.served.max(run);
                let s = &mut env.stores[store];
                set_ended(s, run, state);
                next_round(a, s, m.r);
            }
            _ => next_round(a, &mut env.stores[store], m.r),
        }
    }
}

/// The job's outcome and restarts, from the first pod to follow a verdict.
/// Restarts are counted in one store once each: the next follows the last
/// (a store host back with an empty store counts on from what the agents
/// remember, which is nothing once every container restarted).
fn record_first(env: &mut Env, (generation, store): (u32, usize), agreed: &str) {
    if let Some(n) = agreed.strip_prefix("restart:").and_then(|n| n.parse::<u32>().ok()) {
        if let Some(&was) = env.facts.restarts.get(&(generation, store)).filter(|&&was| n != was + 1) {
            env.violate(format!("restart {n} follows restart {was}: restarts counted twice or lost"));
        }
        env.facts.restarts.insert((generation, store), n);
    }
    if matches!(agreed, "success" | "fail") && env.cfg.kind != Kind::Serve {
        env.facts.outcome.insert(generation, agreed == "success");
        env.facts.decided_at = Some(env.tick);
    }
}

/// `finish_round`: move the job past round `r` (a forgotten round needs
/// no `next`).
fn next_round(a: &mut Agent, s: &mut Store, r: u64) {
    let mut f = Finish::new(r);
    loop {
        let got = match f.next() {
            Op::RaiseRound(to) => Got::Num(s.raise(Key::Round, to)),
            Op::PointNext(now) => {
                Agent::point_next(s, r, now);
                Got::Done
            }
            Op::Propose | Op::RaiseRestarts(_) => Got::Done,
            Op::Done(_) => break,
        };
        f.answer(got);
    }
    a.phase = Phase::Join { want: r + 1 };
}

/// `serve::Link::set_ended`: mark run `seq` over with `state`; true when
/// this call marked it first.
pub fn set_ended(s: &mut Store, seq: u64, state: &str) -> bool {
    if over_already(s.has(Key::Ended(seq))) {
        return false;
    }
    let mine = format!("{seq} {state}").into_bytes();
    s.cas(Key::Ended(seq), mine.clone()) == mine
}
