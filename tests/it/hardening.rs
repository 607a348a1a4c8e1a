//! Hostile conditions and real faults around the supervisor: fork failure
//! under a real pids cgroup, leftover processes that escaped their process
//! group, signals that must reach the worker and not its children, the
//! exit code against the report, unwritable logs, waits that say what they
//! wait for.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::util::{Pod, bin, free_port, pet_env};

const LIMIT: Duration = Duration::from_secs(90);

/// A real pids cgroup (v1 `pids` hierarchy, else cgroup v2 with the pids
/// controller), removed with whatever is left in it when dropped.
struct PidsCgroup {
    dir: PathBuf,
}

impl PidsCgroup {
    fn new(tag: &str) -> PidsCgroup {
        let name = format!("trainlet-test-{tag}-{}", std::process::id());
        let v1 = Path::new("/sys/fs/cgroup/pids");
        let v2 = Path::new("/sys/fs/cgroup");
        let parent = if v1.join("pids.max").exists() || v1.join("cgroup.procs").exists() {
            v1.to_path_buf()
        } else {
            let controllers = std::fs::read_to_string(v2.join("cgroup.controllers")).unwrap_or_default();
            assert!(
                controllers.split_whitespace().any(|c| c == "pids"),
                "this test needs the pids cgroup controller (v1 /sys/fs/cgroup/pids or v2) and root"
            );
            let _ = std::fs::write(v2.join("cgroup.subtree_control"), "+pids");
            v2.to_path_buf()
        };
        let dir = parent.join(name);
        std::fs::create_dir_all(&dir).expect("create a pids cgroup (needs root)");
        PidsCgroup { dir }
    }

    fn procs(&self) -> String {
        self.dir.join("cgroup.procs").display().to_string()
    }

    fn current(&self) -> u64 {
        std::fs::read_to_string(self.dir.join("pids.current")).expect("pids.current").trim().parse().expect("number")
    }

    fn set_max(&self, max: &str) {
        std::fs::write(self.dir.join("pids.max"), max).expect("pids.max");
    }

    /// `trainlet ARGS` started inside this cgroup.
    fn start(&self, args: &[&str], env: &[(&str, &str)]) -> Pod {
        let argv = crate::util::cgroup_argv(&self.procs(), &bin(), args);
        let refs: Vec<&str> = argv.iter().map(String::as_str).collect();
        Pod::start_as(Path::new("/bin/sh"), &refs, env)
    }
}

impl Drop for PidsCgroup {
    fn drop(&mut self) {
        self.set_max("max");
        crate::util::remove_cgroup(&self.dir);
    }
}

/// Two pods; pod 0 inside `cg`, frozen at its current process count once
/// it waits for pod 1, so its workers' fork fails with EAGAIN.
fn job_with_a_full_pids_cgroup(cg: &PidsCgroup) -> (Pod, Pod) {
    let port = free_port();
    let args = ["run", "--no-python", "--grace-period", "3", "/bin/true"];
    let env0 = pet_env(2, 1, 0, port);
    let env0: Vec<(&str, &str)> = env0.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut pod0 = cg.start(&args, &env0);
    pod0.wait_for_stderr("serving the rendezvous store", LIMIT);
    std::thread::sleep(Duration::from_millis(500));
    cg.set_max(&cg.current().to_string());
    let env1 = pet_env(2, 1, 1, port);
    let env1: Vec<(&str, &str)> = env1.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let pod1 = Pod::start(&args, &env1);
    (pod0, pod1)
}

/// fork failing with EAGAIN under a real pids limit is retried with
/// backoff; when pids come free within the grace period the job succeeds,
/// and when they do not the pod exits 210 naming fork and the pids limit
/// (it used to exit 127, "not found").
#[test]
fn fork_failure_under_a_pids_limit_is_retried_then_exits_210() {
    let cg = PidsCgroup::new("fork-retry");
    let (mut pod0, mut pod1) = job_with_a_full_pids_cgroup(&cg);
    pod0.wait_for_stderr("fork failed; retrying", LIMIT);
    cg.set_max("max");
    assert_eq!(pod0.code(LIMIT), 0, "{}", pod0.stderr());
    assert_eq!(pod1.code(LIMIT), 0, "{}", pod1.stderr());
    drop(cg);

    let cg = PidsCgroup::new("fork-fail");
    let (mut pod0, mut pod1) = job_with_a_full_pids_cgroup(&cg);
    let code = pod0.code(LIMIT);
    let err = pod0.stderr();
    assert_eq!(code, 210, "{err}");
    assert!(err.contains("fork failed") && err.contains("pids cgroup"), "{err}");
    assert!(err.contains("Resource temporarily unavailable"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(pod1.code(LIMIT), 210, "the other pod reports the same root cause: {}", pod1.stderr());
}

/// Descendants that called setsid() (a TERM-ignoring daemon with a child of
/// its own, and a daemon that re-forks every few ms) are killed at the end
/// of the round, before the next attempt starts, and again at the agent's
/// exit: nothing carrying the job's marker outlives trainlet.
#[test]
fn escaped_descendants_die_at_the_end_of_every_round_and_at_exit() {
    let marker = crate::util::unique_marker();
    let dir = tempfile::tempdir().expect("tmp");
    let out = dir.path().display().to_string();
    let script = crate::util::fixture("escape.py");
    let mut pod =
        Pod::start(&["run", "--max-restarts", "1", &script, &out, "leave"], &[("TRAINLET_TEST_MARKER", &marker)]);
    let code = pod.code(LIMIT);
    let (stdout, stderr) = (pod.stdout(), pod.stderr());
    assert_eq!(code, 0, "round 1 found survivors of round 0:\n{stdout}\n{stderr}");
    assert!(stdout.contains("no leftovers from the last round"), "{stdout}");
    assert!(stderr.contains("killed leftover processes"), "{stderr}");
    let left = crate::util::processes_with_marker(&marker);
    for &pid in &left {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
    }
    assert!(left.is_empty(), "processes outlived trainlet: {left:?}\n{stderr}");
}

/// The checkpoint signal goes to the rank's main process, not its process
/// group: a real DataLoader with 2 `spawn` workers keeps loading after
/// SIGUSR1 (with killpg they died: "DataLoader worker ... exited
/// unexpectedly"), and the rank exits 0 before SIGTERM is due.
#[test]
fn the_checkpoint_signal_reaches_the_rank_and_not_its_dataloader_workers() {
    let script = crate::util::fixture("loader_ckpt.py");
    let args =
        ["run", "--checkpoint-signal", "SIGUSR1", "--checkpoint-timeout", "60", "--shutdown-timeout", "90", &script];
    let mut pod = Pod::start(&args, &[]);
    pod.wait_for_output("READY", LIMIT);
    pod.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(pod.code(LIMIT), 143, "{}", pod.stderr());
    let (out, err) = (pod.stdout(), pod.stderr());
    assert!(out.contains("CHECKPOINTED with live loader workers"), "{out}\n{err}");
    assert!(!err.contains("exited unexpectedly"), "{err}");
}

/// Attempt 0 fails with 3, attempt 1 with 4: the job exits 4, and the JSON
/// report's root cause, the summary's "Root Cause" and the exit status say
/// the same; attempt 0's failure is listed once, as history, with what
/// became of it (a restart), not the rule's action.
#[test]
fn the_exit_code_and_the_reports_root_cause_agree() {
    let dir = tempfile::tempdir().expect("tmp");
    let script = dir.path().join("fail.sh");
    std::fs::write(&script, "#!/bin/sh\nexit $((3 + TORCHELASTIC_RESTART_COUNT))\n").expect("script");
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    let logs = dir.path().join("logs");
    let (script, logs_s) = (script.display().to_string(), logs.display().to_string());
    let mut pod = Pod::start(&["run", "--no-python", "--max-restarts", "1", "--log-dir", &logs_s, &script], &[]);
    assert_eq!(pod.code(LIMIT), 4, "{}", pod.stderr());
    let err = pod.stderr();
    let report = err.lines().find_map(|l| l.strip_prefix("trainlet: failure report written to ")).expect("report path");
    assert!(Path::new(report).starts_with(&logs), "{report}");
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(report).expect("read")).expect("json");
    assert_eq!(json["exit_code"], 4);
    assert_eq!(json["root_cause"]["exit_code"], 4, "{json}");
    assert_eq!(json["root_cause"]["attempt"], 1, "{json}");
    assert_eq!(json["failures"].as_array().map(Vec::len), Some(2), "{json}");
    assert!(err.contains("Root Cause (exit code 4):"), "{err}");
    assert_eq!(err.matches("exitcode  : 4 ").count(), 1, "the root cause is printed once:\n{err}");
    assert_eq!(err.matches("exitcode  : 3 ").count(), 1, "{err}");
    assert!(err.contains("outcome   : the job restarted (restart 1)"), "{err}");
    assert!(err.contains("outcome   : no restarts left: the job failed"), "{err}");
    assert!(!err.contains("policy    : restart"), "{err}");
}

/// An unwritable --log-dir with --redirects is a configuration error naming
/// the directory, before any worker starts; without --log-dir and an
/// unwritable temporary directory, redirected output goes to the console
/// (one warning) instead of being dropped.
#[test]
fn worker_output_is_never_dropped_for_want_of_a_log_directory() {
    let dir = tempfile::tempdir().expect("tmp");
    // A regular file where a directory is needed: unwritable even for root.
    let blocker = dir.path().join("not-a-dir");
    std::fs::write(&blocker, "").expect("file");
    let log_dir = blocker.join("logs").display().to_string();
    let args = ["run", "--no-python", "--redirects", "3", "--log-dir", &log_dir, "/bin/echo", "LINE-FROM-WORKER"];
    let mut pod = Pod::start(&args, &[]);
    assert_eq!(pod.code(LIMIT), 200, "{}", pod.stderr());
    let err = pod.stderr();
    assert!(err.contains(&format!("--log-dir {log_dir}")), "{err}");
    assert!(!err.contains("starting workers"), "no worker may start: {err}");

    let tmp = blocker.display().to_string();
    let args = ["run", "--no-python", "--redirects", "3", "/bin/echo", "LINE-FROM-WORKER"];
    let mut pod = Pod::start(&args, &[("TMPDIR", &tmp)]);
    assert_eq!(pod.code(LIMIT), 0, "{}", pod.stderr());
    let (out, err) = (pod.stdout(), pod.stderr());
    assert!(out.contains("LINE-FROM-WORKER"), "the line reaches the console:\n{out}\n{err}");
    assert_eq!(err.matches("worker output goes to the console only").count(), 1, "{err}");
}

/// Workers get the agent's `oom_score_adj` plus 100 (the kernel prefers a
/// worker over the agent), and a container whose cgroup has
/// `memory.oom.group=1` gets one warning saying what an OOM will do (a fake
/// /proc and /sys tree, as the GPU tests use: no cgroup v2 node here).
#[test]
fn workers_score_above_the_agent_for_the_oom_killer_and_group_kill_is_announced() {
    let agent: i32 = std::fs::read_to_string("/proc/self/oom_score_adj").expect("adj").trim().parse().expect("int");
    let root = tempfile::tempdir().expect("tmp");
    std::fs::create_dir_all(root.path().join("proc/self")).expect("mkdir");
    std::fs::write(root.path().join("proc/self/cgroup"), "0::/kubepods/pod1/ctr\n").expect("write");
    let group = root.path().join("sys/fs/cgroup/kubepods/pod1/ctr");
    std::fs::create_dir_all(&group).expect("mkdir");
    std::fs::write(group.join("memory.oom.group"), "1\n").expect("write");
    let root_s = root.path().display().to_string();
    let mut pod = Pod::start(
        &["run", "--no-python", "/bin/cat", "/proc/self/oom_score_adj"],
        &[("TRAINLET_SYSFS_ROOT", &root_s)],
    );
    assert_eq!(pod.code(LIMIT), 0, "{}", pod.stderr());
    let want = (agent + 100).min(1000);
    assert!(pod.stdout().contains(&format!("]: {want}")), "want {want}: {}", pod.stdout());
    assert_eq!(pod.stderr().matches("memory.oom.group is 1").count(), 1, "{}", pod.stderr());
}
