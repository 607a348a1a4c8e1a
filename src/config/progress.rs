//! Progress: where the job's progress goes (Trainer's status endpoint,
//! from the `TrainJobStatus` plugin's three variables) and how long a
//! worker may go without reporting any (`--progress-timeout`).

use std::path::PathBuf;
use std::time::Duration;

use super::setting::{Settings, invalid, lookup, parse_secs};
use super::{Error, Source};
use crate::cli::RunArgs;
use crate::env;

/// Trainer's status endpoint for this TrainJob.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    /// `https://<svc>.<ns>.svc:<port>/apis/trainer.kubeflow.org/v1alpha1/namespaces/<ns>/trainjobs/<name>/status`.
    pub url: String,
    /// The CA bundle its certificate must chain to.
    pub ca_file: PathBuf,
    /// The bearer token file, re-read before every POST (it rotates).
    pub token_file: PathBuf,
}

/// What the job does with its workers' progress.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Progress {
    /// Post the job's progress here (the store host only).
    pub upstream: Option<Upstream>,
    /// A worker that reported once and then stays silent this long is hung.
    pub timeout: Option<Duration>,
    /// Why reporting is off although some of Trainer's variables are set
    /// (the run warns; reporting never stops training).
    pub off_because: Option<String>,
}

impl Progress {
    /// Do workers get trainlet's status endpoint (and a heartbeat file)?
    pub fn collects(&self) -> bool {
        self.upstream.is_some() || self.timeout.is_some()
    }
}

/// The three `KUBEFLOW_TRAINER_SERVER_*` variables (all three, else no
/// reporting and a reason to warn) and the progress timeout (flag > env >
/// `--rdzv-conf progress_timeout`).
pub(super) fn resolve(args: &RunArgs, s: &mut Settings<'_>, conf: Option<Duration>) -> Result<Progress, Error> {
    let env = s.env;
    let mut off_because = None;
    let names =
        [env::KUBEFLOW_TRAINER_SERVER_URL, env::KUBEFLOW_TRAINER_SERVER_CA_CERT, env::KUBEFLOW_TRAINER_SERVER_TOKEN];
    let parts = names.map(|n| env.get(n));
    let upstream = match parts {
        [Some(url), Some(ca), Some(token)] => {
            let url = url.trim();
            if !(url.starts_with("https://") || url.starts_with("http://")) || url.contains(char::is_whitespace) {
                s.prov.push(("status endpoint", "off".into(), Source::Derived("not an https:// URL".into())));
                off_because = Some(format!(
                    "{} is not an https:// URL ({:?}), so progress is not reported",
                    env::KUBEFLOW_TRAINER_SERVER_URL,
                    url.chars().take(200).collect::<String>()
                ));
                None
            } else {
                s.prov.push(("status endpoint", url.to_string(), Source::Env(env::KUBEFLOW_TRAINER_SERVER_URL)));
                Some(Upstream { url: url.to_string(), ca_file: ca.into(), token_file: token.into() })
            }
        }
        [None, None, None] => None,
        _ => {
            let missing: Vec<&str> =
                names.into_iter().zip(parts).filter(|(_, v)| v.is_none()).map(|(n, _)| n).collect();
            let why = format!(
                "Trainer's status endpoint needs KUBEFLOW_TRAINER_SERVER_URL, _CA_CERT and _TOKEN together (as Trainer's TrainJobStatus plugin sets them); {} unset, so progress is not reported",
                missing.join(", ")
            );
            s.prov.push(("status endpoint", "off".into(), Source::Derived(format!("{} unset", missing.join(", ")))));
            off_because = Some(why);
            None
        }
    };
    let l = lookup(args.progress_timeout.as_deref(), "--progress-timeout", env, &[env::TRAINLET_PROGRESS_TIMEOUT]);
    let timeout = match (l.value, conf) {
        (None, Some(t)) => Some(t),
        (None, None) => None,
        (Some(_), _) => {
            let t = parse_secs(&l, Duration::ZERO)?;
            if t.is_zero() {
                return Err(invalid(&l.origin(), l.value.unwrap_or_default(), "a number of seconds > 0"));
            }
            Some(t)
        }
    };
    if let Some(t) = timeout {
        let source = if l.value.is_some() { l.source } else { Source::Derived("--rdzv-conf progress_timeout".into()) };
        s.prov.push(("progress timeout", format!("{t:?}"), source));
    }
    Ok(Progress { upstream, timeout, off_because })
}
