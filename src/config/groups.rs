//! `--replica-groups G`: TorchFT replica groups. The pods split into `G`
//! groups of consecutive node ranks; each group is its own world with its
//! own rendezvous, worker store and restart budget, and TorchFT's
//! Lighthouse (on the pod of node rank 0, or the user's own through
//! `TORCHFT_LIGHTHOUSE`) forms the quorum across groups.

use std::time::Duration;

use super::framework::Framework;
use super::nodes::Nodes;
use super::setting::{Settings, invalid, lookup, parse_secs, parse_u32};
use super::{Error, Source};
use crate::cli::RunArgs;
use crate::env::{self, Env};

/// TorchFT's Lighthouse port (`torchft_lighthouse --bind [::]:29510`).
pub const DEFAULT_LIGHTHOUSE_PORT: u16 = 29510;
/// The Lighthouse program in the torchft wheel.
const LIGHTHOUSE_PROGRAM: &str = "torchft_lighthouse";

/// This pod's replica group, and the job around it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Groups {
    /// Number of replica groups (`NUM_REPLICA_GROUPS`).
    pub count: u32,
    /// This pod's group (`REPLICA_GROUP_ID`): node rank / pods per group.
    pub group: u32,
    /// Pods in the whole job.
    pub job_nnodes: u32,
    /// This pod's node rank in the whole job.
    pub job_node_rank: u32,
    /// The quorum's Lighthouse.
    pub lighthouse: Lighthouse,
}

/// Where the Lighthouse is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lighthouse {
    /// trainlet runs it on the pod of node rank 0 and publishes its
    /// address through the store.
    Run(RunLighthouse),
    /// The user's own (`TORCHFT_LIGHTHOUSE`), given to the workers as it is.
    External(String),
}

/// How trainlet runs the Lighthouse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunLighthouse {
    /// The program (None on pods other than node rank 0, which do not run it).
    pub program: Option<String>,
    /// Its port (0: a free port picked once on the store host).
    pub port: u16,
    /// `--min_replicas`: groups needed for a quorum.
    pub min_replicas: u32,
    /// `--join_timeout_ms`: how long a quorum waits for groups that heartbeat but have not joined.
    pub join_timeout_ms: u64,
    /// `--heartbeat_timeout_ms`: a group silent this long is out of the quorum.
    pub heartbeat_timeout_ms: u64,
    /// The pod sets no RUST_LOG: the Lighthouse gets `warn` (its quorum
    /// log at info is hundreds of lines a minute).
    pub quiet: bool,
}

/// The Lighthouse's join wait: once more than half of the heartbeating
/// groups asked for a quorum, the others get this long to join it
/// (torchft's default, 60 s, lets one group that heartbeats but never
/// joins stall every other group for a minute).
const LIGHTHOUSE_JOIN: Duration = Duration::from_secs(1);
/// A group whose rank 0 is silent this long leaves the quorum. The
/// surviving groups wait this long after a group died before they go on
/// alone (a quorum needs more than half of the heartbeating groups);
/// managers heartbeat every 100 ms from a native thread. torchft's default
/// is 5 s, during which the others commit nothing.
const LIGHTHOUSE_HEARTBEAT: Duration = Duration::from_secs(2);
/// Quorum retries a worker's manager gets when trainlet runs the
/// Lighthouse, unless TORCHFT_QUORUM_RETRIES says otherwise: a restarted
/// Lighthouse (about 1 s away) is then not a crash of every group.
const QUORUM_RETRIES: &str = "10";

/// Resolve `--replica-groups`; returns the groups and this pod's group as
/// the nodes the rendezvous sees (or `nodes` unchanged when off).
pub(super) fn resolve(
    args: &RunArgs,
    s: &mut Settings<'_>,
    nodes: Nodes,
    (fw, serve, python): (Framework, bool, Option<&str>),
) -> Result<(Option<Groups>, Nodes), Error> {
    let env = s.env;
    let l = lookup(args.replica_groups.as_deref(), "--replica-groups", env, &[env::TRAINLET_REPLICA_GROUPS]);
    let Some(v) = l.value else { return Ok((None, nodes)) };
    let origin = l.origin();
    let count = parse_u32(&l, 0, "a number of replica groups >= 1")?;
    if count == 0 {
        return Err(invalid(&origin, v, "a number of replica groups >= 1"));
    }
    if fw != Framework::Torch {
        return Err(Error::Usage(format!(
            "{origin}: replica groups are TorchFT's, for torch jobs; drop it for {} jobs",
            fw.name()
        )));
    }
    if serve {
        return Err(Error::Usage(format!("{origin}: serve mode runs one world; drop --replica-groups or --serve")));
    }
    if nodes.min_nodes != nodes.nnodes {
        return Err(Error::Usage(format!(
            "{origin}: replica groups need a fixed number of pods: give --nnodes N, not {}:{}",
            nodes.min_nodes, nodes.nnodes
        )));
    }
    if !nodes.nnodes.is_multiple_of(count) {
        return Err(Error::Usage(format!(
            "{origin} {count} does not divide the job's {} pods: each group has the same number of consecutive node ranks",
            nodes.nnodes
        )));
    }
    let per = nodes.nnodes / count;
    let group = nodes.node_rank / per;
    s.prov.push(("replica groups", format!("{count} of {per} pod(s); this pod is in group {group}"), l.source));
    let lighthouse = match env.get(env::TORCHFT_LIGHTHOUSE).map(str::trim).filter(|v| !v.is_empty()) {
        Some(url) => {
            s.prov.push(("lighthouse", url.to_string(), Source::Env(env::TORCHFT_LIGHTHOUSE)));
            Lighthouse::External(url.to_string())
        }
        None => Lighthouse::Run(run_lighthouse(s, count, nodes.node_rank == 0, python)?),
    };
    let groups = Groups { count, group, job_nnodes: nodes.nnodes, job_node_rank: nodes.node_rank, lighthouse };
    let mine = Nodes { min_nodes: per, nnodes: per, node_rank: nodes.node_rank % per, nproc: nodes.nproc };
    Ok((Some(groups), mine))
}

fn run_lighthouse(s: &mut Settings<'_>, count: u32, here: bool, python: Option<&str>) -> Result<RunLighthouse, Error> {
    let env = s.env;
    let l = lookup(None, "TRAINLET_LIGHTHOUSE_PORT", env, &[env::TRAINLET_LIGHTHOUSE_PORT]);
    let port = match l.value {
        None => DEFAULT_LIGHTHOUSE_PORT,
        Some(v) => v.trim().parse::<u16>().map_err(|_| invalid(&l.origin(), v, "a TCP port (0: a free port)"))?,
    };
    let l = lookup(None, "TRAINLET_LIGHTHOUSE_MIN_REPLICAS", env, &[env::TRAINLET_LIGHTHOUSE_MIN_REPLICAS]);
    let expected = format!("a number of groups from 1 to {count}");
    let min_replicas = parse_u32(&l, 1, &expected)?;
    if min_replicas == 0 || min_replicas > count {
        return Err(invalid(&l.origin(), l.value.unwrap_or_default(), &expected));
    }
    let millis = |name: &'static str, default: Duration| -> Result<u64, Error> {
        let l = lookup(None, name, env, &[name]);
        let d = parse_secs(&l, default)?;
        let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        if ms < 100 {
            return Err(invalid(&l.origin(), l.value.unwrap_or_default(), "seconds, at least 0.1"));
        }
        Ok(ms)
    };
    let join_timeout_ms = millis(env::TRAINLET_LIGHTHOUSE_JOIN_TIMEOUT, LIGHTHOUSE_JOIN)?;
    let heartbeat_timeout_ms = millis(env::TRAINLET_LIGHTHOUSE_HEARTBEAT_TIMEOUT, LIGHTHOUSE_HEARTBEAT)?;
    let program = if here { Some(find_lighthouse(env, python)?) } else { None };
    s.prov.push((
        "lighthouse",
        format!(
            "run on node rank 0, port {port}, min_replicas {min_replicas}, join {join_timeout_ms} ms, heartbeat {heartbeat_timeout_ms} ms"
        ),
        Source::Derived("--replica-groups without TORCHFT_LIGHTHOUSE".into()),
    ));
    let quiet = env.get("RUST_LOG").is_none();
    Ok(RunLighthouse { program, port, min_replicas, join_timeout_ms, heartbeat_timeout_ms, quiet })
}

/// `TRAINLET_LIGHTHOUSE`, else `torchft_lighthouse` beside the workers'
/// python (a venv's bin), else on PATH.
fn find_lighthouse(env: &Env, python: Option<&str>) -> Result<String, Error> {
    let path = env.get("PATH").unwrap_or_default();
    let on_path = |name: &str| -> Vec<std::path::PathBuf> {
        path.split(':').filter(|d| !d.is_empty()).map(|d| std::path::Path::new(d).join(name)).collect()
    };
    if let Some(p) = env.get(env::TRAINLET_LIGHTHOUSE).map(str::trim).filter(|v| !v.is_empty()) {
        use std::os::unix::fs::PermissionsExt;
        let runnable = |f: &std::path::Path| {
            std::fs::metadata(f).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        };
        // A path as it is; a bare name from PATH, as exec would.
        let found = if p.contains('/') {
            runnable(std::path::Path::new(p)).then(|| p.to_string())
        } else {
            on_path(p).into_iter().find(|f| runnable(f)).map(|f| f.display().to_string())
        };
        return found
            .ok_or_else(|| invalid(env::TRAINLET_LIGHTHOUSE, p, "an executable file (torchft's torchft_lighthouse)"));
    }
    let beside = python
        .filter(|p| p.contains('/'))
        .and_then(|p| std::path::Path::new(p).parent().map(|d| d.join(LIGHTHOUSE_PROGRAM)));
    beside
        .into_iter()
        .chain(on_path(LIGHTHOUSE_PROGRAM))
        .find(|p| p.is_file())
        .map(|p| p.display().to_string())
        .ok_or_else(|| {
            Error::Usage(format!(
                "--replica-groups: {LIGHTHOUSE_PROGRAM} is not beside the workers' python nor on PATH; \
                 install torchft in the image (pip install torchft), give its path in TRAINLET_LIGHTHOUSE, \
                 or set TORCHFT_LIGHTHOUSE to a Lighthouse you run"
            ))
        })
}

/// The variables a worker of `groups` gets beside torchrun's, with the
/// Lighthouse's address; `inherited(name)`: the pod already sets it.
pub fn replica_env(groups: &Groups, lighthouse: &str, inherited: impl Fn(&str) -> bool) -> Vec<(String, String)> {
    let mut v = vec![
        ("REPLICA_GROUP_ID".to_string(), groups.group.to_string()),
        ("NUM_REPLICA_GROUPS".to_string(), groups.count.to_string()),
        (env::TORCHFT_LIGHTHOUSE.to_string(), lighthouse.to_string()),
    ];
    if matches!(groups.lighthouse, Lighthouse::Run(_)) && !inherited(env::TORCHFT_QUORUM_RETRIES) {
        v.push((env::TORCHFT_QUORUM_RETRIES.to_string(), QUORUM_RETRIES.to_string()));
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::TorchrunCli;
    use clap::Parser;

    fn run(a: &[&str], env: &[(&str, &str)], rank: u32) -> Result<(Option<Groups>, Nodes), Error> {
        let args =
            TorchrunCli::try_parse_from(std::iter::once("torchrun").chain(a.iter().copied())).expect("parse").run;
        let env = Env::from_pairs(env.to_vec());
        let mut s = Settings::new(&env);
        let nodes = Nodes { min_nodes: 4, nnodes: 4, node_rank: rank, nproc: 2 };
        resolve(&args, &mut s, nodes, (Framework::Torch, false, None))
    }

    #[test]
    fn consecutive_node_ranks_form_a_group() {
        let lh = [("TRAINLET_LIGHTHOUSE", "/bin/true")];
        for (rank, group, in_group) in [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)] {
            let (g, n) = run(&["--replica-groups", "2", "t.py"], &lh, rank).expect("resolves");
            let g = g.expect("groups on");
            assert_eq!((g.group, g.count, g.job_nnodes, g.job_node_rank), (group, 2, 4, rank));
            assert_eq!((n.node_rank, n.nnodes, n.min_nodes, n.nproc), (in_group, 2, 2, 2));
            let Lighthouse::Run(r) = &g.lighthouse else { panic!("trainlet runs the lighthouse") };
            assert_eq!(r.program.is_some(), rank == 0, "only node rank 0 runs it");
            assert_eq!((r.port, r.min_replicas), (DEFAULT_LIGHTHOUSE_PORT, 1));
        }
    }

    #[test]
    fn workers_learn_their_group_and_survive_a_lighthouse_restart() {
        let lh = [("TRAINLET_LIGHTHOUSE", "/bin/true"), ("TRAINLET_LIGHTHOUSE_HEARTBEAT_TIMEOUT", "0.5")];
        let (g, _) = run(&["--replica-groups", "2", "t.py"], &lh, 3).expect("resolves");
        let g = g.expect("on");
        let Lighthouse::Run(r) = &g.lighthouse else { panic!("trainlet runs it") };
        assert_eq!((r.join_timeout_ms, r.heartbeat_timeout_ms), (1_000, 500));
        let env = replica_env(&g, "http://h:1", |_| false);
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("REPLICA_GROUP_ID"), Some("1"));
        assert_eq!(get("NUM_REPLICA_GROUPS"), Some("2"));
        assert_eq!(get("TORCHFT_LIGHTHOUSE"), Some("http://h:1"));
        assert_eq!(get("TORCHFT_QUORUM_RETRIES"), Some("10"));
        assert!(
            replica_env(&g, "u", |n| n == "TORCHFT_QUORUM_RETRIES").iter().all(|(n, _)| n != "TORCHFT_QUORUM_RETRIES")
        );
        let e = run(&["--replica-groups", "2", "t.py"], &[lh[0], ("TRAINLET_LIGHTHOUSE_JOIN_TIMEOUT", "0")], 0);
        assert!(e.expect_err("too short").to_string().contains("at least 0.1"));
    }

    #[test]
    fn off_unless_asked_and_external_lighthouse_kept() {
        let (g, n) = run(&["t.py"], &[], 3).expect("resolves");
        assert!(g.is_none());
        assert_eq!(n.nnodes, 4);
        let (g, _) =
            run(&["t.py"], &[("TRAINLET_REPLICA_GROUPS", "4"), ("TORCHFT_LIGHTHOUSE", "http://lh:1")], 0).expect("ok");
        assert_eq!(g.expect("on").lighthouse, Lighthouse::External("http://lh:1".into()));
    }

    #[test]
    fn bad_settings_say_what_to_do() {
        let lh = ("TRAINLET_LIGHTHOUSE", "/bin/true");
        let e = |a: &[&str], env: &[(&str, &str)]| run(a, env, 0).expect_err("refused").to_string();
        assert!(e(&["--replica-groups", "3", "t.py"], &[lh]).contains("does not divide the job's 4 pods"));
        assert!(e(&["--replica-groups", "0", "t.py"], &[lh]).contains(">= 1"));
        assert!(e(&["--replica-groups", "x", "t.py"], &[lh]).contains(">= 1"));
        assert!(
            e(&["--replica-groups", "2", "t.py"], &[lh, ("TRAINLET_LIGHTHOUSE_MIN_REPLICAS", "3")])
                .contains("from 1 to 2")
        );
        let missing = e(&["--replica-groups", "2", "t.py"], &[("PATH", "/nonexistent")]);
        assert!(missing.contains("pip install torchft") && missing.contains("TORCHFT_LIGHTHOUSE"), "{missing}");
        let e2 = e(&["--replica-groups", "2", "t.py"], &[("TRAINLET_LIGHTHOUSE", "/nonexistent/lh")]);
        assert!(e2.contains("TRAINLET_LIGHTHOUSE") && e2.contains("executable"), "{e2}");
        // Pods other than node rank 0 do not need the program.
        assert!(run(&["--replica-groups", "2", "t.py"], &[("PATH", "/nonexistent")], 1).is_ok());
    }
}
