//! Failure policy: what a worker's exit means for the job.
//!
//! Rules match a worker's exit code or the signal that killed it and say
//! `restart` (a retriable fault: the whole job restarts if the job-wide
//! budget allows), `fail` (fail the job now, whatever the budget) or
//! `ignore` (the worker is done; the others keep running, as after exit 0).
//! The first matching rule wins; with no match, exit 0 is `ignore` and
//! anything else is `restart` (torchrun's behaviour).
//!
//! A worker that stops reporting progress for `--progress-timeout` is
//! matched by the word `no-progress` (`--on-exit no-progress=fail`, or
//! `no_progress = true` in a file rule); with no match it is `restart`.
//!
//! Codes follow the shell convention: a code N >= 129 also matches death by
//! signal N-128, so `137` covers both `exit 137` and SIGKILL (OOM kill).
//!
//! Rules come from a TOML file (`--policy FILE`) and repeatable flags
//! (`--on-exit 3=fail`); flag rules are checked before file rules.
//!
//! ```toml
//! [[rule]]
//! exit_codes = [3]
//! action = "fail"
//!
//! [[rule]]
//! signals = ["SIGSEGV", "SIGKILL"]
//! action = "restart"
//! ```

use std::path::Path;

use serde::Deserialize;

use crate::sys::Exit;

/// What a matching exit does to the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RuleAction {
    /// Restart every pod's workers (counts against the job-wide budget).
    Restart,
    /// Fail the job now, without restarting.
    Fail,
    /// The worker is done; wait for the others.
    Ignore,
}

impl std::fmt::Display for RuleAction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RuleAction::Restart => "restart",
            RuleAction::Fail => "fail",
            RuleAction::Ignore => "ignore",
        })
    }
}

/// A policy file or flag that does not parse.
#[derive(Debug, thiserror::Error)]
pub enum RuleError {
    /// The policy file cannot be read.
    #[error("cannot read the failure policy file {path}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The policy file is not valid TOML or has unknown fields.
    #[error("invalid failure policy file {path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// What the parser said (line and column included).
        message: String,
    },
    /// A rule is malformed.
    #[error("invalid failure rule {rule:?}: {why}")]
    Rule {
        /// The rule as given.
        rule: String,
        /// What is wrong.
        why: String,
    },
}

/// One rule: exits it matches and what they mean.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    codes: Vec<i32>,
    signals: Vec<i32>,
    no_progress: bool,
    action: RuleAction,
    text: String,
}

impl Rule {
    fn matches(&self, exit: Exit) -> bool {
        match exit {
            Exit::Code(c) => self.codes.contains(&c),
            Exit::Signal(s) => self.signals.contains(&s) || self.codes.contains(&(128 + s)),
        }
    }
}

/// The ordered rule list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rules(Vec<Rule>);

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    rule: Vec<FileRule>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileRule {
    #[serde(default)]
    exit_codes: Vec<i32>,
    #[serde(default)]
    signals: Vec<String>,
    #[serde(default)]
    no_progress: bool,
    action: RuleAction,
}

/// A signal by name (`SIGSEGV`, `segv`) or number.
pub fn parse_signal_name(s: &str) -> Option<i32> {
    let s = s.trim();
    if let Ok(n) = s.parse::<i32>() {
        return (1..=64).contains(&n).then_some(n);
    }
    let upper = s.to_ascii_uppercase();
    let full = if upper.starts_with("SIG") { upper } else { format!("SIG{upper}") };
    full.parse::<nix::sys::signal::Signal>().ok().map(|sig| sig as i32)
}

impl Rules {
    /// What `exit` means: the first matching rule, else the default.
    pub fn action(&self, exit: Exit) -> RuleAction {
        self.0
            .iter()
            .find(|r| r.matches(exit))
            .map_or(if exit.success() { RuleAction::Ignore } else { RuleAction::Restart }, |r| r.action)
    }

    /// What a worker silent past `--progress-timeout` means: the first
    /// `no-progress` rule, else restart.
    pub fn no_progress_action(&self) -> RuleAction {
        self.0.iter().find(|r| r.no_progress).map_or(RuleAction::Restart, |r| r.action)
    }

    /// The rules as given, for `trainlet doctor`.
    pub fn describe(&self) -> String {
        if self.0.is_empty() {
            return "default (exit 0: wait for the rest; anything else: restart)".into();
        }
        self.0.iter().map(|r| r.text.as_str()).collect::<Vec<_>>().join("; ")
    }

    /// Parse one `--on-exit` flag: `CODES=ACTION`, where CODES is a comma
    /// list of exit codes and signal names, e.g. `3,4=fail`, `SIGSEGV=restart`.
    pub fn parse_flag(text: &str) -> Result<Rule, RuleError> {
        let bad = |why: &str| RuleError::Rule { rule: text.to_string(), why: why.to_string() };
        let (what, action) = text.rsplit_once('=').ok_or_else(|| bad("expected CODES=ACTION, e.g. 3=fail"))?;
        let action = match action.trim().to_ascii_lowercase().as_str() {
            "restart" => RuleAction::Restart,
            "fail" => RuleAction::Fail,
            "ignore" => RuleAction::Ignore,
            _ => return Err(bad("the action must be restart, fail or ignore")),
        };
        let (mut codes, mut signals, mut no_progress) = (Vec::new(), Vec::new(), false);
        for item in what.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            if matches!(item.to_ascii_lowercase().as_str(), "no-progress" | "no_progress") {
                no_progress = true;
            } else if let Ok(c) = item.parse::<i32>() {
                if !(0..=255).contains(&c) {
                    return Err(bad("exit codes are 0-255"));
                }
                codes.push(c);
            } else {
                signals.push(
                    parse_signal_name(item)
                        .ok_or_else(|| bad(&format!("{item} is neither an exit code nor a signal name")))?,
                );
            }
        }
        if codes.is_empty() && signals.is_empty() && !no_progress {
            return Err(bad("name at least one exit code, signal or no-progress"));
        }
        Ok(Rule { codes, signals, no_progress, action, text: text.trim().to_string() })
    }

    /// Read a TOML policy file (see the module docs for the format).
    pub fn load(path: &Path) -> Result<Vec<Rule>, RuleError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| RuleError::Read { path: shown.clone(), source })?;
        let file: File =
            toml::from_str(&text).map_err(|e| RuleError::Parse { path: shown.clone(), message: e.to_string() })?;
        let mut rules = Vec::new();
        for (i, r) in file.rule.into_iter().enumerate() {
            let mut text = format!("{shown} rule {}: ", i + 1);
            let mut items: Vec<String> = r.exit_codes.iter().map(i32::to_string).collect();
            items.extend(r.signals.iter().cloned());
            if r.no_progress {
                items.push("no-progress".into());
            }
            text.push_str(&format!("{}={}", items.join(","), r.action));
            let rule = Self::parse_flag(&format!("{}={}", items.join(","), r.action))
                .map_err(|e| RuleError::Rule { rule: text.clone(), why: e.to_string() })?;
            rules.push(Rule { text, ..rule });
        }
        Ok(rules)
    }

    /// Flag rules first, then file rules.
    pub fn new(flags: Vec<Rule>, file: Vec<Rule>) -> Self {
        Self(flags.into_iter().chain(file).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    fn rules(flags: &[&str]) -> Rules {
        Rules::new(flags.iter().map(|f| Rules::parse_flag(f).expect("rule")).collect(), Vec::new())
    }

    #[test_case(&[], Exit::Code(0), RuleAction::Ignore; "default success waits for the rest")]
    #[test_case(&[], Exit::Code(1), RuleAction::Restart; "default failure restarts")]
    #[test_case(&[], Exit::Signal(11), RuleAction::Restart; "default signal restarts")]
    #[test_case(&["3=fail"], Exit::Code(3), RuleAction::Fail; "code fails the job")]
    #[test_case(&["3=fail"], Exit::Code(4), RuleAction::Restart; "other codes keep the default")]
    #[test_case(&["137=fail"], Exit::Signal(9), RuleAction::Fail; "137 matches sigkill")]
    #[test_case(&["137=fail"], Exit::Code(137), RuleAction::Fail; "137 matches exit 137")]
    #[test_case(&["SIGSEGV=ignore"], Exit::Signal(11), RuleAction::Ignore; "signal by name")]
    #[test_case(&["segv=fail"], Exit::Signal(11), RuleAction::Fail; "short signal name")]
    #[test_case(&["SIGSEGV=fail"], Exit::Code(11), RuleAction::Restart; "a signal does not match the same code")]
    #[test_case(&["1=ignore", "1=fail"], Exit::Code(1), RuleAction::Ignore; "first match wins")]
    #[test_case(&["0=fail"], Exit::Code(0), RuleAction::Fail; "exit 0 can be a failure")]
    #[test_case(&["2,3,SIGABRT=fail"], Exit::Signal(6), RuleAction::Fail; "lists mix codes and signals")]
    fn actions(flags: &[&str], exit: Exit, want: RuleAction) {
        assert_eq!(rules(flags).action(exit), want);
    }

    #[test_case("3"; "no action")]
    #[test_case("3=explode"; "unknown action")]
    #[test_case("=fail"; "nothing matched")]
    #[test_case("SIGNOPE=fail"; "unknown signal")]
    #[test_case("300=fail"; "code out of range")]
    fn bad_flags_are_named(flag: &str) {
        let e = Rules::parse_flag(flag).expect_err("bad").to_string();
        assert!(e.contains(flag), "{e}");
    }

    #[test]
    fn file_rules_come_after_flag_rules() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("policy.toml");
        std::fs::write(&path, "[[rule]]\nexit_codes = [3]\naction = \"fail\"\n\n[[rule]]\nsignals = [\"SIGSEGV\"]\nexit_codes = [137]\naction = \"restart\"\n").expect("write");
        let file = Rules::load(&path).expect("load");
        let r = Rules::new(vec![Rules::parse_flag("3=ignore").expect("flag")], file);
        assert_eq!(r.action(Exit::Code(3)), RuleAction::Ignore);
        assert_eq!(r.action(Exit::Signal(9)), RuleAction::Restart);
        assert!(r.describe().contains("policy.toml rule 2"), "{}", r.describe());
    }

    #[test]
    fn unknown_fields_in_the_file_are_errors_with_a_position() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("policy.toml");
        std::fs::write(&path, "[[rule]]\nexit_code = [3]\naction = \"fail\"\n").expect("write");
        let e = Rules::load(&path).expect_err("unknown field").to_string();
        assert!(e.contains("exit_code") && e.contains("line 2"), "{e}");
    }

    #[test]
    fn no_progress_rules_from_flags_and_files() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("policy.toml");
        std::fs::write(&path, "[[rule]]\nno_progress = true\naction = \"fail\"\n").expect("write");
        let file = Rules::new(Vec::new(), Rules::load(&path).expect("load"));
        assert_eq!(file.no_progress_action(), RuleAction::Fail);
        assert_eq!(file.action(Exit::Code(1)), RuleAction::Restart, "it matches no exit");
        let flag = Rules::new(vec![Rules::parse_flag("No-Progress,3=ignore").expect("flag")], Vec::new());
        assert_eq!((flag.no_progress_action(), flag.action(Exit::Code(3))), (RuleAction::Ignore, RuleAction::Ignore));
        assert_eq!(Rules::default().no_progress_action(), RuleAction::Restart);
    }

    #[test]
    fn a_missing_file_is_named() {
        let e = Rules::load(Path::new("/nonexistent/policy.toml")).expect_err("missing").to_string();
        assert!(e.contains("/nonexistent/policy.toml"), "{e}");
    }
}
