//! Workers' names and output: `--role`, the log directory, `--redirects`,
//! `--tee`, `--local-ranks-filter`, the line prefix template, and this
//! pod's name in reports.

use std::path::PathBuf;

use super::machine::Machine;
use super::setting::{Settings, invalid, lookup};
use super::{Error, Source};
use crate::cli::RunArgs;
use crate::env;

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

    pub(super) fn parse(origin: &str, v: &str) -> Result<Self, Error> {
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

/// Names and output of the workers, and this pod's name in reports.
#[derive(Debug, Clone)]
pub struct Output {
    /// `--role` (ROLE_NAME).
    pub role: String,
    /// Log directory given by the user (files are written for every rank).
    pub log_dir: Option<PathBuf>,
    /// Streams written to files only.
    pub redirects: Streams,
    /// Streams written to files and the console.
    pub tee: Streams,
    /// Local ranks shown on the console (None = all).
    pub console_ranks: Option<Vec<u32>>,
    /// Worker line prefix template.
    pub prefix_template: String,
    /// This pod's name for reports (`--local-addr`, else the hostname).
    pub host: String,
    /// `TRAINLET_TERMINATION_LOG`: where a failed job's one-line reason
    /// goes (None: `/dev/termination-log` when it exists).
    pub termination_log: Option<PathBuf>,
    /// `TORCHELASTIC_ERROR_FILE` in the agent's own environment: where a
    /// failed or stopped job's root cause goes, as torchrun's `@record`
    /// writes it (`crate::launch::error_file`).
    pub error_file: Option<PathBuf>,
}

/// Resolve the output settings.
pub(super) fn resolve(args: &RunArgs, s: &mut Settings<'_>, machine: &Machine) -> Result<Output, Error> {
    let env = s.env;
    let l = lookup(args.role.as_deref(), "--role", env, &[env::PET_ROLE]);
    let role = l.value.unwrap_or("default").to_string();
    s.prov.push(("role", role.clone(), l.source.clone()));

    let l = lookup(None, "--log-dir", env, &[env::PET_LOG_DIR]);
    let log_dir = args.log_dir.clone().or_else(|| l.value.map(PathBuf::from));
    if let Some(dir) = &log_dir {
        let source = if args.log_dir.is_some() { Source::Flag("--log-dir") } else { l.source.clone() };
        s.prov.push(("log dir", dir.display().to_string(), source));
    }
    let l = lookup(args.redirects.as_deref(), "--redirects", env, &[env::PET_REDIRECTS]);
    let redirects = l.value.map_or(Ok(Streams::default()), |v| Streams::parse(&l.origin(), v))?;
    s.prov.push(("redirects", l.value.unwrap_or("0").to_string(), l.source.clone()));
    let l = lookup(args.tee.as_deref(), "--tee", env, &[env::PET_TEE]);
    let tee = l.value.map_or(Ok(Streams::default()), |v| Streams::parse(&l.origin(), v))?;
    s.prov.push(("tee", l.value.unwrap_or("0").to_string(), l.source.clone()));
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
    s.prov.push(("console ranks", l.value.unwrap_or("all").to_string(), l.source.clone()));

    let l = lookup(
        args.log_line_prefix_template.as_deref(),
        "--log-line-prefix-template",
        env,
        &[env::TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE],
    );
    let prefix_template = l.value.unwrap_or("[${role_name}${local_rank}]:").to_string();
    s.prov.push(("line prefix", prefix_template.clone(), l.source.clone()));

    let l = lookup(args.local_addr.as_deref(), "--local-addr", env, &[env::PET_LOCAL_ADDR]);
    let host = l.value.map_or_else(|| machine.hostname.clone(), str::to_string);

    let source = if l.value.is_some() { l.source } else { Source::Derived("host name".into()) };
    s.prov.push(("host", host.clone(), source));
    let termination_log = env.get(env::TRAINLET_TERMINATION_LOG).map(PathBuf::from);
    let error_file = env.get(env::TORCHELASTIC_ERROR_FILE).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(path) = &error_file {
        s.prov.push(("error file", path.display().to_string(), Source::Env(env::TORCHELASTIC_ERROR_FILE)));
    }
    Ok(Output { role, log_dir, redirects, tee, console_ranks, prefix_template, host, termination_log, error_file })
}
