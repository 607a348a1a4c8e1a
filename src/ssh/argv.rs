//! ssh(1) command lines as MPI launchers write them (reference/mpi.md 1.2,
//! 2, 3 and 8.2): options first, then `[user@]host`, then the command words
//! joined with single spaces and never re-quoted. Pure: no I/O.
//!
//! Unknown `-o` keys are accepted and ignored (launchers pass `LogLevel`,
//! `BatchMode`, ...); options that only make sense for an interactive or
//! forwarding session are accepted and have no effect, since this client
//! only ever runs one `exec`.

use std::path::PathBuf;
use std::time::Duration;

/// A bad ssh command line.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ArgvError {
    /// An option that takes a value came last.
    #[error("option requires an argument -- {0}")]
    MissingValue(char),
    /// A flag ssh(1) does not have.
    #[error("unknown option -- {0}")]
    Unknown(char),
    /// No destination was given.
    #[error("no destination host given")]
    NoHost,
    /// A number that is not one.
    #[error("bad value {value:?} for {what}")]
    BadValue {
        /// Which option.
        what: &'static str,
        /// What was given.
        value: String,
    },
}

/// Host key checking, as `StrictHostKeyChecking`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostKeyCheck {
    /// Only pinned keys (the default; `yes`, `ask`, `accept-new` too, since
    /// this client never writes a known_hosts file).
    Strict,
    /// Any host key (`no` or `off`): for foreign servers only.
    Off,
}

impl HostKeyCheck {
    /// A `StrictHostKeyChecking` value (also TRAINLET_SSH_HOST_KEY_CHECKING):
    /// `no`, `off` or `false` turn pinning off; anything else keeps it.
    pub fn from_setting(value: &str) -> Self {
        match value.trim().to_ascii_lowercase().as_str() {
            "no" | "off" | "false" => HostKeyCheck::Off,
            _ => HostKeyCheck::Strict,
        }
    }
}

/// One parsed ssh command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SshArgs {
    /// Login name (`-l`, `user@`, `-o User=`).
    pub user: Option<String>,
    /// Destination host.
    pub host: String,
    /// Port (`-p`, `-o Port=`, `ssh://host:port`).
    pub port: Option<u16>,
    /// Identity files in the order given (`-i`, `-o IdentityFile=`).
    pub identities: Vec<PathBuf>,
    /// `-o StrictHostKeyChecking=`.
    pub host_key_check: Option<HostKeyCheck>,
    /// `-o UserKnownHostsFile=` (first file).
    pub known_hosts: Option<PathBuf>,
    /// `-o ConnectionAttempts=`.
    pub attempts: Option<u32>,
    /// `-o ConnectTimeout=` (per attempt).
    pub connect_timeout: Option<Duration>,
    /// `-n`: stdin from /dev/null.
    pub no_stdin: bool,
    /// `-q`: quiet.
    pub quiet: bool,
    /// `-v` count.
    pub verbose: u8,
    /// `-V`: print the version and exit (no host needed).
    pub version: bool,
    /// The remote command: the words after the host joined with one space.
    pub command: String,
}

/// Options that take a value (ssh 9.2 getopt string).
const VALUED: &str = "BbcDEeFIiJLlmOopQRSWw";
/// Options that are flags.
const FLAGS: &str = "46AaCfGgKkMNnqsTtVvXxYy";

/// Parse `args` (without argv[0]).
pub fn parse(args: &[String]) -> Result<SshArgs, ArgvError> {
    let mut out = SshArgs {
        user: None,
        host: String::new(),
        port: None,
        identities: Vec::new(),
        host_key_check: None,
        known_hosts: None,
        attempts: None,
        connect_timeout: None,
        no_stdin: false,
        quiet: false,
        verbose: 0,
        version: false,
        command: String::new(),
    };
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        if a == "--" {
            i += 1;
            break;
        }
        if !a.starts_with('-') || a == "-" {
            break;
        }
        for (at, c) in a[1..].char_indices() {
            if VALUED.contains(c) {
                let rest = &a[1 + at + c.len_utf8()..];
                let value = if rest.is_empty() {
                    i += 1;
                    args.get(i).cloned().ok_or(ArgvError::MissingValue(c))?
                } else {
                    rest.to_string()
                };
                apply_valued(&mut out, c, &value)?;
                break;
            }
            if !FLAGS.contains(c) {
                return Err(ArgvError::Unknown(c));
            }
            match c {
                'n' => out.no_stdin = true,
                'q' => out.quiet = true,
                'v' => out.verbose = out.verbose.saturating_add(1),
                'V' => out.version = true,
                _ => {}
            }
        }
        i += 1;
    }
    if out.version {
        return Ok(out);
    }
    let dest = args.get(i).ok_or(ArgvError::NoHost)?;
    destination(&mut out, dest)?;
    out.command = args[i + 1..].join(" ");
    Ok(out)
}

fn destination(out: &mut SshArgs, dest: &str) -> Result<(), ArgvError> {
    let (user, hostport, uri) = match dest.strip_prefix("ssh://") {
        Some(rest) => match rest.rsplit_once('@') {
            Some((u, h)) => (Some(u), h, true),
            None => (None, rest, true),
        },
        None => match dest.rsplit_once('@') {
            Some((u, h)) => (Some(u), h, false),
            None => (None, dest, false),
        },
    };
    let mut host = hostport.to_string();
    if uri {
        let hp = hostport.trim_end_matches('/');
        let (h, p) = match hp.strip_prefix('[') {
            Some(v6) => match v6.split_once(']') {
                Some((h, rest)) => (h, rest.strip_prefix(':')),
                None => (hp, None),
            },
            None => match hp.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (hp, None),
            },
        };
        host = h.to_string();
        if let Some(p) = p {
            out.port = Some(number(p, "port")?);
        }
    }
    if host.is_empty() {
        return Err(ArgvError::NoHost);
    }
    out.host = host;
    // As ssh(1): the first -l / -o User wins; user@ only fills in.
    if out.user.is_none()
        && let Some(u) = user.filter(|u| !u.is_empty())
    {
        out.user = Some(u.to_string());
    }
    Ok(())
}

fn number<T: std::str::FromStr>(value: &str, what: &'static str) -> Result<T, ArgvError> {
    value.trim().parse().map_err(|_| ArgvError::BadValue { what, value: value.to_string() })
}

fn apply_valued(out: &mut SshArgs, flag: char, value: &str) -> Result<(), ArgvError> {
    match flag {
        'p' => out.port = Some(number(value, "port")?),
        'l' if out.user.is_none() => out.user = Some(value.to_string()),
        'i' => out.identities.push(PathBuf::from(value)),
        'o' => apply_option(out, value)?,
        _ => {} // accepted, no effect on a single exec
    }
    Ok(())
}

/// One `-o Key=Value` (or `Key Value`); keys are case-insensitive.
fn apply_option(out: &mut SshArgs, opt: &str) -> Result<(), ArgvError> {
    let opt = opt.trim();
    let split = opt.find(['=', ' ', '\t']).unwrap_or(opt.len());
    let key = opt[..split].to_ascii_lowercase();
    let value = opt[split..].trim_start_matches([' ', '\t']).trim_start_matches('=').trim();
    let value = value.trim_matches('"');
    match key.as_str() {
        "port" => out.port = Some(number(value, "Port")?),
        "user" if out.user.is_none() => out.user = Some(value.to_string()),
        "user" => {}
        "identityfile" => out.identities.push(PathBuf::from(value)),
        "stricthostkeychecking" => {
            out.host_key_check = Some(HostKeyCheck::from_setting(value));
        }
        "userknownhostsfile" => {
            if let Some(first) = value.split_whitespace().next() {
                out.known_hosts = Some(PathBuf::from(first));
            }
        }
        "connectionattempts" => out.attempts = Some(number(value, "ConnectionAttempts")?),
        "connecttimeout" => {
            let secs: u64 = number(value, "ConnectTimeout")?;
            out.connect_timeout = (secs > 0).then(|| Duration::from_secs(secs));
        }
        "loglevel" => {
            if matches!(value.to_ascii_lowercase().as_str(), "quiet" | "fatal" | "error") {
                out.quiet = true;
            }
        }
        _ => tracing::debug!(option = %opt, "ssh option ignored"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    fn words(s: &str) -> Vec<String> {
        s.split(' ').map(str::to_string).collect()
    }

    #[test]
    fn open_mpi_4_tree_spawn_line() {
        // reference/mpi.md 1.2: the agent gets `-x`, then the host, then
        // words with literal quotes and a leading empty word.
        let mut argv = vec!["-x".to_string(), "127.0.0.2".to_string(), " orted".to_string()];
        argv.extend(words(r#"-mca ess "env" -mca orte_hnp_uri "1.0;tcp://127.0.0.1:47969" --tree-spawn"#));
        let a = parse(&argv).expect("test setup");
        assert_eq!(a.host, "127.0.0.2");
        assert_eq!(a.port, None);
        assert_eq!(a.command, r#" orted -mca ess "env" -mca orte_hnp_uri "1.0;tcp://127.0.0.1:47969" --tree-spawn"#);
    }

    #[test]
    fn rsh_args_and_hydra_extra_args() {
        let a = parse(&words(r#"-x -o ConnectionAttempts=10 -p 2200 -i /k/id_rsa mpiuser@w-0.job "/usr/bin/hydra_pmi_proxy" --control-port vm:1"#)).expect("test setup");
        assert_eq!(a.attempts, Some(10));
        assert_eq!(a.port, Some(2200));
        assert_eq!(a.identities, vec![PathBuf::from("/k/id_rsa")]);
        assert_eq!(a.user.as_deref(), Some("mpiuser"));
        assert_eq!(a.host, "w-0.job");
        assert_eq!(a.command, r#""/usr/bin/hydra_pmi_proxy" --control-port vm:1"#);
    }

    #[test]
    fn intel_quiet_and_bundled_flags() {
        let a = parse(&words("-q -x -oPort=2201 -p2202 -qxn host true")).expect("test setup");
        assert!(a.quiet && a.no_stdin);
        assert_eq!(a.port, Some(2202), "the last one wins");
        assert_eq!(a.command, "true");
    }

    #[test_case("StrictHostKeyChecking=no", Some(HostKeyCheck::Off); "no")]
    #[test_case("StrictHostKeyChecking no", Some(HostKeyCheck::Off); "space form")]
    #[test_case("stricthostkeychecking=accept-new", Some(HostKeyCheck::Strict); "accept-new stays strict")]
    #[test_case("LogLevel=ERROR", None; "unrelated")]
    fn host_key_option(opt: &str, want: Option<HostKeyCheck>) {
        let a = parse(&["-o".to_string(), opt.to_string(), "h".to_string()]).expect("test setup");
        assert_eq!(a.host_key_check, want);
    }

    #[test]
    fn uri_destination_and_user_precedence() {
        let a = parse(&words("ssh://alice@[::1]:2222 id")).expect("test setup");
        assert_eq!((a.user.as_deref(), a.host.as_str(), a.port), (Some("alice"), "::1", Some(2222)));
        let a = parse(&words("-l bob alice@h id")).expect("test setup");
        assert_eq!(a.user.as_deref(), Some("bob"), "-l wins over user@, as in ssh(1)");
        let a = parse(&words("-o User=carol h id")).expect("test setup");
        assert_eq!(a.user.as_deref(), Some("carol"));
    }

    #[test_case("-p", ArgvError::MissingValue('p'); "missing value")]
    #[test_case("-Z h", ArgvError::Unknown('Z'); "unknown flag")]
    #[test_case("-x", ArgvError::NoHost; "no host")]
    #[test_case("-p x h", ArgvError::BadValue { what: "port", value: "x".into() }; "bad port")]
    fn errors(line: &str, want: ArgvError) {
        assert_eq!(parse(&words(line)).expect_err("should fail"), want);
    }

    #[test]
    fn version_needs_no_host() {
        assert!(parse(&words("-V")).expect("parse").version);
    }

    #[test]
    fn words_after_the_host_are_not_options() {
        let a = parse(&words("h ls -p -o x")).expect("test setup");
        assert_eq!((a.port, a.command.as_str()), (None, "ls -p -o x"));
    }
}
