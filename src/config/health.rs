//! `--checkpoint-dir` and `--min-shm`: what a pod checks of itself before
//! every round besides its GPUs (`crate::launch` leaves with 207 when a
//! check fails); `--stragglers`: whether it watches its workers for the
//! ranks the others wait for while they run.

use std::path::PathBuf;

use super::Error;
use super::setting::{Settings, invalid, lookup};
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
    Ok(Health { checkpoint_dir, min_shm, stragglers })
}

impl Default for Health {
    fn default() -> Self {
        Health { checkpoint_dir: None, min_shm: None, stragglers: true }
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
}
