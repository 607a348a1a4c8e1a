//! OpenSSH sshd's command line and config file, as Trainer's MPI runtimes
//! run it (`/usr/sbin/sshd -De -f /home/mpiuser/.sshd_config`,
//! reference/kubeflow.md 3.2 and 8.10), so an image can make
//! `/usr/sbin/sshd` a link to trainlet and keep the shipped runtimes.
//! Pure: the caller reads the file.
//!
//! Honoured: `-p`, `-h`, `-f`, `-g`, `-o Key=Value`; in the file `Port`,
//! `ListenAddress`, `HostKey`, `AuthorizedKeysFile` (`%h`, `%u`, `%%`, and
//! paths relative to the home directory), `PidFile`, `LoginGraceTime`
//! (sshd's time format: `120`, `2m`, `1h30m`; 0 = none) and `MaxStartups`. Everything else
//! (`StrictModes`, `UsePAM`, ...) has no meaning for trainlet's server and
//! is ignored; `-D` and `-e` are what it always does.

use std::path::PathBuf;

/// What sshd's flags and config file ask for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SshdConfig {
    /// `-f FILE`.
    pub config_file: Option<PathBuf>,
    /// `Port` / `-p`.
    pub port: Option<u16>,
    /// `ListenAddress` (host, optional port).
    pub listen: Option<(String, Option<u16>)>,
    /// `HostKey` / `-h` (the first).
    pub host_key: Option<PathBuf>,
    /// `AuthorizedKeysFile` (the first), tokens not yet expanded.
    pub authorized_keys: Option<String>,
    /// `PidFile` (`none` = None).
    pub pid_file: Option<PathBuf>,
    /// `LoginGraceTime` / `-g`.
    pub login_grace: Option<std::time::Duration>,
    /// `MaxStartups`.
    pub max_startups: Option<crate::ssh::server::MaxStartups>,
}

/// A bad sshd command line or config line.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SshdConfigError {
    /// A flag without its value.
    #[error("option requires an argument -- {0}")]
    MissingValue(char),
    /// A flag sshd does not have.
    #[error("unknown option -- {0}")]
    Unknown(char),
    /// A value that does not parse.
    #[error("{origin}: bad {key} {value:?}")]
    Bad {
        /// Where (flag or file:line).
        origin: String,
        /// Which setting.
        key: String,
        /// What was given.
        value: String,
    },
}

const VALUED: &str = "CcEfghkOop";
const FLAGS: &str = "46DdeGiqTtV";

/// Parse sshd's argv (without argv[0]); the file named by `-f` is applied
/// afterwards with [`SshdConfig::apply_file`] (command-line values win).
pub fn parse_args(args: &[String]) -> Result<(SshdConfig, Vec<(String, String)>), SshdConfigError> {
    let mut cfg = SshdConfig::default();
    let mut options = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        let Some(flags) = a.strip_prefix('-').filter(|f| !f.is_empty()) else {
            return Err(SshdConfigError::Unknown(a.chars().next().unwrap_or('?')));
        };
        for (at, c) in flags.char_indices() {
            if VALUED.contains(c) {
                let rest = &flags[at + c.len_utf8()..];
                let value = if rest.is_empty() {
                    i += 1;
                    args.get(i).cloned().ok_or(SshdConfigError::MissingValue(c))?
                } else {
                    rest.to_string()
                };
                match c {
                    'f' => cfg.config_file = Some(value.into()),
                    'p' => cfg.port = Some(port("-p", "port", &value)?),
                    'g' => cfg.login_grace = Some(grace("-g", "login grace time", &value)?),
                    'h' => cfg.host_key = cfg.host_key.take().or(Some(value.into())),
                    'o' => {
                        let (k, v) = split_setting(&value);
                        options.push((k.to_string(), v.to_string()));
                    }
                    _ => {}
                }
                break;
            }
            if !FLAGS.contains(c) {
                return Err(SshdConfigError::Unknown(c));
            }
        }
        i += 1;
    }
    for (k, v) in &options {
        cfg.set("-o", k, v, true)?;
    }
    Ok((cfg, options))
}

/// sshd's time format (sshd_config(5) TIME FORMATS): `120`, `2m`,
/// `1h30m`, qualifiers s, m, h, d, w.
pub fn sshd_time(v: &str) -> Option<std::time::Duration> {
    let mut total = 0u64;
    let mut n: Option<u64> = None;
    for c in v.trim().chars() {
        if let Some(d) = c.to_digit(10) {
            n = Some(n.unwrap_or(0).checked_mul(10)?.checked_add(u64::from(d))?);
            continue;
        }
        let unit = match c.to_ascii_lowercase() {
            's' => 1,
            'm' => 60,
            'h' => 3600,
            'd' => 86_400,
            'w' => 604_800,
            _ => return None,
        };
        total = total.checked_add(n.take()?.checked_mul(unit)?)?;
    }
    if let Some(n) = n {
        total = total.checked_add(n)?;
    } else if total == 0 {
        return None;
    }
    Some(std::time::Duration::from_secs(total))
}

fn grace(origin: &str, key: &str, v: &str) -> Result<std::time::Duration, SshdConfigError> {
    sshd_time(v).ok_or_else(|| SshdConfigError::Bad { origin: origin.into(), key: key.into(), value: v.into() })
}

fn split_setting(line: &str) -> (&str, &str) {
    let line = line.trim();
    let at = line.find(['=', ' ', '\t']).unwrap_or(line.len());
    (&line[..at], line[at..].trim_start_matches([' ', '\t', '=']).trim())
}

fn port(origin: &str, key: &str, v: &str) -> Result<u16, SshdConfigError> {
    v.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(|| SshdConfigError::Bad {
        origin: origin.into(),
        key: key.into(),
        value: v.into(),
    })
}

impl SshdConfig {
    /// Apply one setting; `force` (command line) overrides, the file only fills in.
    fn set(&mut self, origin: &str, key: &str, value: &str, force: bool) -> Result<(), SshdConfigError> {
        let value = value.trim_matches('"');
        match key.to_ascii_lowercase().as_str() {
            "port" if force || self.port.is_none() => self.port = Some(port(origin, key, value)?),
            "listenaddress" if force || self.listen.is_none() => self.listen = Some(listen_address(origin, value)?),
            "hostkey" if force || self.host_key.is_none() => self.host_key = Some(value.into()),
            "authorizedkeysfile" if force || self.authorized_keys.is_none() => {
                self.authorized_keys = value.split_whitespace().next().map(str::to_string);
            }
            "logingracetime" if force || self.login_grace.is_none() => {
                self.login_grace = Some(grace(origin, key, value)?);
            }
            "maxstartups" if force || self.max_startups.is_none() => {
                self.max_startups = Some(value.parse().map_err(|_| SshdConfigError::Bad {
                    origin: origin.into(),
                    key: key.into(),
                    value: value.into(),
                })?);
            }
            "pidfile" if force || self.pid_file.is_none() => {
                self.pid_file = (!value.eq_ignore_ascii_case("none")).then(|| value.into());
            }
            _ => {}
        }
        Ok(())
    }

    /// Fill in from sshd_config text (`origin` names it in errors).
    pub fn apply_file(&mut self, text: &str, origin: &str) -> Result<(), SshdConfigError> {
        for (n, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            if line.to_ascii_lowercase().starts_with("match ") {
                break; // conditional blocks: trainlet serves one configuration
            }
            let (k, v) = split_setting(line);
            self.set(&format!("{origin}:{}", n + 1), k, v, false)?;
        }
        Ok(())
    }

    /// The authorized_keys path for `user` with home `home`.
    pub fn authorized_keys_path(&self, home: &std::path::Path, user: &str) -> Option<PathBuf> {
        let raw = self.authorized_keys.as_deref()?;
        let mut out = String::new();
        let mut chars = raw.chars();
        while let Some(c) = chars.next() {
            if c == '%' {
                match chars.next() {
                    Some('h') => out.push_str(&home.display().to_string()),
                    Some('u') => out.push_str(user),
                    Some('%') => out.push('%'),
                    Some(o) => {
                        out.push('%');
                        out.push(o);
                    }
                    None => out.push('%'),
                }
            } else {
                out.push(c);
            }
        }
        let p = PathBuf::from(out);
        Some(if p.is_absolute() { p } else { home.join(p) })
    }

    /// The address to listen on, defaulting to all interfaces on `default_port`.
    pub fn listen_on(&self, default_port: u16) -> Option<std::net::SocketAddr> {
        let port = self.port.unwrap_or(default_port);
        let (host, p) = self.listen.clone()?;
        let ip: std::net::IpAddr = host.parse().ok()?;
        Some(std::net::SocketAddr::new(ip, p.unwrap_or(port)))
    }
}

fn listen_address(origin: &str, v: &str) -> Result<(String, Option<u16>), SshdConfigError> {
    let bad = || SshdConfigError::Bad { origin: origin.into(), key: "ListenAddress".into(), value: v.into() };
    let v = v.split_whitespace().next().unwrap_or("");
    if let Some(rest) = v.strip_prefix('[') {
        let (h, after) = rest.split_once(']').ok_or_else(bad)?;
        let p = after.strip_prefix(':').map(|p| port(origin, "ListenAddress", p)).transpose()?;
        return Ok((h.to_string(), p));
    }
    match v.split_once(':') {
        Some((h, p)) if !p.contains(':') => Ok((h.to_string(), Some(port(origin, "ListenAddress", p)?))),
        _ if v.is_empty() => Err(bad()),
        _ => Ok((v.to_string(), None)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn words(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test_case::test_case("120", Some(120); "seconds")]
    #[test_case::test_case("2m", Some(120); "minutes")]
    #[test_case::test_case("1h30m", Some(5400); "mixed")]
    #[test_case::test_case("1W", Some(604_800); "week")]
    #[test_case::test_case("0", Some(0); "zero means none")]
    #[test_case::test_case("", None; "empty")]
    #[test_case::test_case("m", None; "no number")]
    #[test_case::test_case("5x", None; "bad unit")]
    fn sshd_times(v: &str, want: Option<u64>) {
        assert_eq!(sshd_time(v).map(|d| d.as_secs()), want);
    }

    #[test]
    fn login_grace_time_and_max_startups_from_the_line_and_the_file() {
        use crate::ssh::server::MaxStartups;
        let (mut cfg, _) = parse_args(&words("-D -g 30s -f x")).expect("parse");
        cfg.apply_file("LoginGraceTime 5m\nMaxStartups 5:50:20\n", "x").expect("file");
        assert_eq!(cfg.login_grace, Some(std::time::Duration::from_secs(30)), "the command line wins");
        assert_eq!(cfg.max_startups, Some(MaxStartups { start: 5, rate: 50, full: 20 }));
        let mut cfg = SshdConfig::default();
        assert!(cfg.apply_file("MaxStartups lots\n", "x").is_err());
        assert!(cfg.apply_file("LoginGraceTime soon\n", "x").is_err());
    }

    #[test]
    fn mpi_operator_images_line_and_file() {
        let (mut cfg, _) = parse_args(&words("-De -f /home/mpiuser/.sshd_config")).expect("parse");
        assert_eq!(cfg.config_file, Some(PathBuf::from("/home/mpiuser/.sshd_config")));
        let text = "PidFile /home/mpiuser/sshd.pid\nHostKey /home/mpiuser/.ssh/id_rsa\nStrictModes no\nPort 2222\n";
        cfg.apply_file(text, "f").expect("file");
        assert_eq!(cfg.port, Some(2222));
        assert_eq!(cfg.host_key, Some(PathBuf::from("/home/mpiuser/.ssh/id_rsa")));
        assert_eq!(cfg.pid_file, Some(PathBuf::from("/home/mpiuser/sshd.pid")));
        assert_eq!(cfg.listen_on(22), None, "no ListenAddress: all interfaces");
    }

    #[test]
    fn command_line_wins_and_tokens_expand() {
        let (mut cfg, _) = parse_args(&words("-p 2200 -o ListenAddress=127.0.0.9")).expect("parse");
        cfg.apply_file(
            "Port 2222\nListenAddress 10.0.0.1\nAuthorizedKeysFile .ssh/authorized_keys %h/.ssh/other\n",
            "f",
        )
        .expect("file");
        assert_eq!(cfg.listen_on(22), Some("127.0.0.9:2200".parse().expect("addr")));
        assert_eq!(
            cfg.authorized_keys_path(Path::new("/home/u"), "u"),
            Some(PathBuf::from("/home/u/.ssh/authorized_keys"))
        );
        let mut c = SshdConfig { authorized_keys: Some("/keys/%u/%%ak".into()), ..Default::default() };
        c.apply_file("PidFile none\nMatch User x\nPort 1\n", "f").expect("file");
        assert_eq!(c.authorized_keys_path(Path::new("/h"), "bob"), Some(PathBuf::from("/keys/bob/%ak")));
        assert_eq!((c.pid_file, c.port), (None, None), "Match blocks are not applied");
    }

    #[test]
    fn errors() {
        assert_eq!(parse_args(&words("-f")).expect_err("missing"), SshdConfigError::MissingValue('f'));
        assert_eq!(parse_args(&words("-Z")).expect_err("unknown"), SshdConfigError::Unknown('Z'));
        let mut c = SshdConfig::default();
        let e = c.apply_file("Port 22x\n", "/etc/ssh/sshd_config").expect_err("bad port");
        assert_eq!(e.to_string(), "/etc/ssh/sshd_config:1: bad Port \"22x\"");
        assert_eq!(listen_address("x", "[::1]:2222").expect("v6"), ("::1".to_string(), Some(2222)));
    }
}
