//! One schedule: the world drawn from its seed, its faults placed in time,
//! then tick by tick the environment (faults, the store host's heartbeat
//! judge, served runs' stops, containers restarted in place) and one agent
//! chosen at random take a step, and the invariants are checked.

use round::monitor::{self as monitor, Beat, Orphaned, VerdictSeen, orphaned};
use round::stop::{Op, StopRun};

use super::agent::Agent;
use super::phase::{self, Phase, parse_uids};
use super::round_end::set_ended;
use super::store::{End, Key, Store, Uid};
use super::world::{Cfg, Code, Env, HEARTBEAT_TIMEOUT, Kind, LOST_GRACE, PAUSE_MAX, Rng, STALL_MAX, TICK_LIMIT};

/// The most rounds whose keys a store may hold: the previous round and the
/// one that formed (the store host keeps them), the one the pods join
/// next, and one the monitor has not caught up with yet.
const ROUNDS_HELD: usize = 4;

/// How a schedule went.
#[derive(Debug)]
pub struct Outcome {
    /// The configuration it ran.
    pub cfg: String,
    /// Ticks run.
    pub ticks: u64,
    /// The first invariant broken, and the trace that led to it.
    pub violation: Option<(String, Vec<String>)>,
}

/// A fault placed in time.
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// SIGKILL of a pod (the store host's when `host`).
    Kill { host: bool },
    /// SIGTERM of a pod that is not the store host.
    Term,
    /// A second container of a live pod starts (a stale pod back).
    Stale,
}

/// A stop of a served run on its way through the control API: one of its
/// store operations at a time, a few ticks apart.
#[derive(Debug, Clone, Copy)]
struct Stop {
    seq: u64,
    run: StopRun,
    /// When it does its next operation.
    at: u64,
}

/// The world of one schedule.
#[derive(Debug)]
struct Sim {
    env: Env,
    agents: Vec<Agent>,
    faults: Vec<(u64, Fault)>,
    /// Containers that start later: (tick, pod, generation).
    starts: Vec<(u64, u32, u32)>,
    /// When each killed uid died, and whether its machine vanished (its
    /// connections never closed: only the heartbeat timeout finds it) or
    /// only its processes died (the store read its heartbeat connection's
    /// close: `lost`, dead after the grace).
    killed: Vec<(super::store::Uid, u64, bool)>,
    stop: Option<Stop>,
    /// The host monitor's round per store, and whether it forgot the old rounds.
    monitored: std::collections::BTreeMap<usize, (u64, bool)>,
}

/// Run schedule `seed`.
pub fn run(seed: u64) -> Outcome {
    let mut rng = Rng::new(seed);
    let cfg = Cfg::draw(&mut rng);
    let described = cfg.describe();
    let mut sim = Sim::new(rng, cfg);
    while sim.env.tick < TICK_LIMIT && sim.env.violation.is_none() && !sim.over() {
        sim.tick();
    }
    if sim.env.violation.is_none() {
        sim.finally();
    }
    Outcome {
        cfg: described,
        ticks: sim.env.tick,
        violation: sim.env.violation.take().map(|v| (v, sim.env.trace.iter().cloned().collect())),
    }
}

impl Sim {
    fn new(rng: Rng, cfg: Cfg) -> Sim {
        let mut env = Env::new(rng, cfg);
        let pods = env.cfg.pods;
        // Pods start a little apart, as a job's pods are scheduled; with
        // replica groups, group g's are pods g*P .. (g+1)*P on group g's keys.
        let mut agents = Vec::new();
        for g in 0..env.cfg.groups {
            env.generation = g;
            agents.extend((0..pods).map(|p| Agent::new(&mut env, g * pods + p, g as usize, false)));
        }
        env.generation = 0;
        for a in &mut agents {
            a.paused_until = env.rng.below(40);
        }
        let mut faults = Vec::new();
        let span = 200 + 40 * u64::from(pods);
        if env.cfg.kill {
            let at = env.rng.below(span);
            faults.push((at, Fault::Kill { host: false }));
        }
        if env.cfg.stale_pod {
            let at = env.rng.below(span);
            faults.push((at, Fault::Stale));
        }
        if env.cfg.host_crash {
            let at = env.rng.below(span);
            faults.push((at, Fault::Kill { host: true }));
        }
        if env.cfg.sigterm {
            let at = env.rng.below(span);
            faults.push((at, Fault::Term));
        }
        if env.cfg.kind == Kind::InPlace {
            // The first job fails: its workers fail at once, with no restart left.
            env.cfg.fail_rate = 200;
            env.cfg.max_restarts = 0;
        }
        Sim {
            env,
            agents,
            faults,
            starts: Vec::new(),
            killed: Vec::new(),
            stop: None,
            monitored: std::collections::BTreeMap::new(),
        }
    }

    fn over(&self) -> bool {
        self.starts.is_empty() && self.agents.iter().all(|a| a.phase == Phase::Gone)
    }

    fn tick(&mut self) {
        let tick = self.env.tick;
        self.faults_now(tick);
        self.start_containers(tick);
        self.monitor(tick);
        self.serve_stops(tick);
        // Every agent may take a step in a tick, in a random order; each
        // is late at random (its step waits for a later tick), and now and
        // then one is paused for longer (a loaded machine).
        let mut order: Vec<usize> = (0..self.agents.len()).filter(|&i| self.agents[i].runnable(tick)).collect();
        for k in (1..order.len()).rev() {
            let j = usize::try_from(self.env.rng.below(k as u64 + 1)).unwrap_or(0);
            order.swap(k, j);
        }
        for i in order {
            if self.env.violation.is_some() {
                break;
            }
            let load = self.env.cfg.load;
            if self.env.rng.chance(load) {
                let pause = 1 + self.env.rng.below(PAUSE_MAX);
                self.agents[i].paused_until = tick + pause;
                let name = self.agents[i].name();
                self.env.note(&name, format!("is paused for {pause} ticks"));
            } else if self.env.rng.chance(700) {
                let before = self.agents[i].since;
                self.agents[i].step(&mut self.env);
                self.check();
                // Between two protocol steps is where a pause hurts most
                // (FoundationDB's "buggify": delays where they matter).
                // One in eight is long: a store reply that comes late (a
                // lost packet's retransmits) while the heartbeat goes on.
                if self.agents[i].since != before && self.env.rng.chance(load * 2) {
                    let longest = if self.env.rng.below(8) == 0 { STALL_MAX } else { PAUSE_MAX };
                    let pause = 1 + self.env.rng.below(longest);
                    self.agents[i].paused_until = tick + pause;
                    let name = self.agents[i].name();
                    self.env.note(&name, format!("is paused for {pause} ticks after its step"));
                }
            }
        }
        self.env.tick += 1;
    }

    fn faults_now(&mut self, tick: u64) {
        self.kill_at_end(tick);
        self.term_at_start();
        self.kill_closer(tick);
        let due: Vec<Fault> = self.faults.iter().filter(|(at, _)| *at == tick).map(|(_, f)| *f).collect();
        for f in due {
            let live: Vec<usize> = (0..self.agents.len())
                .filter(|&i| self.agents[i].phase != Phase::Gone)
                .filter(|&i| self.env.cfg.groups > 1 || self.agents[i].generation == self.env.generation)
                .filter(|&i| match f {
                    Fault::Kill { host } => self.agents[i].hosts() == host,
                    Fault::Term | Fault::Stale => !self.agents[i].hosts(),
                })
                .collect();
            if live.is_empty() {
                continue;
            }
            let i = live[usize::try_from(self.env.rng.below(live.len() as u64)).unwrap_or(0)];
            match f {
                Fault::Kill { .. } => self.kill(i, tick),
                Fault::Term => self.term(i),
                Fault::Stale => {
                    let (pod, store, generation) =
                        (self.agents[i].pod, self.agents[i].store, self.agents[i].generation);
                    self.starts.push((tick, pod, generation));
                    let _ = store;
                }
            }
        }
    }

    /// Once, as a round of the newest store succeeds: SIGKILL of every one
    /// of its members but the store host's.
    fn kill_at_end(&mut self, tick: u64) {
        let store = self.env.newest();
        let s = &self.env.stores[store];
        if !self.env.cfg.kill_at_end || !s.open {
            return;
        }
        let r = s.round();
        if End::read(&s.get(Key::End(r))) != Some(End::Success) {
            return;
        }
        self.env.cfg.kill_at_end = false;
        for i in self.live_members_but_host(store, r) {
            self.kill(i, tick);
        }
    }

    /// The live agents among round `r`'s members (of `store`) but the
    /// store host's.
    fn live_members_but_host(&self, store: usize, r: u64) -> Vec<usize> {
        let members = parse_uids(&self.env.stores[store].get(Key::Members(r)));
        (0..self.agents.len())
            .filter(|&i| members.contains(&self.agents[i].uid) && !self.agents[i].hosts())
            .filter(|&i| self.agents[i].phase != Phase::Gone)
            .collect()
    }

    /// Once, as a round of the newest store closes: SIGKILL of the pod
    /// that closed it, before it assigns the ranks (unless it is the store
    /// host's).
    fn kill_closer(&mut self, tick: u64) {
        let store = self.env.newest();
        let s = &self.env.stores[store];
        let r = s.round();
        if !self.env.cfg.kill_closer || !s.open || s.has(Key::Members(r)) {
            return;
        }
        let Some(closed) = round::Closed::read(&s.get(Key::Closed(r))) else { return };
        let Some(uid) = phase::MemberRecord::read(&s.get(Key::Member(r, closed.slot))).map(|m| m.uid) else { return };
        self.env.cfg.kill_closer = false;
        if let Some(i) = (0..self.agents.len()).find(|&i| self.agents[i].uid == uid && !self.agents[i].hosts()) {
            self.kill(i, tick);
        }
    }

    /// Once, as the first round of the newest store forms: SIGTERM of
    /// every one of its members but the store host's.
    fn term_at_start(&mut self) {
        let store = self.env.newest();
        let s = &self.env.stores[store];
        let r = s.round();
        if !self.env.cfg.term_at_start
            || !s.open
            || !s.has(Key::Members(r))
            || s.get(Key::Members(r)) == round::join::ABANDONED
        {
            return;
        }
        self.env.cfg.term_at_start = false;
        for i in self.live_members_but_host(store, r) {
            self.term(i);
        }
    }

    /// SIGKILL: the container is gone at once; its store with it when it
    /// hosts one.
    fn kill(&mut self, i: usize, tick: u64) {
        let a = &mut self.agents[i];
        let name = a.name();
        a.phase = Phase::Gone;
        let (uid, pod, store, generation) = (a.uid, a.pod, a.store, a.generation);
        // One kill in 8 is a machine that vanished (power, a partition).
        let vanished = self.env.rng.chance(125);
        self.env.note(&name, if vanished { "vanishes with its machine" } else { "is killed (SIGKILL)" });
        self.env.facts.signalled.insert(uid);
        self.killed.push((uid, tick, vanished));
        self.env.facts.killed_at.insert(uid, tick);
        if !vanished {
            self.env.facts.lost_at.insert(uid, tick);
        }
        if pod == 0 {
            self.env.close(store);
        }
        // In place, a new container of the pod starts later (not once the
        // job has its outcome: that container would start a job of its own).
        if self.env.cfg.in_place && !self.env.facts.outcome.contains_key(&generation) {
            let back = tick + 20 + self.env.rng.below(300);
            self.starts.push((back, pod, generation));
        }
    }

    /// SIGTERM: the pod says it leaves (it ends its round), reports its
    /// workers stopped, and exits with the signal's code.
    fn term(&mut self, i: usize) {
        let a = &mut self.agents[i];
        let name = a.name();
        let (uid, store) = (a.uid, a.store);
        self.env.note(&name, "is stopped (SIGTERM)");
        self.env.facts.signalled.insert(uid);
        let s = &mut self.env.stores[store];
        if let (true, Phase::Running(m) | Phase::Stopping(m)) = (s.open, a.phase.clone()) {
            s.cas(Key::End(m.r), End::Abort(uid).value());
            let n = s.add(Key::Stopped(m.r), 1);
            if n >= i64::try_from(m.size).unwrap_or(i64::MAX) {
                s.set(Key::AllStopped(m.r), "1");
            }
        }
        let hosts = a.hosts();
        a.phase = Phase::Gone;
        self.env.facts.exits.insert(
            uid,
            super::world::Exit { code: Code::Signal, why: "SIGTERM".into(), no_word: false, generation: a.generation },
        );
        if hosts {
            self.env.close(store);
        }
    }

    /// Containers that start now: a pod's in place (the store host's with
    /// a new, empty store); an in-place job's next generation.
    fn start_containers(&mut self, tick: u64) {
        if self.env.cfg.kind == Kind::InPlace && self.env.generation == 0 {
            self.restart_failed_job(tick);
        }
        let due: Vec<(u32, u32)> =
            self.starts.iter().filter(|(at, ..)| *at <= tick).map(|(_, p, g)| (*p, *g)).collect();
        self.starts.retain(|(at, ..)| *at > tick);
        for (pod, generation) in due {
            let groups = self.env.cfg.groups;
            if pod == 0 {
                let incarnation = self.env.stores.iter().map(|s| s.incarnation).max().unwrap_or(0) + 1;
                if groups > 1 {
                    self.env.stores.extend((0..groups).map(|g| Store::new(g, incarnation)));
                } else {
                    self.env.stores.push(Store::new(generation, incarnation));
                }
            }
            let store = if groups > 1 { self.env.newest_of(generation) } else { self.env.newest() };
            let saved = self.env.generation;
            self.env.generation = generation;
            let a = Agent::new(&mut self.env, pod, store, true);
            self.env.generation = saved;
            let name = a.name();
            self.env.note(&name, format!("starts in place (store {store})"));
            self.agents.push(a);
        }
    }

    /// The first job of an in-place schedule failed (its host's pod
    /// exited): every pod restarts in place, as a new generation; the new
    /// containers meet the old store while it closes.
    fn restart_failed_job(&mut self, tick: u64) {
        let host_gone = self.agents.iter().any(|a| a.hosts() && a.phase == Phase::Gone && a.generation == 0);
        let failed = self.env.facts.outcome.get(&0) == Some(&false);
        let started = self.agents.iter().any(|a| !a.hosts() && a.phase != Phase::Gone && a.generation == 0);
        if !failed || (!host_gone && started) {
            return;
        }
        self.env.generation = 1;
        self.env.cfg.fail_rate = 0;
        self.env.cfg.max_restarts = 1;
        self.env.note("jobset", "the job failed: every pod restarts in place");
        for pod in 0..self.env.cfg.pods {
            let at = tick + if pod == 0 { 5 + self.env.rng.below(40) } else { self.env.rng.below(20) };
            self.starts.push((at, pod, 1));
        }
    }

    /// The store host's monitor, beside its store whether or not its agent
    /// is a member: it follows the rounds (`rR/next`); once a round has
    /// members it deletes the keys of the rounds before the previous one,
    /// and declares dead a member killed a heartbeat timeout ago (its
    /// machine vanished) or the grace ago (its heartbeat connection closed:
    /// `lost`), which ends the round.
    fn monitor(&mut self, tick: u64) {
        // The newest store host's: every replica group's store it serves.
        let incarnation = self.env.stores[self.env.newest()].incarnation;
        for store in 0..self.env.stores.len() {
            if self.env.stores[store].incarnation == incarnation && self.env.stores[store].open {
                self.monitor_store(tick, store);
            }
        }
    }

    fn monitor_store(&mut self, tick: u64, store: usize) {
        let s: &mut Store = &mut self.env.stores[store];
        let mut notes = Vec::new();
        let mut decided = None;
        let (mut r, mut forgot) = self.monitored.get(&store).copied().unwrap_or((0, false));
        if s.has(Key::Next(r)) {
            // A round that never formed forgets the old rounds as it goes.
            if round::monitor::forgets_on_moving_on(forgot) {
                s.drop_rounds_before(r, tick);
            }
            r = s.next_of(r);
            forgot = false;
            notes.push(format!("follows the job to round {r}"));
        }
        if s.has(Key::Members(r)) && s.get(Key::Members(r)) != round::join::ABANDONED {
            if !forgot {
                s.drop_rounds_before(r, tick);
                forgot = true;
                notes.push(format!("round {r} formed; forgets the rounds before {}", r.saturating_sub(1)));
            }
            // Members silent for the heartbeat timeout are declared dead
            // (after a success only counted); a round whose members are
            // all gone is moved on, or (a success) decided.
            let members = parse_uids(&s.get(Key::Members(r)));
            let mut dead = parse_uids(&s.get(Key::Dead(r)));
            let succeeded = End::read(&s.get(Key::End(r))) == Some(End::Success);
            let silent: Vec<Uid> = self
                .killed
                .iter()
                .filter(|(u, at, vanished)| {
                    let beat = if *vanished { Beat::Beating } else { Beat::Lost };
                    members.contains(u) && monitor::dead(beat, tick - at, HEARTBEAT_TIMEOUT, LOST_GRACE)
                })
                .map(|(u, _, _)| *u)
                .collect();
            let newly: Vec<Uid> = silent.iter().filter(|u| !dead.contains(u)).copied().collect();
            if let (Some(first), false) = (newly.first(), succeeded) {
                dead.extend(&newly);
                let list: Vec<String> = dead.iter().map(Uid::to_string).collect();
                s.set(Key::Dead(r), list.join(","));
                s.cas(Key::End(r), End::Dead(*first).value());
                notes.push(format!("declares {newly:?} dead in round {r}"));
            }
            let exits = &self.env.facts.exits;
            let gone = members.iter().filter(|u| silent.contains(u) || exits.contains_key(u)).count();
            let all_gone = !members.is_empty() && gone == members.len();
            let verdict = match s.get(Key::Verdict(r)).as_slice() {
                b"" => VerdictSeen::None,
                b"success" | b"fail" => VerdictSeen::Final,
                _ => VerdictSeen::MovesOn,
            };
            match orphaned(all_gone, !silent.is_empty(), succeeded, verdict) {
                Orphaned::MoveOn if !s.has(Key::Next(r)) => {
                    let to = s.raise(Key::Round, r + 1);
                    s.cas(Key::Next(r), to.to_string());
                    notes.push(format!("every member of round {r} is gone; opens round {to}"));
                }
                Orphaned::Succeed => {
                    s.cas(Key::Verdict(r), "success");
                    decided = Some(s.generation);
                    notes.push(format!("round {r} succeeded and lost every member before its verdict; decides it"));
                }
                _ => {}
            }
        }
        self.monitored.insert(store, (r, forgot));
        if let Some(generation) = decided {
            self.env.facts.outcome.entry(generation).or_insert(true);
            self.env.facts.decided_at.get_or_insert(tick);
        }
        for n in notes {
            self.env.note("store host", n);
        }
    }

    /// Stops of served runs, as the control API takes them, through the
    /// protocol's [`StopRun`].
    fn serve_stops(&mut self, tick: u64) {
        if !self.env.cfg.stops || !self.env.stores[0].open {
            return;
        }
        let mut stop = match self.stop {
            Some(stop) if stop.at <= tick => stop,
            Some(_) => return,
            None if self.env.rng.chance(8) => {
                let seq = 1 + self.env.rng.below((self.env.facts.served + 1).min(self.env.cfg.runs));
                self.env.note("control API", format!("a stop of run {seq}"));
                Stop { seq, run: StopRun::new(), at: tick }
            }
            None => return,
        };
        let seq = stop.seq;
        let s = &mut self.env.stores[0];
        match stop.run.next() {
            Op::ReadRound => stop.run.read(s.round()),
            Op::Mark => {
                let first = set_ended(s, seq, "stopped");
                stop.run.marked(first);
                self.env.note("control API", format!("marks run {seq} stopped (first: {first})"));
            }
            Op::EndRound(r) => {
                stop.run.ended();
                let v = End::Stop(seq).value();
                if s.cas(Key::End(r), v.clone()) == v {
                    self.env.note("control API", format!("the stop of run {seq} ends round {r}"));
                    // The run of round r: the one it ran, or (not formed yet)
                    // the one it will run.
                    let facts = &self.env.facts;
                    let run = facts.run_of_round.get(&(0, r)).copied().unwrap_or(facts.served + 1);
                    if run != seq {
                        let runs = if run <= self.env.cfg.runs { format!("run {run}") } else { "no run".into() };
                        self.env.violate(format!("a stop of run {seq} ended round {r}, which runs {runs}"));
                    }
                }
            }
            Op::Done => {
                self.stop = None;
                return;
            }
        }
        stop.at = tick + self.env.rng.below(4);
        self.stop = Some(stop);
    }

    /// The invariants after a step.
    fn check(&mut self) {
        // One live agent per place in the job (past its claim), in each
        // store that serves: a store that closed holds no claim (its agents
        // find out at their next step; one that comes back claims again).
        let mut in_job: Vec<(u32, u32)> = self
            .agents
            .iter()
            .filter(|a| !matches!(a.phase, Phase::Start | Phase::Join { .. } | Phase::Claim { .. } | Phase::Gone))
            .filter(|a| !matches!(a.phase, Phase::Reconnect { .. } | Phase::Rejoin { .. }))
            .filter(|a| self.env.stores[a.store].open)
            .map(|a| (a.generation, a.pod))
            .collect();
        in_job.sort_unstable();
        if let Some(w) = in_job.windows(2).find(|w| w[0] == w[1]) {
            let pod = w[0].1;
            let phases: Vec<String> = self
                .agents
                .iter()
                .filter(|a| a.pod == pod && a.phase != Phase::Gone)
                .map(|a| format!("uid {} on store {} {:?}", a.uid, a.store, a.phase))
                .collect();
            self.env.violate(format!("two live agents of pod {pod} are in the job: {}", phases.join("; ")));
        }
        if let Some(held) =
            self.env.stores.iter().filter(|s| s.open).map(Store::rounds_held).find(|h| h.len() > ROUNDS_HELD)
        {
            self.env.violate(format!("the store holds the keys of {} rounds: {held:?}", held.len()));
        }
    }

    /// At the end: every agent is gone (liveness), and every exit agrees
    /// with its job's outcome.
    fn finally(&mut self) {
        if let Some(a) = self.agents.iter().find(|a| a.phase != Phase::Gone) {
            let what = format!("{} still waits at tick {} ({:?})", a.name(), self.env.tick, a.phase);
            self.env.violate(what);
            return;
        }
        for (uid, e) in self.env.facts.exits.clone() {
            let outcome = self.env.facts.outcome.get(&e.generation).copied();
            let wrong = match e.code {
                Code::Success => outcome != Some(true),
                Code::Failure => outcome == Some(true),
                Code::PeerLost => outcome == Some(true) && !e.no_word,
                Code::Signal | Code::Refused | Code::Stale => false,
            };
            if wrong {
                let job = match outcome {
                    Some(true) => "succeeded",
                    Some(false) => "failed",
                    None => "has no outcome",
                };
                self.env.violate(format!("uid {uid} exited {:?} ({}) but its job {job}", e.code, e.why));
                return;
            }
        }
    }
}
