//! One setting looked up with CLI > env > default precedence, parsed, and
//! named in errors by where it came from; [`Provenance`] collects what
//! `trainlet doctor` prints for every value.

use std::time::Duration;

use super::{Error, Source};
use crate::env::Env;

/// (setting, value, where it came from), in the order doctor prints them.
pub(super) type Provenance = Vec<(&'static str, String, Source)>;

/// One resolution's settings: where they are looked up (CLI > `env` >
/// default) and what doctor will print of them. [`Settings::secs`] and
/// [`Settings::count`] do lookup, parse and record in one call; settings
/// with more to them use [`lookup`] and record themselves.
#[derive(Debug)]
pub(super) struct Settings<'a> {
    /// The environment resolution reads.
    pub env: &'a Env,
    /// What doctor prints.
    pub prov: Provenance,
}

impl<'a> Settings<'a> {
    /// No setting read yet.
    pub fn new(env: &'a Env) -> Self {
        Self { env, prov: Vec::new() }
    }

    /// A number of seconds >= 0 (`default` when unset), recorded as `name`.
    pub fn secs(
        &mut self,
        name: &'static str,
        (cli, flag, names): (Option<&str>, &'static str, &[&'static str]),
        default: Duration,
    ) -> Result<Duration, Error> {
        let l = lookup(cli, flag, self.env, names);
        let v = parse_secs(&l, default)?;
        self.prov.push((name, format!("{v:?}"), l.source));
        Ok(v)
    }

    /// A count >= 0 (`default` when unset), recorded as `name`; `expected`
    /// says what a bad value should have been.
    pub fn count(
        &mut self,
        name: &'static str,
        (cli, flag, names): (Option<&str>, &'static str, &[&'static str]),
        default: u32,
        expected: &str,
    ) -> Result<u32, Error> {
        let l = lookup(cli, flag, self.env, names);
        let v = parse_u32(&l, default, expected)?;
        self.prov.push((name, v.to_string(), l.source));
        Ok(v)
    }
}

pub(super) fn invalid(origin: &str, value: &str, expected: &str) -> Error {
    Error::Invalid { origin: origin.to_string(), value: value.to_string(), expected: expected.to_string() }
}

/// One setting looked up with CLI > env > default precedence.
pub(super) struct Lookup<'a> {
    pub value: Option<&'a str>,
    pub source: Source,
}

impl Lookup<'_> {
    pub fn origin(&self) -> String {
        match &self.source {
            Source::Flag(n) => n.to_string(),
            Source::Env(n) => n.to_string(),
            Source::Default | Source::Derived(_) => "default".to_string(),
        }
    }
}

pub(super) fn lookup<'a>(cli: Option<&'a str>, flag: &'static str, env: &'a Env, names: &[&'static str]) -> Lookup<'a> {
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

pub(super) fn flag_or_env(
    cli: bool,
    flag: &'static str,
    env: &Env,
    name: &'static str,
) -> Result<(bool, Source), Error> {
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

/// `--store-memory` (else TRAINLET_STORE_MEMORY): a size of at least
/// [`crate::store::MIN_BUDGET`], or `default` (sized from the container's
/// memory limit by the caller); with where it came from. `trainlet run` and
/// `trainlet store` both read it here.
pub fn store_memory(cli: Option<&str>, env: &Env, default: u64) -> Result<(u64, Source), Error> {
    let l = lookup(cli, "--store-memory", env, &[crate::env::TRAINLET_STORE_MEMORY]);
    let Some(v) = l.value else { return Ok((default, l.source)) };
    let n = crate::store::parse_size(v)
        .filter(|n| *n >= crate::store::MIN_BUDGET)
        .ok_or_else(|| invalid(&l.origin(), v, "a size of at least 64M, e.g. 512M or 2G"))?;
    Ok((n, l.source))
}

pub(super) fn parse_u32(l: &Lookup<'_>, default: u32, expected: &str) -> Result<u32, Error> {
    l.value.map_or(Ok(default), |v| v.trim().parse::<u32>().map_err(|_| invalid(&l.origin(), v, expected)))
}

pub(super) fn parse_secs(l: &Lookup<'_>, default: Duration) -> Result<Duration, Error> {
    l.value.map_or(Ok(default), |v| {
        v.trim()
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s >= 0.0)
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
            .ok_or_else(|| invalid(&l.origin(), v, "a number of seconds >= 0"))
    })
}

/// A TCP port 1-65535; a bad one is an error naming `origin` (the flag or
/// variable it came from).
pub fn parse_port(origin: &str, v: &str) -> Result<u16, Error> {
    v.trim().parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(|| invalid(origin, v, "a TCP port 1-65535"))
}

/// A TCP port 0-65535, 0 meaning a free port picked when the store binds
/// (torchrun's `--rdzv-endpoint=localhost:0`); whether 0 can work is the
/// caller's to check.
pub(super) fn parse_port_or_free(origin: &str, v: &str) -> Result<u16, Error> {
    v.trim().parse::<u16>().map_err(|_| invalid(origin, v, "a TCP port 1-65535, or 0 for a free port"))
}
