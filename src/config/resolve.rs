//! `RunArgs` + `Env` -> `Plan`: parsing, precedence and validation.

use std::path::PathBuf;
use std::time::Duration;

use super::{Entrypoint, Error, Plan, Source};
use crate::cli::RunArgs;
use crate::env::{self, Env};
use crate::store::Endpoint;

/// Default store port (torchrun's `--master-port`, Trainer's PET_MASTER_PORT).
pub const DEFAULT_PORT: u16 = 29500;
/// Default join deadline (torchrun's c10d `join_timeout`).
pub const DEFAULT_JOIN_TIMEOUT: Duration = Duration::from_secs(600);
/// Default grace before SIGKILL: with the kill timeout it fits inside
/// Kubernetes' default terminationGracePeriodSeconds of 30 s.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(25);
/// Default bound on waiting for workers after SIGKILL.
pub const DEFAULT_KILL_TIMEOUT: Duration = Duration::from_secs(3);
/// Default time workers get to checkpoint (capped below the grace period).
pub const DEFAULT_CHECKPOINT_TIMEOUT: Duration = Duration::from_secs(15);
/// Default elastic last-call window (torch's `last_call_timeout`).
pub const DEFAULT_LAST_CALL: Duration = Duration::from_secs(30);
/// Default heartbeat period.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(1);
/// Default silence after which a pod is dead.
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(10);

/// Which output streams a setting applies to, per local rank.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Streams {
    all: (bool, bool),
    per_rank: Vec<(u32, (bool, bool))>,
}

impl Streams {
    /// (stdout, stderr) selected for `local_rank`.
    pub fn for_rank(&self, local_rank: u32) -> (bool, bool) {
        self.per_rank.iter().find(|(r, _)| *r == local_rank).map_or(self.all, |(_, s)| *s)
    }

    fn parse(origin: &str, v: &str) -> Result<Self, Error> {
        let bits = |d: &str| -> Result<(bool, bool), Error> {
            match d.trim() {
                "0" => Ok((false, false)),
                "1" => Ok((true, false)),
                "2" => Ok((false, true)),
                "3" => Ok((true, true)),
                _ => Err(invalid(origin, v, "0, 1, 2, 3 or local_rank:value pairs like 0:3,1:1")),
            }
        };
        if !v.contains(':') {
            return Ok(Self { all: bits(v)?, per_rank: Vec::new() });
        }
        let mut per_rank = Vec::new();
        for pair in v.split(',') {
            let (r, d) = pair.split_once(':').ok_or_else(|| invalid(origin, v, "local_rank:value pairs"))?;
            let r = r.trim().parse().map_err(|_| invalid(origin, v, "local_rank:value pairs"))?;
            per_rank.push((r, bits(d)?));
        }
        Ok(Self { all: (false, false), per_rank })
    }
}

fn invalid(origin: &str, value: &str, expected: &str) -> Error {
    Error::Invalid { origin: origin.to_string(), value: value.to_string(), expected: expected.to_string() }
}

/// One setting looked up with CLI > env > default precedence.
struct Lookup<'a> {
    value: Option<&'a str>,
    source: Source,
}

impl Lookup<'_> {
    fn origin(&self) -> String {
        match &self.source {
            Source::Flag(n) => n.to_string(),
            Source::Env(n) => n.to_string(),
            Source::Default | Source::Derived(_) => "default".to_string(),
        }
    }
}

fn lookup<'a>(cli: Option<&'a str>, flag: &'static str, env: &'a Env, names: &[&'static str]) -> Lookup<'a> {
    if let Some(v) = cli {
        return Lookup { value: Some(v), source: Source::Flag(flag) };
    }
    for name in names {
        if let Some(v) = env.get(name) {
            return Lookup { value: Some(v), source: Source::Env(name) };
        }
    }
    Lookup { value: None, source: Source::Default }
}

fn flag_or_env(cli: bool, flag: &'static str, env: &Env, name: &'static str) -> Result<(bool, Source), Error> {
    if cli {
        return Ok((true, Source::Flag(flag)));
    }
    match env.get(name) {
        None => Ok((false, Source::Default)),
        Some("1" | "true" | "True") => Ok((true, Source::Env(name))),
        Some("0" | "false" | "False") => Ok((false, Source::Env(name))),
        Some(v) => Err(invalid(name, v, "0 or 1")),
    }
}

/// `--store-memory`: a size of at least [`crate::store::MIN_BUDGET`], or
/// the default sized from the container's memory limit.
fn store_memory(l: &Lookup<'_>) -> Result<u64, Error> {
    let Some(v) = l.value else { return Ok(crate::store::default_budget(std::path::Path::new("/"))) };
    crate::store::parse_size(v)
        .filter(|n| *n >= crate::store::MIN_BUDGET)
        .ok_or_else(|| invalid(&l.origin(), v, "a size of at least 64M, e.g. 512M or 2G"))
}

fn parse_u32(l: &Lookup<'_>, default: u32, expected: &str) -> Result<u32, Error> {
    l.value.map_or(Ok(default), |v| v.trim().parse::<u32>().map_err(|_| invalid(&l.origin(), v, expected)))
}

fn parse_secs(l: &Lookup<'_>, default: Duration) -> Result<Duration, Error> {
    l.value.map_or(Ok(default), |v| {
        v.trim()
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s >= 0.0)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| invalid(&l.origin(), v, "a number of seconds >= 0"))
    })
}

fn parse_port(origin: &str, v: &str) -> Result<u16, Error> {
    v.trim().parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(|| invalid(origin, v, "a TCP port 1-65535"))
}

/// `host`, `host:port`, `[v6]`, `[v6]:port`.
fn parse_endpoint(origin: &str, v: &str, default_port: u16) -> Result<Endpoint, Error> {
    let bad = || invalid(origin, v, "host[:port] or [ipv6][:port]");
    let v = v.trim();
    let (host, port) = if let Some(rest) = v.strip_prefix('[') {
        let (h, after) = rest.split_once(']').ok_or_else(bad)?;
        match after.strip_prefix(':') {
            Some(p) => (h, Some(p)),
            None if after.is_empty() => (h, None),
            None => return Err(bad()),
        }
    } else if v.matches(':').count() == 1 {
        let (h, p) = v.split_once(':').ok_or_else(bad)?;
        (h, Some(p))
    } else {
        (v, None)
    };
    if host.is_empty() {
        return Err(bad());
    }
    let port = port.map_or(Ok(default_port), |p| parse_port(origin, p))?;
    Ok(Endpoint { host: host.to_string(), port })
}

fn parse_signal(origin: &str, v: &str, name: &str) -> Result<i32, Error> {
    let upper = name.trim().to_ascii_uppercase();
    let full = if upper.starts_with("SIG") { upper } else { format!("SIG{upper}") };
    full.parse::<nix::sys::signal::Signal>()
        .map(|s| s as i32)
        .map_err(|_| invalid(origin, v, "a comma list of signal names like SIGTERM,SIGINT"))
}

/// Settings accepted in `--rdzv-conf`.
#[derive(Debug, Default)]
struct RdzvConf {
    join_timeout: Option<Duration>,
    is_host: Option<bool>,
    last_call: Option<Duration>,
    keep_alive_interval: Option<Duration>,
    keep_alive_max_attempt: Option<u32>,
}

fn parse_rdzv_conf(origin: &str, v: &str) -> Result<RdzvConf, Error> {
    let mut conf = RdzvConf::default();
    for item in v.split(',').filter(|s| !s.trim().is_empty()) {
        let (k, val) = item.split_once('=').ok_or_else(|| invalid(origin, v, "key=value pairs"))?;
        let (k, val) = (k.trim(), val.trim());
        if val.is_empty() {
            return Err(invalid(origin, v, &format!("a value for {k}")));
        }
        let secs = || {
            val.parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s > 0.0)
                .map(Duration::from_secs_f64)
                .ok_or_else(|| invalid(origin, v, &format!("{k} in seconds > 0")))
        };
        match k {
            "join_timeout" | "timeout" => conf.join_timeout = Some(secs()?),
            "read_timeout" => {
                secs()?;
            }
            "is_host" => {
                conf.is_host = Some(match val.to_ascii_lowercase().as_str() {
                    "1" | "true" | "yes" | "y" => true,
                    "0" | "false" | "no" | "n" => false,
                    _ => return Err(invalid(origin, v, "is_host=true|false")),
                });
            }
            "last_call_timeout" => conf.last_call = Some(secs()?),
            "keep_alive_interval" => conf.keep_alive_interval = Some(secs()?),
            "keep_alive_max_attempt" => {
                conf.keep_alive_max_attempt = Some(
                    val.parse::<u32>()
                        .ok()
                        .filter(|n| *n > 0)
                        .ok_or_else(|| invalid(origin, v, "keep_alive_max_attempt >= 1"))?,
                );
            }
            // torch's own tuning of its CAS-based state; nothing to tune here.
            "close_timeout" | "heartbeat_timeout" | "cas_backoff_max_seconds" => {
                secs()?;
            }
            "store_type" if val == "tcp" => {}
            "use_libuv" => {}
            "store_type" => {
                return Err(Error::Unsupported {
                    what: format!("--rdzv-conf {k}={val}"),
                    hint: "trainlet serves its own TCP store; remove the setting".into(),
                });
            }
            _ => {
                return Err(invalid(
                    origin,
                    v,
                    "keys among join_timeout, timeout, read_timeout, is_host, last_call_timeout, keep_alive_interval, keep_alive_max_attempt",
                ));
            }
        }
    }
    Ok(conf)
}

fn resolve_python(args: &RunArgs, env: &Env) -> Result<(String, Source), Error> {
    let l = lookup(args.python.as_deref(), "--python", env, &[env::TRAINLET_PYTHON, env::PYTHON_EXEC]);
    if let Some(v) = l.value {
        return Ok((v.to_string(), l.source));
    }
    for name in ["python", "python3"] {
        if let Some(p) = env.which(name) {
            return Ok((p.display().to_string(), Source::Derived(format!("{name} on PATH"))));
        }
    }
    Err(Error::Usage(
        "no python interpreter: neither python nor python3 is on PATH; pass --python PATH or set TRAINLET_PYTHON"
            .into(),
    ))
}

/// Python snippet for `--run-path`: run the script via runpy, as torchrun does.
const RUN_PATH: &str = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')";

fn random_id() -> String {
    format!("{:016x}", crate::sys::random_u64())
}

impl Plan {
    /// Resolve `args` against `env`. `need_command` is false for `doctor`.
    pub fn resolve(args: &RunArgs, env: &Env, need_command: bool) -> Result<Plan, Error> {
        if let Some(flag) = args.unsupported() {
            return Err(Error::Unsupported { what: flag.into(), hint: "remove it from the command line".into() });
        }
        let mut prov = Vec::new();

        // nnodes: N or MIN:MAX.
        let l = lookup(args.nnodes.as_deref(), "--nnodes", env, &[env::PET_NNODES]);
        let (min_nodes, nnodes) = match l.value {
            None => (1, 1),
            Some(v) => {
                let expected = "a node count N >= 1 or MIN:MAX";
                let num = |s: &str| s.trim().parse::<u32>().ok().filter(|n| *n > 0);
                match v.split_once(':') {
                    None => {
                        let n = num(v).ok_or_else(|| invalid(&l.origin(), v, expected))?;
                        (n, n)
                    }
                    Some((a, b)) => {
                        let (min, max) = (
                            num(a).ok_or_else(|| invalid(&l.origin(), v, expected))?,
                            num(b).ok_or_else(|| invalid(&l.origin(), v, expected))?,
                        );
                        if min > max {
                            return Err(invalid(&l.origin(), v, "MIN <= MAX"));
                        }
                        (min, max)
                    }
                }
            }
        };
        let spec = if min_nodes == nnodes { nnodes.to_string() } else { format!("{min_nodes}:{nnodes}") };
        prov.push(("nnodes", spec, l.source.clone()));

        // node rank, with JOB_COMPLETION_INDEX as the last fallback.
        let l = lookup(args.node_rank.as_deref(), "--node-rank", env, &[env::PET_NODE_RANK, env::JOB_COMPLETION_INDEX]);
        let node_rank = parse_u32(&l, 0, "a node rank >= 0")?;
        if node_rank >= nnodes {
            return Err(invalid(
                &l.origin(),
                l.value.unwrap_or("0"),
                &format!("a node rank below nnodes ({nnodes}), i.e. 0..={}", nnodes - 1),
            ));
        }
        prov.push(("node rank", node_rank.to_string(), l.source));

        // GPUs (nproc auto|gpu counts them).
        let root = crate::gpu::root(env);
        let gpus = crate::gpu::discover(&crate::gpu::sysfs::Sysfs::new(&root), env)?;
        prov.push((
            "gpus",
            gpus.len().to_string(),
            Source::Derived(format!("{} and sysfs", root.join("proc/driver/nvidia/gpus").display())),
        ));

        // nproc per node.
        let l = lookup(args.nproc_per_node.as_deref(), "--nproc-per-node", env, &[env::PET_NPROC_PER_NODE]);
        let (nproc, src) = match l.value.map(str::trim) {
            None => (1, l.source.clone()),
            Some("auto") => {
                let gpus = gpus.len();
                if gpus > 0 {
                    (gpus, Source::Derived(format!("auto: {gpus} visible GPUs")))
                } else {
                    let cpus = crate::sys::cpu_count();
                    (cpus, Source::Derived(format!("auto: no GPU, {cpus} CPUs")))
                }
            }
            Some("cpu") => {
                let cpus = crate::sys::cpu_count();
                (cpus, Source::Derived(format!("cpu: {cpus} CPUs")))
            }
            Some("gpu") => {
                let gpus = gpus.len();
                if gpus == 0 {
                    return Err(invalid(
                        &l.origin(),
                        "gpu",
                        "auto, cpu or an integer: no GPU is usable here (none in /proc/driver/nvidia/gpus, \
                         or hidden by CUDA_VISIBLE_DEVICES/NVIDIA_VISIBLE_DEVICES)",
                    ));
                }
                (gpus, Source::Derived(format!("gpu: {gpus} visible GPUs")))
            }
            Some(v) => (
                v.parse::<usize>()
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or_else(|| invalid(&l.origin(), v, "an integer >= 1, auto, cpu or gpu"))?,
                l.source.clone(),
            ),
        };
        let nproc = u32::try_from(nproc).map_err(|_| invalid(&l.origin(), &nproc.to_string(), "fewer workers"))?;
        prov.push(("nproc per node", nproc.to_string(), src));

        // Rendezvous backend, endpoint, standalone.
        let l = lookup(args.rdzv_backend.as_deref(), "--rdzv-backend", env, &[env::PET_RDZV_BACKEND]);
        let backend = l.value.unwrap_or("static");
        if !matches!(backend, "static" | "c10d") {
            return Err(Error::Unsupported {
                what: format!("{} {backend}", l.origin()),
                hint: "use static or c10d; both are served by trainlet's own store".into(),
            });
        }
        let conf_l = lookup(args.rdzv_conf.as_deref(), "--rdzv-conf", env, &[env::PET_RDZV_CONF]);
        let conf = conf_l.value.map_or(Ok(RdzvConf::default()), |v| parse_rdzv_conf(&conf_l.origin(), v))?;
        let (standalone_flag, standalone_src) = flag_or_env(args.standalone, "--standalone", env, env::PET_STANDALONE)?;
        let port_l = lookup(args.master_port.as_deref(), "--master-port", env, &[env::PET_MASTER_PORT]);
        let master_port = port_l.value.map_or(Ok(DEFAULT_PORT), |v| parse_port(&port_l.origin(), v))?;
        let addr_l = lookup(args.master_addr.as_deref(), "--master-addr", env, &[env::PET_MASTER_ADDR]);
        let ep_l = lookup(args.rdzv_endpoint.as_deref(), "--rdzv-endpoint", env, &[env::PET_RDZV_ENDPOINT]);
        let implicit = backend == "static" && ep_l.value.is_none() && port_l.value.is_none() && nnodes == 1;
        let standalone = standalone_flag || implicit;
        if standalone_flag && nnodes > 1 {
            return Err(Error::Usage(format!("--standalone runs one node, but nnodes is {nnodes}")));
        }
        let (endpoint, ep_src) = if standalone {
            let how = if standalone_flag { standalone_src } else { Source::Derived("one node, no endpoint".into()) };
            (Endpoint { host: "127.0.0.1".into(), port: 0 }, how)
        } else if let Some(v) = ep_l.value {
            let default_port = if backend == "c10d" { 29400 } else { master_port };
            (parse_endpoint(&ep_l.origin(), v, default_port)?, ep_l.source.clone())
        } else {
            let host = addr_l.value.unwrap_or("127.0.0.1").trim().to_string();
            if host.is_empty() || host.contains(char::is_whitespace) {
                return Err(invalid(&addr_l.origin(), &host, "a host name or IP address"));
            }
            let src = if addr_l.value.is_some() { addr_l.source.clone() } else { port_l.source.clone() };
            (Endpoint { host, port: master_port }, src)
        };
        prov.push((
            "store endpoint",
            if standalone { "127.0.0.1:<free port>".into() } else { endpoint.to_string() },
            ep_src,
        ));
        let serve_store = standalone || conf.is_host.unwrap_or(node_rank == 0);

        let l = lookup(args.rdzv_id.as_deref(), "--rdzv-id", env, &[env::PET_RDZV_ID]);
        let run_id = match l.value {
            Some(v) => v.to_string(),
            None if standalone => random_id(),
            None => "none".to_string(),
        };
        prov.push(("run id", run_id.clone(), l.source));

        let l = lookup(args.max_restarts.as_deref(), "--max-restarts", env, &[env::PET_MAX_RESTARTS]);
        let max_restarts = parse_u32(&l, 0, "an integer >= 0")?;
        prov.push(("max restarts", max_restarts.to_string(), l.source));

        let l = lookup(args.monitor_interval.as_deref(), "--monitor-interval", env, &[env::PET_MONITOR_INTERVAL]);
        parse_secs(&l, Duration::ZERO)?;

        let l = lookup(args.join_timeout.as_deref(), "--join-timeout", env, &[env::TRAINLET_JOIN_TIMEOUT]);
        let join_timeout = match (l.value, conf.join_timeout) {
            (None, Some(t)) => t,
            _ => parse_secs(&l, DEFAULT_JOIN_TIMEOUT)?,
        };
        prov.push(("join timeout", format!("{join_timeout:?}"), l.source));

        let l = lookup(args.store_memory.as_deref(), "--store-memory", env, &[env::TRAINLET_STORE_MEMORY]);
        let store_memory = store_memory(&l)?;
        prov.push(("store memory budget", format!("{store_memory} bytes"), l.source));

        let l =
            lookup(args.shutdown_timeout.as_deref(), "--shutdown-timeout", env, &[env::TORCH_ELASTIC_SHUTDOWN_TIMEOUT]);
        let grace = parse_secs(&l, DEFAULT_GRACE)?;
        prov.push(("grace period", format!("{grace:?}"), l.source));

        let l = lookup(
            args.signals_to_handle.as_deref(),
            "--signals-to-handle",
            env,
            &[env::TORCHELASTIC_SIGNALS_TO_HANDLE],
        );
        let mut stop_signals = Vec::new();
        for name in l.value.unwrap_or("SIGTERM,SIGINT,SIGHUP,SIGQUIT").split(',').filter(|s| !s.trim().is_empty()) {
            stop_signals.push(parse_signal(&l.origin(), l.value.unwrap_or(""), name)?);
        }
        for always in [libc::SIGTERM, libc::SIGINT] {
            if !stop_signals.contains(&always) {
                stop_signals.push(always);
            }
        }

        let l = lookup(args.start_method.as_deref(), "--start-method", env, &[env::PET_START_METHOD]);
        if let Some(v) = l.value.filter(|v| !matches!(*v, "spawn" | "fork" | "forkserver")) {
            return Err(invalid(&l.origin(), v, "spawn, fork or forkserver"));
        }

        let l = lookup(args.role.as_deref(), "--role", env, &[env::PET_ROLE]);
        let role = l.value.unwrap_or("default").to_string();

        let l = lookup(None, "--log-dir", env, &[env::PET_LOG_DIR]);
        let log_dir = args.log_dir.clone().or_else(|| l.value.map(PathBuf::from));
        let l = lookup(args.redirects.as_deref(), "--redirects", env, &[env::PET_REDIRECTS]);
        let redirects = l.value.map_or(Ok(Streams::default()), |v| Streams::parse(&l.origin(), v))?;
        let l = lookup(args.tee.as_deref(), "--tee", env, &[env::PET_TEE]);
        let tee = l.value.map_or(Ok(Streams::default()), |v| Streams::parse(&l.origin(), v))?;
        let l = lookup(args.local_ranks_filter.as_deref(), "--local-ranks-filter", env, &[env::PET_LOCAL_RANKS_FILTER]);
        let console_ranks = match l.value {
            None => None,
            Some(v) => Some(
                v.split(',')
                    .filter(|s| !s.trim().is_empty())
                    .map(|s| s.trim().parse::<u32>())
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|_| invalid(&l.origin(), v, "a comma list of local ranks like 0,2"))?,
            ),
        };
        let l = lookup(
            args.log_line_prefix_template.as_deref(),
            "--log-line-prefix-template",
            env,
            &[env::TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE],
        );
        let prefix_template = l.value.unwrap_or("[${role_name}${local_rank}]:").to_string();

        let l = lookup(args.local_addr.as_deref(), "--local-addr", env, &[env::PET_LOCAL_ADDR]);
        let host = l.value.map(str::to_string).unwrap_or_else(|| {
            nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok()).unwrap_or_else(|| "localhost".into())
        });

        // Entrypoint.
        let (module, _) = flag_or_env(args.module, "--module", env, env::PET_MODULE)?;
        let (no_python, _) = flag_or_env(args.no_python, "--no-python", env, env::PET_NO_PYTHON)?;
        let (run_path, _) = flag_or_env(args.run_path, "--run-path", env, env::PET_RUN_PATH)?;
        if no_python && module {
            return Err(Error::Usage("--no-python and -m/--module cannot be combined".into()));
        }
        if run_path && (module || no_python) {
            return Err(Error::Usage("--run-path cannot be combined with -m/--module or --no-python".into()));
        }
        if let Some(first) = args.command.first().filter(|f| f.starts_with('-') && f.len() > 1) {
            return Err(Error::Usage(format!(
                "unknown option {first} (options go before the script; see trainlet run --help)"
            )));
        }
        let entry = match args.command.split_first() {
            None if need_command => {
                return Err(Error::Usage(
                    "missing the training script: trainlet run [options] SCRIPT [ARGS]...".into(),
                ));
            }
            None => Entrypoint { program: String::new(), args: Vec::new(), script: String::new() },
            Some((script, rest)) if no_python => {
                Entrypoint { program: script.clone(), args: rest.to_vec(), script: script.clone() }
            }
            Some((script, rest)) => {
                let (python, src) = resolve_python(args, env)?;
                prov.push(("python", python.clone(), src));
                let mut a = vec!["-u".to_string()];
                if module {
                    a.push("-m".into());
                } else if run_path {
                    a.extend(["-c".to_string(), RUN_PATH.to_string()]);
                }
                a.push(script.clone());
                a.extend(rest.iter().cloned());
                Entrypoint { program: python, args: a, script: script.clone() }
            }
        };

        let omp_default = (nproc > 1 && env.get(env::OMP_NUM_THREADS).is_none()).then(|| "1".to_string());

        // Elastic rendezvous, failure policy, preemption.
        let l = lookup(None, "--job-set-attempt", env, &[env::JOBSET_RESTART_ATTEMPT]);
        let jobset_attempt = match l.value {
            None => 0,
            Some(v) => v
                .trim()
                .parse::<u64>()
                .map_err(|_| invalid(&l.origin(), v, "the JobSet restart attempt, an integer >= 0"))?,
        };
        prov.push(("jobset attempt", jobset_attempt.to_string(), l.source));
        let l =
            lookup(args.last_call_timeout.as_deref(), "--last-call-timeout", env, &[env::TRAINLET_LAST_CALL_TIMEOUT]);
        let last_call = match (l.value, conf.last_call) {
            (None, Some(t)) => t,
            _ => parse_secs(&l, DEFAULT_LAST_CALL)?,
        };
        if min_nodes != nnodes {
            prov.push(("last call", format!("{last_call:?}"), l.source));
        }
        let heartbeat = conf.keep_alive_interval.unwrap_or(DEFAULT_HEARTBEAT);
        let l =
            lookup(args.heartbeat_timeout.as_deref(), "--heartbeat-timeout", env, &[env::TRAINLET_HEARTBEAT_TIMEOUT]);
        let heartbeat_timeout = match (l.value, conf.keep_alive_interval, conf.keep_alive_max_attempt) {
            (None, Some(i), Some(n)) => i * n,
            (None, None, Some(n)) => DEFAULT_HEARTBEAT * n,
            _ => parse_secs(&l, DEFAULT_HEARTBEAT_TIMEOUT)?,
        };
        if heartbeat_timeout < heartbeat * 2 {
            return Err(invalid(
                &l.origin(),
                l.value.unwrap_or("(from --rdzv-conf)"),
                &format!("a heartbeat timeout of at least two heartbeat periods ({:?})", heartbeat * 2),
            ));
        }
        // A period well below the timeout, so one late heartbeat is not a death.
        let heartbeat = heartbeat.min(heartbeat_timeout / 4).max(Duration::from_millis(100));
        prov.push(("heartbeat timeout", format!("{heartbeat_timeout:?} (every {heartbeat:?})"), l.source));
        let l = lookup(args.restart_backoff.as_deref(), "--restart-backoff", env, &[env::TRAINLET_RESTART_BACKOFF]);
        let restart_backoff = parse_secs(&l, Duration::ZERO)?;
        let l = lookup(args.kill_timeout.as_deref(), "--kill-timeout", env, &[env::TRAINLET_KILL_TIMEOUT]);
        let kill_timeout = parse_secs(&l, DEFAULT_KILL_TIMEOUT)?;
        let l = lookup(
            args.hung_timeout.as_deref(),
            "--hung-timeout",
            env,
            &[env::TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT],
        );
        let hung_timeout = match l.value {
            None => None,
            Some(_) => Some(parse_secs(&l, Duration::ZERO)?).filter(|d| !d.is_zero()),
        };
        let l =
            lookup(args.checkpoint_signal.as_deref(), "--checkpoint-signal", env, &[env::TRAINLET_CHECKPOINT_SIGNAL]);
        let checkpoint_signal = match l.value {
            None => None,
            Some(v) => Some(
                crate::config::rules::parse_signal_name(v)
                    .ok_or_else(|| invalid(&l.origin(), v, "a signal name such as SIGUSR1"))?,
            ),
        };
        let lt = lookup(
            args.checkpoint_timeout.as_deref(),
            "--checkpoint-timeout",
            env,
            &[env::TRAINLET_CHECKPOINT_TIMEOUT],
        );
        let checkpoint_timeout = match lt.value {
            None => DEFAULT_CHECKPOINT_TIMEOUT.min(grace / 2),
            Some(_) => parse_secs(&lt, DEFAULT_CHECKPOINT_TIMEOUT)?,
        };
        if checkpoint_signal.is_some() && checkpoint_timeout >= grace {
            return Err(Error::Usage(format!(
                "the checkpoint timeout ({checkpoint_timeout:?}) must be shorter than the grace period \
                 (--shutdown-timeout, {grace:?}): SIGTERM and SIGKILL both come within the grace period"
            )));
        }
        if let Some(sig) = checkpoint_signal {
            prov.push((
                "checkpoint",
                format!("{} then {checkpoint_timeout:?}", crate::sys::signal_name(sig)),
                l.source,
            ));
        }
        let l = lookup(args.policy.as_ref().and_then(|p| p.to_str()), "--policy", env, &[env::TRAINLET_POLICY]);
        let file_rules = match l.value {
            None => Vec::new(),
            Some(path) => crate::config::rules::Rules::load(std::path::Path::new(path))?,
        };
        let flag_rules =
            args.on_exit.iter().map(|r| crate::config::rules::Rules::parse_flag(r)).collect::<Result<Vec<_>, _>>()?;
        let rules = crate::config::rules::Rules::new(flag_rules, file_rules);
        prov.push(("failure policy", rules.describe(), l.source));

        let gpu = resolve_gpu(args, env, root, gpus, nproc, &mut prov)?;

        Ok(Plan {
            gpu,
            min_nodes,
            jobset_attempt,
            last_call,
            heartbeat,
            heartbeat_timeout,
            restart_backoff,
            checkpoint_signal,
            checkpoint_timeout,
            kill_timeout,
            hung_timeout,
            store_memory,
            rules,
            nnodes,
            nproc,
            node_rank,
            standalone,
            endpoint,
            serve_store,
            run_id,
            role,
            max_restarts,
            join_timeout,
            grace,
            stop_signals,
            entry,
            log_dir,
            redirects,
            tee,
            console_ranks,
            prefix_template,
            host,
            omp_default,
            provenance: prov,
        })
    }
}

/// `--pin`, `--gpu-visibility`, `--preflight` and their kin.
fn resolve_gpu(
    args: &RunArgs,
    env: &Env,
    root: PathBuf,
    gpus: Vec<crate::gpu::Gpu>,
    nproc: u32,
    prov: &mut Vec<(&'static str, String, Source)>,
) -> Result<crate::gpu::GpuPlan, Error> {
    use crate::gpu::preflight::{Check, Expect};
    use crate::gpu::{PinMode, Visibility};
    let pin = match (&args.numa_binding, args.pin.as_deref()) {
        (Some(nb), None) => {
            let l = lookup(Some(nb), "--numa-binding", env, &[]);
            let mode = PinMode::parse(nb).filter(|_| matches!(nb.trim(), "node" | "exclusive"));
            (
                mode.ok_or_else(|| Error::Unsupported {
                    what: format!("--numa-binding {nb}"),
                    hint: "use node or exclusive, or trainlet's --pin none|gpu|cpu|numa|auto".into(),
                })?,
                l.source,
            )
        }
        (_, cli) => {
            let l = lookup(cli, "--pin", env, &[env::TRAINLET_PIN]);
            let v = l.value.unwrap_or("auto");
            (PinMode::parse(v).ok_or_else(|| invalid(&l.origin(), v, "none, gpu, cpu, numa or auto"))?, l.source)
        }
    };
    prov.push(("pin", pin.0.to_string(), pin.1));
    let l = lookup(args.gpu_visibility.as_deref(), "--gpu-visibility", env, &[env::TRAINLET_GPU_VISIBILITY]);
    let visibility = match (l.value.map(str::trim), args.virtual_local_rank) {
        (None, true) => Visibility::Single,
        (None | Some("all"), _) => Visibility::All,
        (Some("single"), _) => Visibility::Single,
        (Some(v), _) => return Err(invalid(&l.origin(), v, "all or single")),
    };
    if !gpus.is_empty() {
        prov.push(("gpu visibility", visibility.to_string(), l.source));
    }
    let l = lookup(args.preflight.as_deref(), "--preflight", env, &[env::TRAINLET_PREFLIGHT]);
    let checks = Check::parse_list(l.value.unwrap_or("all")).map_err(|bad| {
        invalid(
            &l.origin(),
            l.value.unwrap_or_default(),
            &format!("all, none or a list of count,lost,ecc,remap,mig (not {bad:?})"),
        )
    })?;
    prov.push(("preflight", checks.iter().map(|c| c.name()).collect::<Vec<_>>().join(","), l.source));
    let l = lookup(args.expect_gpus.as_deref(), "--expect-gpus", env, &[env::TRAINLET_EXPECT_GPUS]);
    let expect_gpus = l.value.map(|_| parse_u32(&l, 0, "a number of GPUs >= 0")).transpose()?;
    let l = lookup(args.mig.as_deref(), "--mig", env, &[env::TRAINLET_MIG]);
    let mig = match l.value.map(str::trim) {
        None => None,
        Some("on") => Some(true),
        Some("off") => Some(false),
        Some(v) => return Err(invalid(&l.origin(), v, "on or off")),
    };
    let l = lookup(args.nvml_timeout.as_deref(), "--nvml-timeout", env, &[env::TRAINLET_NVML_TIMEOUT]);
    let nvml_timeout = parse_secs(&l, Duration::from_secs(10))?;
    let l = lookup(args.metrics_addr.as_deref(), "--metrics-addr", env, &[env::TRAINLET_METRICS_ADDR]);
    let metrics_addr = match l.value {
        None => None,
        Some(v) => Some(
            v.trim()
                .parse::<std::net::SocketAddr>()
                .map_err(|_| invalid(&l.origin(), v, "an address and port like 0.0.0.0:9400"))?,
        ),
    };
    if let Some(a) = metrics_addr {
        prov.push(("metrics", a.to_string(), l.source));
    }
    let (nic_hint, src) = flag_or_env(args.nic_hint, "--nic-hint", env, env::TRAINLET_NIC_HINT)?;
    if nic_hint {
        prov.push(("nic hint", "on".into(), src));
    }
    Ok(crate::gpu::GpuPlan {
        root,
        expect: Expect { nproc, assign: pin.0 != PinMode::None, gpus: expect_gpus, mig },
        gpus,
        pin: pin.0,
        visibility,
        user_order: env.get(env::CUDA_DEVICE_ORDER).is_some(),
        checks,
        nvml_timeout,
        nic_hint,
        metrics_addr,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::TorchrunCli;
    use clap::Parser;
    use test_case::test_case;

    fn args(a: &[&str]) -> RunArgs {
        TorchrunCli::try_parse_from(std::iter::once("torchrun").chain(a.iter().copied())).expect("parse").run
    }

    fn plan(a: &[&str], env: &[(&str, &str)]) -> Result<Plan, Error> {
        let mut e: Vec<(&str, &str)> = vec![("PATH", "/usr/bin:/bin"), ("TRAINLET_SYSFS_ROOT", "/nonexistent")];
        e.extend_from_slice(env);
        Plan::resolve(&args(a), &Env::from_pairs(e), true)
    }

    fn err(a: &[&str], env: &[(&str, &str)]) -> String {
        plan(a, env).expect_err("must fail").to_string()
    }

    #[test]
    fn gpu_settings_from_the_inventory() {
        let d = tempfile::tempdir().expect("tmp");
        crate::gpu::sysfs::fake::dgx(d.path()).expect("tree");
        let root = d.path().to_str().expect("utf-8");
        let p = plan(&["--python", "py", "--nproc-per-node", "auto", "t.py"], &[("TRAINLET_SYSFS_ROOT", root)])
            .expect("plan");
        assert_eq!((p.nproc, p.gpu.gpus.len()), (8, 8));
        assert_eq!(p.gpu.pin, crate::gpu::PinMode::Auto);
        let p = plan(
            &["--python", "py", "--nproc-per-node", "gpu", "--numa-binding", "node", "--virtual-local-rank", "t.py"],
            &[("TRAINLET_SYSFS_ROOT", root), ("CUDA_VISIBLE_DEVICES", "3,1")],
        )
        .expect("plan");
        assert_eq!(p.nproc, 2, "CUDA_VISIBLE_DEVICES narrows");
        assert_eq!(p.gpu.gpus[0].bus_id, "0000:5d:00.0", "and orders");
        assert_eq!((p.gpu.pin, p.gpu.visibility), (crate::gpu::PinMode::Numa, crate::gpu::Visibility::Single));
        let p = plan(&["--python", "py", "t.py"], &[("TRAINLET_SYSFS_ROOT", root), ("TRAINLET_PIN", "none")])
            .expect("plan");
        assert_eq!((p.nproc, p.gpu.pin, p.gpu.expect.assign), (1, crate::gpu::PinMode::None, false));
    }

    #[test]
    fn no_options_no_env_is_standalone_on_this_machine() {
        let p = plan(&["--python", "py", "t.py"], &[]).expect("plan");
        assert!(p.standalone && p.serve_store);
        assert_eq!((p.nnodes, p.nproc, p.node_rank), (1, 1, 0));
        assert_eq!(p.endpoint, Endpoint { host: "127.0.0.1".into(), port: 0 });
        assert_eq!(p.entry.args, ["-u", "t.py"]);
    }

    #[test]
    fn trainer_env_is_read() {
        let env = [
            ("PET_NNODES", "3"),
            ("PET_NPROC_PER_NODE", "2"),
            ("PET_NODE_RANK", "2"),
            ("PET_MASTER_ADDR", "job-node-0-0.job"),
            ("PET_MASTER_PORT", "29500"),
        ];
        let p = plan(&["--python", "py", "t.py"], &env).expect("plan");
        assert!(!p.standalone && !p.serve_store);
        assert_eq!((p.nnodes, p.nproc, p.node_rank, p.world_size()), (3, 2, 2, 6));
        assert_eq!(p.endpoint.to_string(), "job-node-0-0.job:29500");
        assert!(p.provenance.iter().any(|(n, _, s)| *n == "node rank" && *s == Source::Env("PET_NODE_RANK")));
    }

    #[test]
    fn cli_beats_env_and_completion_index_is_the_fallback() {
        let env = [("PET_NNODES", "4"), ("JOB_COMPLETION_INDEX", "3"), ("PET_MASTER_ADDR", "m")];
        let p = plan(&["--python", "py", "--nnodes", "5", "t.py"], &env).expect("plan");
        assert_eq!((p.nnodes, p.node_rank), (5, 3));
        let p = plan(
            &["--python", "py", "t.py"],
            &[("PET_NNODES", "4"), ("PET_NODE_RANK", "1"), ("JOB_COMPLETION_INDEX", "3")],
        )
        .expect("plan");
        assert_eq!(p.node_rank, 1, "PET_NODE_RANK before JOB_COMPLETION_INDEX");
    }

    #[test_case(&["--nnodes", "x", "t.py"], &[], "--nnodes value \"x\""; "nnodes not a number")]
    #[test_case(&["t.py"], &[("PET_NNODES", "zero")], "PET_NNODES value \"zero\""; "nnodes env")]
    #[test_case(&["--nnodes", "1:x", "t.py"], &[], "--nnodes value \"1:x\""; "elastic max not a number")]
    #[test_case(&["--nnodes", "3:2", "t.py"], &[], "MIN <= MAX"; "min above max")]
    #[test_case(&["t.py"], &[("PET_NNODES", "2"), ("PET_NODE_RANK", "2")], "PET_NODE_RANK value \"2\": expected a node rank below nnodes (2)"; "rank too big")]
    #[test_case(&["--node-rank", "-1", "t.py"], &[], "--node-rank value \"-1\""; "negative rank")]
    #[test_case(&["t.py"], &[("JOB_COMPLETION_INDEX", "abc")], "JOB_COMPLETION_INDEX value \"abc\""; "completion index")]
    #[test_case(&["--master-port", "70000", "t.py"], &[], "--master-port value \"70000\": expected a TCP port 1-65535"; "port range")]
    #[test_case(&["t.py"], &[("PET_MASTER_PORT", "http")], "PET_MASTER_PORT value \"http\""; "port env")]
    #[test_case(&["--nproc-per-node", "0", "t.py"], &[], "--nproc-per-node value \"0\""; "nproc zero")]
    #[test_case(&["t.py"], &[("PET_NPROC_PER_NODE", "many")], "PET_NPROC_PER_NODE value \"many\": expected an integer >= 1, auto, cpu or gpu"; "nproc env")]
    #[test_case(&["--nproc-per-node", "gpu", "t.py"], &[("CUDA_VISIBLE_DEVICES", "")], "no GPU is usable here"; "gpu without gpus")]
    #[test_case(&["--rdzv-backend", "etcd", "t.py"], &[], "--rdzv-backend etcd is not supported"; "etcd")]
    #[test_case(&["--rdzv-conf", "join_timeout=", "t.py"], &[], "a value for join_timeout"; "empty conf value")]
    #[test_case(&["--rdzv-conf", "store_type=file", "t.py"], &[], "--rdzv-conf store_type=file is not supported"; "store type")]
    #[test_case(&["--rdzv-conf", "keep_alive_max_attempt=0", "t.py"], &[], "keep_alive_max_attempt >= 1"; "keep alive attempts")]
    #[test_case(&["--heartbeat-timeout", "0.5", "t.py"], &[], "at least two heartbeat periods"; "heartbeat too short")]
    #[test_case(&["--checkpoint-signal", "SIGBOGUS", "t.py"], &[], "--checkpoint-signal value \"SIGBOGUS\""; "checkpoint signal")]
    #[test_case(&["--checkpoint-signal", "USR1", "--checkpoint-timeout", "40", "t.py"], &[], "must be shorter than the grace period"; "checkpoint beyond grace")]
    #[test_case(&["--on-exit", "3=explode", "t.py"], &[], "invalid failure rule \"3=explode\""; "bad rule flag")]
    #[test_case(&["--policy", "/nonexistent/p.toml", "t.py"], &[], "cannot read the failure policy file /nonexistent/p.toml"; "missing policy")]
    #[test_case(&["t.py"], &[("JOBSET_RESTART_ATTEMPT", "x")], "JOBSET_RESTART_ATTEMPT value \"x\""; "jobset attempt")]
    #[test_case(&["--kill-timeout", "-1", "t.py"], &[], "--kill-timeout value \"-1\""; "kill timeout")]
    #[test_case(&["--max-restarts", "-2", "t.py"], &[], "--max-restarts value \"-2\""; "restarts")]
    #[test_case(&["--numa-binding", "socket", "t.py"], &[], "--numa-binding socket is not supported"; "numa socket")]
    #[test_case(&["--pin", "sometimes", "t.py"], &[], "--pin value \"sometimes\": expected none, gpu, cpu, numa or auto"; "pin")]
    #[test_case(&["t.py"], &[("TRAINLET_PREFLIGHT", "ecc,temp")], "TRAINLET_PREFLIGHT value \"ecc,temp\""; "preflight")]
    #[test_case(&["--mig", "maybe", "t.py"], &[], "--mig value \"maybe\": expected on or off"; "mig")]
    #[test_case(&["--gpu-visibility", "some", "t.py"], &[], "expected all or single"; "visibility")]
    #[test_case(&["--metrics-addr", "9400", "t.py"], &[], "an address and port like 0.0.0.0:9400"; "metrics addr")]
    #[test_case(&["--no-python", "-m", "t.py"], &[], "cannot be combined"; "no python with module")]
    #[test_case(&["--standalone", "--nnodes", "2"], &[], "--standalone runs one node"; "standalone multi")]
    #[test_case(&["--signals-to-handle", "SIGNOPE", "t.py"], &[], "--signals-to-handle value"; "bad signal")]
    #[test_case(&["--rdzv-endpoint", "[::1", "t.py"], &[], "--rdzv-endpoint value \"[::1\""; "bad endpoint")]
    #[test_case(&["--shutdown-timeout", "soon", "t.py"], &[], "--shutdown-timeout value \"soon\""; "grace")]
    fn bad_input_names_the_culprit(a: &[&str], env: &[(&str, &str)], want: &str) {
        let mut full = vec!["--python", "py"];
        full.extend_from_slice(a);
        let msg = err(&full, env);
        assert!(msg.contains(want), "{msg:?} should contain {want:?}");
    }

    #[test]
    fn elastic_and_failure_settings_are_read() {
        let p = plan(
            &[
                "--nnodes",
                "2:4",
                "--rdzv-conf",
                "last_call_timeout=2,keep_alive_interval=0.5,keep_alive_max_attempt=4",
                "--on-exit",
                "3=fail",
                "--checkpoint-signal",
                "SIGUSR1",
                "--shutdown-timeout",
                "10",
                "t.py",
            ],
            &[
                ("JOBSET_RESTART_ATTEMPT", "3"),
                ("TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT", "60"),
                ("TRAINLET_RESTART_BACKOFF", "2"),
            ],
        )
        .expect("plan");
        assert_eq!((p.min_nodes, p.nnodes, p.nnodes_spec()), (2, 4, "2:4".to_string()));
        assert_eq!(
            (p.last_call, p.heartbeat, p.heartbeat_timeout),
            (Duration::from_secs(2), Duration::from_millis(500), Duration::from_secs(2))
        );
        assert_eq!(p.jobset_attempt, 3);
        assert_eq!(p.hung_timeout, Some(Duration::from_secs(60)));
        assert_eq!(p.restart_backoff, Duration::from_secs(2));
        assert_eq!(p.checkpoint_signal, Some(libc::SIGUSR1));
        assert_eq!(p.checkpoint_timeout, Duration::from_secs(5), "capped at half the grace period");
        assert_eq!(p.rules.action(crate::sys::Exit::Code(3)), crate::config::rules::RuleAction::Fail);
        let d = p.describe();
        assert!(d.contains("2:4") && d.contains("3=fail") && d.contains("SIGUSR1"), "{d}");
    }

    #[test]
    fn defaults_fit_the_kubernetes_grace_period() {
        let p = plan(&["t.py"], &[]).expect("plan");
        assert!(p.grace + p.kill_timeout < Duration::from_secs(30));
        assert_eq!(p.checkpoint_signal, None);
        assert_eq!(p.hung_timeout, None);
    }

    #[test]
    fn missing_script_is_a_usage_error() {
        assert!(err(&["--python", "py"], &[]).contains("missing the training script"));
    }

    #[test_case("h:1234", "h", 1234; "host port")]
    #[test_case("h", "h", 29400; "default c10d port")]
    #[test_case("[::1]:5", "::1", 5; "ipv6")]
    fn endpoints(v: &str, host: &str, port: u16) {
        let p = plan(&["--python", "py", "--rdzv-backend", "c10d", "--rdzv-endpoint", v, "--nnodes", "2", "t.py"], &[])
            .expect("plan");
        assert_eq!(p.endpoint, Endpoint { host: host.into(), port });
    }

    #[test]
    fn entrypoints_match_torchrun() {
        let p = plan(&["--python", "py", "-m", "pkg.train", "--lr", "1"], &[]).expect("plan");
        assert_eq!(p.entry.args, ["-u", "-m", "pkg.train", "--lr", "1"]);
        let p = plan(&["--no-python", "/bin/echo", "hi"], &[]).expect("plan");
        assert_eq!((p.entry.program.as_str(), p.entry.args.as_slice()), ("/bin/echo", &["hi".to_string()][..]));
        let p = plan(&["t.py"], &[("TRAINLET_PYTHON", "/opt/py")]).expect("plan");
        assert_eq!(p.entry.program, "/opt/py");
    }

    #[test]
    fn streams_parse_like_torchrun() {
        let s = Streams::parse("--tee", "0:3,1:2").expect("parse");
        assert_eq!((s.for_rank(0), s.for_rank(1), s.for_rank(2)), ((true, true), (false, true), (false, false)));
        assert_eq!(Streams::parse("--tee", "1").expect("parse").for_rank(7), (true, false));
        assert!(Streams::parse("--tee", "4").is_err());
    }

    #[test]
    fn omp_threads_default_like_torchrun() {
        assert_eq!(
            plan(&["--python", "py", "--nproc-per-node", "2", "t.py"], &[]).expect("plan").omp_default.as_deref(),
            Some("1")
        );
        assert_eq!(
            plan(&["--python", "py", "--nproc-per-node", "2", "t.py"], &[("OMP_NUM_THREADS", "4")])
                .expect("plan")
                .omp_default,
            None
        );
    }
}
