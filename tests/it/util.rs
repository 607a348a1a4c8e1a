//! Helpers: the binary, python, free ports, pods as child processes.

use std::collections::HashMap;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

pub fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_trainlet"))
}

pub use crate::support::{free_port, python, repo};

pub fn fixture(name: &str) -> String {
    repo().join("tests/fixtures").join(name).display().to_string()
}

/// The line of `marker` in a fixture.
pub fn line_of(name: &str, marker: &str) -> u32 {
    let text = std::fs::read_to_string(fixture(name)).expect("fixture");
    let i = text.lines().position(|l| l.contains(marker)).expect("marker");
    u32::try_from(i + 1).expect("line")
}

/// A trainlet process with captured output, killed (whole group) on drop.
pub struct Pod {
    pub child: Child,
    pub out: PathBuf,
    pub err: PathBuf,
    _dir: tempfile::TempDir,
}

impl Pod {
    pub fn start(args: &[&str], env: &[(&str, &str)]) -> Pod {
        Self::start_as(&bin(), args, env)
    }

    pub fn start_as(program: &Path, args: &[&str], env: &[(&str, &str)]) -> Pod {
        let dir = tempfile::tempdir().expect("tmp");
        let out = dir.path().join("stdout");
        let err = dir.path().join("stderr");
        let mut cmd = Command::new(program);
        cmd.args(args)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("HOME", std::env::var("HOME").unwrap_or_else(|_| "/tmp".into()))
            .env("TRAINLET_PYTHON", python())
            .env("TRAINLET_LOG", "info")
            .envs(env.iter().copied())
            .current_dir(repo())
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).expect("out"))
            .stderr(std::fs::File::create(&err).expect("err"))
            .process_group(0);
        let child = cmd.spawn().expect("spawn trainlet");
        Pod { child, out, err, _dir: dir }
    }

    pub fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).expect("pid")
    }

    /// Send `sig` to the trainlet process.
    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), sig).expect("kill");
    }

    /// Wait for exit; panics after `limit` with the output so far.
    pub fn wait(&mut self, limit: Duration) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().expect("try_wait") {
                return st;
            }
            if start.elapsed() > limit {
                let _ = self.child.kill();
                panic!(
                    "trainlet did not exit within {limit:?}\nstdout:\n{}\nstderr:\n{}",
                    self.stdout(),
                    self.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn code(&mut self, limit: Duration) -> i32 {
        let st = self.wait(limit);
        st.code().unwrap_or_else(|| panic!("trainlet died of a signal: {st:?}\n{}", self.stderr()))
    }

    pub fn stdout(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    /// Wait until stderr contains `needle` (panics after `limit`).
    pub fn wait_for_stderr(&mut self, needle: &str, limit: Duration) {
        let start = Instant::now();
        while !self.stderr().contains(needle) {
            assert!(start.elapsed() < limit, "no {needle:?} on stderr within {limit:?}:\n{}", self.stderr());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Wait until stdout contains `needle` (panics after `limit`).
    pub fn wait_for_output(&mut self, needle: &str, limit: Duration) -> String {
        let start = Instant::now();
        loop {
            let out = self.stdout();
            if out.contains(needle) {
                return out;
            }
            if let Some(st) = self.child.try_wait().expect("try_wait") {
                panic!(
                    "trainlet exited ({st:?}) before printing {needle:?}\nstdout:\n{out}\nstderr:\n{}",
                    self.stderr()
                );
            }
            assert!(
                start.elapsed() < limit,
                "no {needle:?} within {limit:?}\nstdout:\n{out}\nstderr:\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(self.pid()), nix::sys::signal::Signal::SIGKILL);
            let _ = self.child.wait();
        }
    }
}

/// PET_* env of simulated pod `node` in a job of `nnodes`.
pub fn pet_env(nnodes: u32, nproc: u32, node: u32, port: u16) -> Vec<(String, String)> {
    vec![
        ("PET_NNODES".into(), nnodes.to_string()),
        ("PET_NPROC_PER_NODE".into(), nproc.to_string()),
        ("PET_NODE_RANK".into(), node.to_string()),
        ("PET_MASTER_ADDR".into(), "127.0.0.1".into()),
        ("PET_MASTER_PORT".into(), port.to_string()),
    ]
}

/// Start `nnodes` simulated pods, each a trainlet with its own 127.0.0.N address.
pub fn start_pods(nnodes: u32, nproc: u32, args: &[&str], extra: &[(&str, &str)]) -> Vec<Pod> {
    let port = free_port();
    start_pods_with(nnodes, args, |node| {
        let mut env = pet_env(nnodes, nproc, node, port);
        env.extend(extra.iter().map(|(k, v)| ((*k).to_string(), (*v).to_string())));
        env
    })
}

/// Start `n` simulated pods running `args`: pod `i` is named 127.0.0.(i+1)
/// (`PET_LOCAL_ADDR`) and gets the env `env(i)`.
pub fn start_pods_with(n: u32, args: &[&str], env: impl Fn(u32) -> Vec<(String, String)>) -> Vec<Pod> {
    (0..n)
        .map(|i| {
            let mut e = env(i);
            e.push(("PET_LOCAL_ADDR".into(), format!("127.0.0.{}", i + 1)));
            let pairs: Vec<(&str, &str)> = e.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            Pod::start(args, &pairs)
        })
        .collect()
}

/// Pids of live (non-zombie) processes for which `keep(pid)` holds.
pub fn live_pids(mut keep: impl FnMut(i32) -> bool) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .expect("proc")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map(|s| s.rsplit(')').next().is_some_and(|r| r.trim_start().starts_with('Z')))
                .unwrap_or(true);
            !zombie && keep(*pid)
        })
        .collect()
}

/// Pids of live processes whose environment holds `marker`.
pub fn processes_with_marker(marker: &str) -> Vec<i32> {
    let needle = format!("TRAINLET_TEST_MARKER={marker}");
    live_pids(|pid| {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        environ.split(|b| *b == 0).any(|kv| kv == needle.as_bytes())
    })
}

/// Wait until no live process carries `marker`; panics after `limit`.
pub fn wait_until_gone(marker: &str, limit: Duration) {
    let deadline = Instant::now() + limit;
    loop {
        let left = processes_with_marker(marker);
        if left.is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "processes left behind: {left:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `KEY=value` lines with a given prefix, parsed.
pub fn parse_kv(line: &str) -> HashMap<String, String> {
    line.split_whitespace().filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

pub fn unique_marker() -> String {
    format!("{}-{}", std::process::id(), Instant::now().elapsed().as_nanos() ^ u128::from(rand_u32()))
}

fn rand_u32() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u8(0);
    u32::try_from(h.finish() & 0xffff_ffff).unwrap_or(0)
}

pub use crate::support::tls_pair;

/// `GET /metrics` from `addr` (empty on any failure).
pub fn scrape(addr: &str) -> String {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else { return String::new() };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    text.split_once("\r\n\r\n").map(|(_, body)| body.to_string()).unwrap_or_default()
}

/// `program args` as `/bin/sh` arguments that move the shell into the
/// cgroup whose `cgroup.procs` is `procs`, then exec the program (its pid
/// stays the shell's).
pub fn cgroup_argv(procs: &str, program: &Path, args: &[&str]) -> Vec<String> {
    let script = format!("echo $$ > {procs} && exec \"$0\" \"$@\"");
    let mut argv = vec!["-c".to_string(), script, program.display().to_string()];
    argv.extend(args.iter().map(|a| a.to_string()));
    argv
}

/// Kill what is left in the cgroup `dir` and remove it (retried while the
/// killed processes go).
pub fn remove_cgroup(dir: &Path) {
    for pid in std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default().lines() {
        if let Ok(pid) = pid.parse::<i32>() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        }
    }
    for _ in 0..50 {
        if std::fs::remove_dir(dir).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Is `parent` the parent of `pid` (from /proc; false when it is gone)?
pub fn parent_is(pid: i64, parent: i32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    let after = stat.rfind(')').map_or("", |i| &stat[i + 1..]);
    after.split_whitespace().nth(1).and_then(|p| p.parse::<i32>().ok()) == Some(parent)
}
