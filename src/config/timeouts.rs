//! Restarts and stopping: `--max-restarts`, the grace period and the stop
//! signals, the restart backoff, the kill and hung timeouts, the
//! checkpoint signal and its timeout, and the failure policy.

use std::time::Duration;

use super::defaults::{DEFAULT_CHECKPOINT_TIMEOUT, DEFAULT_GRACE, DEFAULT_KILL_TIMEOUT};
use super::setting::{Settings, invalid, lookup, parse_secs};
use super::{Error, Source};
use crate::cli::RunArgs;
use crate::env;

/// How the job restarts and stops.
#[derive(Debug, Clone)]
pub(super) struct Timeouts {
    pub max_restarts: u32,
    pub grace: Duration,
    pub stop_signals: Vec<i32>,
    pub restart_backoff: Duration,
    pub kill_timeout: Duration,
    pub hung_timeout: Option<Duration>,
    pub checkpoint_signal: Option<i32>,
    pub checkpoint_timeout: Duration,
    pub rules: super::rules::Rules,
}

/// Resolve restarts, stop signals, timeouts and the failure policy.
pub(super) fn resolve(args: &RunArgs, s: &mut Settings<'_>) -> Result<Timeouts, Error> {
    let env = s.env;
    let max_restarts = s.count(
        "max restarts",
        (args.max_restarts.as_deref(), "--max-restarts", &[env::PET_MAX_RESTARTS]),
        0,
        "an integer >= 0",
    )?;

    let l = lookup(args.monitor_interval.as_deref(), "--monitor-interval", env, &[env::PET_MONITOR_INTERVAL]);
    parse_secs(&l, Duration::ZERO)?;

    let grace = s.secs(
        "grace period",
        (args.shutdown_timeout.as_deref(), "--shutdown-timeout", &[env::TORCH_ELASTIC_SHUTDOWN_TIMEOUT]),
        DEFAULT_GRACE,
    )?;

    let l =
        lookup(args.signals_to_handle.as_deref(), "--signals-to-handle", env, &[env::TORCHELASTIC_SIGNALS_TO_HANDLE]);
    let mut stop_signals = Vec::new();
    for name in l.value.unwrap_or("SIGTERM,SIGINT,SIGHUP,SIGQUIT").split(',').filter(|s| !s.trim().is_empty()) {
        stop_signals.push(super::rules::parse_signal_name(name).ok_or_else(|| {
            invalid(&l.origin(), l.value.unwrap_or(""), "a comma list of signal names like SIGTERM,SIGINT")
        })?);
    }
    for always in [libc::SIGTERM, libc::SIGINT] {
        if !stop_signals.contains(&always) {
            stop_signals.push(always);
        }
    }
    let names: Vec<String> = stop_signals.iter().map(|s| crate::sys::signal_name(*s)).collect();
    s.prov.push(("stop signals", names.join(","), l.source.clone()));

    let restart_backoff = s.secs(
        "restart backoff",
        (args.restart_backoff.as_deref(), "--restart-backoff", &[env::TRAINLET_RESTART_BACKOFF]),
        Duration::ZERO,
    )?;
    let kill_timeout = s.secs(
        "kill timeout",
        (args.kill_timeout.as_deref(), "--kill-timeout", &[env::TRAINLET_KILL_TIMEOUT]),
        DEFAULT_KILL_TIMEOUT,
    )?;
    let l =
        lookup(args.hung_timeout.as_deref(), "--hung-timeout", env, &[env::TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT]);
    let hung_timeout = match l.value {
        None => None,
        Some(_) => Some(parse_secs(&l, Duration::ZERO)?).filter(|d| !d.is_zero()),
    };
    s.prov.push((
        "hung timeout",
        hung_timeout.map_or_else(|| "off".to_string(), |d| format!("{d:?}")),
        l.source.clone(),
    ));

    let l = lookup(args.checkpoint_signal.as_deref(), "--checkpoint-signal", env, &[env::TRAINLET_CHECKPOINT_SIGNAL]);
    let checkpoint_signal = match l.value {
        None => None,
        Some(v) => Some(
            super::rules::parse_signal_name(v)
                .ok_or_else(|| invalid(&l.origin(), v, "a signal name such as SIGUSR1"))?,
        ),
    };
    let lt =
        lookup(args.checkpoint_timeout.as_deref(), "--checkpoint-timeout", env, &[env::TRAINLET_CHECKPOINT_TIMEOUT]);
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
        s.prov.push(("checkpoint", format!("{} then {checkpoint_timeout:?}", crate::sys::signal_name(sig)), l.source));
    }
    let l = lookup(args.policy.as_ref().and_then(|p| p.to_str()), "--policy", env, &[env::TRAINLET_POLICY]);
    // `TRAINLET_POLICY_IF_PRESENT` (the runtimes' optional ConfigMap) only
    // when neither names a file, and only when it exists: absent, the
    // default rules apply; any other failure to read it is `load`'s error.
    let (path, policy_source) = match l.value {
        Some(path) => (Some(path), l.source),
        None => match env.get(env::TRAINLET_POLICY_IF_PRESENT) {
            Some(path) if !std::fs::metadata(path).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound) => {
                (Some(path), Source::Env(env::TRAINLET_POLICY_IF_PRESENT))
            }
            _ => (None, l.source),
        },
    };
    let file_rules = match path {
        None => Vec::new(),
        Some(path) => crate::config::rules::Rules::load(std::path::Path::new(path))?,
    };
    let flag_rules =
        args.on_exit.iter().map(|r| crate::config::rules::Rules::parse_flag(r)).collect::<Result<Vec<_>, _>>()?;
    let rules = crate::config::rules::Rules::new(flag_rules, file_rules);
    s.prov.push(("failure policy", rules.describe(), policy_source));

    Ok(Timeouts {
        max_restarts,
        grace,
        stop_signals,
        restart_backoff,
        kill_timeout,
        hung_timeout,
        checkpoint_signal,
        checkpoint_timeout,
        rules,
    })
}
