//! Serve mode's keys, under the job's prefix (the values: `crate::serve`).
//!
//! | key | written by | meaning |
//! |---|---|---|
//! | `serve/session` | the control API, at start | this serving session's random id, sealed |
//! | `serve/run` | the control API | the newest run (JSON, sealed) |
//! | `serve/go/<seq>` | the control API | run `seq` is published, runs in a lane, or the pods shut down |
//! | `serve/ended/<seq>` | the control API, every pod's agent | run `seq` is over: `<id> <state>`, sealed |
//! | `serve/setup` | the control API | the setup steps |
//! | `serve/lanes`, `serve/lanes/v/<version>` | the control API | the open lanes, and a wake-up per version |
//! | `serve/lane/<seq>/run` | the control API | lane `seq`'s run |
//! | `serve/blob/<sha256>/<i>` | the control API | a file's content in 4 MiB chunks |
//! | `serve/log/<seq>/n` | ADD per shipping agent | its slot |
//! | `serve/log/<seq>/<slot>/n`, `.../<i>` | that agent | chunks of its workers' lines, and how many |
//! | `actor/<seq>/op/<n>`, `actor/<seq>/ops`, `actor/<seq>/first/<round>` | the control API | run `seq`'s actor's operations ([`ActorKeys`]) |
//! | `actor/<seq>/res/<n>/<rank>` | each pod's agent | a rank's outcome of call `n` |
//! | `stacks/ask`, `stacks/ask/<n>` | the control API | a request for every rank's stacks ([`StacksKeys`]) |
//! | `stacks/answers/<n>`, `stacks/answers/<n>/<k>` | each pod's agent | the answers, and how many |
//! | `cache/<pod>` | each pod's agent | its file cache's contents ([`cache`]) |

/// The store keys of serve mode under one job prefix.
#[derive(Debug, Clone)]
pub struct ServeKeys {
    base: String,
    /// A lane agent's run (`lane::`): its run is the lane's.
    lane: Option<u64>,
}

impl ServeKeys {
    /// Keys under `base` (the job's prefix).
    pub fn new(base: &str) -> Self {
        Self { base: format!("{base}/serve"), lane: None }
    }

    /// The keys of lane `seq`'s agents: the same, but their run is the lane's.
    pub fn for_lane(base: &str, seq: u64) -> Self {
        Self { lane: Some(seq), ..Self::new(base) }
    }

    /// The open lanes.
    pub fn lanes(&self) -> String {
        format!("{}/lanes", self.base)
    }

    /// Version `version` of the lanes record is out.
    pub fn lanes_wake(&self, version: u64) -> String {
        format!("{}/lanes/v/{version}", self.base)
    }

    /// Lane `seq`'s run.
    pub fn lane_run(&self, seq: u64) -> String {
        format!("{}/lane/{seq}/run", self.base)
    }

    /// The serving session.
    pub fn session(&self) -> String {
        format!("{}/session", self.base)
    }

    /// The setup steps.
    pub fn setup(&self) -> String {
        format!("{}/setup", self.base)
    }

    /// The newest run (a lane agent's: its lane's).
    pub fn run(&self) -> String {
        match self.lane {
            Some(seq) => self.lane_run(seq),
            None => format!("{}/run", self.base),
        }
    }

    /// The go signal of run `seq`.
    pub fn go(&self, seq: u64) -> String {
        format!("{}/go/{seq}", self.base)
    }

    /// Run `seq` is over.
    pub fn ended(&self, seq: u64) -> String {
        format!("{}/ended/{seq}", self.base)
    }

    /// Chunk `i` of a blob.
    pub fn blob(&self, sha256: &str, i: u64) -> String {
        format!("{}/blob/{sha256}/{i}", self.base)
    }

    /// The slot counter of run `seq`'s log shippers.
    pub fn log_slots(&self, seq: u64) -> String {
        format!("{}/log/{seq}/n", self.base)
    }

    /// The chunk count of shipper `slot` in run `seq`.
    pub fn log_count(&self, seq: u64, slot: i64) -> String {
        format!("{}/log/{seq}/{slot}/n", self.base)
    }

    /// Chunk `i` of shipper `slot` in run `seq`.
    pub fn log_chunk(&self, seq: u64, slot: i64, i: i64) -> String {
        format!("{}/log/{seq}/{slot}/{i}", self.base)
    }
}

/// The store keys of the actor of run `seq`.
#[derive(Debug, Clone)]
pub struct ActorKeys {
    base: String,
}

impl ActorKeys {
    /// Keys of run `seq`'s actor under the job prefix `job`.
    pub fn new(job: &str, seq: u64) -> Self {
        Self { base: format!("{job}/actor/{seq}") }
    }

    /// Operation `n`.
    pub fn op(&self, n: u64) -> String {
        format!("{}/op/{n}", self.base)
    }

    /// The number of the first operation for `round`.
    pub fn first(&self, round: u64) -> String {
        format!("{}/first/{round}", self.base)
    }

    /// The newest operation's number.
    pub fn ops(&self) -> String {
        format!("{}/ops", self.base)
    }

    /// `rank`'s outcome of call `n`.
    pub fn result(&self, n: u64, rank: u32) -> String {
        format!("{}/res/{n}/{rank}", self.base)
    }
}

/// The keys of the control API's stacks requests under one job prefix.
#[derive(Debug, Clone)]
pub struct StacksKeys {
    base: String,
}

impl StacksKeys {
    /// Keys under `job` (the job's prefix).
    pub fn new(job: &str) -> Self {
        Self { base: format!("{job}/stacks") }
    }

    /// The request counter.
    pub fn asks(&self) -> String {
        format!("{}/ask", self.base)
    }

    /// Request `n`.
    pub fn request(&self, n: i64) -> String {
        format!("{}/ask/{n}", self.base)
    }

    /// How many pods answered request `n`.
    pub fn answers(&self, n: i64) -> String {
        format!("{}/answers/{n}", self.base)
    }

    /// Answer `k` to request `n`.
    pub fn answer(&self, n: i64, k: i64) -> String {
        format!("{}/answers/{n}/{k}", self.base)
    }
}

/// The key of `pod`'s file cache entry under the job prefix `job`.
pub fn cache(job: &str, pod: &str) -> String {
    format!("{job}/cache/{pod}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_is_spelled_as_the_table_says() {
        let job = "trainlet/job/j0";
        let s = ServeKeys::new(job);
        let lane = ServeKeys::for_lane(job, 4);
        let each = [
            (s.session(), "serve/session"),
            (s.run(), "serve/run"),
            (lane.run(), "serve/lane/4/run"),
            (s.go(3), "serve/go/3"),
            (s.ended(3), "serve/ended/3"),
            (s.setup(), "serve/setup"),
            (s.lanes(), "serve/lanes"),
            (s.lanes_wake(2), "serve/lanes/v/2"),
            (s.blob("ab", 1), "serve/blob/ab/1"),
            (s.log_slots(3), "serve/log/3/n"),
            (s.log_count(3, 1), "serve/log/3/1/n"),
            (s.log_chunk(3, 1, 9), "serve/log/3/1/9"),
            (ActorKeys::new(job, 3).op(8), "actor/3/op/8"),
            (ActorKeys::new(job, 3).ops(), "actor/3/ops"),
            (ActorKeys::new(job, 3).first(2), "actor/3/first/2"),
            (ActorKeys::new(job, 3).result(7, 2), "actor/3/res/7/2"),
            (StacksKeys::new(job).asks(), "stacks/ask"),
            (StacksKeys::new(job).request(5), "stacks/ask/5"),
            (StacksKeys::new(job).answers(5), "stacks/answers/5"),
            (StacksKeys::new(job).answer(5, 1), "stacks/answers/5/1"),
            (cache(job, "p-0"), "cache/p-0"),
        ];
        for (key, rest) in each {
            assert_eq!(key, format!("{job}/{rest}"));
        }
    }
}
