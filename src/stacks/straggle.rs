//! Who the job waits for while it runs: stragglers from sampled stacks.
//! Pure: samples in, each rank's tally, and the verdict out.
//!
//! A rank slower than the others (a throttled GPU, a noisy neighbour, a
//! slow disk, a data loader that cannot keep up) fails nothing: every other
//! rank waits for it in each collective and the job runs at its pace. Its
//! workers' stacks, read from outside at a low rate, tell it apart: the
//! others are inside a `torch.distributed` collective (or a
//! `synchronize()`) a larger share of the time than it is.
//!
//! 1. [`classify`]: one sample of a worker's main thread is
//!    [`State::Wait`] (a collective of `torch.distributed`, a CUDA
//!    `synchronize`), [`State::Loader`] (waiting for the data loader's
//!    next batch), [`State::Io`] (`torch.save`/`load`, or blocked in a
//!    file or socket read or write), else [`State::Compute`], with its
//!    innermost frame.
//! 2. [`Tally`]: each pod counts its ranks' states over a window and
//!    sends the counts ([`RankTally`]) to the store host.
//! 3. [`Judge`]: the store host compares each rank's wait share with
//!    the median of the others' over each window. The rule: rank r is a
//!    straggler when, in each of [`STREAK`] windows in a row, with at
//!    least [`MIN_SAMPLES`] samples of every rank compared, the others'
//!    median wait share stands at least [`GAP`] above r's, and r's is at
//!    most half of it. Its score is that gap (0 to 1: how much more of
//!    the time the others wait than it does).
//!
//! The false-positive bound, for samples that are independent and a
//! median of the others' shares that stands at their true share p: a rank
//! whose true share is p too is behind in a window when its count over
//! n = [`MIN_SAMPLES`] samples is at most n min(p - GAP, p / 2). The
//! binomial tail of that is largest at p = 0.29, 1.1e-2; [`STREAK`]
//! windows in a row, 1.3e-6; so a healthy 10-minute job of 4 ranks (60
//! windows of 10 s) names someone with a probability under 60 x 4 x 1.3e-6
//! = 3e-4. A pod's window lasts until each of its ranks has
//! [`MIN_SAMPLES`] samples (10 s at the sampler's usual rate), and the
//! sampler's times are jittered so that a step period cannot alias with
//! them.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use super::Frame;

/// What a worker's main thread was doing in one sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// Inside a collective (or a CUDA synchronize): waiting for the others.
    Wait,
    /// Waiting for the data loader's next batch.
    Loader,
    /// Reading or writing a file or socket, or a checkpoint.
    Io,
    /// Anything else: it computes (or launches work on a GPU).
    Compute,
}

impl State {
    /// In words, as "it computes in train.py:40 in step" has it.
    pub fn doing(self) -> &'static str {
        match self {
            State::Wait => "waits in a collective",
            State::Loader => "waits for its data loader",
            State::Io => "reads or writes",
            State::Compute => "computes",
        }
    }
}

/// `torch.distributed` calls that wait for the other ranks, the CUDA
/// synchronizes a step waits in, and where `.item()`'s wait shows.
fn waits(f: &Frame) -> bool {
    let name = f.function.rsplit('.').next().unwrap_or(&f.function);
    let file = f.file.replace('\\', "/");
    (file.contains("torch/distributed/") && (super::stall::COLLECTIVES.contains(&name) || name == "wait"))
        || (file.contains("torch/cuda/") && name == "synchronize")
}

fn loads(f: &Frame) -> bool {
    let name = f.function.rsplit('.').next().unwrap_or(&f.function);
    f.file.contains("torch/utils/data/") && matches!(name, "__next__" | "_next_data" | "_get_data" | "_try_get_data")
}

fn saves(f: &Frame) -> bool {
    let name = f.function.rsplit('.').next().unwrap_or(&f.function);
    f.file.contains("torch/serialization.py") && matches!(name, "save" | "load")
}

/// System calls of file and socket I/O (x86-64 numbers).
const IO_CALLS: &[i64] = &[0, 1, 2, 17, 18, 19, 20, 40, 44, 45, 46, 47, 74, 75, 257, 295, 296];

/// One sample of a main thread: its Python frames (innermost first) and
/// the system call it is blocked in (None: it runs). Its state, and the
/// innermost frame outside torch and the standard library's internals
/// when there is one (else the innermost), as `file:line in function`.
pub fn classify(frames: &[Frame], blocked_in: Option<i64>) -> (State, Option<String>) {
    let state = if frames.iter().any(waits) {
        State::Wait
    } else if frames.iter().any(loads) {
        State::Loader
    } else if frames.iter().any(saves) || blocked_in.is_some_and(|nr| IO_CALLS.contains(&nr)) {
        State::Io
    } else {
        State::Compute
    };
    let user = frames.iter().find(|f| !f.file.contains("/torch/") && !f.file.contains("/site-packages/"));
    let at = user.or(frames.first()).map(|f| {
        let file = f.file.rsplit('/').next().unwrap_or(&f.file);
        match f.line {
            Some(l) => format!("{file}:{l} in {}", f.function),
            None => format!("{file} in {}", f.function),
        }
    });
    (state, at.map(|a| super::clean(&a)))
}

/// Most distinct places counted per rank and window (the rest count in
/// the states, not the places).
const PLACES: usize = 64;

/// One rank's counts over a window, as its pod sends them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankTally {
    /// Global rank.
    pub rank: u32,
    /// Its pod.
    pub host: String,
    /// Samples of each state.
    pub wait: u32,
    /// Waiting for the data loader.
    pub loader: u32,
    /// In I/O.
    pub io: u32,
    /// Computing.
    pub compute: u32,
    /// Where it was most often when not waiting in a collective, and in
    /// what state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<(State, String)>,
    /// What its pod's GPUs said, when one ran slow (NVML: clocks held down
    /// and why, PCIe replays).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<String>,
}

impl RankTally {
    /// Samples in all.
    pub fn samples(&self) -> u32 {
        self.wait + self.loader + self.io + self.compute
    }

    /// The share of samples in a collective (0 with none).
    pub fn wait_share(&self) -> f64 {
        match self.samples() {
            0 => 0.0,
            n => f64::from(self.wait) / f64::from(n),
        }
    }
}

/// Samples of a rank at each place (with its state).
type Places = HashMap<(State, String), u32>;

/// A pod's counts for its ranks over the current window.
#[derive(Debug, Default)]
pub struct Tally {
    ranks: BTreeMap<u32, (RankTally, Places)>,
}

impl Tally {
    /// Count one sample of `rank` (on `host`).
    pub fn add(&mut self, rank: u32, host: &str, (state, at): (State, Option<String>)) {
        let (t, places) = self
            .ranks
            .entry(rank)
            .or_insert_with(|| (RankTally { rank, host: super::clean(host), ..RankTally::default() }, HashMap::new()));
        match state {
            State::Wait => t.wait += 1,
            State::Loader => t.loader += 1,
            State::Io => t.io += 1,
            State::Compute => t.compute += 1,
        }
        if state != State::Wait
            && let Some(at) = at
        {
            let key = (state, at);
            if places.len() < PLACES || places.contains_key(&key) {
                *places.entry(key).or_default() += 1;
            }
        }
    }

    /// The fewest samples of any rank in this window (None: no rank yet).
    pub fn fewest(&self) -> Option<u32> {
        self.ranks.values().map(|(t, _)| t.samples()).min()
    }

    /// The window's counts, and a new window.
    pub fn take(&mut self) -> Vec<RankTally> {
        std::mem::take(&mut self.ranks)
            .into_values()
            .map(|(mut t, places)| {
                t.at = places.into_iter().max_by(|a, b| a.1.cmp(&b.1).then_with(|| b.0.cmp(&a.0))).map(|(k, _)| k);
                t
            })
            .collect()
    }
}

/// Fewest samples of a rank in a window for the window to be judged.
pub const MIN_SAMPLES: u32 = 50;
/// How far the others' median wait share must stand above a rank's.
pub const GAP: f64 = 0.15;
/// Windows in a row a rank must be behind to be named.
pub const STREAK: u32 = 3;

/// A rank named a straggler.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Straggler {
    /// Global rank.
    pub rank: u32,
    /// Its pod.
    pub host: String,
    /// The gap, 0 to 1.
    pub score: f64,
    /// The others' median wait share.
    pub others_wait: f64,
    /// Its own.
    pub own_wait: f64,
    /// Ranks compared with it.
    pub others: usize,
    /// What it did most when not waiting, and where.
    pub at: Option<(State, String)>,
    /// What its pod's GPUs said, when one ran slow.
    pub gpu: Option<String>,
}

impl Straggler {
    /// The verdict in one line.
    pub fn line(&self) -> String {
        let pct = |x: f64| (x * 100.0).round();
        let mut what = match &self.at {
            Some((state, at)) => format!("; it {} in {at}", state.doing()),
            None => String::new(),
        };
        if let Some(gpu) = &self.gpu {
            what.push_str(&format!("; its pod's {gpu}"));
        }
        format!(
            "rank {} ({}) is a straggler: the other {} wait for it {:.0}% of the time (it waits {:.0}%){what}",
            self.rank,
            self.host,
            self.others,
            pct(self.others_wait),
            pct(self.own_wait)
        )
    }
}

/// What one window changed.
#[derive(Debug, Default, PartialEq)]
pub struct Window {
    /// Every rank judged, with its score (0 when not behind).
    pub scores: Vec<(u32, f64)>,
    /// Ranks named in this window (they stay named until cleared).
    pub named: Vec<Straggler>,
    /// Ranks named before that are no longer behind.
    pub cleared: Vec<(u32, String)>,
}

/// The store host's judge, one per round: windows in, verdicts out.
#[derive(Debug, Default)]
pub struct Judge {
    streak: HashMap<u32, u32>,
    named: BTreeMap<u32, String>,
}

impl Judge {
    /// Judge one window of every rank's counts. Ranks with fewer than
    /// [`MIN_SAMPLES`] samples are neither judged nor compared with; a
    /// window with fewer than two such ranks judges no one (and keeps the
    /// streaks as they are: a pause in sampling names or clears no one).
    pub fn window(&mut self, all: &[RankTally]) -> Window {
        let mut ranks: Vec<&RankTally> = all.iter().filter(|t| t.samples() >= MIN_SAMPLES).collect();
        ranks.sort_by_key(|t| t.rank);
        ranks.dedup_by_key(|t| t.rank);
        let mut out = Window::default();
        if ranks.len() < 2 {
            return out;
        }
        let shares: Vec<f64> = ranks.iter().map(|t| t.wait_share()).collect();
        for (i, t) in ranks.iter().enumerate() {
            let mut others: Vec<f64> = shares.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, s)| *s).collect();
            let median = median(&mut others);
            let own = shares[i];
            let gap = median - own;
            let behind = gap >= GAP && own <= median / 2.0;
            out.scores.push((t.rank, gap.max(0.0)));
            let streak = self.streak.entry(t.rank).or_default();
            *streak = if behind { *streak + 1 } else { 0 };
            if behind && *streak >= STREAK && !self.named.contains_key(&t.rank) {
                self.named.insert(t.rank, t.host.clone());
                out.named.push(Straggler {
                    rank: t.rank,
                    host: t.host.clone(),
                    score: gap,
                    others_wait: median,
                    own_wait: own,
                    others: others.len(),
                    at: t.at.clone(),
                    gpu: t.gpu.clone(),
                });
            } else if !behind && let Some(host) = self.named.remove(&t.rank) {
                out.cleared.push((t.rank, host));
            }
        }
        out
    }

    /// The ranks named now.
    pub fn named(&self) -> impl Iterator<Item = (&u32, &String)> {
        self.named.iter()
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const C10D: &str = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py";

    fn frame(function: &str, file: &str, line: u32) -> Frame {
        Frame { function: function.into(), file: file.into(), line: Some(line) }
    }

    #[test_case::test_case(&[frame("all_reduce", C10D, 2501), frame("step", "/app/train.py", 40)], None, State::Wait ; "a collective")]
    #[test_case::test_case(&[frame("synchronize", "/venv/lib/python3.11/site-packages/torch/cuda/__init__.py", 985), frame("step", "/app/train.py", 41)], None, State::Wait ; "a cuda synchronize")]
    #[test_case::test_case(&[frame("_next_data", "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", 1328), frame("main", "/app/train.py", 60)], Some(7), State::Loader ; "the data loader")]
    #[test_case::test_case(&[frame("save", "/venv/lib/python3.11/site-packages/torch/serialization.py", 850), frame("main", "/app/train.py", 70)], None, State::Io ; "a checkpoint")]
    #[test_case::test_case(&[frame("read", "/app/data.py", 10)], Some(0), State::Io ; "blocked in read")]
    #[test_case::test_case(&[frame("step", "/app/train.py", 40)], Some(230), State::Compute ; "asleep in a step")]
    #[test_case::test_case(&[frame("step", "/app/train.py", 40)], None, State::Compute ; "running a step")]
    #[test_case::test_case(&[], None, State::Compute ; "no frame")]
    fn classifies_a_sample(frames: &[Frame], blocked_in: Option<i64>, want: State) {
        assert_eq!(classify(frames, blocked_in).0, want);
    }

    #[test]
    fn a_sample_is_placed_at_the_users_frame() {
        let frames = [frame("all_reduce", C10D, 2501), frame("step", "/app/train.py", 40)];
        assert_eq!(classify(&frames, None).1.as_deref(), Some("train.py:40 in step"));
        let torch_only = [frame("all_reduce", C10D, 2501)];
        assert_eq!(classify(&torch_only, None).1.as_deref(), Some("distributed_c10d.py:2501 in all_reduce"));
    }

    fn tally(rank: u32, wait: u32, compute: u32) -> RankTally {
        RankTally { rank, host: format!("pod-{}", rank / 2), wait, compute, ..RankTally::default() }
    }

    /// 2 pods x 2, rank 3 at 1.5x the others' compute: they wait a third
    /// of each step, it hardly waits.
    fn slowed() -> Vec<RankTally> {
        vec![tally(0, 16, 34), tally(1, 17, 33), tally(2, 16, 34), tally(3, 1, 49)]
    }

    #[test]
    fn a_rank_behind_for_streak_windows_is_named_once_and_cleared_when_it_catches_up() {
        let mut j = Judge::default();
        for _ in 1..STREAK {
            let w = j.window(&slowed());
            assert!(w.named.is_empty());
        }
        let w = j.window(&slowed());
        assert_eq!(w.named.len(), 1);
        let s = &w.named[0];
        assert_eq!((s.rank, s.others), (3, 3));
        assert!((s.score - 0.3).abs() < 0.02, "{s:?}");
        assert_eq!(s.line(), "rank 3 (pod-1) is a straggler: the other 3 wait for it 32% of the time (it waits 2%)");
        assert!(j.window(&slowed()).named.is_empty(), "named once");
        let hot =
            Straggler { gpu: Some("GPU 1 SM at 1200 of 1980 MHz (hardware thermal slowdown)".into()), ..s.clone() };
        assert!(hot.line().ends_with("; its pod's GPU 1 SM at 1200 of 1980 MHz (hardware thermal slowdown)"));
        let healthy = vec![tally(0, 10, 40), tally(1, 11, 39), tally(2, 9, 41), tally(3, 10, 40)];
        let w = j.window(&healthy);
        assert_eq!(w.cleared, [(3, "pod-1".to_string())]);
        assert!(w.scores.iter().all(|(_, s)| *s < GAP));
    }

    #[test]
    fn a_break_in_the_streak_starts_it_again() {
        let mut j = Judge::default();
        let healthy = vec![tally(0, 10, 40), tally(1, 11, 39), tally(2, 9, 41), tally(3, 10, 40)];
        for w in [slowed(), slowed(), healthy, slowed(), slowed()] {
            assert!(j.window(&w).named.is_empty());
        }
        assert_eq!(j.window(&slowed()).named.len(), 1);
    }

    #[test_case::test_case(vec![tally(0, 16, 34), tally(1, 1, 49)], Some(1) ; "two ranks")]
    #[test_case::test_case(vec![tally(0, 16, 34), tally(1, 1, 30), tally(2, 16, 34)], None ; "too few samples of the slow one")]
    #[test_case::test_case(vec![tally(0, 4, 46), tally(1, 0, 50), tally(2, 5, 45)], None ; "a small gap")]
    #[test_case::test_case(vec![tally(0, 40, 10), tally(1, 25, 25), tally(2, 40, 10)], None ; "a big gap but not half")]
    #[test_case::test_case(vec![tally(0, 16, 34)], None ; "one rank")]
    fn the_rule(w: Vec<RankTally>, named: Option<u32>) {
        let mut j = Judge::default();
        let mut got = None;
        for _ in 0..STREAK {
            if let Some(s) = j.window(&w).named.first() {
                got = Some(s.rank);
            }
        }
        assert_eq!(got, named);
    }

    #[test]
    fn a_tally_counts_states_and_keeps_the_commonest_place() {
        let mut t = Tally::default();
        for _ in 0..3 {
            t.add(3, "pod-1", (State::Compute, Some("train.py:40 in step".into())));
        }
        t.add(3, "pod-1", (State::Io, Some("train.py:70 in save".into())));
        t.add(3, "pod-1", (State::Wait, Some("train.py:44 in step".into())));
        for i in 0..200 {
            t.add(1, "pod-\n0", (State::Compute, Some(format!("f.py:{i} in g"))));
        }
        let got = t.take();
        assert_eq!(got.len(), 2);
        let r3 = &got[1];
        assert_eq!((r3.wait, r3.io, r3.compute, r3.samples()), (1, 1, 3, 5));
        assert_eq!(r3.at, Some((State::Compute, "train.py:40 in step".into())));
        assert_eq!(got[0].host, "pod-?0", "names are data");
        assert!(t.take().is_empty(), "a new window");
    }
}
