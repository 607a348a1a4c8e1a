//! MPI without mpirun, SSH or a launcher pod (issue 29): `trainlet run
//! --framework mpi` on simulated pods (127.0.0.N, 2 pods x 2 ranks)
//! starts real MPI ranks itself and serves them PMI on a pre-connected
//! `PMI_FD`, the key-value space on the job's store. Debian's MPICH 4.0.2
//! (PMI-1; a C program built with `mpicc.mpich`) and Intel MPI 2021.18
//! from PyPI `impi-rt` with mpi4py (PMI-1 with its own client, PMI-2
//! through Slurm's `libpmi2`, Debian's libpmi2-0). Faults: a rank killed
//! mid-job, `MPI_Abort`, an exit without `MPI_Finalize`, `MPI_Comm_spawn`,
//! and ranks that break the protocol.

use std::path::Path;
use std::time::Duration;

use crate::mpi::{mpi_venv, venv_env};
use crate::util::{Pod, fixture, parse_kv, start_pods, unique_marker, wait_until_gone};

const LIMIT: Duration = Duration::from_secs(120);

/// tests/fixtures/pmi_job.c built with Debian's MPICH into `dir`.
fn build(dir: &Path) -> String {
    crate::mpi::mpicc(dir, "pmi_job")
}

/// Two pods of two ranks running `program` (and `args`) under trainlet's PMI.
fn job(flags: &[&str], program: &[&str], env: &[(&str, &str)]) -> Vec<Pod> {
    let mut args = vec!["run", "--framework", "mpi", "--nproc-per-node", "2", "--shutdown-timeout", "3"];
    args.extend_from_slice(flags);
    args.push("--no-python");
    args.extend_from_slice(program);
    start_pods(2, 2, &args, env)
}

/// Every pod's exit code, and its RESULT lines parsed.
fn finish(pods: &mut [Pod]) -> (Vec<i32>, Vec<std::collections::HashMap<String, String>>) {
    let codes = pods.iter_mut().map(|p| p.code(LIMIT)).collect();
    let rows = pods
        .iter()
        .flat_map(|p| p.stdout().lines().filter(|l| l.contains("RESULT ")).map(parse_kv).collect::<Vec<_>>())
        .collect();
    (codes, rows)
}

fn logs(pods: &[Pod]) -> String {
    pods.iter().enumerate().map(|(i, p)| format!("--- pod {i}\n{}\n{}", p.stdout(), p.stderr())).collect()
}

/// Four ranks, one each, with the exact sum, in attempt `restart`.
fn assert_four(rows: &[std::collections::HashMap<String, String>], restart: &str, all: &str) {
    let mut ranks: Vec<&str> = rows.iter().map(|r| r["rank"].as_str()).collect();
    ranks.sort_unstable();
    assert_eq!(ranks, ["0", "1", "2", "3"], "{all}");
    for r in rows {
        assert_eq!((r["size"].as_str(), r["sum"].as_str(), r["restart"].as_str()), ("4", "10", restart), "{all}");
    }
}

#[test]
fn mpich_ranks_allreduce_on_two_pods_with_no_launcher_and_no_ssh() {
    let dir = tempfile::tempdir().expect("tmp");
    let program = build(dir.path());
    // No ssh, mpirun or mpiexec anywhere on the ranks' PATH.
    let mut pods = job(&[], &[&program], &[("PATH", "/nonexistent")]);
    let (codes, rows) = finish(&mut pods);
    let all = logs(&pods);
    assert_eq!(codes, [0, 0], "{all}");
    assert_four(&rows, "0", &all);
    for p in &pods {
        assert!(p.stderr().contains("pmi_1=2 pmi_2=0"), "both ranks of each pod spoke PMI-1:\n{all}");
    }
}

#[test]
fn intel_mpi_speaks_pmi_1_itself_and_pmi_2_through_slurms_library() {
    let venv = mpi_venv(".venv-impi");
    let python = venv.join("bin/python").display().to_string();
    let script = fixture("mpi_allreduce.py");
    let mut env = venv_env(&[], &venv);
    // libfabric's TCP provider on loopback between the simulated pods.
    for (k, v) in [("FI_PROVIDER", "tcp"), ("FI_TCP_IFACE", "lo"), ("I_MPI_FABRICS", "ofi")] {
        env.push((k.into(), v.into()));
    }
    for (pmi2, want) in [(false, "pmi_1=2 pmi_2=0"), (true, "pmi_1=0 pmi_2=2")] {
        let mut env = env.clone();
        if pmi2 {
            env.push(("I_MPI_PMI_LIBRARY".into(), "/usr/lib/x86_64-linux-gnu/libpmi2.so.0".into()));
        }
        let pairs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let mut pods = job(&[], &[&python, &script], &pairs);
        let (codes, rows) = finish(&mut pods);
        let all = logs(&pods);
        assert_eq!(codes, [0, 0], "{all}");
        assert_eq!(rows.len(), 4, "{all}");
        assert!(rows.iter().all(|r| r["size"] == "4" && r["sum"] == "10"), "{all}");
        for p in &pods {
            assert!(p.stderr().contains(want), "{want}:\n{all}");
        }
    }
}

/// PMI with a spare (3 pods, `--spares 1`): the MPI world is the round's,
/// 2 pods x 2 ranks, and the third pod waits; a killed rank restarts the
/// world on the same two pods, and every pod exits 0.
#[test]
fn an_mpi_world_with_a_spare_is_the_rounds_and_restarts_on_the_same_pods() {
    let dir = tempfile::tempdir().expect("tmp");
    let program = build(dir.path());
    let mut args = vec!["run", "--framework", "mpi", "--nproc-per-node", "2", "--shutdown-timeout", "3"];
    args.extend(["--spares", "1", "--max-restarts", "1", "--no-python", program.as_str()]);
    let mut pods = start_pods(3, 2, &args, &[("FAULT", "kill"), ("FAULT_RANK", "3")]);
    let (codes, rows) = finish(&mut pods);
    let all = logs(&pods);
    assert_eq!(codes, [0, 0, 0], "{all}");
    assert_four(&rows, "1", &all);
    let spares = pods.iter().filter(|p| p.stderr().contains("waiting as a spare")).count();
    assert_eq!(spares, 1, "{all}");
    assert!(!all.contains("takes over"), "the restart kept both pods in place: {all}");
}

#[test]
fn a_rank_killed_mid_job_stops_every_rank_and_the_job_restarts_and_completes() {
    let dir = tempfile::tempdir().expect("tmp");
    let program = build(dir.path());
    let marker = unique_marker();
    let env = [("FAULT", "kill"), ("FAULT_RANK", "3"), ("TRAINLET_TEST_MARKER", marker.as_str())];
    let mut pods = job(&["--max-restarts", "1"], &[&program], &env);
    let (codes, rows) = finish(&mut pods);
    let all = logs(&pods);
    assert_eq!(codes, [0, 0], "{all}");
    assert!(pods[1].stdout().contains("FAULT rank=3 what=kill"), "{all}");
    // The ranks of the first attempt, blocked in a barrier, were stopped;
    // the second attempt ran every rank to the end.
    assert_four(&rows, "1", &all);
    assert!(pods[0].stderr().contains("failed_rank=3"), "{all}");
    wait_until_gone(&marker, Duration::from_secs(10));
}

#[test]
fn with_the_budget_spent_a_killed_rank_ends_the_job_with_its_code_and_a_report_naming_it() {
    let dir = tempfile::tempdir().expect("tmp");
    let program = build(dir.path());
    let marker = unique_marker();
    let logs_dir = dir.path().join("logs");
    let log_dir = logs_dir.display().to_string();
    let env =
        [("FAULT", "kill"), ("FAULT_RANK", "3"), ("FAULT_ALWAYS", "1"), ("TRAINLET_TEST_MARKER", marker.as_str())];
    let mut pods = job(&["--max-restarts", "1", "--log-dir", &log_dir], &[&program], &env);
    let (codes, rows) = finish(&mut pods);
    let all = logs(&pods);
    assert_eq!(codes, [137, 137], "128 + SIGKILL on every pod (docs/src/exit-codes.md):\n{all}");
    assert!(rows.is_empty(), "no attempt got past the barrier:\n{all}");
    wait_until_gone(&marker, Duration::from_secs(10));
    let (v, report) = root_cause_of(&logs_dir);
    assert_eq!(v["root_cause"]["rank"], 3, "{report}");
    assert_eq!(v["root_cause"]["signal"], 9, "{report}");
}

/// The one failure report under `dir` (both pods share it here), parsed, and its text.
fn root_cause_of(dir: &Path) -> (serde_json::Value, String) {
    let report = find_report(dir);
    (serde_json::from_str(&report).expect("json"), report)
}

/// The one failure report under `dir`.
fn find_report(dir: &Path) -> String {
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.file_name().is_some_and(|n| n == "failure_report.json") {
                return std::fs::read_to_string(p).expect("report");
            }
        }
    }
    panic!("no failure_report.json under {}", dir.display())
}

/// `MPI_Abort`, an exit without `MPI_Finalize` and `MPI_Comm_spawn` each
/// end the job at once (the other ranks wait in a barrier), with the
/// documented code and the reason in the report.
#[test]
fn abort_an_exit_without_finalize_and_spawn_each_end_the_job_with_a_reason() {
    let dir = tempfile::tempdir().expect("tmp");
    let program = build(dir.path());
    // MPICH aborts a failed spawn with an error code of its own (as exit()
    // would truncate it): any code but 0, the same on both pods.
    for (fault, code, reason) in [
        ("abort", Some(3), "called MPI_Abort (PMI abort, exit code 3)"),
        ("nofinalize", Some(1), "without MPI_Finalize"),
        ("spawn", None, "called MPI_Abort"),
    ] {
        let logs_dir = dir.path().join(fault);
        let log_dir = logs_dir.display().to_string();
        let marker = unique_marker();
        let env = [("FAULT", fault), ("FAULT_RANK", "2"), ("TRAINLET_TEST_MARKER", marker.as_str())];
        let mut pods = job(&["--log-dir", &log_dir], &[&program], &env);
        let (codes, rows) = finish(&mut pods);
        let all = logs(&pods);
        match code {
            Some(c) => assert_eq!(codes, [c, c], "{fault}:\n{all}"),
            None => assert!(codes[0] != 0 && codes[0] == codes[1], "{fault}: {codes:?}\n{all}"),
        }
        assert!(rows.is_empty(), "{fault}: no rank got past the barrier:\n{all}");
        wait_until_gone(&marker, Duration::from_secs(10));
        let (v, report) = root_cause_of(&logs_dir);
        assert_eq!(v["root_cause"]["rank"], 2, "{fault}: {report}");
        let message = v["root_cause"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(reason), "{fault}: {message:?} in {report}");
    }
}

/// Ranks that are not MPI and break the protocol: a line that is not
/// PMI, and one longer than the bound. Each is stopped at once (they
/// would wait for a reply forever) and the report says why.
#[test]
fn a_rank_that_breaks_the_protocol_is_stopped_with_the_reason() {
    let dir = tempfile::tempdir().expect("tmp");
    for (script, reason) in [
        ("echo 'cmd=init pmi_version=1 pmi_subversion=1' >&3; echo garbage >&3; exec sleep 600", "local rank"),
        ("head -c 70000 /dev/zero | tr '\\0' c >&3; exec sleep 600", "over 65536 bytes"),
    ] {
        let logs_dir = dir.path().join(reason.replace(' ', "_"));
        let log_dir = logs_dir.display().to_string();
        let marker = unique_marker();
        let args = [
            "run",
            "--framework",
            "mpi",
            "--nproc-per-node",
            "1",
            "--log-dir",
            &log_dir,
            "--no-python",
            "sh",
            "-c",
            script,
        ];
        let mut pod = Pod::start(&args, &[("TRAINLET_TEST_MARKER", marker.as_str())]);
        let code = pod.code(Duration::from_secs(60));
        assert_eq!(code, 137, "stopped by SIGKILL, not after its sleep:\n{}", pod.stderr());
        wait_until_gone(&marker, Duration::from_secs(10));
        let (v, report) = root_cause_of(&logs_dir);
        let message = v["root_cause"]["message"].as_str().unwrap_or_default();
        assert!(message.starts_with("stopped by trainlet") && message.contains(reason), "{message:?} in {report}");
    }
}

/// A fence no rank can complete: local rank 0 finalizes and exits while
/// rank 1 waits at a barrier that needs it. Rank 1 is stopped at once
/// (without this it would wait forever) and the report says why.
#[test]
fn a_rank_left_waiting_at_a_fence_a_finalized_rank_cannot_join_is_stopped() {
    let dir = tempfile::tempdir().expect("tmp");
    let log_dir = dir.path().join("logs");
    let script = "echo 'cmd=init pmi_version=1 pmi_subversion=1' >&3; read -r reply <&3; \
                  if [ \"$PMI_RANK\" = 0 ]; then echo cmd=finalize >&3; read -r reply <&3; exit 0; fi; \
                  echo cmd=barrier_in >&3; read -r reply <&3; exec sleep 600";
    let marker = unique_marker();
    let log = log_dir.display().to_string();
    let args =
        ["run", "--framework", "mpi", "--nproc-per-node", "2", "--log-dir", &log, "--no-python", "bash", "-c", script];
    let mut pod = Pod::start(&args, &[("TRAINLET_TEST_MARKER", marker.as_str())]);
    let code = pod.code(Duration::from_secs(60));
    assert_eq!(code, 137, "rank 1 stopped, not left in its barrier:\n{}", pod.stderr());
    wait_until_gone(&marker, Duration::from_secs(10));
    let (v, report) = root_cause_of(&log_dir);
    assert_eq!(v["root_cause"]["rank"], 1, "{report}");
    let message = v["root_cause"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("can never go on"), "{message:?} in {report}");
}
