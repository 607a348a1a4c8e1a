//! MPI without SSH (issue 29): trainlet's PMI server against `mpirun`.
//! Debian's MPICH 4.0.2 runs `benches/pmi_start.c` (built here with
//! `mpicc.mpich`), whose ranks print wall-clock stamps before `MPI_Init`,
//! after it and after their first `MPI_Allreduce`.
//!
//! - Start: from the job's start to `MPI_Init` returned on every rank, 4
//!   pods x 2 ranks. trainlet: the 4 pods' `trainlet run --framework mpi`
//!   start at once (rendezvous included). `mpirun` (MPICH's
//!   `mpiexec.hydra`): its SSH servers already listen (trainlet's, or
//!   OpenSSH's with the same key), so their start is not counted: the
//!   comparison favours `mpirun`.
//! - Address exchange: `MPI_Init` plus the first allreduce, as the slowest
//!   rank sees it, at 64 and 256 ranks on this machine (pods of 8),
//!   against `mpiexec.hydra` forking the same ranks as hosts of 8 here.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::mpi_bench::{addrs, job_keys, openssh_args, openssh_servers, trainlet_servers};
use super::{Row, free_port, median, time_row, trainlet};

/// One rank's stamps (wall-clock microseconds).
struct Stamp {
    start: u64,
    init: u64,
    reduced: u64,
}

fn now_us() -> u64 {
    u64::try_from(SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros())).unwrap_or(u64::MAX)
}

/// The PMISTAMP lines of `out`; panics unless there are `ranks` with the right sum.
fn stamps(out: &str, ranks: usize) -> Vec<Stamp> {
    let rows: Vec<Stamp> = out
        .lines()
        .filter_map(|l| l.split_once("PMISTAMP ").map(|(_, r)| r))
        .map(|r| {
            let kv: std::collections::HashMap<&str, &str> =
                r.split_whitespace().filter_map(|w| w.split_once('=')).collect();
            let n = |k: &str| kv.get(k).and_then(|v| v.parse::<u64>().ok()).expect("a stamp");
            let size = n("size");
            assert_eq!(n("sum"), size * (size + 1) / 2, "a wrong sum: {r}");
            Stamp { start: n("start"), init: n("init"), reduced: n("reduced") }
        })
        .collect();
    assert_eq!(rows.len(), ranks, "{out}");
    rows
}

fn since(t0: u64, t: u64) -> Duration {
    Duration::from_micros(t.saturating_sub(t0))
}

/// `benches/pmi_start.c` built into `dir`.
fn build(dir: &Path) -> String {
    let out = dir.join("pmi_start");
    let st = Command::new("mpicc.mpich")
        .args(["-O2", "-o"])
        .arg(&out)
        .arg(super::bench_file("pmi_start.c"))
        .status()
        .expect("mpicc.mpich (Debian's libmpich-dev: bash tests/setup.sh installs it)");
    assert!(st.success(), "mpicc.mpich failed");
    out.display().to_string()
}

/// `pods` x `per_pod` ranks of `program` under trainlet's PMI; the
/// output of every pod and when they were started.
fn trainlet_job(pods: u32, per_pod: u32, program: &str) -> (String, u64) {
    let port = free_port().to_string();
    let t0 = now_us();
    let children: Vec<_> = (0..pods)
        .map(|i| {
            Command::new(trainlet())
                .args(["run", "--framework", "mpi", "--nproc-per-node", &per_pod.to_string(), "--no-python", program])
                .env("PET_NNODES", pods.to_string())
                .env("PET_NODE_RANK", i.to_string())
                .env("PET_MASTER_ADDR", "127.0.0.1")
                .env("PET_MASTER_PORT", &port)
                .env("PET_LOCAL_ADDR", format!("127.0.0.{}", i + 1))
                .env("TRAINLET_LOG", "warn")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("trainlet")
        })
        .collect();
    let mut out = String::new();
    for c in children {
        let o = c.wait_with_output().expect("wait");
        assert!(o.status.success(), "a pod failed: {}", String::from_utf8_lossy(&o.stderr));
        out.push_str(&String::from_utf8_lossy(&o.stdout));
    }
    (out, t0)
}

/// `mpiexec.hydra` with `args` before the program; its output and start.
fn hydra_job(args: &[String], program: &str, env: &[(&str, &str)]) -> (String, u64) {
    let t0 = now_us();
    let o = Command::new("mpiexec.hydra")
        .args(args)
        .arg(program)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("mpiexec.hydra (Debian's mpich)");
    assert!(o.status.success(), "mpiexec.hydra failed: {}", String::from_utf8_lossy(&o.stderr));
    (String::from_utf8_lossy(&o.stdout).into_owned(), t0)
}

/// Start to `MPI_Init` returned on every rank, 4 pods x 2 ranks: PMI,
/// `mpirun` over trainlet's SSH, `mpirun` over OpenSSH; `rounds` of each,
/// interleaved. Rows: PMI against OpenSSH, PMI against trainlet's SSH.
pub fn start(rows: &mut Vec<Row>, rounds: usize) {
    const PODS: u32 = 4;
    let dir = tempfile::tempdir().expect("tmp");
    let program = build(dir.path());
    let keys = dir.path().join("keys");
    let key = job_keys(&keys);
    let agent_dir = dir.path().join("bin");
    let _ours = trainlet_servers(42, &keys, &agent_dir);
    let ossh_dir = dir.path().join("openssh");
    std::fs::create_dir_all(&ossh_dir).expect("dir");
    std::fs::copy(keys.join("authorized_keys"), ossh_dir.join("authorized_keys")).expect("copy");
    let _theirs = openssh_servers(43, &ossh_dir, &key);
    // hydra runs its launcher with the host and the command only.
    let wrapper = dir.path().join("openssh-ssh");
    std::fs::write(&wrapper, format!("#!/bin/sh\nexec /usr/bin/ssh {} \"$@\"\n", openssh_args(&key))).expect("wrapper");
    std::fs::set_permissions(&wrapper, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    let hydra = |launcher: &Path, subnet: u8| -> Vec<String> {
        let hosts: Vec<String> = addrs(subnet).iter().take(PODS as usize).map(|a| format!("{a}:2")).collect();
        vec![
            "-launcher".into(),
            "ssh".into(),
            "-launcher-exec".into(),
            launcher.display().to_string(),
            "-hosts".into(),
            hosts.join(","),
            "-n".into(),
            (PODS * 2).to_string(),
        ]
    };
    let ssh_dir = keys.display().to_string();
    let ours_env = [("TRAINLET_SSH_DIR", ssh_dir.as_str()), ("TRAINLET_LOG", "warn")];
    let init_all = |(out, t0): (String, u64)| {
        since(t0, stamps(&out, (PODS * 2) as usize).iter().map(|s| s.init).max().unwrap_or(0))
    };
    let (mut pmi, mut over_ours, mut over_openssh) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        pmi.push(init_all(trainlet_job(PODS, 2, &program)));
        over_ours.push(init_all(hydra_job(&hydra(&agent_dir.join("ssh"), 42), &program, &ours_env)));
        over_openssh.push(init_all(hydra_job(&hydra(&wrapper, 43), &program, &[])));
    }
    let pmi = median(pmi);
    rows.push(time_row(
        "job start to MPI_Init on every rank, 4 pods x 2 (MPICH): trainlet's PMI vs mpirun over OpenSSH".into(),
        pmi,
        median(over_openssh),
        ">= 3x",
    ));
    rows.push(time_row(
        "job start to MPI_Init on every rank, 4 pods x 2 (MPICH): trainlet's PMI vs mpirun over trainlet ssh".into(),
        pmi,
        median(over_ours),
        "report",
    ));
}

/// The address exchange at `sizes` ranks (pods of 8): `MPI_Init` and the
/// first allreduce as the slowest rank sees them, PMI against
/// `mpiexec.hydra` forking the same ranks as hosts of 8 on this machine;
/// then the cost per rank at the largest size against the smallest.
pub fn exchange(rows: &mut Vec<Row>, sizes: &[u32], rounds: usize) {
    const PER_POD: u32 = 8;
    let dir = tempfile::tempdir().expect("tmp");
    let program = build(dir.path());
    let slowest = |(out, _): (String, u64), n: u32| {
        let s = stamps(&out, n as usize);
        s.iter().map(|s| Duration::from_micros(s.reduced.saturating_sub(s.start))).max().unwrap_or_default()
    };
    let mut per_rank = Vec::new();
    for &n in sizes {
        let pods = n / PER_POD;
        let hosts: Vec<String> = (0..pods).map(|i| format!("127.0.61.{}:{PER_POD}", i + 1)).collect();
        let args: Vec<String> = ["-launcher", "fork", "-hosts", &hosts.join(","), "-n", &n.to_string()]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let (mut ours, mut theirs) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            ours.push(slowest(trainlet_job(pods, PER_POD, &program), n));
            theirs.push(slowest(hydra_job(&args, &program, &[]), n));
        }
        let (o, t) = (median(ours), median(theirs));
        per_rank.push((n, o / n, t / n));
        rows.push(time_row(
            format!("address exchange (MPI_Init + first allreduce, slowest rank), {n} ranks, {pods} pods of {PER_POD}: PMI vs mpiexec.hydra"),
            o,
            t,
            "report",
        ));
    }
    if let (Some(first), Some(last)) = (per_rank.first(), per_rank.last())
        && first.0 != last.0
    {
        let (n0, o0, _) = *first;
        let (n1, o1, _) = *last;
        // ratio = cost per rank at the smallest size / at the largest: 1 is flat.
        rows.push(time_row(
            format!("PMI exchange cost per rank: {n1} ranks (trainlet column) vs {n0} ranks (reference column)"),
            o1,
            o0,
            "~1x (flat)",
        ));
    }
}
