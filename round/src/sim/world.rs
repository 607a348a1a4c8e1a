//! One schedule's world: its configuration drawn from the seed, the
//! seeded random source, the stores, what the agents did (the facts the
//! invariants are checked on) and the trace that replays it.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use super::store::{Store, Uid};

/// Ticks (one scheduler step each) before a join gives up.
pub const JOIN_TIMEOUT: u64 = 1500;
/// Ticks without a heartbeat before the store host declares a pod dead.
pub const HEARTBEAT_TIMEOUT: u64 = 60;
/// Ticks a member's heartbeat may read `lost` (its connection closed
/// without a `bye`) before the store host declares it dead: the agent's
/// 0.5 s beside its 10 s heartbeat timeout.
pub const LOST_GRACE: u64 = 3;
/// An elastic round's last call, in ticks (three heartbeat timeouts, as the defaults are).
pub const LAST_CALL: u64 = 3 * HEARTBEAT_TIMEOUT;
/// How long a claimant watches a holder's heartbeat before it takes the
/// holder for gone (two heartbeat periods and a little).
pub const STILL_LIMIT: u64 = 2 * (HEARTBEAT_TIMEOUT / 3) + 5;
/// How often a spare checks its health while it waits (the agent's
/// minute, six heartbeat timeouts of 10 s).
pub const SPARE_RECHECK: u64 = 6 * HEARTBEAT_TIMEOUT;
/// How long a pod that lost its store waits for the host's word.
pub const HOST_LEFT_SETTLE: u64 = 10;
/// How long the store host waits for the last round's spares to read the
/// verdict before it closes the store.
pub const SPARES_READ_WAIT: u64 = 30;
/// How long the store host waits for every member to leave.
pub const LEAVE_WAIT: u64 = 200;
/// How long the workers of a round wait for all of its members' workers
/// (torch's rendezvous timeout) before they fail.
pub const WORKER_INIT_TIMEOUT: u64 = 1000;
/// How long a wait for the rest of the pods to stop may take.
pub const STOP_WAIT: u64 = 400;
/// The longest pause of a slow agent: past [`SPARES_READ_WAIT`] and
/// [`HOST_LEFT_SETTLE`], as a loaded machine's can be, but within the
/// heartbeat timeout (the protocol's one timing assumption: a pod silent
/// for longer is taken for dead, and the simulation's kills are those).
pub const PAUSE_MAX: u64 = HEARTBEAT_TIMEOUT - 10;
/// The longest health check before a round (its heartbeat goes on).
pub const HEALTH_CHECK_MAX: u64 = 5 * HEARTBEAT_TIMEOUT;
/// The longest stall of an agent's protocol step (a store reply that is
/// late), past the heartbeat timeout: its heartbeat goes on meanwhile.
pub const STALL_MAX: u64 = 5 * HEARTBEAT_TIMEOUT;
/// Ticks a schedule may take at most; an agent still waiting then broke
/// liveness.
pub const TICK_LIMIT: u64 = 60_000;
/// Trace lines kept for a violation's report.
const TRACE_KEPT: usize = 4000;

/// The seeded source of every choice (SplitMix64).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// Seeded.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next 64 bits.
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in 0..n (0 when n is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }

    /// True `per_mille` times in a thousand.
    pub fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }
}

/// What kind of job a schedule runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A training job: static or elastic, with or without spares, faults.
    Job,
    /// A served job: runs one after another, stopped at random, then its
    /// idle shutdown.
    Serve,
    /// A job that fails, and whose pods all restart in place: the new
    /// containers meet the old store while it closes, then run a new job.
    InPlace,
}

/// A schedule's configuration, drawn from its seed.
#[derive(Debug, Clone)]
pub struct Cfg {
    /// The job's kind.
    pub kind: Kind,
    /// Pods (agents), members and spares.
    pub pods: u32,
    /// MIN pods of a round.
    pub min: u32,
    /// MAX pods of a round.
    pub max: u32,
    /// `--spares K`: members keep their ranks and join first.
    pub spares_flag: bool,
    /// Restarts allowed.
    pub max_restarts: u32,
    /// Served runs (serve mode).
    pub runs: u64,
    /// Per mille per running step: a worker fails.
    pub fail_rate: u64,
    /// Per mille per agent and tick: the agent is paused (a loaded machine).
    pub load: u64,
    /// Faults: SIGKILL of a pod, SIGTERM of a pod, the store host's death,
    /// its return (in place), its leaving word lost (its SET timed out).
    pub kill: bool,
    /// See [`Cfg::kill`].
    pub sigterm: bool,
    /// SIGKILL of every member but the store host's as the first round
    /// that succeeds ends (its workers finished; a node pool drained).
    pub kill_at_end: bool,
    /// SIGTERM of every member but the store host's as the first round
    /// forms (a node pool preempted).
    pub term_at_start: bool,
    /// SIGKILL of the pod that closed a round before it assigned the
    /// ranks (it is not the store host's).
    pub kill_closer: bool,
    /// A second container of a live pod starts (a stale pod back).
    pub stale_pod: bool,
    /// Some pods' workers take long to stop (up to past the others' wait).
    pub slow_stop: bool,
    /// See [`Cfg::kill`].
    pub host_crash: bool,
    /// Killed pods come back in place (a new container, a new uid).
    pub in_place: bool,
    /// See [`Cfg::kill`].
    pub word_lost: bool,
    /// Stops of served runs, at random (some of runs that are over).
    pub stops: bool,
    /// Replica groups (`--replica-groups`): each of `pods` pods, meeting on
    /// keys of its own on the one store; the store host's pod is group 0's.
    pub groups: u32,
}

impl Cfg {
    /// The configuration schedule `seed` runs.
    pub fn draw(rng: &mut Rng) -> Cfg {
        let kind = match rng.below(10) {
            0..=5 => Kind::Job,
            6..=8 => Kind::Serve,
            _ => Kind::InPlace,
        };
        let max = match rng.below(20) {
            0..=13 => 1 + rng.below(5),
            14..=18 => 6 + rng.below(11),
            _ => 17 + rng.below(32),
        };
        let max = u32::try_from(max).unwrap_or(1);
        let elastic = kind == Kind::Job && max > 1 && rng.chance(300);
        let min = if elastic { 1 + u32::try_from(rng.below(u64::from(max - 1))).unwrap_or(0) } else { max };
        let spares_flag = kind != Kind::InPlace && !elastic && rng.chance(300);
        let extra =
            if (elastic || spares_flag) && rng.chance(600) { 1 + u32::try_from(rng.below(2)).unwrap_or(0) } else { 0 };
        let pods = (max + extra).min(64);
        let faults = kind == Kind::Job;
        let groups = if faults && !elastic && !spares_flag && pods <= 16 && rng.chance(150) {
            2 + u32::try_from(rng.below(2)).unwrap_or(0)
        } else {
            1
        };
        Cfg {
            kind,
            pods,
            min,
            max,
            spares_flag,
            max_restarts: u32::try_from(rng.below(3)).unwrap_or(0),
            runs: 1 + rng.below(4),
            fail_rate: if rng.chance(400) { rng.below(6) } else { 0 },
            load: if rng.chance(450) { 10 + rng.below(40) } else { 2 },
            kill: faults && rng.chance(250),
            sigterm: faults && rng.chance(250),
            kill_at_end: faults && rng.chance(100),
            term_at_start: faults && rng.chance(100),
            kill_closer: faults && rng.chance(150),
            host_crash: faults && rng.chance(100),
            in_place: rng.chance(500),
            word_lost: rng.chance(200),
            stops: kind == Kind::Serve && rng.chance(800),
            stale_pod: kind != Kind::InPlace && rng.chance(150),
            slow_stop: faults && rng.chance(200),
            groups,
        }
    }

    /// Its one-line description.
    pub fn describe(&self) -> String {
        let faults: Vec<&str> = [
            (self.kill, "kill"),
            (self.kill_at_end, "kill-at-end"),
            (self.term_at_start, "term-at-start"),
            (self.kill_closer, "kill-closer"),
            (self.stale_pod, "stale-pod"),
            (self.slow_stop, "slow-stop"),
            (self.sigterm, "sigterm"),
            (self.host_crash, "host-crash"),
            (self.in_place, "in-place"),
            (self.word_lost, "word-lost"),
            (self.stops, "stops"),
        ]
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, n)| *n)
        .collect();
        format!(
            "{:?}: {} pods{}, rounds of {}..={}{}, max restarts {}, worker failures {}/1000, pauses {}/1000, runs {}, faults [{}]",
            self.kind,
            self.pods,
            if self.groups > 1 { format!(" in each of {} replica groups", self.groups) } else { String::new() },
            self.min,
            self.max,
            if self.spares_flag { ", --spares" } else { "" },
            self.max_restarts,
            self.fail_rate,
            self.load,
            self.runs,
            faults.join(" ")
        )
    }
}

/// How an agent's pod exits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// 0.
    Success,
    /// The job failed.
    Failure,
    /// It lost its peers (the store, or a pod that never came).
    PeerLost,
    /// Killed or stopped by a signal.
    Signal,
    /// Refused: another live agent holds its place (exit 200).
    Refused,
    /// A newer attempt of the job runs (the JobSet restarted it): this
    /// container's is over (`STALE_ATTEMPT`).
    Stale,
}

/// An agent's exit.
#[derive(Debug, Clone)]
pub struct Exit {
    /// Its code.
    pub code: Code,
    /// Why, for the trace.
    pub why: String,
    /// It lost the store with no word and nothing in hand about the end.
    pub no_word: bool,
    /// The job generation it belonged to.
    pub generation: u32,
}

/// What happened, for the invariants.
#[derive(Debug, Default)]
pub struct Facts {
    /// The verdict every pod agreed on, per (store, round).
    pub verdicts: BTreeMap<(usize, u64), String>,
    /// Who holds each group rank, per (store, round).
    pub ranks: BTreeMap<(usize, u64, u32), Uid>,
    /// Each round's members by slot and its spares, per (store, round).
    pub members: BTreeMap<(usize, u64), Vec<Uid>>,
    /// The job's outcome per generation: its final verdict's success.
    pub outcome: BTreeMap<u32, bool>,
    /// When the last outcome was decided.
    pub decided_at: Option<u64>,
    /// The last restart verdict per (generation, store).
    pub restarts: BTreeMap<(u32, usize), u32>,
    /// Agents killed or stopped by a signal.
    pub signalled: BTreeSet<Uid>,
    /// Agents that exited.
    pub exits: BTreeMap<Uid, Exit>,
    /// When each killed agent died (its heartbeat stood still since).
    pub killed_at: BTreeMap<Uid, u64>,
    /// When each agent killed by a signal (not with its machine) died: its
    /// heartbeat has read `lost` since, its connection closed by its kernel.
    pub lost_at: BTreeMap<Uid, u64>,
    /// When each round formed, as its first member saw it, per (store, round).
    pub formed_at: BTreeMap<(usize, u64), u64>,
    /// Each container's pod and generation (its replica group's, with groups).
    pub pod_of: BTreeMap<Uid, (u32, u32)>,
    /// Served runs over.
    pub served: u64,
    /// Served runs: the run each round ran, per (store, round).
    pub run_of_round: BTreeMap<(usize, u64), u64>,
}

/// Everything but the agents.
#[derive(Debug)]
pub struct Env {
    /// The schedule's choices.
    pub rng: Rng,
    /// Now.
    pub tick: u64,
    /// The configuration.
    pub cfg: Cfg,
    /// The stores, one per store host incarnation, the newest last.
    pub stores: Vec<Store>,
    /// The facts.
    pub facts: Facts,
    /// The last lines of the trace.
    pub trace: VecDeque<String>,
    /// The first invariant broken.
    pub violation: Option<String>,
    /// The job generation now (an in-place restart of every pod starts a
    /// new one).
    pub generation: u32,
    /// The next container's uid.
    pub next_uid: Uid,
}

impl Env {
    /// A world for `cfg`, its first store open.
    pub fn new(rng: Rng, cfg: Cfg) -> Env {
        let stores = (0..cfg.groups).map(|g| Store::new(g, 0)).collect();
        Env {
            rng,
            tick: 0,
            cfg,
            stores,
            facts: Facts::default(),
            trace: VecDeque::new(),
            violation: None,
            generation: 0,
            next_uid: 1,
        }
    }

    /// A line of the trace.
    pub fn note(&mut self, who: &str, what: impl std::fmt::Display) {
        if self.trace.len() == TRACE_KEPT {
            self.trace.pop_front();
        }
        self.trace.push_back(format!("t={} {who}: {what}", self.tick));
    }

    /// An invariant broke (the first one is kept).
    pub fn violate(&mut self, what: impl Into<String>) {
        if self.violation.is_none() {
            self.violation = Some(what.into());
        }
    }

    /// The newest store's index.
    pub fn newest(&self) -> usize {
        self.stores.len() - 1
    }

    /// The newest store of job generation (or replica group) `generation`.
    pub fn newest_of(&self, generation: u32) -> usize {
        self.stores.iter().rposition(|s| s.generation == generation).unwrap_or(0)
    }

    /// The store host's store process ends: every group's store it served
    /// (those of `store`'s incarnation) closes.
    pub fn close(&mut self, store: usize) {
        let incarnation = self.stores[store].incarnation;
        for s in self.stores.iter_mut().filter(|s| s.incarnation == incarnation) {
            s.open = false;
        }
    }

    /// A fresh uid.
    pub fn uid(&mut self) -> Uid {
        self.next_uid += 1;
        self.next_uid
    }
}
