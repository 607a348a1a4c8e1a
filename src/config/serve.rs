//! Serve mode (`--serve`: pods that stay up between runs submitted to the
//! control API) and `--preload` (a Python zygote workers are forked from).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use super::Error;
use super::setting::{Settings, flag_or_env, invalid, lookup, parse_port, parse_secs};
use crate::cli::RunArgs;
use crate::env;

/// The control API's default port (Kubetorch's is 32300; torchrun's c10d
/// default 29400 is free in pods, whose store is on 29500).
pub const DEFAULT_CONTROL_PORT: u16 = 29400;

/// Serve mode's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Serve {
    /// Where the store host's control API listens.
    pub control: SocketAddr,
    /// The bearer token's file; None: a random one is written to `dir`.
    pub token_file: Option<PathBuf>,
    /// Exit 0 after this long without a run or a request.
    pub idle_timeout: Option<Duration>,
    /// Runs' directories and the file cache.
    pub dir: PathBuf,
    /// This agent is a lane agent (`TRAINLET_LANE`), not the pod's own.
    pub lane: Option<Lane>,
}

/// A lane agent's place: the actor beside the pods' main run it serves,
/// the slots it takes, and where it reaches the pod's agent and store. Set
/// by the pod's agent as `TRAINLET_LANE` (JSON) on the lane agent it
/// starts (`crate::serve::lane`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Lane {
    /// The run it serves.
    pub seq: u64,
    /// Its workers on this pod.
    pub nproc: u32,
    /// Its first worker slot on this pod (its GPUs are its slots').
    pub first: u32,
    /// The agents' store, as the pod's agent dials it.
    pub store: SocketAddr,
    /// The control token's file.
    pub token_file: PathBuf,
    /// It tells the store host's board how its run moves (through fd 3).
    pub report: bool,
    /// The pod's agent's serve directory (the cache is its `cache`).
    pub main_dir: PathBuf,
    /// The job's run id and JobSet attempt, as the pod's agent has them
    /// (a standalone agent draws its run id at random).
    pub run_id: String,
    /// The JobSet restart attempt.
    pub attempt: u64,
}

/// The descriptor a lane agent reaches the pod's agent through.
pub const LANE_FD: i32 = 3;

/// The zygote: which interpreter, importing what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preload {
    /// The interpreter the zygote runs in (workers must name the same one).
    pub python: String,
    /// Modules imported before any fork.
    pub modules: Vec<String>,
}

/// `--serve` and its options (None without `--serve`).
pub(super) fn resolve(args: &RunArgs, s: &mut Settings<'_>, standalone: bool) -> Result<Option<Serve>, Error> {
    let env = s.env;
    let (on, src) = flag_or_env(args.serve, "--serve", env, env::TRAINLET_SERVE)?;
    if !on {
        return Ok(None);
    }
    s.prov.push(("serve", "on".into(), src));
    let l = lookup(args.control_port.as_deref(), "--control-port", env, &[env::TRAINLET_CONTROL_PORT]);
    let port = l.value.map_or(Ok(DEFAULT_CONTROL_PORT), |v| parse_port(&l.origin(), v))?;
    let l = lookup(args.control_bind.as_deref(), "--control-bind", env, &[env::TRAINLET_CONTROL_BIND]);
    let ip = match l.value.map(str::trim) {
        None if standalone => IpAddr::V4(Ipv4Addr::LOCALHOST),
        None | Some("any") => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        Some("loopback") => IpAddr::V4(Ipv4Addr::LOCALHOST),
        Some("pod") => {
            let v = env.get(env::POD_IP).ok_or_else(|| {
                Error::Usage(format!(
                    "{} pod: POD_IP is not set; give the pod its IP with the downward API (fieldRef status.podIP) or bind to any",
                    l.origin()
                ))
            })?;
            v.trim().parse().map_err(|_| invalid(env::POD_IP, v, "an IP address"))?
        }
        Some(v) => v.parse().map_err(|_| invalid(&l.origin(), v, "loopback, any, pod or an IP address"))?,
    };
    let control = SocketAddr::new(ip, port);
    s.prov.push(("control API", control.to_string(), l.source));
    let l =
        lookup(args.control_token_file.as_deref(), "--control-token-file", env, &[env::TRAINLET_CONTROL_TOKEN_FILE]);
    let token_file = l.value.map(PathBuf::from);
    let l =
        lookup(args.serve_idle_timeout.as_deref(), "--serve-idle-timeout", env, &[env::TRAINLET_SERVE_IDLE_TIMEOUT]);
    let idle = parse_secs(&l, Duration::ZERO)?;
    let idle_timeout = (!idle.is_zero()).then_some(idle);
    s.prov.push(("serve idle", idle_timeout.map_or_else(|| "off".into(), |d| format!("{d:?}")), l.source));
    let l = lookup(args.serve_dir.as_deref(), "--serve-dir", env, &[env::TRAINLET_SERVE_DIR]);
    let dir = match l.value {
        Some(v) if v.trim().is_empty() => return Err(invalid(&l.origin(), v, "a directory")),
        Some(v) => PathBuf::from(v),
        None => env
            .get("TMPDIR")
            .filter(|t| !t.is_empty())
            .map_or_else(|| PathBuf::from("/tmp"), PathBuf::from)
            .join("trainlet-serve"),
    };
    s.prov.push(("serve dir", dir.display().to_string(), l.source));
    let lane = match env.get(env::TRAINLET_LANE) {
        Some(v) => Some(serde_json::from_str::<Lane>(v).map_err(|e| {
            Error::Usage(format!(
                "{}: {e}; it is set by trainlet for the agents it starts itself: unset it",
                env::TRAINLET_LANE
            ))
        })?),
        None => None,
    };
    Ok(Some(Serve { control, token_file, idle_timeout, dir, lane }))
}

/// `--preload MODULES` (None without it). `python` is the workers'
/// interpreter when the plan has one.
pub(super) fn resolve_preload(
    args: &RunArgs,
    s: &mut Settings<'_>,
    python: Option<&str>,
) -> Result<Option<Preload>, Error> {
    let l = lookup(args.preload.as_deref(), "--preload", s.env, &[env::TRAINLET_PRELOAD]);
    let Some(v) = l.value else { return Ok(None) };
    let mut modules = Vec::new();
    for m in v.split(',').map(str::trim).filter(|m| !m.is_empty()) {
        let ok = m.split('.').all(|part| {
            part.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && part.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        });
        if !ok {
            return Err(invalid(&l.origin(), v, "Python module names separated by commas, e.g. torch,numpy"));
        }
        modules.push(m.to_string());
    }
    let python = match python {
        Some(p) => p.to_string(),
        None => {
            let (p, src) = super::entry::resolve_python(args, s.env)?;
            s.prov.push(("python", p.clone(), src));
            p
        }
    };
    s.prov.push(("preload", modules.join(","), l.source));
    Ok(Some(Preload { python, modules }))
}

/// The plan of a lane agent (`serve.lane`): it dials the pod's agent's
/// store and hosts nothing (no store, control API or metrics), meets the
/// lane's other agents on keys of its own, and runs its actor on its
/// slots: `nproc` workers, the GPUs of its slots when the pod has one per
/// slot. Its files go under a directory of its own; the cache is the pod's.
pub(super) fn into_lane(plan: &mut super::Plan) {
    let Some(serve) = plan.serve.as_mut() else { return };
    let Some(lane) = serve.lane.clone() else { return };
    serve.token_file = Some(lane.token_file.clone());
    serve.idle_timeout = None;
    serve.dir = lane.main_dir.join(format!("lane{}", lane.seq));
    plan.serve_store = false;
    plan.run_id = lane.run_id.clone();
    plan.jobset_attempt = lane.attempt;
    plan.endpoint = crate::store::Endpoint { host: lane.store.ip().to_string(), port: lane.store.port() };
    plan.nproc = lane.nproc;
    let mine = slots_gpus(&plan.gpu.gpus, lane.first, lane.nproc);
    plan.gpu.narrowed = mine.len() < plan.gpu.gpus.len();
    plan.gpu.gpus = mine;
    plan.gpu.metrics_addr = None;
    plan.gpu.checks.clear();
    plan.in_place = None;
    plan.provenance.push((
        "lane",
        format!("run {} on slots {}..{}", lane.seq, lane.first, lane.first.saturating_add(lane.nproc)),
        super::Source::Env(env::TRAINLET_LANE),
    ));
}

/// The GPUs of worker slots `first..first + n`: one per slot when the pod
/// has at least that many, else all of them (the pod shares its GPUs
/// among more workers than it has GPUs, and so do its runs).
pub fn slots_gpus<T: Clone>(gpus: &[T], first: u32, n: u32) -> Vec<T> {
    let (first, n) = (first as usize, n as usize);
    match gpus.get(first..first.saturating_add(n)) {
        Some(mine) if !mine.is_empty() => mine.to_vec(),
        _ => gpus.to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::TorchrunCli;
    use clap::Parser;

    fn serve(a: &[&str], env: &[(&str, &str)]) -> Result<Option<Serve>, Error> {
        let args =
            TorchrunCli::try_parse_from(std::iter::once("torchrun").chain(a.iter().copied())).expect("parse").run;
        let env = env::Env::from_pairs(env.iter().copied());
        let mut s = Settings::new(&env);
        resolve(&args, &mut s, false)
    }

    #[test]
    fn serve_options_resolve_with_clear_errors() {
        assert_eq!(serve(&[], &[]).expect("off"), None);
        let on = serve(&["--serve"], &[("TMPDIR", "/scratch")]).expect("ok").expect("on");
        assert_eq!(on.control, "0.0.0.0:29400".parse().expect("addr"));
        assert_eq!(on.dir, PathBuf::from("/scratch/trainlet-serve"));
        assert_eq!(on.idle_timeout, None);
        let pod = serve(
            &["--serve", "--control-bind", "pod", "--control-port", "8080", "--serve-idle-timeout", "60"],
            &[("POD_IP", "10.0.0.7")],
        )
        .expect("ok")
        .expect("on");
        assert_eq!(pod.control, "10.0.0.7:8080".parse().expect("addr"));
        assert_eq!(pod.idle_timeout, Some(Duration::from_secs(60)));
        let on = serve(&[], &[("TRAINLET_SERVE", "1"), ("TRAINLET_CONTROL_BIND", "loopback")]).expect("ok");
        assert_eq!(on.map(|s| s.control.ip()), Some(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        for (a, env, want) in [
            (&["--serve", "--control-bind", "pod"][..], &[][..], "POD_IP is not set"),
            (&["--serve", "--control-bind", "eth0"][..], &[][..], "loopback, any, pod or an IP address"),
            (&["--serve", "--control-port", "0"][..], &[][..], "--control-port"),
            (&["--serve", "--serve-idle-timeout", "-1"][..], &[][..], "--serve-idle-timeout"),
            (&[][..], &[("TRAINLET_SERVE", "yes")][..], "TRAINLET_SERVE"),
        ] {
            let e = serve(a, env).expect_err("must fail").to_string();
            assert!(e.contains(want), "{a:?}: {e}");
        }
    }

    #[test]
    fn serve_takes_no_script() {
        let args = TorchrunCli::try_parse_from(["torchrun", "--serve", "train.py"]).expect("parse").run;
        let env = env::Env::from_pairs([("PATH", "/usr/bin:/bin"), ("TRAINLET_SYSFS_ROOT", "/nonexistent")]);
        let e = crate::config::Plan::resolve(&args, &env, true).expect_err("refused").to_string();
        assert!(e.contains("drop train.py"), "{e}");
    }

    #[test]
    fn preload_takes_module_names_only() {
        let args = |a: &[&str]| {
            TorchrunCli::try_parse_from(std::iter::once("torchrun").chain(a.iter().copied())).expect("parse").run
        };
        let env = env::Env::from_pairs([("PATH", "/nonexistent")]);
        let mut s = Settings::new(&env);
        let p = resolve_preload(&args(&["--preload", "torch, numpy.linalg"]), &mut s, Some("/py")).expect("ok");
        assert_eq!(p, Some(Preload { python: "/py".into(), modules: vec!["torch".into(), "numpy.linalg".into()] }));
        assert_eq!(resolve_preload(&args(&[]), &mut s, Some("/py")).expect("ok"), None);
        let e = resolve_preload(&args(&["--preload", "torch;rm -rf /"]), &mut s, Some("/py")).expect_err("bad");
        assert!(e.to_string().contains("--preload"), "{e}");
    }
}
