//! Setup steps of a serving job: pip installs, bash scripts and variables
//! every pod applies once, in order, before it takes part in a run or an
//! actor (`POST /v1/setup`). They are recorded in the agents' store
//! (`serve/setup`, sealed), so that a pod that joins later (a replacement,
//! an elastic scale-up) replays them first; declaring them again replays
//! only from the first changed step. pip installs go to
//! `<serve dir>/setup/site`, which every worker's `PYTHONPATH` (and its
//! `bin` the `PATH`) starts with; bash steps run in `<serve dir>/setup/work`.
//!
//! Only the steps may write what later runs import. Runs can write the
//! serve directory (they run as the agent's user), so what a pod applied
//! is kept in its agent's memory ([`Applied`]), with the manifest of the
//! two directories as the steps left them ([`super::manifest`]). Before
//! each run the pod takes it again; a difference (a run wrote there), or a
//! new agent process (its predecessor's runs may have), means fresh
//! directories and every step applied again. Pure but for those
//! directories and the store's key.

use std::collections::BTreeMap;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::manifest::Manifest;
use super::spec::{EXEC_ROOM, env_name_refused, exec_size, sha256_hex, shown};

/// Most steps.
const MAX_STEPS: usize = 256;
/// Most bytes of one step (a script, the pip arguments, the variables).
const MAX_STEP: usize = 256 * 1024;
/// Most bytes of one pip argument or one variable (`NAME=value`): what the
/// kernel lets one string of a command line or environment hold
/// (MAX_ARG_STRLEN, 32 pages, with its NUL byte).
const MAX_ARG: usize = 128 * 1024 - 1;

/// Most words of a pip step, and most variables of an env step (counted
/// while the body is parsed, so that a long list of short words cannot
/// grow to many times the body's size).
const MAX_STEP_WORDS: usize = 1024;

/// One setup step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", deny_unknown_fields)]
pub enum Step {
    /// `python -m pip install --target <site> --upgrade <args>`.
    Pip(#[serde(deserialize_with = "pip_words")] Vec<String>),
    /// `bash <file>`, the file holding the script.
    Bash(String),
    /// Variables for every later step and every worker.
    Env(#[serde(deserialize_with = "env_vars")] BTreeMap<String, String>),
}

fn pip_words<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    super::bounded::seq(d, MAX_STEP_WORDS, "words in a pip step")
}

fn env_vars<'de, D: serde::Deserializer<'de>>(d: D) -> Result<BTreeMap<String, String>, D::Error> {
    super::bounded::map(d, MAX_STEP_WORDS, "variables in an env step")
}

fn steps<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<Step>, D::Error> {
    super::bounded::seq(d, MAX_STEPS, "steps")
}

impl Step {
    /// The step in words, for logs and errors (cut, escaped).
    pub fn describe(&self) -> String {
        match self {
            Step::Pip(a) => format!("pip install {}", shown(&a.join(" "))),
            Step::Bash(s) => format!("bash -c {}", shown(s)),
            Step::Env(e) => format!("env {}", shown(&e.keys().cloned().collect::<Vec<_>>().join(","))),
        }
    }
}

/// `POST /v1/setup`'s body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Submit {
    /// The steps, in order.
    #[serde(deserialize_with = "steps")]
    pub steps: Vec<Step>,
}

/// Check a submission.
pub fn check(body: &[u8]) -> Result<Vec<Step>, String> {
    let s: Submit = serde_json::from_slice(body).map_err(|e| {
        format!("the body is not a valid setup: {e} (want {{\"steps\": [{{\"pip\": [...]}}, {{\"bash\": \"...\"}}, {{\"env\": {{...}}}}]}})")
    })?;
    if s.steps.len() > MAX_STEPS {
        return Err(format!("steps: {} steps, at most {MAX_STEPS}", s.steps.len()));
    }
    for (i, step) in s.steps.iter().enumerate() {
        let size = serde_json::to_vec(step).map_or(usize::MAX, |v| v.len());
        if size > MAX_STEP {
            return Err(format!("steps[{i}]: {size} bytes, at most {MAX_STEP}"));
        }
        let words: Vec<&str> = match step {
            Step::Pip(a) if a.is_empty() => return Err(format!("steps[{i}]: pip needs what to install")),
            Step::Pip(a) => a.iter().map(String::as_str).collect(),
            Step::Bash(s) => vec![s.as_str()],
            Step::Env(e) => {
                if let Some(why) = e.keys().find_map(|k| env_name_refused(k)) {
                    return Err(format!("steps[{i}]: {why}"));
                }
                e.values().map(String::as_str).collect()
            }
        };
        if words.iter().any(|w| w.contains('\0')) {
            return Err(format!("steps[{i}]: holds a NUL byte"));
        }
        let longest = match step {
            Step::Pip(a) => a.iter().map(String::len).max(),
            Step::Env(e) => e.iter().map(|(k, v)| k.len() + 1 + v.len()).max(),
            Step::Bash(_) => None,
        };
        if let Some(n) = longest.filter(|n| *n > MAX_ARG) {
            return Err(format!(
                "steps[{i}]: an argument or variable of {n} bytes, at most {MAX_ARG} (what one string of a command line or environment may hold); put it in a file"
            ));
        }
    }
    exec_fits(&s.steps)?;
    Ok(s.steps)
}

/// Whether the steps' variables (every env step, a later value replacing
/// an earlier one, as workers get them), with the longest pip step's
/// arguments, fit their share of a worker's or a step's `execve`
/// ([`EXEC_ROOM`]): past it, every run would fail to start (E2BIG, issue 53).
fn exec_fits(steps: &[Step]) -> Result<(), String> {
    let mut vars: BTreeMap<&str, usize> = BTreeMap::new();
    for s in steps {
        if let Step::Env(e) = s {
            vars.extend(e.iter().map(|(k, v)| (k.as_str(), k.len() + 1 + v.len())));
        }
    }
    let env = exec_size(vars.values().copied());
    let (pip, args) = steps
        .iter()
        .enumerate()
        .filter_map(|(i, s)| match s {
            Step::Pip(a) => Some((i, exec_size(a.iter().map(String::len)))),
            _ => None,
        })
        .max_by_key(|(_, n)| *n)
        .unwrap_or((0, 0));
    let all = env.saturating_add(args);
    if all > EXEC_ROOM {
        let with = if args > 0 { format!(" and steps[{pip}]'s pip arguments ({args} bytes)") } else { String::new() };
        return Err(format!(
            "steps: the env steps' variables ({env} bytes){with} take {all} bytes of a worker's command line and environment (each string with its NUL and pointer), at most {EXEC_ROOM} (the kernel's ARG_MAX is 2 MiB with an 8 MiB stack, shared with the pod's own variables and the run's); put large values in a file"
        ));
    }
    Ok(())
}

/// Record the steps of `body` (sealed) for every pod; how many. Err((true,
/// why)) for a bad body, Err((false, why)) when they cannot be recorded.
pub async fn declare(
    link: &mut super::Link,
    token_file: &Path,
    scope: &super::Scope,
    body: &[u8],
) -> Result<usize, (bool, String)> {
    let steps = check(body).map_err(|why| (true, why))?;
    let token = super::read_token(token_file)
        .map_err(|e| (false, format!("cannot read the control token to sign the setup: {e}")))?;
    let json = serde_json::to_vec(&steps).unwrap_or_default();
    let key = link.keys.setup();
    link.set(&key, &super::seal(&token, scope, super::kind::SETUP, 0, &json))
        .await
        .map_err(|e| (false, format!("cannot record the setup: {}", crate::error::error_chain(&e))))?;
    tracing::info!(steps = steps.len(), "setup steps declared; every pod applies them before its next run");
    Ok(steps.len())
}

/// The steps declared (none when none were).
pub async fn declared(link: &mut super::Link, token_file: &Path, scope: &super::Scope) -> Result<Vec<Step>, String> {
    let token = super::read_token(token_file).unwrap_or_default();
    match link.setup(&token, scope).await {
        Ok(Some(Ok(steps))) => Ok(steps),
        Ok(None) => Ok(Vec::new()),
        Ok(Some(Err(why))) => Err(why),
        Err(e) => Err(crate::error::error_chain(&e)),
    }
}

/// The digest of each step with all before it: equal digests, equal prefixes.
pub fn chain(steps: &[Step]) -> Vec<String> {
    let mut out = Vec::with_capacity(steps.len());
    let mut prev = String::new();
    for s in steps {
        let json = serde_json::to_string(s).unwrap_or_default();
        prev = sha256_hex(format!("{prev}\n{json}").as_bytes());
        out.push(prev.clone());
    }
    out
}

/// The first step this pod has not applied (`steps.len()` when none).
pub fn first_to_apply(steps: &[Step], applied: &[String]) -> usize {
    chain(steps).iter().zip(applied).take_while(|(a, b)| a == b).count()
}

/// What this agent applied on its pod: in memory only, since runs can
/// write the serve directory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Applied {
    /// The chain of the steps applied.
    pub chain: Vec<String>,
    /// What the steps left in their directories (None: never taken by
    /// this agent).
    pub left: Option<Manifest>,
}

/// Where a pod keeps its setup.
#[derive(Debug, Clone)]
pub struct Dirs {
    /// `<serve dir>/setup`.
    pub root: PathBuf,
}

impl Dirs {
    /// Under the serve directory `dir`.
    pub fn new(dir: &Path) -> Self {
        Self { root: dir.join("setup") }
    }

    /// pip's `--target`.
    pub fn site(&self) -> PathBuf {
        self.root.join("site")
    }

    /// The file a bash step runs from.
    pub fn script(&self) -> PathBuf {
        self.root.join("step.sh")
    }

    /// The steps' working directory.
    pub fn work(&self) -> PathBuf {
        self.root.join("work")
    }

    /// What is in the site and work directories now ([`Manifest`]), and
    /// what differs from `was`.
    pub fn manifest(&self, was: Option<&Manifest>) -> std::io::Result<(Manifest, Vec<String>)> {
        Manifest::take(&self.root, &[self.site(), self.work()], was)
    }

    /// Start the site and work directories afresh: moved aside (whatever
    /// a run did to what is inside, a rename of each works), then removed
    /// with every earlier leftover, as far as they can be (what cannot is
    /// logged). `root` is made a plain directory again if a run made it
    /// something else (a symbolic link to elsewhere).
    pub fn wipe(&self) -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        match std::fs::symlink_metadata(&self.root) {
            Ok(m) if !m.is_dir() => std::fs::remove_file(&self.root)?,
            _ => {}
        }
        std::fs::create_dir_all(&self.root)?;
        // A run's chmod of the root would stop the renames below.
        std::fs::set_permissions(&self.root, std::fs::Permissions::from_mode(0o700))?;
        for d in [self.site(), self.work()] {
            let aside = self.root.join(format!("old-{:016x}", crate::sys::random_u64()));
            match std::fs::rename(&d, &aside) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        // Removed beside what follows: a run may have left millions of
        // entries there, and nothing waits on their removal.
        let old: Vec<PathBuf> = std::fs::read_dir(&self.root)?
            .flatten()
            .filter(|e| e.file_name().as_bytes().starts_with(b"old-"))
            .map(|e| e.path())
            .collect();
        std::thread::spawn(move || {
            for dir in old {
                if let Err(err) = std::fs::remove_dir_all(&dir) {
                    tracing::warn!(dir = %dir.display(), error = %err, "cannot remove the setup steps' old directories");
                }
            }
        });
        Ok(())
    }

    /// The variables every worker (and every step) gets from `steps`:
    /// `PYTHONPATH` and `PATH` led by the site directory, then the env steps.
    pub fn env(&self, steps: &[Step], path: &str, pythonpath: &str) -> Vec<(String, String)> {
        let site = self.site().display().to_string();
        let join = |first: String, rest: &str| if rest.is_empty() { first } else { format!("{first}:{rest}") };
        let mut env = vec![
            ("PYTHONPATH".to_string(), join(site.clone(), pythonpath)),
            ("PATH".into(), join(format!("{site}/bin"), path)),
        ];
        for s in steps {
            if let Step::Env(e) = s {
                for (k, v) in e {
                    env.retain(|(n, _)| n != k);
                    env.push((k.clone(), v.clone()));
                }
            }
        }
        env
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_steps_from_the_first_changed_one_are_applied_again() {
        let a = Step::Pip(vec!["datasets==3.0".into()]);
        let b = Step::Bash("echo hi > x".into());
        let c = Step::Env(BTreeMap::from([("HF_HOME".to_string(), "/cache".to_string())]));
        let applied = chain(&[a.clone(), b.clone()]);
        assert_eq!(first_to_apply(&[a.clone(), b.clone()], &applied), 2, "nothing new");
        assert_eq!(first_to_apply(&[a.clone(), b.clone(), c.clone()], &applied), 2, "only the added step");
        assert_eq!(first_to_apply(&[a.clone(), c.clone(), b.clone()], &applied), 1, "from the changed one on");
        assert_eq!(first_to_apply(&[b.clone(), a.clone()], &applied), 0);
        assert_eq!(first_to_apply(&[a, b], &[]), 0, "a new pod applies all");
        let d = Dirs::new(Path::new("/s"));
        let env = d.env(&[c], "/usr/bin", "");
        assert_eq!(env[0], ("PYTHONPATH".into(), "/s/setup/site".into()));
        assert_eq!(env[1], ("PATH".into(), "/s/setup/site/bin:/usr/bin".into()));
        assert_eq!(env[2], ("HF_HOME".into(), "/cache".into()));
    }

    #[test]
    fn a_wipe_starts_afresh_whatever_a_run_did_to_the_directories() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().expect("tmp");
        let d = Dirs::new(tmp.path());
        let (empty, _) = d.manifest(None).expect("manifest");
        std::fs::create_dir_all(d.site().join("locked/inner")).expect("site");
        std::fs::create_dir_all(d.work()).expect("work");
        std::fs::set_permissions(d.site().join("locked"), std::fs::Permissions::from_mode(0o000)).expect("chmod");
        d.wipe().expect("wipe");
        assert_eq!(d.manifest(None).expect("manifest").0, empty, "as before any step");
        // The root made a link to elsewhere: a plain directory again.
        let elsewhere = tmp.path().join("elsewhere");
        std::fs::create_dir_all(&elsewhere).expect("elsewhere");
        std::fs::remove_dir_all(&d.root).expect("rm");
        std::os::unix::fs::symlink(&elsewhere, &d.root).expect("link");
        d.wipe().expect("wipe");
        assert!(std::fs::symlink_metadata(&d.root).expect("root").is_dir());
    }

    #[test]
    fn bad_setups_name_the_step() {
        for (body, want) in [
            (r#"{"steps": [{"pip": []}]}"#, "steps[0]: pip needs"),
            (r#"{"steps": [{"env": {"RANK": "1"}}]}"#, "RANK is set by trainlet"),
            (r#"{"steps": [{"env": {"A B": "1"}}]}"#, "not a variable name"),
            (r#"{"steps": [{"run": "x"}]}"#, "not a valid setup"),
            (&format!(r#"{{"steps": [{{"env": {{"A": "{}"}}}}]}}"#, "x".repeat(MAX_ARG)), "at most 131071"),
            (&format!(r#"{{"steps": [{{"pip": ["{}"]}}]}}"#, "x".repeat(MAX_ARG + 1)), "at most 131071"),
        ] {
            let e = check(body.as_bytes()).expect_err(body);
            assert!(e.contains(want), "{body}: {e}");
        }
        assert_eq!(check(br#"{"steps": [{"bash": "true"}]}"#).expect("ok"), [Step::Bash("true".into())]);
    }

    /// Issue 53: 13 env steps of 25 variables of 120 KiB each (2.9 MiB)
    /// were taken, and every later run failed E2BIG. The steps' variables
    /// are counted as workers get them (a later value replaces an earlier
    /// one), with the longest pip step's arguments.
    #[test]
    fn steps_that_would_not_fit_a_workers_exec_are_refused() {
        let value = "x".repeat(120 * 1024);
        let step = |from: usize, n: usize| {
            let vars: Vec<String> = (from..from + n).map(|k| format!(r#""V{k}": "{value}""#)).collect();
            format!(r#"{{"env": {{{}}}}}"#, vars.join(", "))
        };
        let steps = |list: Vec<String>| format!(r#"{{"steps": [{}]}}"#, list.join(", "));
        // Two variables a step (a step holds at most 256 KiB).
        let vars = |from: usize, n: usize| -> Vec<String> {
            (from..from + n).step_by(2).map(|k| step(k, (from + n - k).min(2))).collect()
        };
        let attack = steps(vars(0, 25));
        let e = check(attack.as_bytes()).expect_err("2.9 MiB of variables");
        assert!(e.contains("at most 786432") && e.contains("put large values in a file"), "{e}");
        // Six variables fit; the same six set again in later steps still do.
        let six = steps([vars(0, 6), vars(0, 6)].concat());
        assert_eq!(check(six.as_bytes()).expect("they fit").len(), 6);
        assert!(check(steps(vars(0, 7)).as_bytes()).is_err(), "seven are 840 KiB");
        // A pip step's arguments count with the variables.
        let arg = "y".repeat(100 * 1024);
        let pip = format!(r#"{{"pip": ["{arg}", "{arg}"]}}"#);
        let e = check(steps([vars(0, 5), vec![pip]].concat()).as_bytes()).expect_err("env and pip");
        assert!(e.contains("steps[3]'s pip arguments (204818 bytes)"), "{e}");
    }
}
