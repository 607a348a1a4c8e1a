//! trainlet as PID 1 of real containers: podman with runc (real PID, mount
//! and UTS namespaces), images built from `images/` by `tests/images.sh` on
//! a Debian base made with mmdebstrap (no registry). Containers share the
//! host network and use loopback addresses only. PyTorch comes from the
//! test venv's site-packages, bind-mounted read-only at /opt/torch and run
//! by the image's own python3 (the same 3.11 on Debian bookworm).

use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::util::repo;

const LIMIT: Duration = Duration::from_secs(120);

/// `CONTAINERS_CONF` after the images are built (once per test run).
fn images() -> &'static str {
    static CONF: OnceLock<String> = OnceLock::new();
    CONF.get_or_init(|| {
        let out = Command::new("bash").arg(repo().join("tests/images.sh")).output().expect("bash tests/images.sh");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "tests/images.sh failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        stdout
            .lines()
            .find_map(|l| l.strip_prefix("export CONTAINERS_CONF="))
            .expect("tests/images.sh prints CONTAINERS_CONF")
            .to_string()
    })
}

fn podman(args: &[&str]) -> Output {
    Command::new("podman").env("CONTAINERS_CONF", images()).args(args).output().expect("podman")
}

pub(crate) use crate::support::cluster::torch_site;

/// A container started detached; removed (with force) when dropped.
struct Container {
    name: String,
}

impl Container {
    /// `podman run -d --name NAME --network host [opts] IMAGE [args]`.
    fn start(test: &str, opts: &[&str], image: &str, args: &[&str]) -> Self {
        let name = format!("tl-{test}-{}", std::process::id());
        let _ = podman(&["rm", "-f", &name]);
        let mut all = vec!["run", "-d", "--name", &name, "--network", "host"];
        all.extend_from_slice(opts);
        all.push(image);
        all.extend_from_slice(args);
        let out = podman(&all);
        assert!(out.status.success(), "podman run: {}", String::from_utf8_lossy(&out.stderr));
        Self { name }
    }

    /// stdout and stderr so far.
    fn logs(&self) -> String {
        let out = podman(&["logs", &self.name]);
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    }

    fn wait_for_log(&self, needle: &str, limit: Duration) {
        let started = Instant::now();
        while !self.logs().contains(needle) {
            assert!(started.elapsed() < limit, "no {needle:?} within {limit:?}:\n{}", self.logs());
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The exit code once the container stopped.
    fn exit_code(&self, limit: Duration) -> i32 {
        let started = Instant::now();
        loop {
            match self.state() {
                Ok(code) => return code,
                Err(state) => {
                    if started.elapsed() >= limit {
                        panic!("still {state} after {limit:?}:\n{}\n{}", self.logs(), self.why_still_running());
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Asserts the exit code once the container stopped (within `limit`),
    /// naming both codes before the logs (a long log must not hide which).
    fn expect_exit(&self, want: i32, limit: Duration, what: &str) {
        let got = self.exit_code(limit);
        assert_eq!(got, want, "{what}exit code {got}, expected {want}; logs:\n{}", self.logs());
    }

    /// What a container past its time is doing: its processes, its
    /// workers' stacks (`trainlet stacks` asks the agent inside), and the
    /// host's free disk (a full or stalled disk stalls conmon's log and
    /// exit file, so a job that ended can still look running).
    fn why_still_running(&self) -> String {
        let text = |o: Output| format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        let top = text(podman(&["top", &self.name, "pid", "ppid", "state", "args"]));
        let stacks = text(podman(&["exec", &self.name, "trainlet", "stacks"]));
        let df = Command::new("df")
            .args(["-h", "/var/lib/containers", "/tmp"])
            .output()
            .map_or_else(|e| e.to_string(), text);
        format!("=== podman top\n{top}=== trainlet stacks in the container\n{stacks}=== df -h\n{df}")
    }

    /// `Some(exit code)` once the container stopped, else its state.
    fn state(&self) -> Result<i32, String> {
        let out = podman(&["inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", &self.name]);
        let state = String::from_utf8_lossy(&out.stdout).trim().to_string();
        state.strip_prefix("exited ").and_then(|c| c.parse().ok()).ok_or(state)
    }

    /// `podman stop -t GRACE`; returns how long it took.
    fn stop(&self, grace: u64) -> Duration {
        let started = Instant::now();
        let out = podman(&["stop", "-t", &grace.to_string(), &self.name]);
        assert!(out.status.success(), "podman stop: {}", String::from_utf8_lossy(&out.stderr));
        started.elapsed()
    }
}

/// Asserts that every container of one job exits `want` within `limit`
/// (together: one that hangs waits for the others); when one does not,
/// the message gives every container's state and logs (a pod waiting on
/// another says little by itself).
fn expect_exits(pods: &[Container], want: i32, limit: Duration) {
    let started = Instant::now();
    loop {
        let states: Vec<Result<i32, String>> = pods.iter().map(Container::state).collect();
        let done = states.iter().all(Result::is_ok);
        if done && states.iter().all(|s| *s == Ok(want)) {
            return;
        }
        if done || started.elapsed() > limit {
            let all: String = pods
                .iter()
                .zip(&states)
                .enumerate()
                .map(|(i, (p, s))| {
                    let why = if s.is_err() { p.why_still_running() } else { String::new() };
                    format!("--- container {i} ({}): {s:?}\n{}\n{why}", p.name, p.logs())
                })
                .collect();
            panic!("expected every container to exit {want} within {limit:?}:\n{all}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = podman(&["rm", "-f", "-t", "0", &self.name]);
    }
}

/// The settings a shipped runtime gives the trainer container: (grace
/// period, checkpoint timeout, termination grace of the pod).
fn shipped_grace() -> (u64, u64, u64) {
    let text = std::fs::read_to_string(repo().join("runtimes/torch-distributed.yaml")).expect("runtime");
    let env_value = |name: &str| -> u64 {
        let at = text.find(&format!("name: {name}")).unwrap_or_else(|| panic!("{name} in the runtime"));
        let value = text[at..].lines().nth(1).and_then(|l| l.trim().strip_prefix("value: ")).expect("value");
        value.trim_matches('"').parse().expect("seconds")
    };
    let pod: u64 = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("terminationGracePeriodSeconds: "))
        .and_then(|v| v.parse().ok())
        .expect("terminationGracePeriodSeconds");
    (env_value("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"), env_value("TRAINLET_CHECKPOINT_TIMEOUT"), pod)
}

/// Mounts and env that give a container torch and the fixtures.
fn torch_opts(site: &std::path::Path) -> Vec<String> {
    let fixtures = repo().join("tests/fixtures");
    vec![
        "-v".into(),
        format!("{}:/opt/torch:ro", site.display()),
        "-e".into(),
        "PYTHONPATH=/opt/torch".into(),
        "-v".into(),
        format!("{}:/fixtures:ro", fixtures.display()),
        "-v".into(),
        format!("{}:/examples:ro", repo().join("examples").display()),
    ]
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// `podman stop` (SIGTERM to PID 1, SIGKILL after -t) of a running
/// 2-worker job with the shipped runtime's settings: trainlet sends the
/// checkpoint signal first, the workers checkpoint and exit, and the
/// container exits 143 on its own, well before the runtime's SIGKILL.
#[test]
fn podman_stop_checkpoints_first_and_exits_143() {
    let (grace, ckpt_timeout, pod_grace) = shipped_grace();
    let site = torch_site();
    let mut opts = torch_opts(&site);
    for e in [
        "TRAINLET_CHECKPOINT_SIGNAL=SIGUSR1".to_string(),
        format!("TRAINLET_CHECKPOINT_TIMEOUT={ckpt_timeout}"),
        format!("TORCH_ELASTIC_SHUTDOWN_TIMEOUT={grace}"),
        "CKPT_SIGNAL=SIGUSR1".into(),
        "CKPT_DIR=/tmp".into(),
        "STEPS=100000".into(),
    ] {
        opts.extend(["-e".to_string(), e]);
    }
    let c = Container::start(
        "stop",
        &refs(&opts),
        "localhost/trainlet/torch-runtime:test",
        &["run", "--standalone", "--nproc-per-node", "2", "--python", "/usr/bin/python3", "/fixtures/ckpt_train.py"],
    );
    c.wait_for_log("START rank=1", LIMIT);
    let took = c.stop(pod_grace);
    c.expect_exit(143, LIMIT, "");
    assert!(took < Duration::from_secs(pod_grace), "trainlet exited on its own ({took:?}), not by SIGKILL");
    // The workers exit from their SIGUSR1 handler: before the checkpoint
    // timeout, when trainlet would have sent SIGTERM.
    assert!(took < Duration::from_secs(ckpt_timeout), "{took:?}");
    let logs = c.logs();
    assert!(logs.contains("CHECKPOINT step=") && logs.contains("reason=signal"), "{logs}");
    assert!(logs.contains("stop signal; stopping workers signal=SIGTERM checkpoint=\"SIGUSR1\""), "{logs}");
}

/// A worker that ignores SIGTERM is killed at trainlet's grace deadline
/// and the container still exits 143 by itself inside the pod's
/// termination grace (never 137 from the runtime's SIGKILL).
#[test]
fn a_worker_ignoring_sigterm_is_killed_at_the_grace_deadline_and_the_container_exits_143() {
    let (grace, _, pod_grace) = shipped_grace();
    let fixtures = format!("{}:/fixtures:ro", repo().join("tests/fixtures").display());
    let shutdown = format!("TORCH_ELASTIC_SHUTDOWN_TIMEOUT={grace}");
    let c = Container::start(
        "stubborn",
        &["-v", &fixtures, "-e", &shutdown],
        "localhost/trainlet/torch-runtime:test",
        &["run", "--standalone", "--nproc-per-node", "2", "--no-python", "/fixtures/stubborn_worker.sh"],
    );
    c.wait_for_log("READY 1", LIMIT);
    let took = c.stop(pod_grace);
    c.expect_exit(143, LIMIT, "");
    assert!(took >= Duration::from_secs(grace) && took < Duration::from_secs(pod_grace), "{took:?}");
    assert!(c.logs().contains("grace period over; killing workers"), "{}", c.logs());
}

/// The restricted pod a platform admin runs: a non-root uid with no
/// passwd entry, a read-only root and a tmpfs /tmp. A real 2-worker DDP
/// job runs and exits 0, and leaves nothing behind in /tmp.
#[test]
fn a_torch_job_runs_as_uid_1000_on_a_read_only_root() {
    let site = torch_site();
    let mut opts = torch_opts(&site);
    opts.extend(["--user", "1000:1000", "--read-only", "--tmpfs", "/tmp:rw,mode=1777"].map(String::from));
    let c = Container::start(
        "readonly",
        &refs(&opts),
        "localhost/trainlet/torch-runtime:test",
        &[
            "run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--python",
            "/usr/bin/python3",
            "/examples/train_ddp.py",
            "--steps",
            "5",
            "--check",
        ],
    );
    c.expect_exit(0, LIMIT, "");
    assert!(c.logs().contains("round decided round=0 end=success"), "{}", c.logs());
}

/// The Kubeflow SDK's XGBoost command, word for word as the container's
/// entrypoint (the SDK sets `command`, which replaces ENTRYPOINT), in
/// trainlet's XGBoost image as uid 1000 on a read-only root: the image's
/// `python` link makes the SDK's `python "sdk_train.py"` a trainlet job
/// (the tracker it needs included), and the workers run the real python3.
#[test]
fn the_sdks_xgboost_command_runs_under_trainlet_in_its_image_as_uid_1000_on_a_read_only_root() {
    let (command, sdk) = crate::frameworks::sdk_command("xgboost-distributed.yaml", "train_xgboost", &[]);
    let entrypoint = serde_json::to_string(&command).expect("json");
    let site = torch_site();
    let mut opts = torch_opts(&site);
    let policy = repo().join("runtimes/failure-policy.toml");
    opts.extend(
        [
            "--user",
            "1000:1000",
            "--read-only",
            "--tmpfs",
            "/tmp:rw,mode=1777",
            // The SDK writes its script into the working directory.
            "-w",
            "/tmp",
            "--entrypoint",
            &entrypoint,
            "-v",
            &format!("{}:/etc/trainlet/policy.toml:ro", policy.display()),
            "-e",
            "TRAINLET_POLICY_IF_PRESENT=/etc/trainlet/policy.toml",
            "-e",
            "DMLC_TRACKER_URI=127.0.0.1",
            "-e",
            &format!("DMLC_TRACKER_PORT={}", crate::util::free_port()),
            "-e",
            "DMLC_TASK_ID=0",
            "-e",
            "DMLC_NUM_WORKER=1",
            "-e",
            "PET_NPROC_PER_NODE=2",
        ]
        .map(String::from),
    );
    let c = Container::start("sdk-xgboost", &refs(&opts), "localhost/trainlet/xgboost-runtime:test", &[]);
    c.expect_exit(0, LIMIT, &format!("SDK {sdk}: "));
    let logs = c.logs();
    assert!(logs.contains("python sdk_train.py is this xgboost pod's entry"), "{logs}");
    assert!(logs.contains("XGBoost tracker listening"), "{logs}");
    let seen: Vec<&str> = logs.lines().filter(|l| l.contains("SDKXGB task=")).collect();
    assert_eq!(seen.len(), 2, "{logs}");
    for line in seen {
        let kv = crate::util::parse_kv(line);
        assert_eq!(kv["world"], "2", "{line}");
        assert_eq!(kv["model"], kv["reference"], "{line}");
    }
}

/// The FROM-scratch image holds the static binary alone and runs it.
#[test]
fn the_scratch_image_runs_the_static_binary() {
    let out = podman(&["run", "--rm", "--network", "host", "localhost/trainlet/trainlet:test", "--version"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), format!("trainlet {}", env!("CARGO_PKG_VERSION")));
}

/// The MPI image as Trainer runs it: two worker containers serve SSH with
/// `trainlet sshd` as uid 1000 from Trainer's root-owned 0640 ECDSA P-521
/// key (group 1000, as fsGroup makes it), and a launcher container runs
/// the TrainJob's own `mpirun -np 4` across them. No OpenSSH is in the
/// image; every rank gets the exact sum; the workers exit 0 when told the
/// job is done.
#[test]
fn the_mpi_image_runs_mpirun_across_two_containers_as_uid_1000_without_openssh() {
    use std::os::unix::fs::PermissionsExt;
    let keys = crate::sshkit::trainer_keys();
    std::fs::set_permissions(keys.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let key = keys.path().join("id_rsa");
    std::os::unix::fs::chown(&key, Some(0), Some(1000)).expect("chown");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o640)).expect("chmod");
    let mount = format!("{}:/home/mpiuser/.ssh:ro", keys.path().display());
    let fixtures = format!("{}:/fixtures:ro", repo().join("tests/fixtures").display());
    let image = "localhost/trainlet/mpi-runtime:test";
    let no_openssh = podman(&["run", "--rm", image, "--version"]);
    assert!(no_openssh.status.success(), "{}", String::from_utf8_lossy(&no_openssh.stderr));
    let listing = podman(&[
        "run",
        "--rm",
        "--entrypoint",
        "/bin/sh",
        image,
        "-c",
        "ls /usr/bin/ssh /usr/sbin/sshd.real /usr/lib/openssh 2>/dev/null; readlink -f $(command -v ssh) /usr/sbin/sshd",
    ]);
    assert_eq!(
        String::from_utf8_lossy(&listing.stdout),
        "/usr/local/bin/trainlet\n/usr/local/bin/trainlet\n",
        "no OpenSSH: ssh and sshd are trainlet"
    );
    let workers: Vec<Container> = ["127.0.45.2", "127.0.45.3"]
        .iter()
        .enumerate()
        .map(|(i, addr)| {
            let listen = format!("--listen={addr}:2222");
            let c = Container::start(
                &format!("mpi-node{i}"),
                &["--user", "1000:1000", "-v", &mount, "-v", &fixtures],
                image,
                &["sshd", &listen],
            );
            c.wait_for_log("trainlet sshd listening on", LIMIT);
            c
        })
        .collect();
    let mut args = vec!["mpi", "--hosts", "127.0.45.2:2,127.0.45.3:2", "--", "mpirun", "-np", "4"];
    args.extend_from_slice(&["--mca", "oob_tcp_if_include", "lo", "--mca", "btl_tcp_if_include", "lo"]);
    args.extend_from_slice(&["--mca", "btl", "self,tcp", "python3", "/fixtures/mpi_allreduce.py"]);
    let launcher =
        Container::start("mpi-launcher", &["--user", "1000:1000", "-v", &mount, "-v", &fixtures], image, &args);
    launcher.expect_exit(0, LIMIT, "");
    let logs = launcher.logs();
    let rows: Vec<&str> = logs.lines().filter(|l| l.starts_with("RESULT ")).collect();
    assert_eq!(rows.len(), 4, "{logs}");
    for r in &rows {
        assert!(r.contains("size=4 sum=10") && r.contains("ssh=/usr/local/bin/trainlet"), "{r}");
    }
    for node in ["127.0.45.2", "127.0.45.3"] {
        assert!(rows.iter().any(|r| r.contains(&format!("node={node}"))), "ranks on {node}:\n{logs}");
    }
    for w in &workers {
        w.expect_exit(0, LIMIT, "a worker told the job is done exits 0: ");
    }
}

/// MPI without SSH in the image runtimes/mpich-pmi.yaml names: two "pods"
/// (containers on the host network, each with its own /dev/shm and /tmp),
/// each with `trainlet run` as PID 1, uid 1000, a read-only root, start
/// their 2 ranks of mpi4py on the image's MPICH and serve them PMI
/// (`TRAINLET_FRAMEWORK=mpi` is the image's); every rank gets the exact
/// sum, with no mpirun, hydra or ssh in the image. mpi4py's wheel is the
/// test venv's (.venv-mpich, tests/mpi_venvs.sh), mounted read-only as
/// PyTorch is in the torch tests: the image sets up MPICH for it. The
/// image's MPICH is 5.0.2, not Debian's 4.0.2, whose `MPI_Finalize` hung
/// here 1 run in 3 under load (images/mpich-pmi-runtime.Dockerfile says why).
#[test]
fn the_mpich_pmi_image_runs_mpi4py_across_two_containers_as_uid_1000_on_a_read_only_root() {
    let fixtures = format!("{}:/fixtures:ro", repo().join("tests/fixtures").display());
    let site = crate::mpi::mpi_venv(".venv-mpich").join("lib/python3.11/site-packages");
    let site = format!("{}:/opt/mpi4py:ro", site.display());
    let image = "localhost/trainlet/mpich-pmi-runtime:test";
    let none =
        podman(&["run", "--rm", "--entrypoint", "/bin/sh", image, "-c", "command -v mpirun mpiexec ssh sshd || true"]);
    assert_eq!(String::from_utf8_lossy(&none.stdout), "", "no launcher and no SSH in the image");
    let version = podman(&[
        "run",
        "--rm",
        "-v",
        &site,
        "-e",
        "PYTHONPATH=/opt/mpi4py",
        "--entrypoint",
        "python3",
        image,
        "-c",
        "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])",
    ]);
    let version = String::from_utf8_lossy(&version.stdout);
    assert!(version.contains("MPICH Version:") && version.contains("5.0.2"), "the image's MPICH: {version:?}");
    let port = crate::util::free_port();
    let pods: Vec<Container> = (0..2)
        .map(|i| {
            let env = [
                "PET_NNODES=2".to_string(),
                format!("PET_NODE_RANK={i}"),
                "PET_MASTER_ADDR=127.0.0.1".to_string(),
                format!("PET_MASTER_PORT={port}"),
                format!("PET_LOCAL_ADDR=127.0.47.{}", i + 1),
            ];
            let mut opts = vec!["--user", "1000:1000", "--read-only", "-v", &fixtures, "-v", &site];
            opts.extend_from_slice(&["-e", "PYTHONPATH=/opt/mpi4py"]);
            for e in &env {
                opts.extend_from_slice(&["-e", e]);
            }
            Container::start(
                &format!("pmi-pod{i}"),
                &opts,
                image,
                &["run", "--nproc-per-node", "2", "/fixtures/mpi_allreduce.py"],
            )
        })
        .collect();
    expect_exits(&pods, 0, LIMIT);
    let mut rows = Vec::new();
    for p in &pods {
        let logs = p.logs();
        assert!(logs.contains("pmi_1=2 pmi_2=0"), "{logs}");
        rows.extend(logs.lines().filter(|l| l.contains("RESULT ")).map(str::to_string));
    }
    assert_eq!(rows.len(), 4, "{rows:?}");
    assert!(rows.iter().all(|r| r.contains("size=4 sum=10")), "{rows:?}");
}

/// Two "pods" (containers on the host network at 127.0.46.1 and .2) run
/// the checkpointing training job. `podman stop` of the second, then
/// `podman start` (the pod replaced in place); then the same with the
/// store host. Each stop checkpoints; the job resumes and ends with
/// exactly the parameters of an uninterrupted run.
#[test]
fn a_two_container_job_survives_restarts_of_either_container_with_identical_parameters() {
    let steps = "150";
    let reference = {
        let out = Command::new(crate::util::python())
            .arg(repo().join("tests/fixtures/ckpt_train.py"))
            .arg("--reference")
            .env("STEPS", steps)
            .output()
            .expect("python");
        String::from_utf8_lossy(&out.stdout).split_whitespace().nth(1).expect("FINAL <digest>").to_string()
    };
    let site = torch_site();
    let ckpt = tempfile::tempdir().expect("tmp");
    let port = crate::util::free_port().to_string();
    let pods: Vec<Container> = (0..2)
        .map(|node| {
            let mut opts = torch_opts(&site);
            opts.extend(["-v".to_string(), format!("{}:/ckpt", ckpt.path().display())]);
            for e in [
                "PET_NNODES=2".to_string(),
                "PET_NPROC_PER_NODE=1".into(),
                format!("PET_NODE_RANK={node}"),
                "PET_MASTER_ADDR=127.0.46.1".into(),
                format!("PET_MASTER_PORT={port}"),
                format!("PET_LOCAL_ADDR=127.0.46.{}", node + 1),
                "TRAINLET_JOIN_TIMEOUT=90".into(),
                "TRAINLET_CHECKPOINT_SIGNAL=SIGUSR1".into(),
                "CKPT_SIGNAL=SIGUSR1".into(),
                "CKPT_DIR=/ckpt".into(),
                format!("STEPS={steps}"),
                "STEP_SLEEP=0.1".into(),
            ] {
                opts.extend(["-e".to_string(), e]);
            }
            Container::start(
                &format!("pod{node}"),
                &refs(&opts),
                "localhost/trainlet/torch-runtime:test",
                &["run", "--python", "/usr/bin/python3", "/fixtures/ckpt_train.py"],
            )
        })
        .collect();
    let starts = |c: &Container| c.logs().matches("START rank=").count();
    let wait_starts = |c: &Container, n: usize| {
        let started = Instant::now();
        while starts(c) < n {
            assert!(started.elapsed() < LIMIT, "{} START lines wanted:\n{}", n, c.logs());
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    wait_starts(&pods[1], 1);
    std::thread::sleep(Duration::from_secs(3));
    for (i, victim) in [1usize, 0].into_iter().enumerate() {
        let c = &pods[victim];
        c.stop(30);
        c.expect_exit(143, LIMIT, "");
        let out = podman(&["start", &c.name]);
        assert!(out.status.success(), "podman start: {}", String::from_utf8_lossy(&out.stderr));
        // Both pods train again (the other one regrouped without it).
        wait_starts(&pods[1 - victim], 2 + i);
        wait_starts(c, 2 + i);
        std::thread::sleep(Duration::from_secs(3));
    }
    expect_exits(&pods, 0, Duration::from_secs(180));
    let logs = pods[0].logs();
    let line = logs.lines().rfind(|l| l.contains("FINAL ")).unwrap_or_else(|| panic!("no FINAL line:\n{logs}"));
    assert!(line.contains(&format!("FINAL {reference} world=2")), "{line}\n{logs}");
    assert!(logs.matches("CHECKPOINT step=").count() >= 2, "{logs}");
    assert!(pods[1].logs().contains("the store host left the job cleanly"), "{}", pods[1].logs());
}

/// The training function the Kubeflow SDK would ship: it joins the
/// process group, checkpoints (prints) and exits on SIGUSR1, and trains
/// (sleeps) until then. No `$` in it: the SDK's heredoc is unquoted.
const SDK_FUNCTION: &str = r#"
def train():
    import os, signal, sys, time
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    def ckpt(signum, frame):
        print(f"CKPT rank={rank}", flush=True)
        os._exit(0)
    signal.signal(signal.SIGUSR1, ckpt)
    print(f"TRAINING rank={rank}", flush=True)
    while True:
        time.sleep(0.1)

train()
"#;

/// A TrainJob's `command` replaces the ENTRYPOINT, so the shell is PID 1:
/// the SDK's exact `bash -c "read -r -d '' SCRIPT << EOM ... torchrun
/// file.py"`, and a `sh` (dash) script that keeps the shell around after
/// torchrun. Without the runtime's preStop hook, `podman stop` of the dash
/// one ends in SIGKILL (137, no checkpoint). With the hook run first
/// (`trainlet stop`, as the kubelet runs preStop before SIGTERM), the agent
/// stops as on SIGTERM: checkpoint signal, workers exit, 143.
#[test]
fn the_prestop_hook_stops_the_agent_when_a_shell_is_pid_1() {
    let site = torch_site();
    let sdk_bash = format!(
        "read -r -d '' SCRIPT << EOM\n{SDK_FUNCTION}\nEOM\nprintf \"%s\" \"$SCRIPT\" > \"/tmp/train.py\"\ntorchrun \"/tmp/train.py\""
    );
    let dash = format!(
        "cat > /tmp/train.py << 'EOM'\n{SDK_FUNCTION}\nEOM\ntorchrun /tmp/train.py\nstatus=$?\necho \"torchrun exited $status\"\nexit $status"
    );
    let run = |test: &str, shell: &str, script: &str| {
        let mut opts = torch_opts(&site);
        let port = crate::util::free_port();
        for e in [
            "PET_NNODES=1".to_string(),
            "PET_NPROC_PER_NODE=2".into(),
            "PET_MASTER_ADDR=127.0.0.1".into(),
            format!("PET_MASTER_PORT={port}"),
            "TRAINLET_CHECKPOINT_SIGNAL=SIGUSR1".into(),
            "TRAINLET_CHECKPOINT_TIMEOUT=15".into(),
        ] {
            opts.extend(["-e".to_string(), e]);
        }
        opts.extend(["--entrypoint".to_string(), shell.to_string()]);
        let c = Container::start(test, &refs(&opts), "localhost/trainlet/torch-runtime:test", &["-c", script]);
        c.wait_for_log("TRAINING rank=1", LIMIT);
        c
    };
    // Without the hook: the shell ignores SIGTERM and the runtime kills it.
    let c = run("nohook", "/bin/sh", &dash);
    c.stop(5);
    c.expect_exit(137, LIMIT, "");
    assert!(!c.logs().contains("CKPT"), "{}", c.logs());
    drop(c);
    for (test, shell, script) in [("hook-bash", "/bin/bash", &sdk_bash), ("hook-dash", "/bin/sh", &dash)] {
        let c = run(test, shell, script);
        let hook = podman(&["exec", &c.name, "trainlet", "stop"]);
        let said = String::from_utf8_lossy(&hook.stderr).to_string();
        // The hook itself may not see the end: once the agent exits, PID 1
        // (the agent itself when bash exec'd torchrun, or the shell right
        // after it) ends and the container's processes go with it.
        assert!(said.contains("sending SIGTERM to trainlet run"), "{shell}: {said}");
        let took = c.stop(30);
        c.expect_exit(143, LIMIT, &format!("{shell}: "));
        assert!(took < Duration::from_secs(10), "{shell}: {took:?}");
        let logs = c.logs();
        assert_eq!(logs.matches("CKPT rank=").count(), 2, "{shell}: both workers checkpointed:\n{logs}");
    }
}

/// Serve mode as PID 1 of a restricted container (uid 1000, read-only
/// root, tmpfs /tmp, a pids limit) with `--preload torch`: runs submitted
/// from outside run forked from the zygote, a DDP run passes its check,
/// and `podman stop` still ends the container with 143 at once.
#[test]
fn a_served_container_with_preload_takes_runs_and_stops_cleanly() {
    let site = torch_site();
    let dir = tempfile::tempdir().expect("tmp");
    let token = dir.path().join("token");
    std::fs::write(&token, "container-token\n").expect("token");
    let mut opts = torch_opts(&site);
    opts.extend(
        ["--user", "1000:1000", "--read-only", "--tmpfs", "/tmp:rw,mode=1777", "--pids-limit", "256"].map(String::from),
    );
    opts.extend(["-v".to_string(), format!("{}:/run/control-token:ro", token.display())]);
    let port = crate::util::free_port().to_string();
    let c = Container::start(
        "serve",
        &refs(&opts),
        "localhost/trainlet/torch-runtime:test",
        &[
            "run",
            "--standalone",
            "--serve",
            "--control-port",
            &port,
            "--control-token-file",
            "/run/control-token",
            "--preload",
            "torch",
            "--nproc-per-node",
            "2",
            "--python",
            "/usr/bin/python3",
        ],
    );
    c.wait_for_log("zygote ready", LIMIT);
    let url = format!("http://127.0.0.1:{port}");
    let run = |body: &str| -> serde_json::Value {
        let (status, reply) = crate::serve::http(&url, "POST", "/v1/runs", Some("container-token"), body);
        assert_eq!(status, 201, "{reply}\n{}", c.logs());
        let id =
            serde_json::from_str::<serde_json::Value>(&reply).expect("json")["id"].as_str().expect("id").to_string();
        let started = Instant::now();
        loop {
            let (_, rec) = crate::serve::http(&url, "GET", &format!("/v1/runs/{id}"), Some("container-token"), "");
            let rec: serde_json::Value = serde_json::from_str(&rec).expect("json");
            if ["succeeded", "failed", "stopped"].iter().any(|s| rec["state"] == *s) {
                let (_, logs) =
                    crate::serve::http(&url, "GET", &format!("/v1/runs/{id}/logs"), Some("container-token"), "");
                return serde_json::json!({ "record": rec, "logs": logs });
            }
            assert!(started.elapsed() < LIMIT, "{rec}\n{}", c.logs());
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let probe = run(
        r#"{"command": ["python", "-c", "import sys, os; print('PRELOADED', 'torch' in sys.modules, os.getuid(), os.getppid())"]}"#,
    );
    assert_eq!(probe["record"]["state"], "succeeded", "{probe}");
    let logs = probe["logs"].as_str().expect("logs");
    assert_eq!(
        logs.matches("PRELOADED True 1000 1").count(),
        2,
        "forked from the zygote, as uid 1000, children of PID 1: {logs}"
    );
    let ddp = run(r#"{"command": ["python", "/examples/train_ddp.py", "--steps", "3", "--check"]}"#);
    assert_eq!(ddp["record"]["state"], "succeeded", "{ddp}\n{}", c.logs());
    let took = c.stop(30);
    c.expect_exit(143, LIMIT, "");
    assert!(took < Duration::from_secs(10), "stopped by trainlet, not SIGKILL: {took:?}");
}

/// A job that hangs in the restricted runtime's profile: uid 1000, a
/// read-only root, every capability dropped, no new privileges. The agent,
/// PID 1 and the workers' ancestor, reads their stacks without ptrace
/// rights of its own: `trainlet stacks` through `podman exec` (not the
/// workers' ancestor) gets them from it, and at the hang verdict the job
/// exits 206 naming the rank that stalled and where.
#[test]
fn a_hang_is_explained_in_a_restricted_container() {
    let site = torch_site();
    let mut opts = torch_opts(&site);
    opts.extend(
        ["--user", "1000:1000", "--read-only", "--tmpfs", "/tmp:rw,mode=1777", "--cap-drop", "all"]
            .into_iter()
            .chain(["--security-opt", "no-new-privileges", "-e", "STALL_RANK=1"])
            .map(String::from),
    );
    let args = ["run", "--standalone", "--nproc-per-node", "2", "--python", "/usr/bin/python3"].into_iter().chain([
        "--progress-timeout",
        "15",
        "--max-restarts",
        "0",
        "/fixtures/stall_job.py",
    ]);
    let c = Container::start("stall", &refs(&opts), "localhost/trainlet/torch-runtime:test", &args.collect::<Vec<_>>());
    c.wait_for_log("STALL rank=1", LIMIT);
    let started = Instant::now();
    let stalled = loop {
        let out = podman(&["exec", "--user", "1000:1000", &c.name, "trainlet", "stacks"]);
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        if text.contains("stall_here (/fixtures/stall_job.py:") {
            break text;
        }
        assert!(started.elapsed() < LIMIT, "{text}\n{}\n{}", String::from_utf8_lossy(&out.stderr), c.logs());
        std::thread::sleep(Duration::from_millis(500));
    };
    assert!(stalled.contains("all_reduce ("), "rank 0 waits in all_reduce: {stalled}");
    c.expect_exit(206, LIMIT, "");
    let logs = c.logs();
    assert!(
        logs.contains("the job hung: rank 1 is not in the all_reduce the other 1 wait in: stall_job.py:"),
        "{logs}"
    );
}
