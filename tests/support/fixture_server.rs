//! A Python fixture server (tests/fixtures/*_server.py) as a child
//! process: started with `--port-file`, ready once that file appears, its
//! fields (ports, keys) parsed, its output kept for failure messages, and
//! killed with its process group on drop. Shared by the integration tests
//! and the benchmarks (through `tests/support`).

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Runs the fixture (argv: this process's pid, the script, its arguments)
/// as `python script args...` would, killed with SIGKILL when the thread
/// that started it ends (`PR_SET_PDEATHSIG`): a test run that is killed
/// (no `Drop`) leaves no server behind in its own process group. The
/// servers live inside one test, on the thread that started them.
const DIE_WITH_PARENT: &str = "\
import ctypes, os, runpy, sys
ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
if os.getppid() != int(sys.argv[1]):
    os._exit(70)  # the parent ended before prctl
sys.argv = sys.argv[2:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name='__main__')
";

/// A running fixture server.
pub struct Server {
    child: Child,
    dir: tempfile::TempDir,
    /// The port file's whitespace-separated fields.
    pub fields: Vec<String>,
}

impl Server {
    /// Run `python script args... --port-file F`; panics if it exits or has
    /// not written F within `limit`.
    pub fn start(python: &str, script: &Path, args: &[String], limit: Duration) -> Server {
        let dir = tempfile::tempdir().expect("tmp");
        let ports = dir.path().join("ports");
        let log = std::fs::File::create(dir.path().join("log")).expect("log");
        let child = Command::new(python)
            .args(["-c", DIE_WITH_PARENT])
            .arg(std::process::id().to_string())
            .arg(script)
            .args(args)
            .arg("--port-file")
            .arg(&ports)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .process_group(0)
            .spawn()
            .expect("start the fixture server");
        let mut s = Server { child, dir, fields: Vec::new() };
        let name = script.display();
        let start = Instant::now();
        while !ports.exists() {
            if let Some(st) = s.child.try_wait().expect("try_wait") {
                panic!("{name} exited ({st:?}):\n{}", s.log());
            }
            assert!(start.elapsed() < limit, "{name} did not start:\n{}", s.log());
            std::thread::sleep(Duration::from_millis(50));
        }
        s.fields = std::fs::read_to_string(&ports).expect("ports").split_whitespace().map(str::to_string).collect();
        s
    }

    /// What it printed.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("log")).unwrap_or_default()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.child.id()).expect("pid"));
        let _ = nix::sys::signal::killpg(pid, nix::sys::signal::Signal::SIGKILL);
        let _ = self.child.wait();
    }
}

/// A stand-in for Trainer's status endpoint (tests/fixtures/status_server.py)
/// on 127.0.0.1 with a CA made in `dir` (`dir/ca.pem`), the token file
/// `dir/token` (rewritten `rotate_after` seconds after the first request,
/// 0: never), `path` the URL path it accepts, and its request log at
/// `dir/log`. Returns the server and the CA.
pub fn status_server(python: &str, dir: &Path, rotate_after: u32, path: &str) -> (Server, std::path::PathBuf) {
    let (ca, cert, key) = super::tls_pair(dir);
    std::fs::write(dir.join("token"), "first-token\n").expect("token");
    let s = |p: &Path| p.display().to_string();
    let args = [
        "--cert".into(),
        s(&cert),
        "--key".into(),
        s(&key),
        "--token-file".into(),
        s(&dir.join("token")),
        "--rotate-after".into(),
        rotate_after.to_string(),
        "--path".into(),
        path.into(),
        "--log".into(),
        s(&dir.join("log")),
    ];
    let script = super::repo().join("tests/fixtures/status_server.py");
    (Server::start(python, &script, &args, Duration::from_secs(60)), ca)
}
