//! `--checkpoint-dir` and `--min-shm`: what a pod checks of itself before
//! every round besides its GPUs (`crate::launch` leaves with 207 when a
//! check fails); `--stragglers`: whether it watches its workers for the
//! ranks the others wait for while they run, and `--evict-stragglers`:
//! how long one may be named before its pod leaves for a spare.

use std::path::PathBuf;

use super::Error;
use super::setting::{Settings, invalid, lookup, parse_secs};
use crate::cli::RunArgs;
use crate::env;

/// The pod's checks before every round, besides its GPUs'.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    /// Must be writable (made when missing).
    pub checkpoint_dir: Option<PathBuf>,
    /// /dev/shm must be at least this many bytes.
    pub min_shm: Option<u64>,
    /// Sample the workers' stacks and name stragglers (`--stragglers`).
    pub stragglers: bool,
    /// A pod whose rank has been named a straggler this long leaves with
    /// 207 for a spare (`--evict-stragglers`; None: never).
    pub evict_stragglers: Option<std::time::Duration>,
}

/// Resolve the health checks.
pub(super) fn resolve(args: &RunArgs, s: &mut Settings<'_>) -> Result<Health, Error> {
    let env = s.env;
    let l = lookup(args.checkpoint_dir.as_deref(), "--checkpoint-dir", env, &[env::TRAINLET_CHECKPOINT_DIR]);
    let checkpoint_dir = match l.value {
        Some(v) if v.trim().is_empty() => return Err(invalid(&l.origin(), v, "a directory")),
        Some(v) => {
            s.prov.push(("checkpoint dir", v.to_string(), l.source));
            Some(PathBuf::from(v))
        }
        None => None,
    };
    let l = lookup(args.min_shm.as_deref(), "--min-shm", env, &[env::TRAINLET_MIN_SHM]);
    let min_shm = match l.value {
        Some(v) => {
            let n = crate::store::parse_size(v).ok_or_else(|| invalid(&l.origin(), v, "a size, e.g. 512M or 8G"))?;
            s.prov.push(("min /dev/shm", v.to_string(), l.source));
            Some(n)
        }
        None => None,
    };
    let l = lookup(args.stragglers.as_deref(), "--stragglers", env, &[env::TRAINLET_STRAGGLERS]);
    let stragglers = match l.value.map(str::trim) {
        None | Some("on") => true,
        Some("off") => false,
        Some(v) => return Err(invalid(&l.origin(), v, "on or off")),
    };
    if let Some(v) = l.value {
        s.prov.push(("stragglers", v.trim().to_string(), l.source));
    }
    let l = lookup(args.evict_stragglers.as_deref(), "--evict-stragglers", env, &[env::TRAINLET_EVICT_STRAGGLERS]);
    let evict_stragglers = match l.value {
        None => None,
        Some(v) => {
            let after = parse_secs(&l, std::time::Duration::ZERO)?;
            if after.is_zero() {
                return Err(invalid(&l.origin(), v, "a number of seconds > 0 (leave it unset to evict no one)"));
            }
            if !stragglers {
                return Err(super::Error::Usage(
                    "--evict-stragglers evicts the ranks --stragglers names; it needs --stragglers on".into(),
                ));
            }
            s.prov.push(("evict stragglers after", format!("{} s", after.as_secs_f64()), l.source));
            Some(after)
        }
    };
    Ok(Health { checkpoint_dir, min_shm, stragglers, evict_stragglers })
}

impl Default for Health {
    fn default() -> Self {
        Health { checkpoint_dir: None, min_shm: None, stragglers: true, evict_stragglers: None }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::TorchrunCli;
    use clap::Parser;

    fn health(a: &[&str], env: &[(&str, &str)]) -> Result<Health, Error> {
        let args =
            TorchrunCli::try_parse_from(std::iter::once("torchrun").chain(a.iter().copied())).expect("parse").run;
        let env = env::Env::from_pairs(env.iter().copied());
        resolve(&args, &mut Settings::new(&env))
    }

    #[test]
    fn checkpoint_dir_and_min_shm_resolve_with_clear_errors() {
        assert_eq!(health(&["t.py"], &[]).expect("none"), Health::default());
        let h = health(&["--checkpoint-dir", "/ckpt", "--min-shm", "8G", "t.py"], &[]).expect("set");
        assert_eq!((h.checkpoint_dir, h.min_shm), (Some(PathBuf::from("/ckpt")), Some(8 << 30)));
        let h = health(&["t.py"], &[("TRAINLET_MIN_SHM", "512M")]).expect("env");
        assert_eq!(h.min_shm, Some(512 << 20));
        let e = health(&["--min-shm", "lots", "t.py"], &[]).expect_err("bad").to_string();
        assert!(e.contains("--min-shm") && e.contains("8G"), "{e}");
        assert!(!health(&["--stragglers", "off", "t.py"], &[]).expect("off").stragglers);
        assert!(!health(&["t.py"], &[("TRAINLET_STRAGGLERS", "off")]).expect("env off").stragglers);
        let e = health(&["--stragglers", "maybe", "t.py"], &[]).expect_err("bad").to_string();
        assert!(e.contains("--stragglers") && e.contains("on or off"), "{e}");
    }

    #[test]
    fn evicting_stragglers_takes_seconds_and_needs_them_named() {
        assert_eq!(health(&["t.py"], &[]).expect("none").evict_stragglers, None);
        let h = health(&["--evict-stragglers", "300", "t.py"], &[]).expect("set");
        assert_eq!(h.evict_stragglers, Some(std::time::Duration::from_secs(300)));
        let h = health(&["t.py"], &[("TRAINLET_EVICT_STRAGGLERS", "2.5")]).expect("env");
        assert_eq!(h.evict_stragglers, Some(std::time::Duration::from_millis(2500)));
        for bad in ["0", "-1", "soon"] {
            let e = health(&["--evict-stragglers", bad, "t.py"], &[]).expect_err(bad).to_string();
            assert!(e.contains("--evict-stragglers") && e.contains("seconds"), "{bad}: {e}");
        }
        let e = health(&["--stragglers", "off", "--evict-stragglers", "60", "t.py"], &[]).expect_err("off").to_string();
        assert!(e.contains("needs --stragglers on"), "{e}");
    }
}
