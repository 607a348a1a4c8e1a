//! Who a stalled job waits for, from every rank's stacks: the ranks inside
//! a `torch.distributed` collective (or rendezvous) wait; a rank outside
//! it, or inside another one, is the one they wait for. A rank whose read
//! stopped short (its budget, its time, a failure) and showed no
//! collective is neither: it is named as not read, and a verdict it could
//! change says so. Where the ranks'
//! Flight Recorder dumps are at hand, their collective sequence numbers
//! decide first: in a process group, the ranks whose last collective is
//! behind the others' never entered the one the others wait in. Pure: the
//! stacks in, the verdict and its one line out.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use super::flight::{Flight, Group};
use super::{Frame, Process, Unread};

/// `torch.distributed` calls that block until every rank of the group
/// makes them.
pub(crate) const COLLECTIVES: &[&str] = &[
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "all_gather_coalesced",
    "_all_gather_base",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "barrier",
    "monitored_barrier",
    "_store_based_barrier",
    "send",
    "recv",
    "send_object_list",
    "recv_object_list",
    "batch_isend_irecv",
    "init_process_group",
    "new_group",
];

/// Most ranks named one by one in the summary line.
const NAMED: usize = 4;

/// One rank's stacks, as the job gathers them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankStacks {
    /// Global rank.
    pub rank: u32,
    /// Local rank on its pod.
    pub local_rank: u32,
    /// Its pod's node rank.
    pub node_rank: u32,
    /// Its pod's name.
    pub host: String,
    /// What was read.
    pub stacks: Process,
    /// The run of the lane it serves, for a worker of an actor beside the
    /// main run (None: the main run's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lane: Option<u64>,
    /// What its Flight Recorder dump says, when one was asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flight: Option<Flight>,
}

/// The job's stall, as the stacks show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Stall {
    /// The ranks the others wait for.
    pub stalled_ranks: Vec<u32>,
    /// The ranks waiting in a collective.
    pub waiting_ranks: Vec<u32>,
    /// Ranks with no Python stack.
    pub unknown_ranks: Vec<u32>,
    /// Ranks whose Python stacks could not be read in full (over the read
    /// budget, out of time, a failed read) and showed no collective: they
    /// may be the ones the others wait for.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub unread_ranks: Vec<u32>,
    /// The verdict in one line.
    pub summary: String,
}

/// Where one rank is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Where {
    /// Inside collective `op`, called at `site`.
    Collective { op: String, site: String },
    /// Outside any collective, at `at`.
    Outside { at: String },
    /// No stack.
    Unknown,
    /// Not read in full, and no collective in what was read.
    Unread(Unread),
}

fn is_torch(f: &Frame) -> bool {
    let file = f.file.replace('\\', "/");
    file.contains("/torch/") || file.starts_with("torch/")
}

fn place(f: &Frame) -> String {
    let file = f.file.rsplit('/').next().unwrap_or(&f.file);
    match f.line {
        Some(l) => format!("{file}:{l} in {}", f.function),
        None => format!("{file} in {}", f.function),
    }
}

/// Where a rank is: the first collective on any of its threads (the main
/// thread first), else its main thread's innermost frame; a rank whose read
/// stopped short is in a collective it shows, or not read.
fn locate(p: &Process) -> Where {
    let found = locate_read(p);
    match (p.unread, &found) {
        (Some(why), Where::Outside { .. } | Where::Unknown) => Where::Unread(why),
        _ => found,
    }
}

fn locate_read(p: &Process) -> Where {
    for t in &p.threads {
        let frames = &t.python;
        let hit = frames.iter().position(|f| {
            let name = f.function.rsplit('.').next().unwrap_or(&f.function);
            f.file.contains("torch/distributed/") && COLLECTIVES.contains(&name)
        });
        if let Some(i) = hit {
            let op = frames[i].function.rsplit('.').next().unwrap_or(&frames[i].function).to_string();
            let site = frames[i..].iter().find(|f| !is_torch(f)).map_or_else(|| place(&frames[i]), place);
            return Where::Collective { op, site };
        }
    }
    match p.threads.first().and_then(|t| t.python.first()) {
        Some(f) => Where::Outside { at: place(f) },
        None => Where::Unknown,
    }
}

fn ranks_text(ranks: &[u32]) -> String {
    let shown: Vec<String> = ranks.iter().take(NAMED).map(u32::to_string).collect();
    let more = ranks.len().saturating_sub(NAMED);
    let list = if more > 0 { format!("{} and {more} more", shown.join(", ")) } else { shown.join(", ") };
    if ranks.len() == 1 { format!("rank {list}") } else { format!("ranks {list}") }
}

/// Where a rank is, in a few words: its collective and call site, or its
/// innermost frame.
fn whereabouts(w: &Where) -> String {
    match w {
        Where::Collective { op, site } => format!("in {op} at {site}"),
        Where::Outside { at } => at.clone(),
        Where::Unknown => "no Python stack".into(),
        Where::Unread(why) => format!("not read ({})", why.text()),
    }
}

/// The verdict of the Flight Recorder dumps: in the first process group
/// (by torch's name for it, the same on every rank) that at least two
/// ranks recorded, the ranks whose last collective is behind the others',
/// when the others wait in theirs. `(stalled, waiting, summary)`; None
/// when no dump names anyone.
fn judge_flight(placed: &[(u32, Where)], ranks: &[&RankStacks]) -> Option<(Vec<u32>, Vec<u32>, String)> {
    let mut by_group: BTreeMap<&str, Vec<(u32, &Group)>> = BTreeMap::new();
    for r in ranks {
        for g in r.flight.iter().flat_map(|f| &f.groups) {
            by_group.entry(g.id.as_str()).or_default().push((r.rank, g));
        }
    }
    by_group.into_iter().filter(|(_, rs)| rs.len() > 1).find_map(|(_, rs)| {
        let front = rs.iter().map(|(_, g)| g).max_by_key(|g| g.seq)?;
        let waiting: Vec<u32> = rs.iter().filter(|(_, g)| g.seq == front.seq && !g.done).map(|(r, _)| *r).collect();
        let stalled: Vec<u32> = rs.iter().filter(|(_, g)| g.seq < front.seq).map(|(r, _)| *r).collect();
        if stalled.is_empty() || waiting.is_empty() {
            return None;
        }
        let places: Vec<(u32, String)> = stalled
            .iter()
            .map(|r| (*r, placed.iter().find(|(p, _)| p == r).map_or_else(String::new, |(_, w)| whereabouts(w))))
            .collect();
        // Names from other pods' JSON too: cleaned again.
        let summary = format!(
            "{} never entered {} #{} of {} (Flight Recorder), which the other {} wait in: {}",
            ranks_text(&stalled),
            super::clean(&front.op),
            front.seq,
            super::clean(&front.pg),
            waiting.len(),
            at_list(&places)
        );
        Some((stalled, waiting, summary))
    })
}

/// The verdict over every rank's stacks (any order).
pub fn judge(all: &[RankStacks]) -> Stall {
    let mut ranks: Vec<&RankStacks> = all.iter().collect();
    ranks.sort_by_key(|r| r.rank);
    let placed: Vec<(u32, Where)> = ranks.iter().map(|r| (r.rank, locate(&r.stacks))).collect();
    let unknown: Vec<u32> = placed.iter().filter(|(_, w)| *w == Where::Unknown).map(|(r, _)| *r).collect();
    let unread: Vec<(u32, Unread)> =
        placed.iter().filter_map(|(r, w)| if let Where::Unread(why) = w { Some((*r, *why)) } else { None }).collect();
    let unread_ranks: Vec<u32> = unread.iter().map(|(r, _)| *r).collect();
    if let Some((stalled, waiting, mut summary)) = judge_flight(&placed, &ranks) {
        summary.push_str(&unread_text(&unread));
        return Stall { stalled_ranks: stalled, waiting_ranks: waiting, unknown_ranks: unknown, unread_ranks, summary };
    }
    // (op, site) -> ranks in it.
    let mut groups: BTreeMap<(String, String), Vec<u32>> = BTreeMap::new();
    let mut outside: Vec<(u32, String)> = Vec::new();
    for (rank, w) in &placed {
        match w {
            Where::Collective { op, site } => groups.entry((op.clone(), site.clone())).or_default().push(*rank),
            Where::Outside { at } => outside.push((*rank, at.clone())),
            Where::Unknown | Where::Unread(_) => {}
        }
    }
    let mut summary = String::new();
    let (stalled, waiting) = if groups.is_empty() {
        let stalled: Vec<u32> = outside.iter().map(|(r, _)| *r).collect();
        if stalled.is_empty() {
            summary.push_str("no rank's Python stack could be read");
        } else if !unread.is_empty() {
            let _ = write!(summary, "no rank read is in a collective: {}", at_list(&outside));
        } else {
            let _ = write!(summary, "no rank is in a collective: {}", at_list(&outside));
        }
        (stalled, Vec::new())
    } else if !outside.is_empty() {
        let waiting: Vec<u32> = groups.values().flatten().copied().collect();
        let mut ops: Vec<&str> = groups.keys().map(|(op, _)| op.as_str()).collect();
        ops.dedup();
        let stalled: Vec<u32> = outside.iter().map(|(r, _)| *r).collect();
        let _ = write!(
            summary,
            "{} {} not in the {} the other {} wait in: {}",
            ranks_text(&stalled),
            if stalled.len() == 1 { "is" } else { "are" },
            ops.join("/"),
            waiting.len(),
            at_list(&outside)
        );
        (stalled, waiting)
    } else if groups.len() == 1 && !unread.is_empty() {
        let ((op, site), waiting) = groups.iter().next().map(|(k, v)| (k.clone(), v.clone())).unwrap_or_default();
        let _ = write!(summary, "every rank read waits in {op} at {site}");
        (Vec::new(), waiting)
    } else if groups.len() == 1 {
        let ((op, site), waiting) = groups.iter().next().map(|(k, v)| (k.clone(), v.clone())).unwrap_or_default();
        let _ = write!(
            summary,
            "every rank waits in {op} at {site}: none is missing from it (look at the network, a GPU, or a rank outside this view)"
        );
        (Vec::new(), waiting)
    } else {
        // Ranks in different collectives: the largest group waits for the rest.
        let biggest = groups
            .iter()
            .max_by_key(|(k, v)| (v.len(), std::cmp::Reverse(*k)))
            .map(|(k, _)| k.clone())
            .unwrap_or_default();
        let waiting = groups.get(&biggest).cloned().unwrap_or_default();
        let mut others: Vec<(u32, String)> = groups
            .iter()
            .filter(|(k, _)| **k != biggest)
            .flat_map(|((op, site), rs)| rs.iter().map(move |r| (*r, format!("{op} at {site}"))))
            .collect();
        others.sort();
        let stalled: Vec<u32> = others.iter().map(|(r, _)| *r).collect();
        let _ = write!(
            summary,
            "{} in another collective than the {} at {} the other {} wait in: {}",
            ranks_text(&stalled),
            biggest.0,
            biggest.1,
            waiting.len(),
            at_list(&others)
        );
        (stalled, waiting)
    };
    if !unknown.is_empty() {
        let _ = write!(summary, "; no Python stack from {}", ranks_text(&unknown));
    }
    summary.push_str(&unread_text(&unread));
    Stall { stalled_ranks: stalled, waiting_ranks: waiting, unknown_ranks: unknown, unread_ranks, summary }
}

/// "; rank 2 could not be read in full (over the read's memory budget): it
/// may be what the others wait for", or nothing when every rank was read.
fn unread_text(unread: &[(u32, Unread)]) -> String {
    let Some((_, first)) = unread.first() else { return String::new() };
    let ranks: Vec<u32> = unread.iter().map(|(r, _)| *r).collect();
    let why = if unread.iter().all(|(_, w)| w == first) { first.text() } else { "over a bound, or a failed read" };
    let it = if ranks.len() == 1 { "it" } else { "they" };
    format!("; {} could not be read in full ({why}): {it} may be what the others wait for", ranks_text(&ranks))
}

/// "rank 2 at a.py:3 in f" for one, "rank 2 at ...; rank 3 at ..." for more.
fn at_list(places: &[(u32, String)]) -> String {
    if let [(_, at)] = places {
        return at.clone();
    }
    let mut s: Vec<String> = places.iter().take(NAMED).map(|(r, at)| format!("rank {r} at {at}")).collect();
    if places.len() > NAMED {
        s.push(format!("{} more", places.len() - NAMED));
    }
    s.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stacks::Thread;

    fn frame(function: &str, file: &str, line: u32) -> Frame {
        Frame { function: function.into(), file: file.into(), line: Some(line) }
    }

    fn rank(rank: u32, frames: Vec<Frame>) -> RankStacks {
        let threads = if frames.is_empty() {
            Vec::new()
        } else {
            vec![Thread {
                tid: 1,
                name: "python".into(),
                main: true,
                python: frames,
                native: Vec::new(),
                kernel: "running".into(),
                truncated: false,
            }]
        };
        RankStacks {
            rank,
            local_rank: rank % 2,
            node_rank: rank / 2,
            host: "h".into(),
            stacks: Process { pid: 1, python: Some("3.11.7".into()), threads, note: None, took_ms: 1.0, unread: None },
            lane: None,
            flight: None,
        }
    }

    const C10D: &str = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py";
    const LOGGER: &str = "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py";

    fn in_all_reduce(r: u32) -> RankStacks {
        rank(
            r,
            vec![
                frame("all_reduce", C10D, 2950),
                frame("_exception_logger.<locals>.wrapper", LOGGER, 81),
                frame("step", "/job/stall_job.py", 20),
                frame("<module>", "/job/stall_job.py", 30),
            ],
        )
    }

    #[test]
    fn the_rank_outside_the_collective_is_named() {
        let sleeper =
            rank(2, vec![frame("stall_here", "/job/stall_job.py", 13), frame("<module>", "/job/stall_job.py", 29)]);
        let s = judge(&[in_all_reduce(0), in_all_reduce(3), sleeper, in_all_reduce(1)]);
        assert_eq!(s.stalled_ranks, vec![2]);
        assert_eq!(s.waiting_ranks, vec![0, 1, 3]);
        assert_eq!(s.summary, "rank 2 is not in the all_reduce the other 3 wait in: stall_job.py:13 in stall_here");
    }

    #[test]
    fn a_rank_in_another_collective_is_named() {
        let other = rank(1, vec![frame("barrier", C10D, 4000), frame("evaluate", "/job/t.py", 40)]);
        let s = judge(&[in_all_reduce(0), other, in_all_reduce(2)]);
        assert_eq!(s.stalled_ranks, vec![1]);
        assert_eq!(
            s.summary,
            "rank 1 in another collective than the all_reduce at stall_job.py:20 in step the other 2 wait in: barrier at t.py:40 in evaluate"
        );
    }

    #[test]
    fn every_rank_in_one_collective_names_none() {
        let s = judge(&[in_all_reduce(0), in_all_reduce(1)]);
        assert!(s.stalled_ranks.is_empty());
        assert!(s.summary.starts_with("every rank waits in all_reduce at stall_job.py:20 in step"), "{}", s.summary);
    }

    #[test]
    fn no_collective_names_every_rank_and_unknown_ones_are_said() {
        let a = rank(0, vec![frame("load", "/job/d.py", 5)]);
        let b = rank(1, vec![frame("load", "/job/d.py", 6)]);
        let s = judge(&[a, b, rank(2, Vec::new())]);
        assert_eq!(s.stalled_ranks, vec![0, 1]);
        assert_eq!(s.unknown_ranks, vec![2]);
        assert_eq!(
            s.summary,
            "no rank is in a collective: rank 0 at d.py:5 in load; rank 1 at d.py:6 in load; no Python stack from rank 2"
        );
        assert_eq!(judge(&[]).summary, "no rank's Python stack could be read");
    }

    fn flown(mut r: RankStacks, seq: u64, op: &str, done: bool) -> RankStacks {
        let g = Group { id: "0".into(), pg: "default_pg".into(), seq, op: op.into(), done };
        r.flight = Some(Flight { groups: vec![g], note: None });
        r
    }

    #[test]
    fn the_flight_recorders_sequence_numbers_decide_first() {
        let sleeper =
            rank(2, vec![frame("stall_here", "/job/stall_job.py", 13), frame("<module>", "/job/stall_job.py", 29)]);
        let all = [
            flown(in_all_reduce(0), 5, "all_reduce", false),
            flown(in_all_reduce(1), 5, "all_reduce", false),
            flown(sleeper.clone(), 4, "barrier", true),
            flown(in_all_reduce(3), 5, "all_reduce", false),
        ];
        let s = judge(&all);
        assert_eq!((s.stalled_ranks.clone(), s.waiting_ranks.clone()), (vec![2], vec![0, 1, 3]));
        assert_eq!(
            s.summary,
            "rank 2 never entered all_reduce #5 of default_pg (Flight Recorder), which the other 3 wait in: stall_job.py:13 in stall_here"
        );
        // Every rank in the same collective: the dumps name no one, the stacks decide.
        let even = [flown(in_all_reduce(0), 5, "all_reduce", false), flown(sleeper.clone(), 5, "all_reduce", false)];
        assert_eq!(
            judge(&even).summary,
            "rank 2 is not in the all_reduce the other 1 wait in: stall_job.py:13 in stall_here"
        );
        // Groups apart by name, even with one description (DeviceMesh's):
        // tp group 1 of ranks 0 and 1 at #120, tp group 2 of ranks 2 and 3
        // at #80, is no stall of either.
        let tp = |r: RankStacks, id: &str, seq| {
            let g = Group { id: id.into(), pg: "mesh_tp".into(), seq, op: "all_reduce".into(), done: false };
            RankStacks { flight: Some(Flight { groups: vec![g], note: None }), ..r }
        };
        let mesh = [tp(in_all_reduce(0), "1", 120), tp(in_all_reduce(1), "1", 120), tp(in_all_reduce(2), "2", 80)];
        assert!(!judge(&mesh).summary.contains("Flight Recorder"), "{}", judge(&mesh).summary);
        // A dump from one rank only, or none with entries, decides nothing.
        let lone = [flown(in_all_reduce(0), 5, "all_reduce", false), sleeper];
        assert_eq!(judge(&lone).stalled_ranks, vec![2]);
        assert!(!judge(&lone).summary.contains("Flight Recorder"));
    }

    #[test]
    fn many_stalled_ranks_are_cut() {
        let mut all: Vec<RankStacks> = (0..8).map(|r| rank(r, vec![frame("f", "/a.py", r)])).collect();
        all.push(in_all_reduce(8));
        let s = judge(&all);
        assert_eq!(s.stalled_ranks.len(), 8);
        assert!(
            s.summary.starts_with("ranks 0, 1, 2, 3 and 4 more are not in the all_reduce the other 1 wait in"),
            "{}",
            s.summary
        );
        assert!(s.summary.ends_with("; 4 more"), "{}", s.summary);
    }

    /// Issue 53: a rank whose read stopped at its budget is not counted
    /// as outside the collective, nor as in it: the verdict names it.
    #[test]
    fn a_rank_not_read_in_full_is_named_as_such() {
        let cut = |mut r: RankStacks, why| {
            r.stacks.unread = Some(why);
            r
        };
        let main_only = rank(2, vec![frame("<module>", "/job/stall_job.py", 29)]);
        let s = judge(&[in_all_reduce(0), in_all_reduce(1), cut(main_only, Unread::Budget)]);
        assert!(s.stalled_ranks.is_empty(), "{s:?}");
        assert_eq!((s.waiting_ranks.clone(), s.unread_ranks.clone()), (vec![0, 1], vec![2]));
        assert_eq!(
            s.summary,
            "every rank read waits in all_reduce at stall_job.py:20 in step; rank 2 could not be read in full (over the read's memory budget): it may be what the others wait for"
        );
        // Beside a rank read in full outside it: that one is named, and the unread one too.
        let sleeper = rank(3, vec![frame("stall_here", "/job/stall_job.py", 13)]);
        let s = judge(&[in_all_reduce(0), sleeper, cut(rank(2, Vec::new()), Unread::Time)]);
        assert_eq!((s.stalled_ranks.clone(), s.unread_ranks.clone()), (vec![3], vec![2]));
        assert!(
            s.summary.ends_with(
                "rank 2 could not be read in full (the read's time ran out): it may be what the others wait for"
            ),
            "{}",
            s.summary
        );
        // A cut read that shows a collective is in it.
        let s = judge(&[in_all_reduce(0), cut(in_all_reduce(1), Unread::Budget)]);
        assert!(s.unread_ranks.is_empty() && s.summary.starts_with("every rank waits in all_reduce"), "{s:?}");
    }
}
