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
//! is kept in its agent's memory ([`Applied`]), with a digest of the two
//! directories as the steps left them ([`Dirs::digest`]: every entry's
//! name, type, mode, size, inode and change time, which no write, rename
//! or chmod leaves unchanged). Before each run the pod takes the digest
//! again; a difference (a run wrote there), or a new agent process (its
//! predecessor's runs may have), means fresh directories and every step
//! applied again. Pure but for those directories and the store's key.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::spec::{env_name_refused, sha256_hex, shown};

/// Most steps.
const MAX_STEPS: usize = 256;
/// Most bytes of one step (a script, the pip arguments, the variables).
pub const MAX_STEP: usize = 256 * 1024;
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
    Ok(s.steps)
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
    /// [`Dirs::digest`] as the steps left the directories (None: never
    /// taken by this agent).
    pub left: Option<String>,
}

/// Most entries [`Dirs::digest`] reads (a pip install of torch is about
/// 20,000): more, and the directories are taken as changed.
const MAX_ENTRIES: usize = 1_000_000;
/// Most entries of one directory it reads (the names are held to be sorted).
const MAX_DIR_ENTRIES: usize = 100_000;

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

    /// A digest of the site and work directories: every entry's path,
    /// type, mode, size, inode and change time, in name order. Err when
    /// one cannot be read or there are more than the bounds allow.
    pub fn digest(&self) -> std::io::Result<String> {
        use std::os::unix::ffi::OsStrExt;
        use std::os::unix::fs::MetadataExt;
        let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
        let mut seen = 0usize;
        for top in [self.site(), self.work()] {
            let mut todo = vec![top];
            while let Some(dir) = todo.pop() {
                let meta = match std::fs::symlink_metadata(&dir) {
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        ctx.update(b"absent\0");
                        ctx.update(dir.as_os_str().as_bytes());
                        continue;
                    }
                    m => m?,
                };
                let mut entries = Vec::new();
                let line = |path: &Path, m: &std::fs::Metadata| {
                    format!(
                        "{}\0{:o} {} {} {}.{}\n",
                        path.display(),
                        m.mode(),
                        m.size(),
                        m.ino(),
                        m.ctime(),
                        m.ctime_nsec()
                    )
                };
                ctx.update(line(&dir, &meta).as_bytes());
                if !meta.is_dir() {
                    continue;
                }
                for e in std::fs::read_dir(&dir)? {
                    entries.push(e?.file_name());
                    if entries.len() > MAX_DIR_ENTRIES {
                        return Err(std::io::Error::other(format!(
                            "{} holds over {MAX_DIR_ENTRIES} entries",
                            dir.display()
                        )));
                    }
                }
                seen += entries.len();
                if seen > MAX_ENTRIES {
                    return Err(std::io::Error::other(format!("over {MAX_ENTRIES} entries")));
                }
                entries.sort();
                for name in entries.into_iter().rev() {
                    todo.push(dir.join(name));
                }
            }
        }
        Ok(data_encoding::HEXLOWER.encode(ctx.finish().as_ref()))
    }

    /// Remove the site and work directories (what the steps wrote).
    pub fn wipe(&self) -> std::io::Result<()> {
        for d in [self.site(), self.work()] {
            match std::fs::remove_dir_all(&d) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
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
    fn any_write_to_the_steps_directories_changes_their_digest() {
        let tmp = tempfile::tempdir().expect("tmp");
        let d = Dirs::new(tmp.path());
        let empty = d.digest().expect("digest");
        std::fs::create_dir_all(d.site().join("pkg")).expect("site");
        std::fs::create_dir_all(d.work()).expect("work");
        std::fs::write(d.site().join("pkg/__init__.py"), "x = 1\n").expect("write");
        let made = d.digest().expect("digest");
        assert_ne!(empty, made);
        assert_eq!(made, d.digest().expect("digest"), "nothing changed, the same digest");
        let changes: [&dyn Fn(); 4] = [
            &|| std::fs::write(d.site().join("pkg/__init__.py"), "x = 2\n").expect("rewrite, same size"),
            &|| std::fs::write(d.site().join("sitecustomize.py"), "").expect("a new file"),
            &|| std::fs::write(d.work().join("helper.sh"), "").expect("a file in work"),
            &|| {
                use std::os::unix::fs::PermissionsExt;
                let p = d.site().join("pkg");
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o777)).expect("chmod");
            },
        ];
        let mut last = made;
        for change in changes {
            // File times tick with the kernel's coarse clock (4 ms at HZ=250):
            // a run's write comes long after the steps' last one; here, wait.
            std::thread::sleep(std::time::Duration::from_millis(15));
            change();
            let now = d.digest().expect("digest");
            assert_ne!(now, last, "a change went unseen");
            last = now;
        }
        d.wipe().expect("wipe");
        assert_eq!(d.digest().expect("digest"), empty, "wiped: as before any step");
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
}
