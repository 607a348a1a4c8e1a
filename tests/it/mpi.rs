//! Real MPI jobs launched by `trainlet mpi` over `trainlet sshd` on
//! simulated hosts (one loopback address each, port 2222): Open MPI 4.1 +
//! mpi4py, MPICH hydra, Open MPI 5 (PRRTE) and Intel MPI from their PyPI
//! wheels, tree spawn, exit codes, SIGTERM, readiness. The
//! main job runs where OpenSSH cannot: `no_openssh.sh` hides `ssh` and
//! `sshd` in a private mount namespace, and the test watches for any
//! OpenSSH process while the job runs.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::sshkit::{NetNs, Wrap, empty_file, keygen, openssh_processes, pids_with_cmdline, ssh_env, sshd, wait_until};
use crate::util::{Pod, fixture, parse_kv};

const LIMIT: Duration = Duration::from_secs(120);
const DEBIAN_PYTHON: &str = "/usr/bin/python3";
/// Open MPI with every simulated host on one machine: OOB and BTL over
/// loopback, and no shared-memory BTL. Every "host" has the same hostname,
/// so vader's per-node segments of different hosts collide (ranks crash in
/// mca_btl_vader_poll_handle_frag, with OpenSSH as much as with trainlet);
/// on real pods each host has its own /dev/shm.
const OMPI_LOOPBACK: [&str; 9] =
    ["--mca", "oob_tcp_if_include", "lo", "--mca", "btl_tcp_if_include", "lo", "--mca", "btl", "self,tcp"];

fn hosts(subnet: u8, n: u8, slots: u8) -> (Vec<String>, String) {
    let addrs: Vec<String> = (2..2 + n).map(|i| format!("127.0.{subnet}.{i}")).collect();
    let list = addrs.iter().map(|a| format!("{a}:{slots}")).collect::<Vec<_>>().join(",");
    (addrs, list)
}

fn results(out: &str) -> Vec<std::collections::HashMap<String, String>> {
    out.lines().filter(|l| l.starts_with("RESULT ")).map(parse_kv).collect()
}

/// Exit 0 and one RESULT line per rank, each with the exact sum, the
/// world size, trainlet as the `ssh` on PATH and a simulated host; the rows.
fn check_allreduce(job: &mut Pod, ranks: usize, addrs: &[String]) -> Vec<std::collections::HashMap<String, String>> {
    assert_eq!(job.code(LIMIT), 0, "stdout:\n{}\nstderr:\n{}", job.stdout(), job.stderr());
    let rows = results(&job.stdout());
    assert_eq!(rows.len(), ranks, "one line per rank:\n{}", job.stdout());
    let sum = (ranks * (ranks + 1) / 2).to_string();
    let exe = std::fs::canonicalize(crate::util::bin()).expect("exe");
    for r in &rows {
        assert_eq!(r["sum"], sum, "{r:?}");
        assert_eq!(r["size"], ranks.to_string(), "{r:?}");
        assert_eq!(Path::new(&r["ssh"]), exe, "the `ssh` every rank sees is trainlet");
        assert!(addrs.contains(&r["node"]), "ranks ran on the simulated hosts: {r:?}");
    }
    rows
}

fn launcher(args: &[&str], env: &[(String, String)], wrap: &Wrap) -> Pod {
    wrap.trainlet(args, env)
}

#[test]
fn open_mpi_and_mpi4py_over_four_hosts_with_no_openssh() {
    assert!(
        Path::new(DEBIAN_PYTHON).exists(),
        "Debian's python3 with python3-mpi4py is needed (bash tests/setup.sh installs it, as root)"
    );
    let keys = keygen("ecdsa-p521");
    let work = tempfile::tempdir().expect("tmp");
    let empty = empty_file(work.path());
    let env = ssh_env(keys.path(), work.path());
    let (addrs, list) = hosts(21, 4, 2);
    let mut servers: Vec<Pod> =
        addrs.iter().map(|a| sshd(&format!("{a}:2222"), &env, &Wrap::without_openssh(&empty))).collect();

    let script = fixture("mpi_allreduce.py");
    let mut args = vec!["mpi", "--hosts", &list, "--", "mpirun.openmpi", "-np", "8"];
    args.extend_from_slice(&OMPI_LOOPBACK);
    args.extend_from_slice(&[DEBIAN_PYTHON, &script]);
    // A system sshd the machine may run is not part of the job.
    let before = openssh_processes();
    let mut job = launcher(&args, &env, &Wrap::without_openssh(&empty));
    let mut seen_openssh = Vec::new();
    let started = std::time::Instant::now();
    while job.child.try_wait().expect("try_wait").is_none() {
        assert!(started.elapsed() < LIMIT, "the job did not end within {LIMIT:?}:\n{}", job.stderr());
        seen_openssh.extend(openssh_processes().into_iter().filter(|p| !before.contains(p)));
        std::thread::sleep(Duration::from_millis(20));
    }
    let rows = check_allreduce(&mut job, 8, &addrs);
    assert!(seen_openssh.is_empty(), "OpenSSH ran during the job: {seen_openssh:?}");
    for a in &addrs {
        assert_eq!(rows.iter().filter(|r| &r["node"] == a).count(), 2, "2 slots on {a}");
    }
    // The launcher told every worker the job is done; they exit 0.
    for s in &mut servers {
        assert_eq!(s.code(LIMIT), 0, "{}", s.stderr());
        assert!(s.stderr().contains("the launcher says the job is done"));
    }
}

fn compile_mpich(dir: &Path) -> String {
    mpicc(dir, "mpi_allreduce")
}

/// tests/fixtures/`name`.c built with Debian's MPICH into `dir`.
pub(crate) fn mpicc(dir: &Path, name: &str) -> String {
    let out = dir.join(name);
    let st = Command::new("mpicc.mpich")
        .arg("-o")
        .arg(&out)
        .arg(fixture(&format!("{name}.c")))
        .status()
        .expect("mpicc.mpich (Debian's mpich, installed by bash tests/setup.sh as root)");
    assert!(st.success());
    out.display().to_string()
}

#[test]
fn mpich_hydra_over_four_hosts() {
    let keys = keygen("ed25519");
    let work = tempfile::tempdir().expect("tmp");
    let program = compile_mpich(work.path());
    let env = ssh_env(keys.path(), work.path());
    let (addrs, list) = hosts(22, 4, 2);
    let mut servers: Vec<Pod> = addrs.iter().map(|a| sshd(&format!("{a}:2222"), &env, &Wrap::default())).collect();
    // MPI Operator's misspelt variable must not break anything.
    let mut env = env;
    env.push(("HYDRA_LAUNCH_EXTRA_ARGS".into(), "-o ConnectionAttempts=10".into()));
    let mut job =
        launcher(&["mpi", "--hosts", &list, "--", "mpiexec.hydra", "-n", "8", &program], &env, &Wrap::default());
    assert_eq!(job.code(LIMIT), 0, "stdout:\n{}\nstderr:\n{}", job.stdout(), job.stderr());
    let rows = results(&job.stdout());
    assert_eq!(rows.len(), 8, "{}", job.stdout());
    assert!(rows.iter().all(|r| r["sum"] == "36"), "{rows:?}");
    for s in &mut servers {
        assert_eq!(s.code(LIMIT), 0);
        assert!(s.stderr().contains("exec started"), "hydra reached every host");
    }
}

#[test]
fn open_mpi_tree_spawn_with_more_hosts_than_the_radix() {
    let keys = keygen("ed25519");
    let work = tempfile::tempdir().expect("tmp");
    let mut env = ssh_env(keys.path(), work.path());
    env.push(("TRAINLET_LOG".into(), "info,trainlet::ssh=debug".into()));
    let (addrs, list) = hosts(23, 4, 1);
    let mut servers: Vec<Pod> = addrs.iter().map(|a| sshd(&format!("{a}:2222"), &env, &Wrap::default())).collect();
    let script = fixture("mpi_allreduce.py");
    let mut args =
        vec!["mpi", "--tree-spawn", "--hosts", &list, "--", "mpirun.openmpi", "-np", "4", "--mca", "routed_radix", "1"];
    args.extend_from_slice(&OMPI_LOOPBACK);
    args.extend_from_slice(&[DEBIAN_PYTHON, &script]);
    let mut job = launcher(&args, &env, &Wrap::default());
    check_allreduce(&mut job, 4, &addrs);
    for s in &mut servers {
        assert_eq!(s.code(LIMIT), 0);
    }
    // With radix 1 the daemons form a chain: every host but the first was
    // launched by another worker's daemon (its parent URI is not mpirun's
    // vpid 0), through trainlet's client on that worker.
    for s in &servers[1..] {
        let log = s.stderr();
        assert!(log.contains("--tree-spawn"), "{log}");
        let parent = log
            .split("orte_parent_uri \"")
            .nth(1)
            .and_then(|rest| rest.split(';').next())
            .unwrap_or_else(|| panic!("no orte_parent_uri in the exec:\n{log}"));
        assert!(!parent.ends_with(".0"), "launched by mpirun (vpid 0), not by a worker: {parent}\n{log}");
    }
}

#[test]
fn the_launcher_passes_mpiruns_exit_code_through_and_keeps_workers_after_a_failure() {
    let keys = keygen("ed25519");
    let work = tempfile::tempdir().expect("tmp");
    let env = ssh_env(keys.path(), work.path());
    let (addrs, list) = hosts(24, 2, 1);
    let mut servers: Vec<Pod> = addrs.iter().map(|a| sshd(&format!("{a}:2222"), &env, &Wrap::default())).collect();
    let mut args = vec!["mpi", "--hosts", &list, "--", "mpirun.openmpi", "-np", "2"];
    args.extend_from_slice(&OMPI_LOOPBACK);
    args.extend_from_slice(&["sh", "-c", "exit 3"]);
    let mut job = launcher(&args, &env, &Wrap::default());
    assert_eq!(job.code(LIMIT), 3, "{}", job.stderr());
    // A failed launcher may be retried by its Job: the workers stay up.
    std::thread::sleep(Duration::from_millis(500));
    for s in &mut servers {
        assert!(s.child.try_wait().expect("try_wait").is_none(), "worker exited after a failed launch");
        s.signal(nix::sys::signal::Signal::SIGTERM);
        assert_eq!(s.code(LIMIT), 0);
    }
}

#[test]
fn sigterm_to_the_launcher_stops_mpirun_and_the_remote_ranks() {
    let keys = keygen("ed25519");
    let work = tempfile::tempdir().expect("tmp");
    let env = ssh_env(keys.path(), work.path());
    let (addrs, list) = hosts(25, 2, 2);
    let _servers: Vec<Pod> = addrs.iter().map(|a| sshd(&format!("{a}:2222"), &env, &Wrap::default())).collect();
    let mut args = vec!["mpi", "--hosts", &list, "--grace", "10", "--", "mpirun.openmpi", "-np", "4"];
    args.extend_from_slice(&OMPI_LOOPBACK);
    args.extend_from_slice(&[DEBIAN_PYTHON, "-c", "import time; time.sleep(3174)"]);
    let mut job = launcher(&args, &env, &Wrap::default());
    wait_until(LIMIT, "4 ranks to run", || pids_with_cmdline("time.sleep(3174)").len() >= 4);
    job.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(job.code(LIMIT), 143, "{}", job.stderr());
    wait_until(Duration::from_secs(30), "the remote ranks to go", || pids_with_cmdline("time.sleep(3174)").is_empty());
    // The job's daemons carry its agent directory in their environment.
    let ours = format!("TRAINLET_AGENT_DIR={}", work.path().display());
    wait_until(Duration::from_secs(30), "this job's orted daemons to go", || {
        pids_with_cmdline("orted").iter().all(|p| {
            let environ = std::fs::read(format!("/proc/{p}/environ")).unwrap_or_default();
            !environ.split(|b| *b == 0).any(|kv| kv == ours.as_bytes())
        })
    });
}

#[test]
fn workers_that_start_late_are_waited_for() {
    let keys = keygen("ed25519");
    let work = tempfile::tempdir().expect("tmp");
    let env = ssh_env(keys.path(), work.path());
    let (addrs, list) = hosts(26, 4, 1);
    let script = fixture("mpi_allreduce.py");
    let mut args = vec!["mpi", "--hosts", &list, "--", "mpirun.openmpi", "-np", "4"];
    args.extend_from_slice(&OMPI_LOOPBACK);
    args.extend_from_slice(&[DEBIAN_PYTHON, &script]);
    let mut job = launcher(&args, &env, &Wrap::default());
    // Workers come up 2-5 s after the launcher, one per second.
    let mut servers = Vec::new();
    std::thread::sleep(Duration::from_secs(2));
    for a in &addrs {
        servers.push(sshd(&format!("{a}:2222"), &env, &Wrap::default()));
        std::thread::sleep(Duration::from_secs(1));
    }
    check_allreduce(&mut job, 4, &addrs);
    assert!(job.stderr().matches("host ready").count() == 4, "{}", job.stderr());
}

#[test]
fn a_host_that_never_comes_up_is_named_within_the_deadline() {
    let keys = keygen("ed25519");
    let work = tempfile::tempdir().expect("tmp");
    let env = ssh_env(keys.path(), work.path());
    let (addrs, list) = hosts(27, 3, 1);
    let _up: Vec<Pod> = addrs[..2].iter().map(|a| sshd(&format!("{a}:2222"), &env, &Wrap::default())).collect();
    let started = std::time::Instant::now();
    let mut job = launcher(
        &["mpi", "--hosts", &list, "--wait-timeout", "4", "--", "mpirun.openmpi", "-np", "3", "true"],
        &env,
        &Wrap::default(),
    );
    assert_eq!(job.code(LIMIT), 201, "{}", job.stderr());
    assert!(started.elapsed() < Duration::from_secs(30), "bounded by --wait-timeout");
    let err = job.stderr();
    assert!(err.contains("1 of 3 MPI hosts did not complete the SSH handshake"), "{err}");
    assert!(err.contains("127.0.27.4: ssh: connect to host 127.0.27.4 port 2222: Connection refused"), "{err}");
    assert!(!err.contains("127.0.27.2:"), "ready hosts are not listed: {err}");
}

/// As in the MPI image: an `mpirun` link to trainlet first on PATH (in
/// `<dir>/ours`, returned), the real Open MPI mpirun after it.
fn mpirun_links(dir: &Path, env: &mut Vec<(String, String)>) -> std::path::PathBuf {
    let ours = dir.join("ours");
    let real = dir.join("real");
    std::fs::create_dir_all(&ours).expect("dir");
    std::fs::create_dir_all(&real).expect("dir");
    std::os::unix::fs::symlink(crate::util::bin(), ours.join("mpirun")).expect("link");
    std::os::unix::fs::symlink("/usr/bin/mpirun.openmpi", real.join("mpirun")).expect("link");
    let path = format!("{}:{}:{}", ours.display(), real.display(), std::env::var("PATH").unwrap_or_default());
    env.push(("PATH".into(), path));
    ours
}

#[test]
fn a_symlink_named_mpirun_runs_the_trainjob_command_under_trainlet_mpi() {
    let keys = keygen("ed25519");
    let work = tempfile::tempdir().expect("tmp");
    let mut env = ssh_env(keys.path(), work.path());
    let (addrs, list) = hosts(28, 2, 1);
    let mut servers: Vec<Pod> = addrs.iter().map(|a| sshd(&format!("{a}:2222"), &env, &Wrap::default())).collect();
    let ours = mpirun_links(work.path(), &mut env);
    env.push(("TRAINLET_MPI_HOSTS".into(), list));
    let mut args = vec!["-np", "2"];
    args.extend_from_slice(&OMPI_LOOPBACK);
    args.extend_from_slice(&["echo", "RESULT", "sum=hi"]);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut job = Pod::start_as(&ours.join("mpirun"), &args, &env);
    assert_eq!(job.code(LIMIT), 0, "stdout:\n{}\nstderr:\n{}", job.stdout(), job.stderr());
    assert_eq!(results(&job.stdout()).len(), 2, "{}", job.stdout());
    assert!(job.stderr().contains("waiting for the MPI hosts"), "{}", job.stderr());
    for s in &mut servers {
        assert_eq!(s.code(LIMIT), 0, "the workers were told the job is done");
    }
}

/// In the MPI image `mpirun` on PATH is trainlet's link, so the book's
/// `trainlet mpi -- mpirun ...` used to run trainlet inside trainlet (9.8 s
/// instead of 0.6 s, and the inner one could not tell the workers the job
/// was done): the real mpirun is found the way the link finds it.
#[test]
fn trainlet_mpi_with_the_link_on_path_runs_the_real_mpirun_once() {
    let keys = keygen("ed25519");
    let work = tempfile::tempdir().expect("tmp");
    let mut env = ssh_env(keys.path(), work.path());
    let (addrs, list) = hosts(31, 2, 1);
    let mut servers: Vec<Pod> = addrs.iter().map(|a| sshd(&format!("{a}:2222"), &env, &Wrap::default())).collect();
    mpirun_links(work.path(), &mut env);
    let mut args = vec!["mpi", "--hosts", &list, "--", "mpirun", "-np", "2"];
    args.extend_from_slice(&OMPI_LOOPBACK);
    args.extend_from_slice(&["echo", "RESULT", "sum=hi"]);
    let mut job = launcher(&args, &env, &Wrap::default());
    assert_eq!(job.code(LIMIT), 0, "stdout:\n{}\nstderr:\n{}", job.stdout(), job.stderr());
    assert_eq!(results(&job.stdout()).len(), 2, "{}", job.stdout());
    let err = job.stderr();
    assert_eq!(err.matches("waiting for the MPI hosts").count(), 1, "one launcher, not two:\n{err}");
    assert!(err.contains("running the real one"), "{err}");
    assert!(!err.contains("could not tell the worker the job is done"), "{err}");
    for s in &mut servers {
        assert_eq!(s.code(LIMIT), 0, "the workers were told the job is done");
    }
}

#[test]
fn the_launchers_own_host_needs_no_ssh_server() {
    // runLauncherAsNode: the launcher's own name is in the hostfile.
    let keys = keygen("ed25519");
    let work = tempfile::tempdir().expect("tmp");
    let env = ssh_env(keys.path(), work.path());
    let mut server = sshd("127.0.29.2:2222", &env, &Wrap::default());
    let mut args = vec!["mpi", "--hosts", "localhost:1,127.0.29.2:1", "--", "mpirun.openmpi", "-np", "2"];
    args.extend_from_slice(&OMPI_LOOPBACK);
    args.extend_from_slice(&["echo", "RESULT", "sum=hi"]);
    let mut job = launcher(&args, &env, &Wrap::default());
    assert_eq!(job.code(LIMIT), 0, "stdout:\n{}\nstderr:\n{}", job.stdout(), job.stderr());
    assert_eq!(results(&job.stdout()).len(), 2, "{}", job.stdout());
    assert!(job.stderr().contains("this pod is one of the hosts"), "{}", job.stderr());
    assert_eq!(server.code(LIMIT), 0, "the remote worker was told the job is done");
}

/// A venv made by tests/mpi_venvs.sh.
pub(crate) fn mpi_venv(name: &str) -> std::path::PathBuf {
    let dir = crate::util::repo().join(name);
    assert!(
        dir.join("bin/python").exists(),
        "{} is missing: run tests/mpi_venvs.sh (tests/run.sh does)",
        dir.display()
    );
    dir
}

/// The env of every simulated pod of a job whose MPI lives in `venv`
/// (as an image's ENV would put it on PATH and LD_LIBRARY_PATH).
pub(crate) fn venv_env(base: &[(String, String)], venv: &Path) -> Vec<(String, String)> {
    let mut env = base.to_vec();
    let path = format!("{}:{}", venv.join("bin").display(), std::env::var("PATH").unwrap_or_default());
    env.push(("PATH".into(), path));
    env.push(("LD_LIBRARY_PATH".into(), venv.join("lib").display().to_string()));
    env
}

#[test]
fn open_mpi_5_with_prrte_over_four_hosts() {
    // PRRTE's daemons refuse loopback interfaces: the whole job runs in a
    // network namespace that also has a non-loopback veth (reference/mpi.md 1.3).
    let venv = mpi_venv(".venv-ompi5");
    let ns = NetNs::new("ompi5");
    let wrap = Wrap::in_netns(&ns);
    let keys = keygen("ed25519");
    let work = tempfile::tempdir().expect("tmp");
    let env = venv_env(&ssh_env(keys.path(), work.path()), &venv);
    let (addrs, list) = hosts(31, 4, 2);
    let mut servers: Vec<Pod> = addrs.iter().map(|a| sshd(&format!("{a}:2222"), &env, &wrap)).collect();
    let mpirun = venv.join("bin/mpirun").display().to_string();
    let python = venv.join("bin/python").display().to_string();
    let script = fixture("mpi_allreduce.py");
    let args = [
        "mpi",
        "--hosts",
        &list,
        "--",
        &mpirun,
        "--allow-run-as-root",
        "-np",
        "8",
        "--mca",
        "btl",
        "self,tcp",
        "--mca",
        "btl_tcp_if_include",
        "127.0.0.0/8",
        &python,
        &script,
    ];
    let mut job = launcher(&args, &env, &wrap);
    check_allreduce(&mut job, 8, &addrs);
    for s in &mut servers {
        assert_eq!(s.code(LIMIT), 0, "{}", s.stderr());
        assert!(s.stderr().contains("exec started"), "prted was started over trainlet's SSH");
    }
}

#[test]
fn intel_mpi_over_four_hosts() {
    let venv = mpi_venv(".venv-impi");
    let keys = keygen("ecdsa-p521");
    let work = tempfile::tempdir().expect("tmp");
    let mut env = venv_env(&ssh_env(keys.path(), work.path()), &venv);
    // libfabric's TCP provider on loopback, no shared memory between the
    // simulated hosts (they share one hostname).
    for (k, v) in [("FI_PROVIDER", "tcp"), ("FI_TCP_IFACE", "lo"), ("I_MPI_FABRICS", "ofi")] {
        env.push((k.into(), v.into()));
    }
    let (addrs, list) = hosts(32, 4, 2);
    let mut servers: Vec<Pod> = addrs.iter().map(|a| sshd(&format!("{a}:2222"), &env, &Wrap::default())).collect();
    let mpiexec = venv.join("bin/mpiexec.hydra").display().to_string();
    let python = venv.join("bin/python").display().to_string();
    let script = fixture("mpi_allreduce.py");
    let args = ["mpi", "--hosts", &list, "--", &mpiexec, "-n", "8", "-ppn", "2", &python, &script];
    let mut job = launcher(&args, &env, &Wrap::default());
    check_allreduce(&mut job, 8, &addrs);
    for s in &mut servers {
        assert_eq!(s.code(LIMIT), 0, "{}", s.stderr());
        assert!(s.stderr().contains("exec started"), "hydra_bstrap_proxy was started over trainlet's SSH");
    }
}
