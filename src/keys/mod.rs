//! The one key schema of the agents' store: every key the agents, the
//! store host's services and the control API read or write there comes
//! from a method here, and no other source spells one
//! (`tests/it/layout.rs` checks it). The values' formats are the owners'
//! (a round's end is [`crate::supervise::round_end::RoundEnd`], a member
//! [`crate::rendezvous::Member`], a verdict
//! [`crate::supervise::policy::Verdict`]), except `closed`'s, read here
//! ([`Closed`]).
//!
//! A job's keys live under its prefix, `trainlet/<run_id>/j<JobSet restart
//! attempt>` ([`JobKeys`]); torch's own clients prefix their keys with `/`,
//! so they never collide. A replica group, a serve lane and a served run's
//! rounds are jobs of their own (their run ids: `crate::config`).
//!
//! | key | written by | meaning |
//! |---|---|---|
//! | `trainlet/<run_id>/attempt` | every agent, raised to the max | the newest JobSet restart attempt seen |
//! | `trainlet/<run_id>/stale-store-watch` | nobody | a WAIT on it ends only when the store closes |
//! | `round` | raised to the max | the open (or running) round R |
//! | `restarts` | raised to the max | restarts used, job-wide |
//! | `takeovers` | ADD per spare that got in | takeovers so far (the TrainJob's status) |
//! | `host_left` | the store host's agent, as it leaves | why: the others stop waiting for it |
//! | `hb/<uid>` | each agent, every interval | heartbeat counter, `bye` on exit; `lost` when its connection closed without `bye` ([`heartbeat_tie`]) |
//! | `claim/<place>` | each agent, first COMPARE_SET wins | the uid of the live agent that holds a node rank (elastic: `<node rank>@<host>`) |
//! | `leaving/<uid>` | an agent that got a stop signal | its signal: a pod that comes for its place waits for it to go |
//! | `pod/<job node rank>` | each pod of a replica group job | the key it heartbeats |
//! | `lighthouse` | the store host of a replica group job | the TorchFT Lighthouse's address |
//! | `status/<node rank>` | each pod's progress relay | its workers' newest `trainerStatus` |
//! | `rR/lead` | the store host's agent | its `--spares`, once it joined |
//! | `rR/join` | ADD per pod | arrival slots |
//! | `rR/m/<slot>` | each pod | its member record |
//! | `rR/quorum` | the pod that made MIN | the last call has started |
//! | `rR/closed` | first COMPARE_SET wins | [`Closed`], `N:<slot>`: the first N slots are members, slot assigns ranks |
//! | `rR/members` | first COMPARE_SET wins: the pod that closed the round, or one that gave it up | the [`Roster`](crate::rendezvous::Roster): the members' slots in group-rank order (a member's group rank is its slot's place), or why their records disagree, or `abandoned` |
//! | `rR/port` | the store host | `PORT,AUX`: the round's worker store, and a free port for a coordinator or tracker |
//! | `rR/service` | the store host's agent | `ready` or `failed: <why>`: XGBoost's tracker for the round |
//! | `rR/pmi/<fence>/<node>`, `rR/pmi/<fence>/in` | each pod, a barrier | the PMI fences' puts ([`PmiKeys`]) |
//! | `rR/end` | first COMPARE_SET wins | how the round ended (`RoundEnd`) |
//! | `rR/done`, `rR/stopped`, `rR/all_stopped` | ADD per pod, then the last | workers done / gone everywhere |
//! | `rR/failures/<group rank>` | each pod | JSON list of its failures |
//! | `rR/failed` | APPEND per pod with failures | `RANK,` each: the group ranks whose failures are not `[]` |
//! | `rR/stacks/<group rank>`, `rR/dumped/<group rank>` | each pod, at a hang | its workers' stacks, with their Flight Recorder dumps once `dumped` is set |
//! | `rR/sampled/<group rank>` | each pod, every window | its ranks' sampled states (`crate::stacks::straggle`): the store host names stragglers from them |
//! | `rR/dead` | the store host | uids that stopped heartbeating |
//! | `rR/verdict` | first COMPARE_SET wins | what every pod does next |
//! | `rR/next` | whoever moves the job on | the next round number |
//! | `rR/left`, `rR/all_left` | ADD per pod, then the last | the store host may close the store |
//! | `rR/spare_left` | ADD per spare that read the last verdict | the store host closes the store |
//! | `serve/...`, `actor/...`, `stacks/...`, `cache/...` | serve mode | [`serve`] |
//!
//! The store host deletes the keys of every round before R - 1 when round
//! R forms ([`JobKeys::round_of`] tells them), so the store holds two
//! rounds' keys whatever the number of rounds.

pub mod serve;

/// The keys of one job, under its prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobKeys {
    base: String,
}

impl JobKeys {
    /// The keys of run `run_id`'s JobSet restart attempt `jobset_attempt`.
    pub fn new(run_id: &str, jobset_attempt: u64) -> Self {
        Self { base: job_base(run_id, jobset_attempt) }
    }

    /// The keys of the job whose prefix is `base` (a [`job_base`]).
    pub fn under(base: &str) -> Self {
        Self { base: base.to_string() }
    }

    /// The newest JobSet restart attempt of run `run_id` (above every
    /// attempt's prefix).
    pub fn attempt(run_id: &str) -> String {
        format!("trainlet/{run_id}/attempt")
    }

    /// A key of run `run_id` nobody sets: a WAIT on it ends only when the
    /// store closes.
    pub fn never_set(run_id: &str) -> String {
        format!("trainlet/{run_id}/stale-store-watch")
    }

    /// The open (or running) round.
    pub fn round(&self) -> String {
        format!("{}/round", self.base)
    }

    /// Restarts used, job-wide.
    pub fn restarts(&self) -> String {
        format!("{}/restarts", self.base)
    }

    /// Spares that took a place so far.
    pub fn takeovers(&self) -> String {
        format!("{}/takeovers", self.base)
    }

    /// Why the store host's agent left.
    pub fn host_left(&self) -> String {
        format!("{}/host_left", self.base)
    }

    /// Agent `uid`'s heartbeat.
    pub fn heartbeat(&self, uid: &str) -> String {
        format!("{}/hb/{uid}", self.base)
    }

    /// Who holds `place` (a node rank, or `<node rank>@<host>`).
    pub fn claim(&self, place: &str) -> String {
        format!("{}/claim/{place}", self.base)
    }

    /// Agent `uid` got a stop signal and is leaving.
    pub fn leaving(&self, uid: &str) -> String {
        format!("{}/leaving/{uid}", self.base)
    }

    /// The heartbeat key of the pod of job node rank `rank` (replica groups).
    pub fn pod(&self, rank: u32) -> String {
        format!("{}/pod/{rank}", self.base)
    }

    /// The TorchFT Lighthouse's address, from the store host (replica groups).
    pub fn lighthouse(&self) -> String {
        format!("{}/lighthouse", self.base)
    }

    /// The progress of node rank `rank`'s workers.
    pub fn status(&self, rank: u32) -> String {
        format!("{}/status/{rank}", self.base)
    }

    /// Round `r`'s keys.
    pub fn round_keys(&self, r: u64) -> RoundKeys {
        RoundKeys { prefix: format!("{}/r{r}", self.base) }
    }

    /// The round a key of this job belongs to (`<base>/r<N>/...`); None
    /// for a job-wide key or another job's.
    pub fn round_of(&self, key: &str) -> Option<u64> {
        let rest = key.strip_prefix(&self.base)?.strip_prefix("/r")?;
        let (n, _) = rest.split_once('/')?;
        if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        n.parse().ok()
    }
}

/// The prefix of run `run_id`'s JobSet restart attempt `jobset_attempt`.
pub fn job_base(run_id: &str, jobset_attempt: u64) -> String {
    format!("trainlet/{run_id}/j{jobset_attempt}")
}

/// The agents' store's tie rule (`crate::store::State::tie`): an agent's
/// heartbeat key (`trainlet/<run_id>/j<N>/hb/<uid>`, any job under the
/// store, lanes' and replica groups' too) is tied to the connection that
/// beats it, so the key reads `lost` once that connection is closed by its
/// peer; its `bye` unties it (the agent left).
pub fn heartbeat_tie(key: &[u8], value: &[u8]) -> bool {
    let Some(rest) = key.strip_prefix(b"trainlet/") else { return false };
    let mut parts = rest.rsplitn(3, |b| *b == b'/');
    let (uid, hb) = (parts.next(), parts.next());
    hb == Some(b"hb") && uid.is_some_and(|u| !u.is_empty()) && parts.next().is_some() && value != b"bye"
}

/// The keys of one round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoundKeys {
    prefix: String,
}

/// Round keys with no argument: `fn name(&self) -> String` for `rR/name`.
macro_rules! round_keys {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        impl RoundKeys {
            $(
                $(#[$doc])*
                pub fn $name(&self) -> String {
                    format!("{}/{}", self.prefix, stringify!($name))
                }
            )*
        }
    };
}

round_keys! {
    /// The store host's `--spares`, once it joined.
    lead,
    /// Arrival slots (ADD).
    join,
    /// The last call has started.
    quorum,
    /// [`Closed`]: the round's size and the slot that assigns ranks.
    closed,
    /// The members' slots by group rank ([`Roster`](crate::rendezvous::Roster)).
    members,
    /// The round's worker store port and the auxiliary port.
    port,
    /// The round's service (XGBoost's tracker): `ready` or why not.
    service,
    /// How the round ended.
    end,
    /// Pods whose workers are done (ADD).
    done,
    /// Pods whose workers stopped (ADD).
    stopped,
    /// Every pod's workers stopped.
    all_stopped,
    /// `RANK,` for each group rank that reported failures (APPEND).
    failed,
    /// Uids that stopped heartbeating.
    dead,
    /// What every pod does next.
    verdict,
    /// The next round's number.
    next,
    /// Pods that left (ADD).
    left,
    /// Every pod left.
    all_left,
    /// Spares that read the last verdict (ADD).
    spare_left,
}

impl RoundKeys {
    /// Slot `slot`'s member record.
    pub fn member(&self, slot: impl std::fmt::Display) -> String {
        format!("{}/m/{slot}", self.prefix)
    }

    /// Group rank `rank`'s failures.
    pub fn failures(&self, rank: u32) -> String {
        format!("{}/failures/{rank}", self.prefix)
    }

    /// Group rank `rank`'s workers' stacks, at a hang.
    pub fn stacks(&self, rank: u32) -> String {
        format!("{}/stacks/{rank}", self.prefix)
    }

    /// Group rank `rank`'s stacks carry its Flight Recorder dumps.
    pub fn dumped(&self, rank: u32) -> String {
        format!("{}/dumped/{rank}", self.prefix)
    }

    /// Group rank `rank`'s ranks' sampled states over its last window.
    pub fn sampled(&self, rank: u32) -> String {
        format!("{}/sampled/{rank}", self.prefix)
    }

    /// Why group rank `rank`'s pod is asked to leave as a straggler's
    /// (`--evict-stragglers`), set by the store host.
    pub fn evict(&self, rank: u32) -> String {
        format!("{}/evict/{rank}", self.prefix)
    }

    /// The round's PMI fences.
    pub fn pmi(&self) -> PmiKeys {
        PmiKeys { prefix: format!("{}/pmi", self.prefix) }
    }
}

/// The keys of one round's PMI fences (`rR/pmi/...`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PmiKeys {
    prefix: String,
}

impl PmiKeys {
    /// Pod `node`'s puts for fence `seq`.
    pub fn puts(&self, seq: u64, node: usize) -> String {
        format!("{}/{seq}/{node}", self.prefix)
    }

    /// Fence `seq`'s barrier.
    pub fn barrier(&self, seq: u64) -> String {
        format!("{}/{seq}/in", self.prefix)
    }
}

/// What `rR/closed` holds (the round's protocol reads and writes it).
pub use round::Closed;

#[cfg(test)]
mod tests {
    use super::*;

    /// The schema's spelling is the protocol: a pod of this build and one
    /// of the previous build meet in one store during a rolling update.
    #[test]
    fn every_key_is_spelled_as_the_table_says() {
        let job = JobKeys::new("job-a", 2);
        assert_eq!(job, JobKeys::under("trainlet/job-a/j2"));
        assert_eq!(JobKeys::attempt("job-a"), "trainlet/job-a/attempt");
        assert_eq!(JobKeys::never_set("job-a"), "trainlet/job-a/stale-store-watch");
        assert_eq!(job.round(), "trainlet/job-a/j2/round");
        assert_eq!(job.restarts(), "trainlet/job-a/j2/restarts");
        assert_eq!(job.takeovers(), "trainlet/job-a/j2/takeovers");
        assert_eq!(job.host_left(), "trainlet/job-a/j2/host_left");
        assert_eq!(job.heartbeat("h#1#2"), "trainlet/job-a/j2/hb/h#1#2");
        // Heartbeats tie to their connection; nothing else does, nor `bye`.
        let hb = job.heartbeat("h#1#2");
        assert!(heartbeat_tie(hb.as_bytes(), b"17"));
        assert!(!heartbeat_tie(hb.as_bytes(), b"bye"));
        let lane = JobKeys::under("trainlet/job-a/lane/x/j0").heartbeat("u");
        assert!(heartbeat_tie(lane.as_bytes(), b"1"));
        for other in [job.claim("hb"), job.round(), "trainlet/hb/".into(), "x/j/hb/u".into(), "/hb/u".into()] {
            assert!(!heartbeat_tie(other.as_bytes(), b"1"), "{other}");
        }
        assert_eq!(job.claim("3@h"), "trainlet/job-a/j2/claim/3@h");
        assert_eq!(job.leaving("u"), "trainlet/job-a/j2/leaving/u");
        assert_eq!(job.pod(4), "trainlet/job-a/j2/pod/4");
        assert_eq!(job.lighthouse(), "trainlet/job-a/j2/lighthouse");
        assert_eq!(job.status(1), "trainlet/job-a/j2/status/1");
        let r = job.round_keys(7);
        let each = [
            (r.lead(), "lead"),
            (r.join(), "join"),
            (r.quorum(), "quorum"),
            (r.closed(), "closed"),
            (r.members(), "members"),
            (r.port(), "port"),
            (r.service(), "service"),
            (r.end(), "end"),
            (r.done(), "done"),
            (r.stopped(), "stopped"),
            (r.all_stopped(), "all_stopped"),
            (r.failed(), "failed"),
            (r.dead(), "dead"),
            (r.verdict(), "verdict"),
            (r.next(), "next"),
            (r.left(), "left"),
            (r.all_left(), "all_left"),
            (r.spare_left(), "spare_left"),
            (r.member(5), "m/5"),
            (r.failures(2), "failures/2"),
            (r.stacks(2), "stacks/2"),
            (r.dumped(2), "dumped/2"),
            (r.pmi().puts(3, 1), "pmi/3/1"),
            (r.pmi().barrier(3), "pmi/3/in"),
        ];
        for (key, rest) in each {
            assert_eq!(key, format!("trainlet/job-a/j2/r7/{rest}"));
            assert_eq!(job.round_of(&key), Some(7), "{key}");
        }
    }

    #[test]
    fn only_round_keys_of_this_job_belong_to_a_round() {
        let job = JobKeys::under("trainlet/none/j0");
        assert_eq!(job.round_of("trainlet/none/j0/r12/m/0"), Some(12));
        assert_eq!(job.round_of("trainlet/none/j0/r0/pmi/3/in"), Some(0));
        assert_eq!(job.round_of("trainlet/none/j0/round"), None);
        assert_eq!(job.round_of("trainlet/none/j0/restarts"), None);
        assert_eq!(job.round_of("trainlet/none/j0/r/x"), None);
        assert_eq!(job.round_of("trainlet/none/j0/r1x/x"), None);
        assert_eq!(job.round_of("trainlet/none/j0/r3"), None);
        assert_eq!(job.round_of("trainlet/none/j1/r3/end"), None);
        assert_eq!(job.round_of("trainlet/none-lane/j0/r3/end"), None);
        assert_eq!(job.round_of("trainlet/none/j0/serve/go/3"), None);
        assert_eq!(job.round_of("trainlet/none/j0/r99999999999999999999999/end"), None);
    }

    #[test]
    fn closed_reads_what_it_writes_and_nothing_else() {
        let c = Closed { size: 4, slot: 2 };
        assert_eq!(c.value(), "4:2");
        assert_eq!(Closed::read(c.value().as_bytes()), Some(c));
        for bad in [&b""[..], b"4", b"4:", b":2", b"-1:2", b"4:x", b"\xff:1", b"4:2:1"] {
            assert_eq!(Closed::read(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }
}
