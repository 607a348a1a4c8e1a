//! `--in-place-restart`: trainlet as its pod's JobSet in-place restart
//! agent (`crate::inplace`), from the env JobSet's own agent reads.

use super::Error;
use super::setting::{Settings, flag_or_env, invalid, lookup};
use crate::cli::RunArgs;
use crate::env;

/// The in-place restart agent's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InPlace {
    /// The pod's JobSet (`JOBSET_NAME`).
    pub jobset: String,
    /// This pod (`POD_NAME`).
    pub pod: String,
    /// `POD_NAMESPACE`; `None`: the service account's namespace file.
    pub namespace: Option<String>,
    /// Exit code that asks the kubelet to restart the pod's containers.
    pub exit_code: u8,
}

/// Codes that mean something else to a runtime: success, stopped, and
/// those its `podFailurePolicy` ignores or fails the Job on.
const ROUTED: [u8; 6] = [0, 143, 200, 204, 205, 208];
/// JobSet's agent exits 1 unless told otherwise.
const DEFAULT_EXIT_CODE: u8 = 1;

pub(super) fn resolve(args: &RunArgs, s: &mut Settings<'_>) -> Result<Option<InPlace>, Error> {
    let env = s.env;
    let (on, src) = flag_or_env(args.in_place_restart, "--in-place-restart", env, env::TRAINLET_IN_PLACE_RESTART)?;
    if !on {
        return Ok(None);
    }
    let required = |name: &'static str, field: &str| -> Result<String, Error> {
        match env.get(name).map(str::trim) {
            Some(v) if !v.is_empty() => Ok(v.to_string()),
            _ => Err(Error::Usage(format!(
                "--in-place-restart: {name} is not set; give it with the downward API ({field})"
            ))),
        }
    };
    let jobset = required(env::JOBSET_NAME, "fieldRef metadata.annotations['jobset.sigs.k8s.io/jobset-name']")?;
    let pod = required(env::POD_NAME, "fieldRef metadata.name")?;
    let namespace = env.get(env::POD_NAMESPACE).map(str::trim).filter(|v| !v.is_empty()).map(str::to_string);
    let l = lookup(None, "IN_PLACE_RESTART_EXIT_CODE", env, &[env::IN_PLACE_RESTART_EXIT_CODE]);
    let exit_code = match l.value {
        None => DEFAULT_EXIT_CODE,
        Some(v) => v.trim().parse::<u8>().ok().filter(|c| !ROUTED.contains(c)).ok_or_else(|| {
            invalid(
                &l.origin(),
                v,
                "an exit code from 1 to 255 other than 143, 200, 204, 205 and 208 (the runtimes route those)",
            )
        })?,
    };
    s.prov.push(("in-place restart", format!("JobSet {jobset}, pod {pod}, exit code {exit_code}"), src));
    Ok(Some(InPlace { jobset, pod, namespace, exit_code }))
}
