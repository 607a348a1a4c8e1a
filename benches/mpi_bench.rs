//! MPI bootstrap benchmarks: trainlet sshd + trainlet ssh against OpenSSH's
//! sshd + ssh with the same keys (an ECDSA P-521 job key that doubles as
//! host key, as Trainer and MPI Operator ship), on simulated hosts
//! 127.0.N.x:2222. Needs Debian's openmpi-bin and openssh-server.
//!
//! Both servers run their remote shells without the machine's ~/.bashrc:
//! under sshd bash reads it, and here it runs `pyenv init` (about 90 ms a
//! shell, and a rehash lock that concurrent shells wait on for up to a
//! minute, which hangs Open MPI launches with either server). A private
//! mount namespace binds /dev/null over it for both.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{Row, median, memory_row, rss_kib, time_row, trainlet};

const HOSTS: u8 = 8;

pub(super) struct Servers {
    children: Vec<Child>,
}

impl Drop for Servers {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub(super) fn addrs(subnet: u8) -> Vec<String> {
    (2..2 + HOSTS).map(|i| format!("127.0.{subnet}.{i}")).collect()
}

fn wait_listening(addr: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect((addr, 2222)).is_err() {
        assert!(Instant::now() < deadline, "no server on {addr}:2222");
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub(super) fn job_keys(dir: &Path) -> PathBuf {
    let st = Command::new(trainlet())
        .args(["keygen", "--type", "ecdsa-p521", "--out"])
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("keygen");
    assert!(st.success());
    dir.join("id_rsa")
}

/// `program` in a mount namespace where ~/.bashrc reads as empty.
fn without_bashrc(program: &str) -> Command {
    let mut c = Command::new("unshare");
    c.args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg(
            r#"for f in "$HOME/.bashrc" /root/.bashrc; do [ -f "$f" ] && mount --bind /dev/null "$f"; done; exec "$@""#,
        )
        .args(["sh", program]);
    c
}

pub(super) fn trainlet_servers(subnet: u8, keys: &Path, agent: &Path) -> Servers {
    let children = addrs(subnet)
        .iter()
        .map(|a| {
            without_bashrc(trainlet())
                .args(["sshd", &format!("--listen={a}:2222")])
                .env("TRAINLET_SSH_DIR", keys)
                .env("TRAINLET_AGENT_DIR", agent)
                .env("TRAINLET_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("trainlet sshd")
        })
        .collect();
    addrs(subnet).iter().for_each(|a| wait_listening(a));
    Servers { children }
}

pub(super) fn openssh_servers(subnet: u8, dir: &Path, key: &Path) -> Servers {
    std::fs::create_dir_all("/run/sshd").expect("privsep dir");
    let children = addrs(subnet)
        .iter()
        .map(|a| {
            let cfg = dir.join(format!("sshd_config.{a}"));
            std::fs::write(
                &cfg,
                format!(
                    "ListenAddress {a}:2222\nHostKey {}\nAuthorizedKeysFile {}\nStrictModes no\nUsePAM no\n\
                     PasswordAuthentication no\nKbdInteractiveAuthentication no\nPidFile none\nMaxStartups 100\n\
                     PermitRootLogin prohibit-password\nLogLevel ERROR\n",
                    key.display(),
                    dir.join("authorized_keys").display()
                ),
            )
            .expect("sshd_config");
            without_bashrc("/usr/sbin/sshd")
                .args(["-D", "-e", "-f"])
                .arg(&cfg)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("OpenSSH sshd")
        })
        .collect();
    addrs(subnet).iter().for_each(|a| wait_listening(a));
    Servers { children }
}

pub(super) fn openssh_args(key: &Path) -> String {
    format!(
        "-p 2222 -i {} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR -o BatchMode=yes",
        key.display()
    )
}

fn run_ok(cmd: &mut Command) -> Duration {
    run_bounded(cmd).expect("a single ssh command hung")
}

/// Run to success; None when it hung past a minute (its process group is
/// killed). Open MPI 4 launches can hang on a 2-core machine; they are
/// counted, not waited for.
fn run_bounded(cmd: &mut Command) -> Option<Duration> {
    use std::os::unix::process::CommandExt;
    let start = Instant::now();
    let mut child =
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).process_group(0).spawn().expect("run");
    let mut err = child.stderr.take().expect("stderr");
    let drain = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut err, &mut s);
        s
    });
    loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            let took = start.elapsed();
            let err = drain.join().unwrap_or_default();
            assert!(st.success(), "benchmark command failed: {st:?}\n{err}");
            return Some(took);
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid")),
                nix::sys::signal::Signal::SIGKILL,
            );
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn mpirun(agent: &str, extra_args: &str, hosts: &[String]) -> Command {
    let list = hosts.iter().map(|h| format!("{h}:1")).collect::<Vec<_>>().join(",");
    let mut c = Command::new("mpirun.openmpi");
    c.args(["-np", &HOSTS.to_string(), "--host", &list])
        .args(["--mca", "oob_tcp_if_include", "lo", "--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", "lo"])
        .args(["--mca", "plm_rsh_agent", agent, "--mca", "plm_rsh_no_tree_spawn", "1"])
        .args(["echo", "hello"])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    if !extra_args.is_empty() {
        c.env("OMPI_MCA_plm_rsh_args", extra_args);
    }
    c
}

/// `mpirun` hello world over 8 hosts, and one connection (`true`) per host.
pub fn launch(rows: &mut Vec<Row>) {
    let dir = tempfile::tempdir().expect("tmp");
    let keys = dir.path().join("keys");
    let key = job_keys(&keys);
    let agent_dir = dir.path().join("bin");
    let _ours = trainlet_servers(40, &keys, &agent_dir);
    let ossh_dir = dir.path().join("openssh");
    std::fs::create_dir_all(&ossh_dir).expect("dir");
    std::fs::copy(keys.join("authorized_keys"), ossh_dir.join("authorized_keys")).expect("copy");
    let _theirs = openssh_servers(41, &ossh_dir, &key);
    let agent = agent_dir.join("ssh");
    assert!(agent.exists(), "trainlet sshd made the agent link");
    let (ours_hosts, their_hosts) = (addrs(40), addrs(41));
    let with_keys = |c: &mut Command| {
        c.env("TRAINLET_SSH_DIR", &keys).env("TRAINLET_LOG", "warn");
    };

    // Per-host connection setup: connect, key exchange, auth, exec `true`.
    let rounds = 15;
    let (mut o, mut t) = (Vec::new(), Vec::new());
    for i in 0..rounds {
        let h = &ours_hosts[i % ours_hosts.len()];
        let mut c = Command::new(&agent);
        c.args([h.as_str(), "true"]);
        with_keys(&mut c);
        o.push(run_ok(&mut c));
        let h = &their_hosts[i % their_hosts.len()];
        let mut c = Command::new("/usr/bin/ssh");
        c.args(openssh_args(&key).split(' ')).args([h.as_str(), "true"]);
        t.push(run_ok(&mut c));
    }
    let (o, t) = (median(o), median(t));
    rows.push(time_row("ssh connection setup per host (connect, kex, auth, exec true)".to_string(), o, t, "report"));

    let rounds = 7;
    let (mut o, mut t, mut hung) = (Vec::new(), Vec::new(), (0, 0));
    for _ in 0..rounds {
        let mut c = mpirun(&agent.display().to_string(), "", &ours_hosts);
        with_keys(&mut c);
        run_bounded(&mut c).map_or_else(|| hung.0 += 1, |d| o.push(d));
        let mut c = mpirun("/usr/bin/ssh", &openssh_args(&key), &their_hosts);
        run_bounded(&mut c).map_or_else(|| hung.1 += 1, |d| t.push(d));
    }
    if hung != (0, 0) {
        eprintln!("hung mpirun launches (killed after 60 s): trainlet {}, OpenSSH {}", hung.0, hung.1);
    }
    let (o, t) = (median(o), median(t));
    rows.push(time_row(format!("mpirun hello world over {HOSTS} hosts (Open MPI 4.1, flat)"), o, t, ">= 1.2x"));

    // What a user runs: `trainlet mpi` (with its readiness handshake to every host).
    let list = ours_hosts.iter().map(|h| format!("{h}:1")).collect::<Vec<_>>().join(",");
    let mut o = Vec::new();
    for _ in 0..rounds {
        let mut c = Command::new(trainlet());
        c.args(["mpi", "--stop-workers", "never", "--hosts", &list, "--", "mpirun.openmpi", "-np", &HOSTS.to_string()])
            .args([
                "--mca",
                "oob_tcp_if_include",
                "lo",
                "--mca",
                "btl",
                "self,tcp",
                "--mca",
                "btl_tcp_if_include",
                "lo",
            ])
            .args(["echo", "hello"])
            .env("TRAINLET_AGENT_DIR", &agent_dir)
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
        with_keys(&mut c);
        if let Some(d) = run_bounded(&mut c) {
            o.push(d);
        }
    }
    let o = median(o);
    rows.push(time_row(
        format!("`trainlet mpi -- mpirun` hello world over {HOSTS} hosts, readiness check included"),
        o,
        t,
        ">= 1.2x",
    ));
}

/// Processes whose executable is `exe` (all of OpenSSH's per-connection children).
fn pids_of(exe: &Path) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .expect("proc")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| std::fs::read_link(format!("/proc/{p}/exe")).is_ok_and(|e| e == exe))
        .collect()
}

/// Resident memory of the server side with one idle session open.
pub fn idle_rss(rows: &mut Vec<Row>) {
    let dir = tempfile::tempdir().expect("tmp");
    let keys = dir.path().join("keys");
    let key = job_keys(&keys);
    let agent_dir = dir.path().join("bin");
    let ours = trainlet_servers(42, &keys, &agent_dir);
    let before: Vec<u32> = pids_of(Path::new("/usr/sbin/sshd"));
    let ossh_dir = dir.path().join("openssh");
    std::fs::create_dir_all(&ossh_dir).expect("dir");
    std::fs::copy(keys.join("authorized_keys"), ossh_dir.join("authorized_keys")).expect("copy");
    let _theirs = openssh_servers(43, &ossh_dir, &key);
    let mut ours_session = Command::new(agent_dir.join("ssh"))
        .args(["127.0.42.2", "sleep 30"])
        .env("TRAINLET_SSH_DIR", &keys)
        .stdin(Stdio::null())
        .spawn()
        .expect("session");
    let mut their_session = Command::new("/usr/bin/ssh")
        .args(openssh_args(&key).split(' '))
        .args(["127.0.43.2", "sleep 30"])
        .stdin(Stdio::null())
        .spawn()
        .expect("session");
    std::thread::sleep(Duration::from_secs(3));
    let o = rss_kib(ours.children[0].id());
    // OpenSSH: the listener of 127.0.43.2 plus its per-session processes
    // (privsep monitor and the user's session process).
    let listener = _theirs.children[0].id();
    let theirs: u64 = pids_of(Path::new("/usr/sbin/sshd"))
        .into_iter()
        .filter(|p| !before.contains(p))
        .filter(|p| *p == listener || parent_chain_contains(*p, listener))
        .map(rss_kib)
        .sum();
    let _ = ours_session.kill();
    let _ = their_session.kill();
    let _ = ours_session.wait();
    let _ = their_session.wait();
    rows.push(memory_row("idle SSH server with one session, resident memory", o, theirs, "report"));
}

fn parent_chain_contains(mut pid: u32, ancestor: u32) -> bool {
    for _ in 0..8 {
        let Some(ppid) = i32::try_from(pid).ok().and_then(trainlet::sys::parent_of) else { return false };
        if ppid == ancestor {
            return true;
        }
        if ppid <= 1 {
            return false;
        }
        pid = ppid;
    }
    false
}
