//! MPI hostfiles: read Open MPI's (`host slots=N`) and hydra's (`host:N`)
//! forms, write both (reference/mpi.md 1.6 and 2; reference/kubeflow.md 3.1
//! and 8.8). Pure apart from [`read`].

use std::path::{Path, PathBuf};

/// A bad hostfile.
#[derive(Debug, thiserror::Error)]
pub enum HostfileError {
    /// It could not be read.
    #[error("cannot read hostfile {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A line did not parse.
    #[error("hostfile {path} line {line}: {what}")]
    Line {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        what: String,
    },
    /// No host in it.
    #[error("hostfile {0} lists no host")]
    Empty(PathBuf),
}

/// One node of the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    /// Login name, when the line gave one (`user@host`, `user=NAME`).
    pub user: Option<String>,
    /// Host name or address, as written.
    pub name: String,
    /// Slots (processes) on it, when given.
    pub slots: Option<u32>,
}

/// Read and parse a hostfile.
pub fn read(path: &Path) -> Result<Vec<Host>, HostfileError> {
    let text = std::fs::read_to_string(path).map_err(|source| HostfileError::Read { path: path.into(), source })?;
    parse(&text, path)
}

/// Parse either form; `^host` exclusions are dropped.
pub fn parse(text: &str, origin: &Path) -> Result<Vec<Host>, HostfileError> {
    let mut hosts = Vec::new();
    for (n, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() || line.starts_with('^') {
            continue;
        }
        let bad = |what: String| HostfileError::Line { path: origin.into(), line: n + 1, what };
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or("");
        let (user, rest) = match first.split_once('@') {
            Some((u, h)) => (Some(u.to_string()), h),
            None => (None, first),
        };
        // hydra `host:N`; an IPv6 address has several colons and no count.
        let (name, mut slots) = match rest.rsplit_once(':') {
            Some((h, n)) if !h.contains(':') => {
                (h.to_string(), Some(n.parse::<u32>().map_err(|_| bad(format!("bad process count {n:?}")))?))
            }
            _ => (rest.to_string(), None),
        };
        let mut user = user;
        for w in words {
            let (k, v) = w.split_once('=').unwrap_or((w, ""));
            match k.to_ascii_lowercase().as_str() {
                "slots" | "count" | "cpu" => {
                    slots = Some(v.parse().map_err(|_| bad(format!("bad slots {v:?}")))?);
                }
                "user" => user = Some(v.to_string()),
                _ => {} // max_slots, binding=...: for mpirun, not for us
            }
        }
        if name.is_empty() {
            return Err(bad("no host name".into()));
        }
        hosts.push(Host { user, name, slots });
    }
    if hosts.is_empty() {
        return Err(HostfileError::Empty(origin.into()));
    }
    Ok(hosts)
}

/// Open MPI form: `host slots=N`.
pub fn open_mpi(hosts: &[Host]) -> String {
    hosts
        .iter()
        .map(|h| {
            let name = h.user.as_ref().map_or_else(|| h.name.clone(), |u| format!("{u}@{}", h.name));
            h.slots.map_or_else(|| format!("{name}\n"), |s| format!("{name} slots={s}\n"))
        })
        .collect()
}

/// hydra form: `host:N [user=NAME]`.
pub fn hydra(hosts: &[Host]) -> String {
    hosts
        .iter()
        .map(|h| {
            let mut line = h.slots.map_or_else(|| h.name.clone(), |s| format!("{}:{s}", h.name));
            if let Some(u) = &h.user {
                line.push_str(&format!(" user={u}"));
            }
            line + "\n"
        })
        .collect()
}

/// Parse `--hosts h1,h2:4`, all with `default_slots` unless given.
pub fn from_list(list: &str, default_slots: Option<u32>) -> Result<Vec<Host>, HostfileError> {
    let text: String = list.split(',').filter(|s| !s.trim().is_empty()).map(|s| format!("{}\n", s.trim())).collect();
    let mut hosts = parse(&text, Path::new("--hosts"))?;
    for h in &mut hosts {
        h.slots = h.slots.or(default_slots);
    }
    Ok(hosts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trainer_and_operator_forms() {
        let text = "# generated\nalpha-node-0-0.alpha slots=8\nmpiuser@alpha-node-0-1.alpha slots=8 max_slots=8\n\
                    w-2.job.ns.svc:4\nw-3 user=bob\n^w-4\n2001:db8::1\n";
        let hosts = parse(text, Path::new("h")).expect("test setup");
        assert_eq!(hosts.len(), 5);
        assert_eq!(hosts[0], Host { user: None, name: "alpha-node-0-0.alpha".into(), slots: Some(8) });
        assert_eq!(hosts[1].user.as_deref(), Some("mpiuser"));
        assert_eq!((hosts[2].name.as_str(), hosts[2].slots), ("w-2.job.ns.svc", Some(4)));
        assert_eq!(hosts[3].user.as_deref(), Some("bob"));
        assert_eq!((hosts[4].name.as_str(), hosts[4].slots), ("2001:db8::1", None));
    }

    #[test]
    fn writers_round_trip() {
        let hosts = from_list("127.0.0.2,127.0.0.3:4", Some(2)).expect("test setup");
        assert_eq!(open_mpi(&hosts), "127.0.0.2 slots=2\n127.0.0.3 slots=4\n");
        assert_eq!(hydra(&hosts), "127.0.0.2:2\n127.0.0.3:4\n");
        assert_eq!(parse(&hydra(&hosts), Path::new("x")).expect("test setup"), hosts);
        assert_eq!(parse(&open_mpi(&hosts), Path::new("x")).expect("test setup"), hosts);
    }

    #[test]
    fn errors_name_the_line() {
        let e = parse("a slots=2\nb slots=x\n", Path::new("/etc/mpi/hostfile")).expect_err("should fail");
        assert_eq!(e.to_string(), "hostfile /etc/mpi/hostfile line 2: bad slots \"x\"");
        assert!(matches!(parse("# nothing\n", Path::new("h")), Err(HostfileError::Empty(_))));
    }
}
