//! Helpers for the SSH and MPI tests: job keys, `trainlet sshd` pods on
//! their own loopback addresses, real OpenSSH peers, process scans.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::util::{Pod, bin, live_pids};

/// A key directory from `trainlet keygen --out` (Trainer layout).
pub fn keygen(kind: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tmp");
    let out =
        Command::new(bin()).args(["keygen", "--type", kind, "--out"]).arg(dir.path()).output().expect("run keygen");
    assert!(out.status.success(), "keygen failed: {}", String::from_utf8_lossy(&out.stderr));
    let manifest = String::from_utf8_lossy(&out.stdout);
    assert!(manifest.contains("type: kubernetes.io/ssh-auth"), "{manifest}");
    dir
}

/// A key directory exactly as Trainer mounts it (reference/kubeflow.md
/// 3.1): an ECDSA P-521 key in SEC1 PEM named `id_rsa` with mode 0640, the
/// public key as `id_rsa.pub` and `authorized_keys` with mode 0644.
pub fn trainer_keys() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tmp");
    let key = dir.path().join("id_rsa");
    let st = Command::new("openssl")
        .args(["ecparam", "-name", "secp521r1", "-genkey", "-noout", "-out"])
        .arg(&key)
        .status()
        .expect("openssl");
    assert!(st.success());
    let pem = std::fs::read_to_string(&key).expect("pem");
    assert!(pem.starts_with("-----BEGIN EC PRIVATE KEY-----"), "not SEC1: {pem}");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let public = Command::new("ssh-keygen").arg("-y").arg("-f").arg(&key).output().expect("ssh-keygen -y");
    assert!(public.status.success(), "{}", String::from_utf8_lossy(&public.stderr));
    for name in ["id_rsa.pub", "authorized_keys"] {
        let p = dir.path().join(name);
        std::fs::write(&p, &public.stdout).expect("write pub");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    }
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o640)).expect("chmod");
    dir
}

/// A private copy of `key` with mode 0600 (OpenSSH's client refuses 0640).
pub fn private_copy(key: &Path, dir: &Path) -> PathBuf {
    let p = dir.join("openssh_id");
    std::fs::copy(key, &p).expect("copy key");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    p
}

/// An empty, non-executable file for `no_openssh.sh`.
pub fn empty_file(dir: &Path) -> PathBuf {
    let p = dir.join("not-openssh");
    std::fs::write(&p, "").expect("empty");
    p
}

/// Environment of a simulated pod's SSH side. HOME is a directory of the
/// test's own: remote shells read `$HOME/.bashrc` as under sshd, and the
/// machine's own (pyenv init, with a rehash lock that concurrent shells
/// wait on for up to a minute) must not take part in the tests.
pub fn ssh_env(keys: &Path, agent_dir: &Path) -> Vec<(String, String)> {
    vec![
        ("HOME".into(), agent_dir.display().to_string()),
        ("TRAINLET_SSH_DIR".into(), keys.display().to_string()),
        ("TRAINLET_AGENT_DIR".into(), agent_dir.display().to_string()),
        ("TRAINLET_SSH_RETRY".into(), "20".into()),
        ("OMPI_ALLOW_RUN_AS_ROOT".into(), "1".into()),
        ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM".into(), "1".into()),
    ]
}

fn refs(env: &[(String, String)]) -> Vec<(&str, &str)> {
    env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

/// How a simulated pod's process is started: directly, or through a
/// wrapper that execs it in place (a namespace).
#[derive(Debug, Clone, Default)]
pub struct Wrap(Vec<String>);

impl Wrap {
    /// In a mount namespace where OpenSSH cannot run (`no_openssh.sh`).
    pub fn without_openssh(empty: &Path) -> Self {
        Self(vec![crate::util::fixture("no_openssh.sh"), empty.display().to_string()])
    }

    /// In network namespace `ns`.
    pub fn in_netns(ns: &NetNs) -> Self {
        Self(vec!["/usr/sbin/ip".into(), "netns".into(), "exec".into(), ns.name.clone()])
    }

    /// Start `trainlet ARGS` this way.
    pub fn trainlet(&self, args: &[&str], env: &[(String, String)]) -> Pod {
        match self.0.split_first() {
            None => Pod::start(args, &refs(env)),
            Some((program, rest)) => {
                let exe = bin().display().to_string();
                let mut all: Vec<&str> = rest.iter().map(String::as_str).collect();
                all.push(&exe);
                all.extend_from_slice(args);
                Pod::start_as(Path::new(program), &all, &refs(env))
            }
        }
    }
}

/// `trainlet sshd` on `addr`, started through `wrap`; returns once it listens.
pub fn sshd(addr: &str, env: &[(String, String)], wrap: &Wrap) -> Pod {
    // Each simulated host gets its own TMPDIR, as each pod has its own /tmp:
    // Open MPI's daemons keep their session directories there, and all
    // simulated hosts share one hostname, so in one /tmp the daemons of one
    // job create and remove the same tree at once.
    let host = addr.split(':').next().unwrap_or(addr);
    let tmp = std::env::temp_dir().join(format!("tl-{host}"));
    std::fs::create_dir_all(&tmp).expect("host tmpdir");
    let mut env = env.to_vec();
    env.retain(|(k, _)| k != "TMPDIR");
    env.push(("TMPDIR".into(), tmp.display().to_string()));
    let mut pod = wrap.trainlet(&["sshd", &format!("--listen={addr}")], &env);
    pod.wait_for_output("trainlet sshd listening on", Duration::from_secs(20));
    pod
}

/// A network namespace with `lo` up and a veth carrying 127.0.0.10/32:
/// PRRTE (Open MPI 5) refuses loopback interfaces for its daemons
/// (reference/mpi.md 1.3), so it needs one that is not flagged loopback.
/// Nothing in it reaches any other address. Deleted on drop.
#[derive(Debug)]
pub struct NetNs {
    pub name: String,
}

impl NetNs {
    pub fn new(tag: &str) -> Self {
        let name = format!("trainlet-{}-{tag}", std::process::id());
        let ip = |args: &[&str]| {
            let st = Command::new("/usr/sbin/ip").args(args).status().expect("ip (iproute2)");
            assert!(st.success(), "ip {args:?} failed");
        };
        ip(&["netns", "add", &name]);
        let ns = Self { name };
        let n = ns.name.as_str();
        ip(&["-n", n, "link", "set", "lo", "up"]);
        ip(&["-n", n, "link", "add", "v0", "type", "veth", "peer", "name", "v1"]);
        ip(&["-n", n, "addr", "add", "127.0.0.10/32", "dev", "v0"]);
        ip(&["-n", n, "link", "set", "v0", "up"]);
        ip(&["-n", n, "link", "set", "v1", "up"]);
        ns
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = Command::new("/usr/sbin/ip").args(["netns", "del", &self.name]).status();
    }
}

/// `trainlet ssh ARGS` as a pod; its exit code after `limit`.
pub fn client(args: &[&str], env: &[(String, String)]) -> Pod {
    let mut all = vec!["ssh"];
    all.extend_from_slice(args);
    Pod::start(&all, &refs(env))
}

/// Pids of live processes whose executable is OpenSSH's.
pub fn openssh_processes() -> Vec<i32> {
    live_pids(|pid| {
        std::fs::read_link(format!("/proc/{pid}/exe"))
            .is_ok_and(|exe| exe == Path::new("/usr/bin/ssh") || exe == Path::new("/usr/sbin/sshd"))
    })
}

/// Pids of live processes whose command line contains `needle`.
pub fn pids_with_cmdline(needle: &str) -> Vec<i32> {
    // Not trainlet's own processes: a `trainlet ssh` client carries the
    // remote command in its argv too, and must not stand in for it.
    let trainlet = std::fs::canonicalize(crate::util::bin()).ok();
    live_pids(|pid| {
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
        exe != trainlet && String::from_utf8_lossy(&cmd).replace('\0', " ").contains(needle)
    })
}

/// Wait until `f` holds; panics with `what` after `limit`.
pub fn wait_until(limit: Duration, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !f() {
        assert!(Instant::now() < deadline, "timed out after {limit:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}
