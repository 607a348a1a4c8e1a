//! `trainlet sshd` and `trainlet ssh` against each other and against real
//! OpenSSH, both ways: exit status, output, refusals, and what happens to
//! remote processes when a client goes away. Each test owns a loopback
//! subnet 127.0.<n>.0/24 and port 2222, like pods with their own IPs.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::sshkit::{Wrap, client, keygen, pids_with_cmdline, private_copy, ssh_env, sshd, trainer_keys, wait_until};

const LIMIT: Duration = Duration::from_secs(60);

fn openssh(args: &[&str], key: &Path, stdin: &str) -> std::process::Output {
    use std::io::Write;
    let mut child = Command::new("/usr/bin/ssh")
        .args(["-p", "2222", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"])
        .args(["-o", "BatchMode=yes", "-o", "LogLevel=ERROR", "-i"])
        .arg(key)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run OpenSSH ssh");
    child.stdin.take().expect("stdin").write_all(stdin.as_bytes()).expect("write stdin");
    child.wait_with_output().expect("ssh output")
}

#[test]
fn openssh_client_runs_commands_on_trainlet_sshd_with_a_trainer_key() {
    let keys = trainer_keys();
    let agent = tempfile::tempdir().expect("tmp");
    let env = ssh_env(keys.path(), agent.path());
    let mut server = sshd("127.0.11.2:2222", &env, &Wrap::default());
    let key = private_copy(&keys.path().join("id_rsa"), agent.path());

    let out =
        openssh(&["127.0.11.2", "echo", "out:$USER;", "echo", "err", ">&2;", "cat;", "exit", "7"], &key, "piped-in\n");
    assert_eq!(out.status.code(), Some(7), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.starts_with("out:"), "{stdout}");
    assert!(stdout.contains("piped-in"), "stdin reaches the command: {stdout}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("err"), "stderr comes back as extended data");

    // A signal death is exit-signal: OpenSSH reports 255.
    let out = openssh(&["127.0.11.2", "kill -9 $$"], &key, "");
    assert_eq!(out.status.code(), Some(255));

    // Allowed env requests arrive, others do not.
    let out = Command::new("/usr/bin/ssh")
        .args([
            "-p",
            "2222",
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "BatchMode=yes",
        ])
        .args(["-o", "SendEnv=LC_TRAINLET OMPI_MCA_test FORBIDDEN", "-i"])
        .arg(&key)
        .args(["127.0.11.2", "echo LC=$LC_TRAINLET MCA=$OMPI_MCA_test NO=$FORBIDDEN"])
        .env("LC_TRAINLET", "c")
        .env("OMPI_MCA_test", "m")
        .env("FORBIDDEN", "f")
        .output()
        .expect("ssh");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "LC=c MCA=m NO=");
    server.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(server.code(LIMIT), 0, "sshd exits 0 on SIGTERM");
}

/// OpenSSH's sshd on `addr`:2222 with `host_key`, letting in `authorized`.
fn openssh_sshd(dir: &Path, addr: &str, host_key: &Path, authorized: &Path) -> crate::util::Pod {
    std::fs::create_dir_all("/run/sshd").expect("privsep dir");
    let cfg = dir.join("sshd_config");
    std::fs::write(
        &cfg,
        format!(
            "ListenAddress {addr}:2222\nHostKey {}\nAuthorizedKeysFile {}\nStrictModes no\nUsePAM no\n\
             PasswordAuthentication no\nKbdInteractiveAuthentication no\nPidFile none\nPermitRootLogin prohibit-password\n",
            host_key.display(),
            authorized.display()
        ),
    )
    .expect("sshd_config");
    let pod =
        crate::util::Pod::start_as(Path::new("/usr/sbin/sshd"), &["-D", "-e", "-f", &cfg.display().to_string()], &[]);
    wait_until(LIMIT, "OpenSSH sshd to listen", || std::net::TcpStream::connect((addr, 2222)).is_ok());
    pod
}

#[test]
fn trainlet_ssh_runs_commands_on_openssh_sshd_and_pins_its_host_key() {
    let keys = trainer_keys();
    let work = tempfile::tempdir().expect("tmp");
    let host = keygen("ed25519");
    let host_key = private_copy(&host.path().join("id_rsa"), work.path());
    let _sshd = openssh_sshd(work.path(), "127.0.12.2", &host_key, &keys.path().join("authorized_keys"));

    let mut env = ssh_env(keys.path(), work.path());
    env.push(("TRAINLET_SSH_RETRY".into(), "1".into()));
    // Not pinned: refused, with OpenSSH's words.
    let mut c = client(&["127.0.12.2", "echo", "hi;", "exit", "5"], &env);
    assert_eq!(c.code(LIMIT), 255);
    assert!(c.stderr().contains("Host key verification failed."), "{}", c.stderr());

    // Explicit opt-out for a foreign server.
    let mut c = client(&["-o", "StrictHostKeyChecking=no", "127.0.12.2", "echo", "hi;", "exit", "5"], &env);
    assert_eq!(c.code(LIMIT), 5, "{}", c.stderr());
    assert_eq!(c.stdout(), "hi\n");

    // Pinned through known_hosts: accepted.
    let pinned = tempfile::tempdir().expect("tmp");
    for f in ["id_rsa", "authorized_keys"] {
        std::fs::copy(keys.path().join(f), pinned.path().join(f)).expect("copy");
    }
    let host_pub = std::fs::read_to_string(host.path().join("id_rsa.pub")).expect("pub");
    std::fs::write(pinned.path().join("known_hosts"), format!("127.0.12.* {host_pub}")).expect("known_hosts");
    let env = ssh_env(pinned.path(), work.path());
    let mut c = client(&["-p", "2222", "127.0.12.2", "exit 3"], &env);
    assert_eq!(c.code(LIMIT), 3, "{}", c.stderr());
}

#[test]
fn refusals_are_logged_and_the_server_keeps_serving() {
    let keys = keygen("ed25519");
    let other = keygen("ed25519");
    let work = tempfile::tempdir().expect("tmp");
    let env = ssh_env(keys.path(), work.path());
    let mut server = sshd("127.0.13.2:2222", &env, &Wrap::default());
    let quick = |dir: &Path| {
        let mut e = ssh_env(dir, work.path());
        e.push(("TRAINLET_SSH_RETRY".into(), "1".into()));
        e
    };

    // A key that is not in authorized_keys.
    let mut stranger_env = quick(other.path());
    stranger_env.push(("TRAINLET_SSH_HOST_KEY_CHECKING".into(), "no".into()));
    let mut c = client(&["127.0.13.2", "true"], &stranger_env);
    assert_eq!(c.code(LIMIT), 255);
    assert!(c.stderr().contains("Permission denied (publickey)."), "{}", c.stderr());
    server.wait_for_stderr("refused public key", LIMIT);
    assert!(server.stderr().contains("peer=127.0.0.1:"), "refusal names the peer: {}", server.stderr());

    // A server whose host key is not one of the job's pinned keys.
    let foreign = keygen("ed25519");
    let mut foreign_server = sshd("127.0.13.3:2222", &ssh_env(foreign.path(), work.path()), &Wrap::default());
    let mut c = client(&["127.0.13.3", "true"], &quick(keys.path()));
    assert_eq!(c.code(LIMIT), 255);
    assert!(c.stderr().contains("Host key verification failed."), "{}", c.stderr());
    foreign_server.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(foreign_server.code(LIMIT), 0);

    // pty and port forwarding, asked for by OpenSSH.
    let key = keys.path().join("id_rsa");
    let out = openssh(&["-tt", "127.0.13.2", "true"], &key, "");
    assert_eq!(out.status.code(), Some(255), "pty refused: {}", String::from_utf8_lossy(&out.stderr));
    server.wait_for_stderr("request=\"pty\"", LIMIT);
    let out = openssh(&["-o", "ExitOnForwardFailure=yes", "-R", "0:127.0.0.1:9", "127.0.13.2", "true"], &key, "");
    assert_eq!(out.status.code(), Some(255), "remote forward refused: {}", String::from_utf8_lossy(&out.stderr));
    server.wait_for_stderr("request=\"tcpip-forward\"", LIMIT);
    let out = openssh(&["-W", "127.0.0.1:9", "127.0.13.2"], &key, "");
    assert_eq!(out.status.code(), Some(255), "direct-tcpip refused");
    server.wait_for_stderr("request=\"direct-tcpip\"", LIMIT);

    // Still serving.
    let mut c = client(&["127.0.13.2", "echo", "alive"], &quick(keys.path()));
    assert_eq!(c.code(LIMIT), 0, "{}", c.stderr());
    assert_eq!(c.stdout(), "alive\n");
}

#[test]
fn remote_commands_die_with_their_session() {
    let keys = keygen("ecdsa-p521");
    let work = tempfile::tempdir().expect("tmp");
    let env = ssh_env(keys.path(), work.path());
    let _server = sshd("127.0.14.2:2222", &env, &Wrap::default());

    // Killed by a signal: 255 at the client.
    let mut c = client(&["127.0.14.2", "kill -TERM $$"], &env);
    assert_eq!(c.code(LIMIT), 255);

    // The client dies: the whole remote process group goes, background jobs included.
    let mut c = client(&["127.0.14.2", "sleep 3171 & sleep 3172; wait"], &env);
    wait_until(LIMIT, "the remote sleeps to start", || {
        !pids_with_cmdline("sleep 3171").is_empty() && !pids_with_cmdline("sleep 3172").is_empty()
    });
    c.signal(nix::sys::signal::Signal::SIGKILL);
    let _ = c.wait(LIMIT);
    wait_until(Duration::from_secs(15), "the remote process group to be terminated", || {
        pids_with_cmdline("sleep 3171").is_empty() && pids_with_cmdline("sleep 3172").is_empty()
    });

    // A command that ignores SIGTERM is killed after the kill timeout.
    let mut c = client(&["127.0.14.2", "trap '' TERM; sleep 3173"], &env);
    wait_until(LIMIT, "the stubborn command to start", || !pids_with_cmdline("sleep 3173").is_empty());
    c.signal(nix::sys::signal::Signal::SIGTERM);
    let _ = c.wait(LIMIT);
    wait_until(Duration::from_secs(15), "SIGKILL after the kill timeout", || {
        pids_with_cmdline("sleep 3173").is_empty()
    });
}

#[test]
fn a_server_that_comes_up_late_is_waited_for_and_one_that_never_does_fails_in_time() {
    let keys = keygen("ed25519");
    let work = tempfile::tempdir().expect("tmp");
    let env = ssh_env(keys.path(), work.path());
    let mut c = client(&["127.0.15.2", "echo", "late"], &env);
    std::thread::sleep(Duration::from_secs(2));
    let _server = sshd("127.0.15.2:2222", &env, &Wrap::default());
    assert_eq!(c.code(LIMIT), 0, "{}", c.stderr());
    assert_eq!(c.stdout(), "late\n");

    let mut quick = env.clone();
    quick.push(("TRAINLET_SSH_RETRY".into(), "2".into()));
    let started = std::time::Instant::now();
    let mut c = client(&["127.0.15.3", "true"], &quick);
    assert_eq!(c.code(LIMIT), 255);
    assert!(started.elapsed() < Duration::from_secs(20), "bounded retry");
    assert!(c.stderr().contains("ssh: connect to host 127.0.15.3 port 2222: Connection refused"), "{}", c.stderr());
}

#[test]
fn sshd_runs_as_an_unprivileged_uid_with_no_passwd_entry_and_trainer_modes() {
    use std::os::unix::fs::PermissionsExt;
    // Trainer mounts the Secret root-owned, id_rsa 0640 with group fsGroup.
    let keys = trainer_keys();
    let uid = 4242;
    std::fs::set_permissions(keys.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let key = keys.path().join("id_rsa");
    std::os::unix::fs::chown(&key, Some(0), Some(uid)).expect("chown");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o640)).expect("chmod");
    let agent = tempfile::tempdir().expect("tmp");
    std::fs::set_permissions(agent.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let env = ssh_env(keys.path(), agent.path());
    let exe = crate::util::bin().display().to_string();
    let ids = [format!("--reuid={uid}"), format!("--regid={uid}")];
    let start_as_uid = |env: &[(String, String)]| {
        let refs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let mut server = crate::util::Pod::start_as(
            Path::new("/usr/bin/setpriv"),
            &[&ids[0], &ids[1], "--clear-groups", &exe, "sshd", "--listen=127.0.16.2:2222"],
            &refs,
        );
        server.wait_for_output("trainlet sshd listening on", LIMIT);
        server
    };
    let mut server = start_as_uid(&env);
    let mut c = client(&["127.0.16.2", "id -u; echo $PWD"], &env);
    assert_eq!(c.code(LIMIT), 0, "client: {}\nserver: {}", c.stderr(), server.stderr());
    assert_eq!(c.stdout(), format!("{uid}\n{}\n", agent.path().display()), "runs as the server's uid, in HOME");
    // A HOME it cannot enter: the command runs in /.
    server.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(server.code(LIMIT), 0);
    let mut locked = env.clone();
    locked.push(("HOME".into(), "/root".into()));
    let mut server = start_as_uid(&locked);
    let mut c = client(&["127.0.16.2", "echo $PWD"], &env);
    assert_eq!(c.code(LIMIT), 0, "client: {}\nserver: {}", c.stderr(), server.stderr());
    assert_eq!(c.stdout(), "/\n");
    server.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(server.code(LIMIT), 0);
}

#[test]
fn a_remote_bash_reads_bashrc_as_under_sshd() {
    // Debian's bash reads ~/.bashrc for a top-level shell started by sshd
    // (SSH_CLIENT set, SHLVL not inherited): where PATH additions for orted
    // usually live.
    let shell = std::fs::read_to_string("/etc/passwd")
        .expect("passwd")
        .lines()
        .find(|l| l.starts_with("root:"))
        .and_then(|l| l.rsplit(':').next().map(str::to_string))
        .expect("root entry");
    assert!(shell.ends_with("bash"), "this test expects root's login shell to be bash, not {shell}");
    let keys = keygen("ed25519");
    let work = tempfile::tempdir().expect("tmp");
    std::fs::write(work.path().join(".bashrc"), "export FROM_BASHRC=yes\n").expect("bashrc");
    let mut env = ssh_env(keys.path(), work.path());
    env.push(("SHLVL".into(), "3".into()));
    let _server = sshd("127.0.17.2:2222", &env, &Wrap::default());
    let mut c = client(&["127.0.17.2", "echo rc=$FROM_BASHRC level=$SHLVL"], &env);
    assert_eq!(c.code(LIMIT), 0, "{}", c.stderr());
    assert_eq!(c.stdout(), "rc=yes level=1\n");
}

#[test]
fn a_link_named_sshd_takes_the_mpi_operator_command_line_and_config() {
    // Trainer's MPI runtimes run `/usr/sbin/sshd -De -f /home/mpiuser/.sshd_config`.
    let keys = trainer_keys();
    let work = tempfile::tempdir().expect("tmp");
    let link = work.path().join("sshd");
    std::os::unix::fs::symlink(crate::util::bin(), &link).expect("link");
    let pid_file = work.path().join("sshd.pid");
    let cfg = work.path().join(".sshd_config");
    std::fs::write(
        &cfg,
        format!(
            "PidFile {}\nHostKey {}\nStrictModes no\nPort 2222\nListenAddress 127.0.18.2\n",
            pid_file.display(),
            keys.path().join("id_rsa").display()
        ),
    )
    .expect("config");
    let mut env = ssh_env(keys.path(), work.path());
    env.retain(|(k, _)| k != "TRAINLET_SSH_DIR"); // keys found through HostKey, as sshd would
    let refs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut server = crate::util::Pod::start_as(&link, &["-De", "-f", &cfg.display().to_string()], &refs);
    server.wait_for_output("trainlet sshd listening on 127.0.18.2:2222", LIMIT);
    let pid: i32 = std::fs::read_to_string(&pid_file).expect("pid file").trim().parse().expect("pid");
    assert_eq!(pid, server.pid());
    let mut c = client(&["127.0.18.2", "echo", "drop-in"], &ssh_env(keys.path(), work.path()));
    assert_eq!(c.code(LIMIT), 0, "{}", c.stderr());
    assert_eq!(c.stdout(), "drop-in\n");
    server.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(server.code(LIMIT), 0);
    assert!(!pid_file.exists(), "the pid file is removed on exit");

    // A config error names the file and line.
    std::fs::write(&cfg, "Port 22x\n").expect("config");
    let mut bad = crate::util::Pod::start_as(&link, &["-De", "-f", &cfg.display().to_string()], &refs);
    assert_eq!(bad.code(LIMIT), 200);
    assert!(bad.stderr().contains(":1: bad Port \"22x\""), "{}", bad.stderr());

    // So does a bad TRAINLET_SSH_PORT when the config names no port: never a silent 22.
    std::fs::write(&cfg, "ListenAddress 127.0.18.2\n").expect("config");
    let mut refs = refs.clone();
    refs.push(("TRAINLET_SSH_PORT", "22x"));
    let mut bad = crate::util::Pod::start_as(&link, &["-De", "-f", &cfg.display().to_string()], &refs);
    assert_eq!(bad.code(LIMIT), 200);
    assert!(bad.stderr().contains("invalid TRAINLET_SSH_PORT value \"22x\""), "{}", bad.stderr());
}

/// A remote command that cannot be exec'd (a 250 KB command line: E2BIG
/// for `sh -c`) used to abort the server (std's spawn raced the reaper and
/// panicked). Now each is refused and the server goes on serving.
#[test]
fn a_command_that_cannot_be_executed_does_not_take_the_server_down() {
    let keys = trainer_keys();
    let agent = tempfile::tempdir().expect("tmp");
    let env = ssh_env(keys.path(), agent.path());
    let mut server = sshd("127.0.19.2:2222", &env, &Wrap::default());
    let key = private_copy(&keys.path().join("id_rsa"), agent.path());
    // Five 50 KB words: each fits ssh's own argv, their join does not fit
    // one argument of the remote `sh -c` (MAX_ARG_STRLEN is 128 KiB).
    let word = format!("echo {}", "x".repeat(50_000));
    let huge: Vec<&str> = std::iter::once("127.0.19.2").chain(std::iter::repeat_n(word.as_str(), 5)).collect();
    for i in 0..10 {
        let out = openssh(&huge, &key, "");
        assert_ne!(out.status.code(), Some(0), "run {i}: a 250 KB command cannot run");
        assert!(server.child.try_wait().expect("try_wait").is_none(), "run {i}: sshd died: {}", server.stderr());
    }
    let out = openssh(&["127.0.19.2", "echo", "still-serving"], &key, "");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "still-serving", "{}", server.stderr());
    let log = server.stderr();
    assert!(log.contains("cannot start the command") && log.contains("Argument list too long"), "{log}");
    server.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(server.code(LIMIT), 0, "sshd exits 0 on SIGTERM: {}", server.stderr());
}

/// A client that accepts any host key and does only what a test tells it
/// (russh's client: OpenSSH never sends an auth method or channel the
/// server did not offer, and never stalls on purpose).
struct AnyHost;

impl russh::client::Handler for AnyHost {
    type Error = russh::Error;

    async fn check_server_key(&mut self, _key: &russh::keys::PublicKeyOrCertificate) -> Result<bool, Self::Error> {
        Ok(true)
    }
}

fn raw_client(addr: &str) -> (tokio::runtime::Runtime, russh::client::Handle<AnyHost>) {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let config = std::sync::Arc::new(russh::client::Config::default());
    let handle = rt.block_on(russh::client::connect(config, addr, AnyHost)).expect("key exchange");
    (rt, handle)
}

/// Read from `s` until the server closes it; what it sent.
fn until_closed(s: &mut std::net::TcpStream) -> Vec<u8> {
    use std::io::Read;
    s.set_read_timeout(Some(LIMIT)).expect("timeout");
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return got,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return got,
            Err(e) => panic!("the server kept an unauthenticated connection open: {e}"),
        }
    }
}

/// OpenSSH's LoginGraceTime: a connection that sends no banner, one that
/// stops in key exchange and one that finishes it but never authenticates
/// are all closed at the grace time; an authenticated session is not.
#[test]
fn unauthenticated_connections_are_closed_at_the_login_grace_time() {
    use std::io::Write;
    let keys = keygen("ed25519");
    let work = tempfile::tempdir().expect("tmp");
    let mut env = ssh_env(keys.path(), work.path());
    env.push(("TRAINLET_SSH_RETRY".into(), "5".into()));
    let mut server = Wrap::default().trainlet(&["sshd", "--listen=127.0.21.2:2222", "--login-grace-time", "2"], &env);
    server.wait_for_output("trainlet sshd listening on", LIMIT);

    let mut silent = std::net::TcpStream::connect("127.0.21.2:2222").expect("connect");
    assert!(until_closed(&mut silent).starts_with(b"SSH-2.0-"), "the server speaks first, then gives up");
    let mut stalled = std::net::TcpStream::connect("127.0.21.2:2222").expect("connect");
    stalled.write_all(b"SSH-2.0-stalled_1.0\r\n").expect("banner");
    until_closed(&mut stalled);
    let (rt, handle) = raw_client("127.0.21.2:2222");
    rt.block_on(async {
        let started = std::time::Instant::now();
        while !handle.is_closed() {
            assert!(started.elapsed() < LIMIT, "a connection past key exchange was never closed");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    // Authenticated sessions outlive the grace time.
    let mut c = client(&["127.0.21.2", "sleep 4; echo done"], &env);
    assert_eq!(c.code(LIMIT), 0, "{}", c.stderr());
    assert_eq!(c.stdout(), "done\n");
    let log = server.stderr();
    assert!(log.contains("sent no SSH banner within the login grace time"), "{log}");
    assert!(log.contains("did not authenticate within the login grace time"), "{log}");
}

/// OpenSSH's MaxStartups: with `--max-startups 3`, a fourth connection
/// while three are unauthenticated is dropped at once (no banner); once
/// they go, clients get in again.
#[test]
fn connections_past_max_startups_are_dropped_until_the_pending_ones_go() {
    use std::io::{BufRead, BufReader};
    let keys = keygen("ed25519");
    let work = tempfile::tempdir().expect("tmp");
    let mut env = ssh_env(keys.path(), work.path());
    env.push(("TRAINLET_SSH_RETRY".into(), "30".into()));
    let mut server = Wrap::default().trainlet(&["sshd", "--listen=127.0.21.3:2222", "--max-startups", "3"], &env);
    server.wait_for_output("trainlet sshd listening on", LIMIT);
    let held: Vec<std::net::TcpStream> = (0..3)
        .map(|_| {
            let s = std::net::TcpStream::connect("127.0.21.3:2222").expect("connect");
            let mut banner = String::new();
            BufReader::new(s.try_clone().expect("clone")).read_line(&mut banner).expect("banner");
            assert!(banner.starts_with("SSH-2.0-"), "{banner:?}");
            s
        })
        .collect();
    let mut fourth = std::net::TcpStream::connect("127.0.21.3:2222").expect("connect");
    assert!(until_closed(&mut fourth).is_empty(), "the fourth connection must be dropped before the banner");
    server.wait_for_stderr("dropped a connection past MaxStartups", LIMIT);
    drop(held);
    let mut c = client(&["127.0.21.3", "echo", "in"], &env);
    assert_eq!(c.code(LIMIT), 0, "{}", c.stderr());
    assert_eq!(c.stdout(), "in\n");
}

/// Auth methods other than publickey (none, password, keyboard-interactive)
/// and channel types other than session are refused and logged at info
/// with the peer; the user name a client sends is escaped in the log.
#[test]
fn refused_auth_methods_and_channel_types_are_logged_with_the_peer() {
    let keys = keygen("ed25519");
    let work = tempfile::tempdir().expect("tmp");
    let env = ssh_env(keys.path(), work.path());
    let mut server = sshd("127.0.22.2:2222", &env, &Wrap::default());
    let (rt, mut handle) = raw_client("127.0.22.2:2222");
    let user = nix::unistd::User::from_uid(nix::unistd::getuid()).ok().flatten().map_or("root".into(), |u| u.name);
    rt.block_on(async {
        let none = handle.authenticate_none("forged\nINFO line").await.expect("none");
        assert!(!none.success());
        let password = handle.authenticate_password(user.as_str(), "secret").await.expect("password");
        assert!(!password.success());
        let kbd = handle.authenticate_keyboard_interactive_start(user.as_str(), None::<String>).await.expect("kbd");
        assert!(matches!(kbd, russh::client::KeyboardInteractiveAuthResponse::Failure { .. }), "{kbd:?}");
        let key = russh::keys::load_secret_key(keys.path().join("id_rsa"), None).expect("key");
        let key = russh::keys::PrivateKeyWithHashAlg::new(std::sync::Arc::new(key), None);
        assert!(handle.authenticate_publickey(user.as_str(), key).await.expect("publickey").success());
        assert!(handle.channel_open_direct_streamlocal("/run/docker.sock").await.is_err());
    });
    server.wait_for_stderr("request=\"direct-streamlocal\"", LIMIT);
    let log = server.stderr();
    for method in ["none", "password", "keyboard-interactive"] {
        let line = log
            .lines()
            .find(|l| l.contains(&format!("method=\"{method}\"")) || l.contains(&format!("method={method}")))
            .unwrap_or_else(|| panic!("no line for {method}:\n{log}"));
        assert!(line.contains(" INFO ") && line.contains("peer=127.0.0.1:"), "{line}");
    }
    assert!(log.contains("forged\\nINFO line"), "the user name is escaped:\n{log}");
    assert!(!log.lines().any(|l| l.starts_with("INFO line")), "a client forged a log line:\n{log}");
}

/// ssh-audit's verdicts on the server on `addr`, by category (`kex`,
/// `key`, `enc`, `mac`): (algorithm, warnings and failures).
fn ssh_audit(addr: &str) -> (serde_json::Value, Vec<(String, String, Vec<String>)>) {
    let out = Command::new(crate::util::python())
        .args(["-m", "ssh_audit", "-j", "--skip-rate-test", "-p", "2222", addr])
        .output()
        .expect("ssh-audit (PyPI) in the test venv");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("ssh-audit output: {e}\n{}", String::from_utf8_lossy(&out.stdout)));
    let mut flagged = Vec::new();
    for kind in ["kex", "key", "enc", "mac"] {
        for alg in report[kind].as_array().expect("category") {
            let name = alg["algorithm"].as_str().expect("name").to_string();
            let notes: Vec<String> = ["warn", "fail"]
                .iter()
                .flat_map(|level| alg["notes"][level].as_array().cloned().unwrap_or_default())
                .filter_map(|n| n.as_str().map(str::to_string))
                .collect();
            flagged.push((kind.to_string(), name, notes));
        }
    }
    (report, flagged)
}

/// ssh-audit (the tool that flagged encrypt-and-MAC) against trainlet
/// sshd: MACs are etm only, ciphers AEAD or CTR (with those MACs), no
/// SHA-1, nothing fails; with an ed25519 host key nothing but key
/// exchange's post-quantum note is flagged (curve25519 stays for OpenSSH
/// 8.x/9.x), with Trainer's ECDSA P-521 key only that key adds to it.
#[test]
fn ssh_audit_finds_only_etm_macs_aead_or_ctr_ciphers_and_no_failures() {
    let work = tempfile::tempdir().expect("tmp");
    for (kind, addr) in [("ed25519", "127.0.23.2"), ("ecdsa-p521", "127.0.23.3")] {
        let keys = keygen(kind);
        let mut server = sshd(&format!("{addr}:2222"), &ssh_env(keys.path(), work.path()), &Wrap::default());
        let (report, flagged) = ssh_audit(addr);
        let names = |k: &str| -> Vec<&str> { flagged.iter().filter(|f| f.0 == k).map(|f| f.1.as_str()).collect() };
        assert_eq!(names("mac"), ["hmac-sha2-512-etm@openssh.com", "hmac-sha2-256-etm@openssh.com"]);
        for c in names("enc") {
            assert!(c.contains("poly1305") || c.ends_with("-gcm@openssh.com") || c.ends_with("-ctr"), "{c}");
        }
        for (cat, name, notes) in &flagged {
            assert!(
                !notes.iter().any(|n| n.contains("SHA-1") || n.contains("encrypt-and-MAC")),
                "{cat} {name}: {notes:?}"
            );
            let post_quantum_only = notes.iter().all(|n| n.contains("post-quantum"));
            match (cat.as_str(), kind) {
                ("kex", _) => assert!(post_quantum_only, "{name}: {notes:?}"),
                ("key", "ecdsa-p521") => assert_eq!(name, "ecdsa-sha2-nistp521"),
                _ => assert!(notes.is_empty(), "{kind}: {cat} {name}: {notes:?}"),
            }
        }
        assert!(names("kex").contains(&"curve25519-sha256"), "OpenSSH 8.x needs it");
        if kind == "ed25519" {
            let recs = &report["recommendations"];
            assert!(recs.as_object().is_none_or(serde_json::Map::is_empty), "{recs}");
        }
        server.signal(nix::sys::signal::Signal::SIGTERM);
        assert_eq!(server.code(LIMIT), 0);
    }
}

/// OpenSSH clients limited to OpenSSH 8.0's default algorithm lists (the
/// oldest in MPI images) connect with every offered cipher and MAC; a
/// client that offers only encrypt-and-MAC is refused by name.
#[test]
fn openssh_8_defaults_connect_and_encrypt_and_mac_is_refused() {
    let keys = trainer_keys();
    let work = tempfile::tempdir().expect("tmp");
    let _server = sshd("127.0.23.4:2222", &ssh_env(keys.path(), work.path()), &Wrap::default());
    let key = private_copy(&keys.path().join("id_rsa"), work.path());
    let openssh_8_0 = [
        "-o",
        "KexAlgorithms=curve25519-sha256,curve25519-sha256@libssh.org,ecdh-sha2-nistp256,ecdh-sha2-nistp384,\
         ecdh-sha2-nistp521,diffie-hellman-group-exchange-sha256,diffie-hellman-group16-sha512,\
         diffie-hellman-group18-sha512,diffie-hellman-group14-sha256,diffie-hellman-group14-sha1",
        "-o",
        "HostKeyAlgorithms=ecdsa-sha2-nistp256,ecdsa-sha2-nistp384,ecdsa-sha2-nistp521,ssh-ed25519,\
         rsa-sha2-512,rsa-sha2-256,ssh-rsa",
    ];
    let ciphers = [
        "chacha20-poly1305@openssh.com",
        "aes128-ctr",
        "aes192-ctr",
        "aes256-ctr",
        "aes128-gcm@openssh.com",
        "aes256-gcm@openssh.com",
    ];
    for cipher in ciphers {
        for mac in ["hmac-sha2-256-etm@openssh.com", "hmac-sha2-512-etm@openssh.com"] {
            let mut args: Vec<&str> = openssh_8_0.to_vec();
            args.extend(["-c", cipher, "-m", mac, "127.0.23.4", "echo", "ok"]);
            let out = openssh(&args, &key, "");
            assert_eq!(
                String::from_utf8_lossy(&out.stdout),
                "ok\n",
                "{cipher} {mac}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    let out = Command::new("/usr/bin/ssh")
        .args(["-p", "2222", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"])
        .args(["-o", "BatchMode=yes", "-o", "LogLevel=INFO", "-c", "aes128-ctr"])
        .args(["-m", "hmac-sha2-256,hmac-sha2-512,hmac-sha1", "-i"])
        .arg(&key)
        .args(["127.0.23.4", "true"])
        .output()
        .expect("ssh");
    assert_eq!(out.status.code(), Some(255));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no matching MAC found"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
