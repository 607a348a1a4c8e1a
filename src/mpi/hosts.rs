//! Where the MPI hosts are (hostfiles, mpirun's own arguments, the
//! Trainer torch env), which of them is this pod, which `mpirun` is the
//! real one, and the environment that points every MPI family at
//! trainlet's ssh client.
//!
//! mpirun's environment gets the remote-shell settings of every MPI family
//! at once, since they are namespaced and each reads only its own
//! (reference/mpi.md 1.6, 2, 3, 8.1 and 8.14): Open MPI 4
//! (`OMPI_MCA_plm_rsh_*`), PRRTE / Open MPI 5 (`PRTE_MCA_plm_ssh_*`), MPICH
//! hydra (`HYDRA_LAUNCHER*`, with the spelling hydra reads, not MPI
//! Operator's `HYDRA_LAUNCH_EXTRA_ARGS`) and Intel MPI
//! (`I_MPI_HYDRA_BOOTSTRAP*`). Launch is flat unless `--tree-spawn`, so
//! workers need no client key (reference/mpi.md 7).

use std::path::{Path, PathBuf};

use crate::cli::MpiArgs;
use crate::env as names;

use crate::ssh::hostfile::{self, Host, HostfileError};

/// Why the launcher's hosts or program cannot be had (exit 200).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The launcher named is trainlet's own link and no real one follows it.
    #[error("{program} is trainlet itself and there is no real {name} after it on PATH (set TRAINLET_MPIRUN)")]
    NoRealLauncher {
        /// What the command named.
        program: String,
        /// Its file name.
        name: String,
    },
    /// A hostfile or host list is bad.
    #[error(transparent)]
    Hosts(#[from] HostfileError),
    /// Nothing names the hosts.
    #[error(
        "no MPI hosts: pass --hostfile or --hosts, set TRAINLET_MPI_HOSTS or OMPI_MCA_orte_default_hostfile, mount \
         /etc/mpi/hostfile, or set PET_MASTER_ADDR=<job>-node-0-0.<job> and PET_NNODES"
    )]
    NoHosts,
}

/// Where the Trainer / MPI Operator hostfile is mounted.
pub const TRAINER_HOSTFILE: &str = "/etc/mpi/hostfile";

/// The real `name` (`mpirun`, `mpiexec`) when trainlet answers to that
/// name through a symlink: `TRAINLET_MPIRUN`, else the first `name` on
/// PATH that is not trainlet itself.
pub fn real_launcher(name: &str) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(names::TRAINLET_MPIRUN).filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    let me = crate::sys::own_exe();
    on_path(name, |c| std::fs::canonicalize(c).ok() != me)
}

/// The first executable `name` on PATH for which `keep` holds (execvp's search).
fn on_path(name: &str, keep: impl Fn(&Path) -> bool) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|c| std::fs::metadata(c).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0) && keep(c))
}

/// The program `trainlet mpi -- PROGRAM ...` runs: PROGRAM itself, unless
/// it is trainlet (the image's `mpirun` link first on PATH), which would
/// wrap the job twice; then the real launcher, found as the link finds it.
pub fn launcher_program(program: &str) -> Result<String, Error> {
    let path = if program.contains('/') { Some(PathBuf::from(program)) } else { on_path(program, |_| true) };
    let is_me = path.and_then(|p| std::fs::canonicalize(p).ok()).is_some_and(|p| Some(p) == crate::sys::own_exe());
    if !is_me {
        return Ok(program.to_string());
    }
    let name = Path::new(program).file_name().map_or_else(|| program.to_string(), |n| n.to_string_lossy().into_owned());
    real_launcher(&name)
        .map(|p| p.display().to_string())
        .ok_or_else(|| Error::NoRealLauncher { program: program.to_string(), name })
}

/// Hosts named on mpirun's own command line: a hostfile flag's file, or
/// `-H`/`--host`/`-hosts` lists.
fn hosts_in_command(cmd: &[String]) -> Option<Result<Vec<Host>, HostfileError>> {
    const FILE_FLAGS: [&str; 6] =
        ["--hostfile", "-hostfile", "--machinefile", "-machinefile", "--default-hostfile", "-f"];
    const LIST_FLAGS: [&str; 4] = ["-H", "--host", "-host", "-hosts"];
    let mut i = 1;
    while i < cmd.len() {
        let a = cmd[i].as_str();
        let (flag, inline) = a.split_once('=').map_or((a, None), |(f, v)| (f, Some(v.to_string())));
        let value = || inline.clone().or_else(|| cmd.get(i + 1).cloned());
        if FILE_FLAGS.contains(&flag) {
            let v = value()?;
            return Some(hostfile::read(Path::new(&v)));
        }
        if LIST_FLAGS.contains(&flag) {
            let v = value()?;
            return Some(hostfile::from_list(&v, None));
        }
        i += 1;
    }
    None
}

/// Is `host` this machine (`runLauncherAsNode`: the launcher's own name is
/// in the hostfile)? As Open MPI decides: the name is ours or `localhost`,
/// or it resolves to an address of one of our interfaces. mpirun starts
/// that node's processes itself, so it needs no SSH server.
pub fn is_local(host: &str, own_name: Option<&str>, interfaces: &[std::net::IpAddr]) -> bool {
    // A pod's hostname is the first label of its FQDN in the hostfile.
    let first = |n: &str| n.split('.').next().map(str::to_string);
    let named = host.parse::<std::net::IpAddr>().is_err();
    if host == "localhost" || (named && own_name.is_some_and(|n| first(n) == first(host))) {
        return true;
    }
    use std::net::ToSocketAddrs;
    (host, 0).to_socket_addrs().is_ok_and(|mut a| a.any(|sa| interfaces.contains(&sa.ip())))
}

/// How the hosts were found.
#[derive(Debug)]
pub struct HostSource {
    /// The hosts, in order.
    pub hosts: Vec<Host>,
    /// mpirun's own arguments name the hosts: no hostfile is handed over.
    pub from_command: bool,
    /// Where they came from, for logs.
    pub what: String,
}

/// The hosts of the job: `--hostfile`, else the hosts mpirun's own
/// arguments name, else the Trainer hostfile, else the Trainer torch env.
pub fn find_hosts(args: &MpiArgs) -> Result<HostSource, Error> {
    if let Some(found) = hosts_in_command(&args.command) {
        return Ok(HostSource { hosts: found?, from_command: true, what: "mpirun's arguments".into() });
    }
    let from_file = |p: PathBuf, what: &str| -> Result<HostSource, Error> {
        let hosts = hostfile::read(&p)?;
        Ok(HostSource { hosts, from_command: false, what: format!("{what} {}", p.display()) })
    };
    if let Some(p) = &args.hostfile {
        return from_file(p.clone(), "--hostfile");
    }
    if let Ok(p) = std::env::var(names::OMPI_MCA_ORTE_DEFAULT_HOSTFILE)
        && !p.is_empty()
    {
        return from_file(PathBuf::from(p), names::OMPI_MCA_ORTE_DEFAULT_HOSTFILE);
    }
    if Path::new(TRAINER_HOSTFILE).is_file() {
        return from_file(PathBuf::from(TRAINER_HOSTFILE), "the Trainer hostfile");
    }
    if let Some(list) = &args.hosts {
        let hosts = hostfile::from_list(list, Some(args.slots.unwrap_or(1)))?;
        return Ok(HostSource { hosts, from_command: false, what: "--hosts".into() });
    }
    let get = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    match pet_hosts(
        get(names::PET_MASTER_ADDR).as_deref(),
        get(names::PET_NNODES).as_deref(),
        args.slots.or_else(|| get(names::PET_NPROC_PER_NODE).and_then(|n| n.parse().ok())),
    ) {
        Some(hosts) => Ok(HostSource { hosts, from_command: false, what: "PET_MASTER_ADDR and PET_NNODES".into() }),
        None => Err(Error::NoHosts),
    }
}

/// JobSet pod names from the torch env Trainer sets (reference/kubeflow.md
/// 8.3): the master is `<job>-<rjob>-0-0.<subdomain>` and its peers are
/// `<job>-<rjob>-0-<i>.<subdomain>` for every i below PET_NNODES.
fn pet_hosts(master: Option<&str>, nnodes: Option<&str>, slots: Option<u32>) -> Option<Vec<Host>> {
    let (name, domain) = master?.split_once('.')?;
    let base = name.strip_suffix("-0")?;
    let n: u32 = nnodes?.split(':').next_back()?.trim().parse().ok().filter(|n| *n > 0)?;
    Some(
        (0..n)
            .map(|i| Host { user: None, name: format!("{base}-{i}.{domain}"), slots: Some(slots.unwrap_or(1)) })
            .collect(),
    )
}

/// Write the hostfiles mpirun reads (Open MPI and hydra forms) into `dir`.
pub fn write_hostfiles(dir: &Path, hosts: &[Host]) -> std::io::Result<(PathBuf, PathBuf)> {
    std::fs::create_dir_all(dir)?;
    let ompi = dir.join("hostfile");
    let hydra = dir.join("hostfile.hydra");
    std::fs::write(&ompi, hostfile::open_mpi(hosts))?;
    std::fs::write(&hydra, hostfile::hydra(hosts))?;
    Ok((ompi, hydra))
}

/// The remote-shell environment for mpirun (see the module doc).
pub fn mpi_env(
    agent: &Path,
    key_dir: &Path,
    port: u16,
    tree: bool,
    files: Option<(&Path, &Path)>,
    get: &dyn Fn(&str) -> Option<String>,
) -> Vec<(String, String)> {
    let agent = agent.display().to_string();
    let mut env: Vec<(String, String)> = Vec::new();
    let mut set = |k: &str, v: String| env.push((k.to_string(), v));
    for k in ["OMPI_MCA_plm_rsh_agent", "PRTE_MCA_plm_ssh_agent", "HYDRA_LAUNCHER_EXEC", "I_MPI_HYDRA_BOOTSTRAP_EXEC"] {
        set(k, agent.clone());
    }
    set("HYDRA_LAUNCHER", "ssh".into());
    set("I_MPI_HYDRA_BOOTSTRAP", "ssh".into());
    let keep = |k: &str, v: &str, set: &mut dyn FnMut(&str, String)| {
        if get(k).is_none() {
            set(k, v.to_string());
        }
    };
    keep("OMPI_MCA_orte_keep_fqdn_hostnames", "true", &mut set);
    keep("PRTE_MCA_prte_keep_fqdn_hostnames", "true", &mut set);
    if !tree {
        set("OMPI_MCA_plm_rsh_no_tree_spawn", "1".into());
        set("PRTE_MCA_plm_ssh_no_tree_spawn", "1".into());
        set("I_MPI_HYDRA_BRANCH_COUNT", "0".into());
    }
    // MPI Operator's MPICH setting has a name hydra never reads.
    let mut hydra_extra =
        get("HYDRA_LAUNCHER_EXTRA_ARGS").or_else(|| get("HYDRA_LAUNCH_EXTRA_ARGS")).unwrap_or_default();
    let mut rsh_args = get("OMPI_MCA_plm_rsh_args").unwrap_or_default();
    let mut impi_extra = get("I_MPI_HYDRA_BOOTSTRAP_EXEC_EXTRA_ARGS").unwrap_or_default();
    if port != 2222 {
        // Travels on tree-spawned daemons' command lines too.
        for a in [&mut hydra_extra, &mut rsh_args, &mut impi_extra] {
            *a = format!("{a} -p {port}").trim().to_string();
        }
    }
    for (k, v) in [
        ("HYDRA_LAUNCHER_EXTRA_ARGS", hydra_extra),
        ("OMPI_MCA_plm_rsh_args", rsh_args.clone()),
        ("PRTE_MCA_plm_ssh_args", rsh_args),
        ("I_MPI_HYDRA_BOOTSTRAP_EXEC_EXTRA_ARGS", impi_extra),
    ] {
        if !v.is_empty() {
            set(k, v);
        }
    }
    if let Some((ompi, hydra)) = files {
        set("OMPI_MCA_orte_default_hostfile", ompi.display().to_string());
        set("PRTE_MCA_prte_default_hostfile", ompi.display().to_string());
        keep("HYDRA_HOST_FILE", &hydra.display().to_string(), &mut set);
        keep("I_MPI_HYDRA_HOST_FILE", &hydra.display().to_string(), &mut set);
    }
    set(names::TRAINLET_SSH_DIR, key_dir.display().to_string());
    set(names::TRAINLET_SSH_PORT, port.to_string());
    let dir = crate::ssh::local::agent_dir().display().to_string();
    set("PATH", get("PATH").map_or(dir.clone(), |p| format!("{dir}:{p}")));
    env
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(tree: bool, port: u16, given: &[(&str, &str)]) -> std::collections::HashMap<String, String> {
        let given: std::collections::HashMap<String, String> =
            given.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let get = |k: &str| given.get(k).cloned();
        mpi_env(
            Path::new("/a/ssh"),
            Path::new("/keys"),
            port,
            tree,
            Some((Path::new("/h"), Path::new("/h.hydra"))),
            &get,
        )
        .into_iter()
        .collect()
    }

    #[test]
    fn flat_launch_for_every_family() {
        let e = env_of(false, 2222, &[("HYDRA_LAUNCH_EXTRA_ARGS", "-o ConnectionAttempts=10"), ("PATH", "/usr/bin")]);
        assert_eq!(e["OMPI_MCA_plm_rsh_agent"], "/a/ssh");
        assert_eq!(e["HYDRA_LAUNCHER_EXEC"], "/a/ssh");
        assert_eq!(e["I_MPI_HYDRA_BOOTSTRAP_EXEC"], "/a/ssh");
        assert_eq!(e["OMPI_MCA_plm_rsh_no_tree_spawn"], "1");
        assert_eq!(e["I_MPI_HYDRA_BRANCH_COUNT"], "0");
        assert_eq!(e["HYDRA_LAUNCHER_EXTRA_ARGS"], "-o ConnectionAttempts=10", "operator's misspelling carried over");
        assert_eq!(e["HYDRA_HOST_FILE"], "/h.hydra");
        assert_eq!(e["OMPI_MCA_orte_default_hostfile"], "/h");
        assert!(e["PATH"].ends_with(":/usr/bin"));
        assert!(!e.contains_key("OMPI_MCA_plm_rsh_args"));
    }

    #[test]
    fn tree_spawn_and_port() {
        let e =
            env_of(true, 2200, &[("OMPI_MCA_plm_rsh_args", "-o ConnectionAttempts=10"), ("HYDRA_HOST_FILE", "/mine")]);
        assert!(!e.contains_key("OMPI_MCA_plm_rsh_no_tree_spawn"));
        assert_eq!(e["OMPI_MCA_plm_rsh_args"], "-o ConnectionAttempts=10 -p 2200");
        assert_eq!(e["HYDRA_LAUNCHER_EXTRA_ARGS"], "-p 2200");
        assert!(!e.contains_key("HYDRA_HOST_FILE"), "the user's own hydra hostfile is kept");
    }

    #[test]
    fn the_launcher_as_a_node_is_local() {
        let ifs: Vec<std::net::IpAddr> = vec!["127.0.0.1".parse().expect("ip"), "10.1.2.3".parse().expect("ip")];
        assert!(is_local("localhost", None, &ifs));
        assert!(is_local("job-launcher-0-0", Some("job-launcher-0-0"), &ifs));
        assert!(is_local("job-launcher-0-0.job", Some("job-launcher-0-0"), &ifs), "pod hostname vs hostfile FQDN");
        assert!(!is_local("job-node-0-1.job", Some("job-launcher-0-0"), &ifs));
        assert!(is_local("10.1.2.3", None, &ifs));
        assert!(is_local("127.0.0.1", None, &ifs));
        assert!(!is_local("127.0.0.2", None, &ifs), "a loopback alias is a simulated remote host, as for Open MPI");
    }

    #[test]
    fn hosts_from_the_trainer_torch_env() {
        let hosts = pet_hosts(Some("alpha-node-0-0.alpha"), Some("3"), Some(8)).expect("hosts");
        let names: Vec<_> = hosts.iter().map(|h| h.name.as_str()).collect();
        assert_eq!(names, ["alpha-node-0-0.alpha", "alpha-node-0-1.alpha", "alpha-node-0-2.alpha"]);
        assert!(hosts.iter().all(|h| h.slots == Some(8)));
        assert_eq!(pet_hosts(Some("a-node-0-0.a"), Some("1:4"), None).expect("elastic spec").len(), 4);
        assert!(pet_hosts(Some("10.0.0.1"), Some("2"), None).is_none(), "an address names no peers");
        assert!(pet_hosts(Some("a-node-0-0.a"), None, None).is_none());
    }

    #[test]
    fn hosts_from_mpirun_arguments() {
        let cmd: Vec<String> = "mpirun -np 4 -H a:2,b:2 python3 x.py".split(' ').map(String::from).collect();
        let hosts = hosts_in_command(&cmd).expect("test setup").expect("test setup");
        assert_eq!(hosts.iter().map(|h| h.name.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        let cmd: Vec<String> = "mpiexec.hydra -f=/nonexistent -n 2 true".split(' ').map(String::from).collect();
        assert!(
            hosts_in_command(&cmd).expect("test setup").expect_err("should fail").to_string().contains("/nonexistent")
        );
        let cmd: Vec<String> = "mpirun -np 2 true".split(' ').map(String::from).collect();
        assert!(hosts_in_command(&cmd).is_none());
    }
}
