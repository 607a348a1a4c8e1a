//! `--events on|off` (env `TRAINLET_EVENTS`): whether the pod writes its
//! verdicts as Kubernetes Events (`crate::events`). Default on: without an
//! API server or the permission, Events turn themselves off.

use super::Error;
use super::setting::{Settings, invalid, lookup};
use crate::cli::RunArgs;
use crate::env;

pub(super) fn resolve(args: &RunArgs, s: &mut Settings<'_>) -> Result<bool, Error> {
    let l = lookup(args.events.as_deref(), "--events", s.env, &[env::TRAINLET_EVENTS]);
    let on = match l.value.map(|v| v.trim().to_ascii_lowercase()).as_deref() {
        None => true,
        Some("on" | "1" | "true") => true,
        Some("off" | "0" | "false") => false,
        Some(_) => return Err(invalid(&l.origin(), l.value.unwrap_or_default(), "on or off")),
    };
    s.prov.push(("Kubernetes Events", if on { "on" } else { "off" }.to_string(), l.source));
    Ok(on)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::TorchrunCli;
    use crate::config::Env;
    use clap::Parser;
    use test_case::test_case;

    fn resolve_with(args: &[&str], env: &[(&str, &str)]) -> Result<bool, Error> {
        let cli = TorchrunCli::try_parse_from(["torchrun"].iter().chain(args).chain(&["t.py"])).expect("parse");
        let env = Env::from_pairs(env.iter().copied());
        resolve(&cli.run, &mut Settings::new(&env))
    }

    #[test_case(&[], &[], true; "on by default")]
    #[test_case(&["--events", "off"], &[], false; "flag off")]
    #[test_case(&["--events=on"], &[("TRAINLET_EVENTS", "off")], true; "the flag wins")]
    #[test_case(&[], &[("TRAINLET_EVENTS", "off")], false; "env off")]
    #[test_case(&[], &[("TRAINLET_EVENTS", "0")], false; "env 0")]
    #[test_case(&[], &[("TRAINLET_EVENTS", "On")], true; "any case")]
    fn events_flag_and_env(args: &[&str], env: &[(&str, &str)], want: bool) {
        assert_eq!(resolve_with(args, env).expect("valid"), want);
    }

    #[test]
    fn a_bad_value_names_its_origin() {
        let e = resolve_with(&[], &[("TRAINLET_EVENTS", "maybe")]).expect_err("invalid");
        assert_eq!(e.to_string(), "invalid TRAINLET_EVENTS value \"maybe\": expected on or off");
    }
}
