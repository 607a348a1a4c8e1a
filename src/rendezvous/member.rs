//! Members of a round and their ranks: pure, table-tested. Static jobs
//! take each pod's node rank; elastic jobs follow the rank hints, then the
//! hosts' names, so a pod that comes back gets its old rank when it can.

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
}

impl Member {
    pub(super) fn who(&self) -> String {
        format!("node rank {} ({} pid {})", self.node_rank, self.host, self.pid)
    }

    pub(super) fn elastic(&self) -> bool {
        self.min_nodes != self.max_nodes
    }
}

/// One slot's place in a formed round.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    /// Group (node) rank in this round.
    pub group_rank: u32,
    /// Pods in this round.
    pub nnodes: u32,
    /// Why the round cannot run (pods disagree); every member exits.
    pub error: Option<String>,
}

/// Assign group ranks to the members of a round, given in slot order:
/// static jobs use each pod's node rank; elastic jobs order pods by
/// (node rank hint, host, pid, slot), so ranks are deterministic.
pub fn assign(members: &[Member]) -> Result<Vec<u32>, String> {
    let Some(first) = members.first() else { return Err("no members".into()) };
    let mut diffs = Vec::new();
    for m in members {
        let mut d = Vec::new();
        for (what, theirs, ours) in [
            ("nnodes", format!("{}:{}", m.min_nodes, m.max_nodes), format!("{}:{}", first.min_nodes, first.max_nodes)),
            ("nproc-per-node", m.nproc.to_string(), first.nproc.to_string()),
            ("max-restarts", m.max_restarts.to_string(), first.max_restarts.to_string()),
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
        }
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
