//! This pod's side of SSH: the local account remote commands run as, and
//! the `ssh` link to this binary that MPI launchers run as their remote
//! shell (used by both `trainlet sshd` and `trainlet mpi`).

use std::path::PathBuf;

use crate::env as names;
use crate::sys;

/// Our account: the password database, else HOME/USER/SHELL from the env
/// (arbitrary uids have no entry), else `/` and `/bin/sh`.
pub fn local_account() -> (String, PathBuf, PathBuf) {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let (name, home, shell) = sys::current_user().map_or((None, None, None), |(n, h, s)| (Some(n), Some(h), Some(s)));
    let name =
        name.or_else(|| env("USER")).unwrap_or_else(|| if sys::is_root() { "root".into() } else { "trainlet".into() });
    let home = env("HOME").map(PathBuf::from).or(home).unwrap_or_else(|| PathBuf::from("/"));
    let shell = shell.filter(|s| s.is_file()).unwrap_or_else(|| PathBuf::from("/bin/sh"));
    (name, home, shell)
}

/// The directory of the `ssh` link MPI launchers run: TRAINLET_AGENT_DIR,
/// else `$TMPDIR/trainlet-bin`. The same path on every pod, since tree
/// spawn passes it on the daemons' command lines.
pub fn agent_dir() -> PathBuf {
    std::env::var_os(names::TRAINLET_AGENT_DIR).map_or_else(|| std::env::temp_dir().join("trainlet-bin"), PathBuf::from)
}

/// Make `<agent_dir>/ssh` a link to this binary (atomically) and return it.
pub fn agent_link() -> std::io::Result<PathBuf> {
    let dir = agent_dir();
    std::fs::create_dir_all(&dir)?;
    let exe = std::env::current_exe()?;
    let link = dir.join("ssh");
    if std::fs::read_link(&link).is_ok_and(|t| t == exe) {
        return Ok(link);
    }
    let tmp = dir.join(format!(".ssh.{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(&exe, &tmp)?;
    std::fs::rename(&tmp, &link)?;
    Ok(link)
}
