//! Members of a round and their ranks: pure, table-tested. Static jobs
//! take each pod's node rank; elastic jobs follow the rank hints, then the
//! hosts' names, so a pod that comes back gets its old rank when it can.
//! Jobs with spares (`--spares`) keep every member's rank from its last
//! round, and a spare takes the rank a lost pod left free, so per-rank
//! checkpoint shards and rank-keyed data still line up.

use serde::{Deserialize, Serialize};

/// What an agent announces about itself when it joins a round.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// Unique per agent incarnation: `host#pid#nonce`.
    pub uid: String,
    /// Host name or --local-addr.
    pub host: String,
    /// Agent pid.
    pub pid: u32,
    /// Node rank from the env: the rank in static jobs, an ordering hint in elastic ones.
    pub node_rank: u32,
    /// Workers per node.
    pub nproc: u32,
    /// MIN of --nnodes.
    pub min_nodes: u32,
    /// MAX of --nnodes.
    pub max_nodes: u32,
    /// Restart budget.
    pub max_restarts: u32,
    /// Pods of the job that wait warm as spares (`--spares`); MIN and MAX
    /// above count the pods that train.
    #[serde(default)]
    pub spares: u32,
    /// Our group rank and the round, in the last round we were a member
    /// of, while we have not been a spare since (jobs with spares keep it).
    #[serde(default)]
    pub last_rank: Option<(u32, u64)>,
}

impl Member {
    pub(super) fn who(&self) -> String {
        format!("node rank {} ({} pid {})", self.node_rank, self.host, self.pid)
    }

    /// What no two live agents of the job may share: the node rank of a
    /// static job (its rank in every round), the host and node rank of an
    /// elastic one (there the node rank is only an ordering hint, which
    /// pods may share). It names the agent's `claim/` key.
    pub(super) fn place(&self) -> String {
        if self.elastic() { format!("{}@{}", self.node_rank, self.host) } else { self.node_rank.to_string() }
    }

    pub(super) fn elastic(&self) -> bool {
        self.min_nodes != self.max_nodes
    }

    /// Ranks are the pods' own node ranks (a static job without spares).
    pub(super) fn ranked_by_env(&self) -> bool {
        !self.elastic() && self.spares == 0
    }
}

/// The value of `rR/members`, which the round's closer writes once: the
/// members' slots (`rR/m/SLOT`) in group-rank order, or why their records
/// cannot form a round. Every member reads it and finds its group rank as
/// its slot's place in the list: a few bytes a member, where the records
/// themselves (hundreds of bytes each, read by every member) cost the
/// store N^2 bytes a round (371 MB for the first round of 1,024 pods).
/// The store host and a spare, one reader each, read the records.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Roster {
    /// The members' slots, in group-rank order.
    Slots(Vec<u64>),
    /// The records disagree or one is unreadable: every member exits with this.
    Mismatch(String),
}

impl Roster {
    /// The roster of round `r`, whose slots `0..` hold `records` (None:
    /// a record this trainlet cannot read).
    pub fn of(r: u64, records: &[Option<Member>]) -> Self {
        if records.iter().any(Option::is_none) {
            return Self::Mismatch(format!(
                "a pod of round {r} announced data the pod that closed it could not read (a different trainlet version?)"
            ));
        }
        let members: Vec<Member> = records.iter().flatten().cloned().collect();
        match assign(&members) {
            Ok(ranks) => {
                let mut by_rank: Vec<(u32, u64)> = ranks.into_iter().zip(0..).collect();
                by_rank.sort_unstable();
                Self::Slots(by_rank.into_iter().map(|(_, slot)| slot).collect())
            }
            Err(e) => Self::Mismatch(e),
        }
    }

    /// A stored roster; None for one this trainlet cannot read (or none).
    pub fn read(v: &[u8]) -> Option<Self> {
        serde_json::from_slice(v).ok()
    }

    /// The stored form.
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// The slots in group-rank order; empty for a mismatch.
    pub fn slots(&self) -> &[u64] {
        match self {
            Self::Slots(s) => s,
            Self::Mismatch(_) => &[],
        }
    }
}

/// Assign group ranks to the members of a round, given in slot order:
/// static jobs use each pod's node rank; jobs with spares keep ranks
/// ([`keep_ranks`]); elastic jobs order pods by (node rank hint, host,
/// pid, slot), so ranks are deterministic.
pub fn assign(members: &[Member]) -> Result<Vec<u32>, String> {
    let Some(first) = members.first() else { return Err("no members".into()) };
    let mut diffs = Vec::new();
    for m in members {
        let mut d = Vec::new();
        for (what, theirs, ours) in [
            ("nnodes", format!("{}:{}", m.min_nodes, m.max_nodes), format!("{}:{}", first.min_nodes, first.max_nodes)),
            ("nproc-per-node", m.nproc.to_string(), first.nproc.to_string()),
            ("max-restarts", m.max_restarts.to_string(), first.max_restarts.to_string()),
            ("spares", m.spares.to_string(), first.spares.to_string()),
        ] {
            if theirs != ours {
                d.push(format!("{what} {theirs} vs {ours} on {}", first.who()));
            }
        }
        if !d.is_empty() {
            diffs.push(format!("{}: {}", m.who(), d.join(", ")));
        }
    }
    if !diffs.is_empty() {
        return Err(diffs.join("; "));
    }
    if first.spares > 0 {
        if !first.elastic() {
            let mut seen: std::collections::HashMap<u32, &Member> = std::collections::HashMap::new();
            for m in members {
                if let Some(other) = seen.insert(m.node_rank, m) {
                    return Err(format!("{} and {} claim the same node rank", other.who(), m.who()));
                }
            }
        }
        return Ok(keep_ranks(members));
    }
    if first.elastic() {
        let mut order: Vec<usize> = (0..members.len()).collect();
        order.sort_by(|&a, &b| {
            let (x, y) = (&members[a], &members[b]);
            (x.node_rank, &x.host, x.pid, a).cmp(&(y.node_rank, &y.host, y.pid, b))
        });
        let mut ranks = vec![0; members.len()];
        for (rank, slot) in order.into_iter().enumerate() {
            ranks[slot] = u32::try_from(rank).unwrap_or(u32::MAX);
        }
        return Ok(ranks);
    }
    let mut seen: std::collections::HashMap<u32, &Member> = std::collections::HashMap::new();
    for m in members {
        if m.node_rank >= m.max_nodes {
            return Err(format!("{} is outside 0..{}", m.who(), m.max_nodes));
        }
        if let Some(other) = seen.insert(m.node_rank, m) {
            return Err(format!("{} and {} claim the same node rank", other.who(), m.who()));
        }
    }
    Ok(members.iter().map(|m| m.node_rank).collect())
}

/// The ranks of a round of a job with spares, members in slot order: each
/// keeps the rank of its last round when it is still below the round's
/// size and no newer claim (a later round's, then an earlier slot's) kept
/// it, so a pod declared dead that comes back does not take its rank from
/// the spare that replaced it; a pod that was never a member takes
/// its own node rank when it is free (the first round looks like a static
/// job's); the others take the free ranks in (node rank, host, pid, slot)
/// order, lowest first. So a spare takes the rank a lost pod left.
fn keep_ranks(members: &[Member]) -> Vec<u32> {
    let size = members.len();
    let mut ranks: Vec<Option<u32>> = vec![None; size];
    let mut taken = vec![false; size];
    let mut claim = |slot: usize, rank: u32, ranks: &mut Vec<Option<u32>>| {
        let Ok(r) = usize::try_from(rank) else { return };
        if r < size && !taken[r] && ranks[slot].is_none() {
            taken[r] = true;
            ranks[slot] = Some(rank);
        }
    };
    let mut claims: Vec<(usize, u32, u64)> = members
        .iter()
        .enumerate()
        .filter_map(|(slot, m)| m.last_rank.map(|(rank, round)| (slot, rank, round)))
        .collect();
    claims.sort_by_key(|&(slot, _, round)| (std::cmp::Reverse(round), slot));
    for (slot, rank, _) in claims {
        claim(slot, rank, &mut ranks);
    }
    for (slot, m) in members.iter().enumerate() {
        if m.last_rank.is_none() {
            claim(slot, m.node_rank, &mut ranks);
        }
    }
    let mut rest: Vec<usize> = (0..size).filter(|&s| ranks[s].is_none()).collect();
    rest.sort_by(|&a, &b| {
        let (x, y) = (&members[a], &members[b]);
        (x.node_rank, &x.host, x.pid, a).cmp(&(y.node_rank, &y.host, y.pid, b))
    });
    let mut free = (0..size).filter(|&r| !taken[r]);
    for slot in rest {
        ranks[slot] = free.next().and_then(|r| u32::try_from(r).ok());
    }
    ranks.into_iter().map(|r| r.unwrap_or(u32::MAX)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    fn m(node_rank: u32, host: &str, nproc: u32, nnodes: (u32, u32)) -> Member {
        Member {
            uid: format!("{host}#1#0"),
            host: host.into(),
            pid: 7,
            node_rank,
            nproc,
            min_nodes: nnodes.0,
            max_nodes: nnodes.1,
            max_restarts: 0,
            spares: 0,
            last_rank: None,
        }
    }

    /// A pod of a job of `world` training pods and one spare, that was
    /// group rank `last` in its last round.
    fn spare_job(node_rank: u32, host: &str, world: u32, last: Option<u32>) -> Member {
        Member { spares: 1, last_rank: last.map(|r| (r, 5)), ..m(node_rank, host, 1, (world, world)) }
    }

    #[test]
    fn the_roster_lists_slots_in_group_rank_order_or_says_why_the_records_cannot_form_a_round() {
        // Slot 0 was group rank 2 of the last round, slot 2 the spare.
        let ms = [(0, Some(2)), (1, Some(0)), (2, None)];
        let records: Vec<Option<Member>> =
            ms.iter().enumerate().map(|(i, &(n, last))| Some(spare_job(n, &format!("h{i}"), 3, last))).collect();
        let roster = Roster::of(4, &records);
        assert_eq!(roster, Roster::Slots(vec![1, 2, 0]));
        assert_eq!(Roster::read(&roster.to_bytes()), Some(roster.clone()));
        assert_eq!(roster.to_bytes(), b"{\"slots\":[1,2,0]}", "a few bytes a member");

        let mut unreadable = records.clone();
        unreadable[1] = None;
        let Roster::Mismatch(why) = Roster::of(4, &unreadable) else { panic!("an unreadable record formed a round") };
        assert!(why.contains("round 4") && why.contains("could not read"), "{why}");
        assert!(Roster::of(4, &unreadable).slots().is_empty());

        let disagree = [Some(m(0, "a", 1, (2, 2))), Some(m(1, "b", 2, (2, 2)))];
        let Roster::Mismatch(why) = Roster::of(0, &disagree) else { panic!("records that disagree formed a round") };
        assert!(why.contains("nproc-per-node 2 vs 1"), "{why}");
        assert_eq!(Roster::read(b"abandoned"), None);
        assert_eq!(Roster::read(b""), None);
    }

    #[test]
    fn a_pod_back_from_the_dead_does_not_take_its_rank_from_the_spare_that_replaced_it() {
        let back = Member { last_rank: Some((1, 3)), ..spare_job(1, "a", 3, None) };
        let spare = Member { last_rank: Some((1, 4)), ..spare_job(2, "s", 3, None) };
        let host = Member { last_rank: Some((0, 4)), ..spare_job(0, "h", 3, None) };
        assert_eq!(assign(&[back, host, spare]), Ok(vec![2, 0, 1]));
    }

    #[test_case(&[(0, None), (1, None)], &[0, 1]; "the first round takes the node ranks")]
    #[test_case(&[(2, None), (0, None)], &[1, 0]; "a spare's node rank is past the world: it fills the hole")]
    #[test_case(&[(0, Some(0)), (2, None)], &[0, 1]; "the spare takes the lost pod's rank")]
    #[test_case(&[(2, None), (1, Some(0)), (0, Some(1))], &[2, 0, 1]; "ranks kept over node ranks")]
    #[test_case(&[(0, Some(1)), (1, Some(1))], &[1, 0]; "a rank claimed twice goes to the first slot")]
    #[test_case(&[(3, Some(2)), (0, Some(0))], &[1, 0]; "a rank past a smaller round is given up")]
    #[test_case(&[(1, None), (3, None), (0, Some(2)), (2, None)], &[1, 3, 2, 0]; "a replacement takes a free rank, not a kept one")]
    fn jobs_with_spares_keep_ranks(pods: &[(u32, Option<u32>)], want: &[u32]) {
        let world = u32::try_from(pods.len()).expect("small");
        let ms: Vec<Member> =
            pods.iter().enumerate().map(|(i, &(n, last))| spare_job(n, &format!("h{i}"), world, last)).collect();
        assert_eq!(assign(&ms), Ok(want.to_vec()));
    }

    #[test]
    fn pods_of_a_job_with_spares_may_not_share_a_node_rank_or_disagree_on_spares() {
        let e = assign(&[spare_job(1, "a", 2, None), spare_job(1, "b", 2, None)]).expect_err("duplicate");
        assert!(e.contains("claim the same node rank"), "{e}");
        let e = assign(&[spare_job(0, "a", 2, None), Member { spares: 2, ..spare_job(1, "b", 2, None) }])
            .expect_err("mismatch");
        assert!(e.contains("spares 2 vs 1"), "{e}");
    }

    #[test]
    fn static_ranks_are_the_node_ranks() {
        let ms = [m(1, "b", 2, (2, 2)), m(0, "a", 2, (2, 2))];
        assert_eq!(assign(&ms), Ok(vec![1, 0]));
    }

    #[test]
    fn elastic_ranks_follow_the_hint_then_the_host() {
        let ms = [m(5, "c", 1, (1, 4)), m(0, "z", 1, (1, 4)), m(5, "a", 1, (1, 4))];
        assert_eq!(assign(&ms), Ok(vec![2, 0, 1]));
    }

    #[test_case(&[m(0, "a", 2, (2, 2)), m(1, "b", 4, (2, 2))], "nproc-per-node 4 vs 2"; "nproc")]
    #[test_case(&[m(0, "a", 1, (2, 2)), m(1, "b", 1, (1, 2))], "nnodes 1:2 vs 2:2"; "nnodes")]
    #[test_case(&[m(1, "a", 1, (2, 2)), m(1, "b", 1, (2, 2))], "claim the same node rank"; "duplicate")]
    #[test_case(&[m(0, "a", 1, (2, 2)), m(2, "b", 1, (2, 2))], "outside 0..2"; "out of range")]
    fn disagreements_are_named(ms: &[Member], needle: &str) {
        let e = assign(ms).expect_err("mismatch");
        assert!(e.contains(needle), "{e}");
    }
}
