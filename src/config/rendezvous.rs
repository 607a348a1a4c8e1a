//! Where and how the pods meet: `--rdzv-backend`/`--rdzv-conf`,
//! standalone or a store endpoint, which pod serves the store, the run id,
//! the join deadline, the store's memory, the JobSet restart attempt, the
//! elastic last call and the heartbeat.

use std::time::Duration;

use super::defaults::{
    DEFAULT_HEARTBEAT, DEFAULT_HEARTBEAT_TIMEOUT, DEFAULT_JOIN_TIMEOUT, DEFAULT_LAST_CALL, DEFAULT_LOST_GRACE,
    DEFAULT_PORT,
};
use super::framework::Framework;
use super::machine::Machine;
use super::nodes::Nodes;
use super::setting::{Settings, flag_or_env, invalid, lookup, parse_secs};
use super::setting::{parse_port_or_free, store_memory};
use super::{Error, Source};
use crate::cli::RunArgs;
use crate::env;
use crate::store::Endpoint;

/// The rendezvous settings of a plan.
#[derive(Debug, Clone)]
pub(super) struct Rendezvous {
    pub standalone: bool,
    pub endpoint: Endpoint,
    pub serve_store: bool,
    pub run_id: String,
    pub join_timeout: Duration,
    pub store_memory: u64,
    pub jobset_attempt: u64,
    pub last_call: Duration,
    pub heartbeat: Duration,
    pub heartbeat_timeout: Duration,
    /// How long a member's closed heartbeat connection may stay closed.
    pub lost_grace: Duration,
    /// `progress_timeout` of `--rdzv-conf`, if given.
    pub progress_timeout: Option<Duration>,
}

/// Resolve the rendezvous settings for `nodes`.
pub(super) fn resolve(
    args: &RunArgs,
    s: &mut Settings<'_>,
    nodes: Nodes,
    machine: &Machine,
    fw: Framework,
) -> Result<Rendezvous, Error> {
    let env = s.env;
    let Nodes { min_nodes, nnodes, node_rank, .. } = nodes;
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
    let port_l = lookup(args.master_port.as_deref(), "--master-port", env, fw.port_env());
    let master_port = port_l.value.map_or(Ok(DEFAULT_PORT), |v| parse_port_or_free(&port_l.origin(), v))?;
    let addr_l = lookup(args.master_addr.as_deref(), "--master-addr", env, fw.addr_env());
    let ep_l = lookup(args.rdzv_endpoint.as_deref(), "--rdzv-endpoint", env, fw.endpoint_env());
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
    let serve_store = standalone || conf.is_host.unwrap_or(node_rank == 0);
    if endpoint.port == 0 && !standalone {
        let origin = if ep_l.value.is_some() { ep_l.origin() } else { port_l.origin() };
        free_port_fits(nnodes, serve_store, &origin)?;
    }
    s.prov.push((
        "store endpoint",
        match (standalone, endpoint.port) {
            (true, _) => "127.0.0.1:<free port>".into(),
            (false, 0) => format!("{}:<free port>", endpoint.host),
            (false, _) => endpoint.to_string(),
        },
        ep_src,
    ));
    if fw != Framework::Torch {
        // JAX's process 0 and XGBoost's tracker run next to the store, on
        // the pod of node rank 0, and both frameworks have a fixed world.
        if min_nodes != nnodes {
            return Err(Error::Usage(format!(
                "{} jobs have a fixed number of processes: give --nnodes N, not {min_nodes}:{nnodes}",
                fw.name()
            )));
        }
        if serve_store != (node_rank == 0) {
            return Err(Error::Usage(format!(
                "{} jobs need the store on node rank 0, where the {} runs; drop is_host from --rdzv-conf",
                fw.name(),
                if fw == Framework::Jax { "JAX coordinator (process 0)" } else { "XGBoost tracker" }
            )));
        }
    }

    let l = lookup(args.rdzv_id.as_deref(), "--rdzv-id", env, &[env::PET_RDZV_ID]);
    let run_id = match l.value {
        Some(v) => v.to_string(),
        None if standalone => random_id(),
        None => "none".to_string(),
    };
    s.prov.push(("run id", run_id.clone(), l.source));

    let l = lookup(args.join_timeout.as_deref(), "--join-timeout", env, &[env::TRAINLET_JOIN_TIMEOUT]);
    let join_timeout = match (l.value, conf.join_timeout) {
        (None, Some(t)) => t,
        _ => parse_secs(&l, DEFAULT_JOIN_TIMEOUT)?,
    };
    s.prov.push(("join timeout", format!("{join_timeout:?}"), l.source));

    let (store_memory, source) = store_memory(args.store_memory.as_deref(), env, machine.store_memory)?;
    s.prov.push(("store memory budget", format!("{store_memory} bytes"), source));

    let l = lookup(None, "--job-set-attempt", env, &[env::JOBSET_RESTART_ATTEMPT]);
    let jobset_attempt = match l.value {
        None => 0,
        Some(v) => v
            .trim()
            .parse::<u64>()
            .map_err(|_| invalid(&l.origin(), v, "the JobSet restart attempt, an integer >= 0"))?,
    };
    s.prov.push(("jobset attempt", jobset_attempt.to_string(), l.source));
    let l = lookup(args.last_call_timeout.as_deref(), "--last-call-timeout", env, &[env::TRAINLET_LAST_CALL_TIMEOUT]);
    let last_call = match (l.value, conf.last_call) {
        (None, Some(t)) => t,
        _ => parse_secs(&l, DEFAULT_LAST_CALL)?,
    };
    if min_nodes != nnodes {
        s.prov.push(("last call", format!("{last_call:?}"), l.source));
    }
    let (heartbeat, heartbeat_timeout, lost_grace) = liveness(args, s, &conf)?;

    Ok(Rendezvous {
        standalone,
        endpoint,
        serve_store,
        run_id,
        join_timeout,
        store_memory,
        jobset_attempt,
        last_call,
        heartbeat,
        heartbeat_timeout,
        lost_grace,
        progress_timeout: conf.progress_timeout,
    })
}

/// Longest heartbeat timeout: a pod silent for a day is dead whatever the
/// setting (and every deadline built from it stays a representable time).
const MAX_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(86_400);

/// The heartbeat period, the heartbeat timeout and the lost grace, from
/// `args`, the environment and `--rdzv-conf`.
fn liveness(args: &RunArgs, s: &mut Settings<'_>, conf: &RdzvConf) -> Result<(Duration, Duration, Duration), Error> {
    let env = s.env;
    let heartbeat = conf.keep_alive_interval.unwrap_or(DEFAULT_HEARTBEAT);
    let l = lookup(args.heartbeat_timeout.as_deref(), "--heartbeat-timeout", env, &[env::TRAINLET_HEARTBEAT_TIMEOUT]);
    let heartbeat_timeout = match (l.value, conf.keep_alive_interval, conf.keep_alive_max_attempt) {
        // Past Duration's range: refused below as too long.
        (None, Some(i), Some(n)) => i.checked_mul(n).unwrap_or(Duration::MAX),
        (None, None, Some(n)) => DEFAULT_HEARTBEAT.checked_mul(n).unwrap_or(Duration::MAX),
        _ => parse_secs(&l, DEFAULT_HEARTBEAT_TIMEOUT)?,
    };
    if heartbeat_timeout > MAX_HEARTBEAT_TIMEOUT {
        return Err(invalid(
            &l.origin(),
            l.value.unwrap_or("(from --rdzv-conf)"),
            &format!("a heartbeat timeout of at most {} s (a day)", MAX_HEARTBEAT_TIMEOUT.as_secs()),
        ));
    }
    if heartbeat_timeout < heartbeat * 2 {
        return Err(invalid(
            &l.origin(),
            l.value.unwrap_or("(from --rdzv-conf)"),
            &format!("a heartbeat timeout of at least two heartbeat periods ({:?})", heartbeat * 2),
        ));
    }
    // A period well below the timeout, so one late heartbeat is not a death.
    let heartbeat = heartbeat.min(heartbeat_timeout / 4).max(Duration::from_millis(100));
    s.prov.push(("heartbeat timeout", format!("{heartbeat_timeout:?} (every {heartbeat:?})"), l.source));
    let l = lookup(args.lost_grace.as_deref(), "--lost-grace", env, &[env::TRAINLET_LOST_GRACE]);
    let lost_grace = parse_secs(&l, DEFAULT_LOST_GRACE.min(heartbeat_timeout))?;
    if lost_grace > heartbeat_timeout {
        return Err(invalid(
            &l.origin(),
            l.value.unwrap_or_default(),
            &format!(
                "a grace of at most the heartbeat timeout ({heartbeat_timeout:?}): a silent pod is dead after that anyway; \
                 raise --heartbeat-timeout too"
            ),
        ));
    }
    s.prov.push(("lost connection grace", format!("{lost_grace:?}"), l.source));
    Ok((heartbeat, heartbeat_timeout, lost_grace))
}

/// Port 0 (a free port, picked when the store binds, as torchrun's
/// `--rdzv-endpoint=localhost:0` for stacked single-node jobs): only a
/// single node that serves the store itself can use it, as no other pod
/// could learn the port picked.
fn free_port_fits(nnodes: u32, serve_store: bool, origin: &str) -> Result<(), Error> {
    if nnodes > 1 {
        return Err(Error::Usage(format!(
            "{origin} gives port 0 (a free port) to a job of up to {nnodes} nodes: the other nodes could not learn \
             the port picked; give a fixed port, or --nnodes 1"
        )));
    }
    if !serve_store {
        return Err(Error::Usage(format!(
            "{origin} gives port 0 (a free port), but is_host=false in --rdzv-conf makes another pod serve the \
             store: give that pod's fixed port"
        )));
    }
    Ok(())
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
    let port = port.map_or(Ok(default_port), |p| parse_port_or_free(origin, p))?;
    Ok(Endpoint { host: host.to_string(), port })
}

/// Every key `--rdzv-conf` takes (torch's c10d and static handlers' own,
/// some of them read and ignored: [`parse_rdzv_conf`]), as its error lists
/// them.
const CONF_KEYS: [&str; 13] = [
    "join_timeout",
    "timeout",
    "read_timeout",
    "is_host",
    "last_call_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "progress_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "cas_backoff_max_seconds",
    "use_libuv",
    "store_type=tcp",
];

/// Settings accepted in `--rdzv-conf`.
#[derive(Debug, Default)]
struct RdzvConf {
    join_timeout: Option<Duration>,
    is_host: Option<bool>,
    last_call: Option<Duration>,
    keep_alive_interval: Option<Duration>,
    keep_alive_max_attempt: Option<u32>,
    progress_timeout: Option<Duration>,
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
                .and_then(|s| Duration::try_from_secs_f64(s).ok())
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
            "progress_timeout" => conf.progress_timeout = Some(secs()?),
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
                return Err(invalid(origin, v, &format!("keys among {}", CONF_KEYS.join(", "))));
            }
        }
    }
    Ok(conf)
}

fn random_id() -> String {
    format!("{:016x}", crate::sys::random_u64())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every key the error lists is taken (with a value of its kind), so
    /// the list and the parser cannot drift apart.
    #[test]
    fn every_key_the_error_lists_is_taken() {
        for key in CONF_KEYS {
            let item = match key {
                "is_host" | "use_libuv" => format!("{key}=true"),
                "keep_alive_max_attempt" => format!("{key}=3"),
                k if k.contains('=') => k.to_string(),
                k => format!("{k}=2.5"),
            };
            assert!(parse_rdzv_conf("--rdzv-conf", &item).is_ok(), "{item}");
        }
        let err = parse_rdzv_conf("--rdzv-conf", "bogus=1").expect_err("an unknown key").to_string();
        for key in CONF_KEYS {
            assert!(err.contains(key), "{key} missing from: {err}");
        }
    }
}
