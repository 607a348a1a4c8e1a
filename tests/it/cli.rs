//! The binary's command line: errors, `doctor`, the `torchrun` name, worker env.

use std::time::Duration;

use crate::util::{Pod, bin, fixture, parse_kv};

const LIMIT: Duration = Duration::from_secs(60);

fn fails_with(args: &[&str], env: &[(&str, &str)], code: i32, needle: &str) {
    let mut pod = Pod::start(args, env);
    let got = pod.code(LIMIT);
    let err = pod.stderr();
    assert_eq!(got, code, "stderr:\n{err}");
    assert!(err.contains(needle), "stderr should contain {needle:?}:\n{err}");
}

#[test]
fn config_errors_name_the_flag_or_variable_and_exit_200() {
    fails_with(&["run", "--nnodes", "two", "t.py"], &[], 200, "invalid --nnodes value \"two\"");
    fails_with(
        &["run", "t.py"],
        &[("PET_NNODES", "2"), ("PET_NODE_RANK", "2")],
        200,
        "invalid PET_NODE_RANK value \"2\": expected a node rank below nnodes (2)",
    );
    fails_with(
        &["run", "t.py"],
        &[("PET_MASTER_PORT", "99999")],
        200,
        "invalid PET_MASTER_PORT value \"99999\": expected a TCP port 1-65535",
    );
    fails_with(&["run", "t.py"], &[("PET_NPROC_PER_NODE", "lots")], 200, "invalid PET_NPROC_PER_NODE value \"lots\"");
    fails_with(&["run", "--nnodes", "4:1", "t.py"], &[], 200, "invalid --nnodes value \"4:1\": expected MIN <= MAX");
    fails_with(&["run", "--on-exit", "3=boom", "t.py"], &[], 200, "invalid failure rule \"3=boom\"");
    fails_with(
        &["run", "--numa-binding", "socket", "t.py"],
        &[],
        200,
        "--numa-binding socket is not supported by trainlet yet",
    );
    fails_with(&["run", "--no-such-flag", "t.py"], &[], 200, "unknown option --no-such-flag");
    fails_with(&["run"], &[], 200, "missing the training script");
}

#[test]
fn an_unresolvable_master_is_a_rendezvous_timeout_naming_the_address() {
    fails_with(
        &["run", "--no-python", "--nnodes", "2", "--node-rank", "1", "--join-timeout", "2", "/bin/true"],
        &[("PET_MASTER_ADDR", "no-such-host.invalid"), ("PET_MASTER_PORT", "29511")],
        201,
        "no-such-host.invalid:29511 not reachable",
    );
}

/// std's `Command::spawn` waited for a child whose exec failed and panicked
/// when the agent's reaper got it first (134 in most runs): 50 runs of each
/// way a worker cannot be executed must all give the documented code.
#[test]
fn a_worker_that_cannot_be_executed_exits_126_or_127_every_time() {
    let dir = tempfile::tempdir().expect("tmp");
    let script = dir.path().join("not_executable.sh");
    std::fs::write(&script, "#!/bin/sh\nexit 0\n").expect("script");
    let script = script.display().to_string();
    for i in 0..50 {
        let cases: [(&[&str], i32, &str); 3] = [
            (&["run", "--no-python", "/nonexistent/worker"], 127, "No such file or directory"),
            (&["run", "--python", "/nonexistent/python", "t.py"], 127, "No such file or directory"),
            (&["run", "--no-python", &script], 126, "Permission denied"),
        ];
        let (args, code, why) = cases[i % 3];
        let mut pod = Pod::start(args, &[]);
        let got = pod.code(LIMIT);
        let err = pod.stderr();
        assert_eq!(got, code, "run {i} of {args:?}; stderr:\n{err}");
        assert!(err.contains("cannot start worker") && err.contains(why), "run {i}: {err}");
        assert!(!err.contains("panicked"), "run {i}: {err}");
    }
}

/// A program found on PATH runs; one missing from every PATH entry is 127.
#[test]
fn workers_are_found_on_path() {
    let mut pod = Pod::start(&["run", "--no-python", "true"], &[]);
    assert_eq!(pod.code(LIMIT), 0, "{}", pod.stderr());
    fails_with(&["run", "--no-python", "no-such-program-anywhere"], &[], 127, "cannot start worker");
}

#[test]
fn doctor_prints_the_plan_and_where_values_came_from() {
    let mut pod = Pod::start(
        &["doctor", "--nproc-per-node", "2"],
        &[("PET_NNODES", "4"), ("PET_NODE_RANK", "3"), ("PET_MASTER_ADDR", "job-node-0-0.job")],
    );
    assert_eq!(pod.code(LIMIT), 0, "{}", pod.stderr());
    let out = pod.stdout();
    assert!(out.contains("nnodes           4"), "{out}");
    assert!(out.contains("(env PET_NNODES)"), "{out}");
    assert!(out.contains("(flag --nproc-per-node)"), "{out}");
    assert!(out.contains("world size       8"), "{out}");
    assert!(out.contains("dial job-node-0-0.job:29500"), "{out}");
}

#[test]
fn answers_to_torchrun_and_gives_workers_torchruns_env() {
    let dir = tempfile::tempdir().expect("tmp");
    let link = dir.path().join("torchrun");
    std::os::unix::fs::symlink(bin(), &link).expect("symlink");
    let script = fixture("print_env.sh");
    let mut pod = Pod::start_as(
        &link,
        &[
            "--no-python",
            "--nproc_per_node=2",
            "--max-restarts",
            "2",
            "--rdzv-id",
            "job7",
            "--standalone",
            &script,
            "lr=${local_rank}",
        ],
        &[],
    );
    assert_eq!(pod.code(LIMIT), 0, "{}", pod.stderr());
    let out = pod.stdout();
    for lr in 0..2 {
        let env: std::collections::HashMap<String, String> = out
            .lines()
            .filter_map(|l| l.strip_prefix(&format!("[default{lr}]: ENV ")))
            .flat_map(|l| parse_kv(l).into_iter())
            .collect();
        let want = [
            ("RANK", lr.to_string()),
            ("LOCAL_RANK", lr.to_string()),
            ("GROUP_RANK", "0".into()),
            ("ROLE_RANK", lr.to_string()),
            ("ROLE_NAME", "default".into()),
            ("LOCAL_WORLD_SIZE", "2".into()),
            ("WORLD_SIZE", "2".into()),
            ("GROUP_WORLD_SIZE", "1".into()),
            ("ROLE_WORLD_SIZE", "2".into()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("TORCHELASTIC_RESTART_COUNT", "0".into()),
            ("TORCHELASTIC_MAX_RESTARTS", "2".into()),
            ("TORCHELASTIC_RUN_ID", "job7".into()),
            ("TORCHELASTIC_USE_AGENT_STORE", "True".into()),
            ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1".into()),
            ("OMP_NUM_THREADS", "1".into()),
        ];
        for (k, v) in want {
            assert_eq!(env.get(k).map(String::as_str), Some(v.as_str()), "{k} of local rank {lr}:\n{out}");
        }
        assert!(env["MASTER_PORT"].parse::<u16>().is_ok_and(|p| p > 0));
        assert!(env["TORCHELASTIC_ERROR_FILE"].ends_with(&format!("attempt_0/{lr}/error.json")), "{out}");
        assert!(out.contains(&format!("[default{lr}]: ARGS lr={lr}")), "${{local_rank}} substituted:\n{out}");
    }
}

#[test]
fn log_dir_gets_per_attempt_per_rank_files_and_redirect_hides_console() {
    let dir = tempfile::tempdir().expect("tmp");
    let logs = dir.path().display().to_string();
    let mut pod = Pod::start(
        &[
            "run",
            "--no-python",
            "--nproc-per-node",
            "2",
            "--log-dir",
            &logs,
            "--redirects",
            "1",
            "--rdzv-id",
            "r1",
            "/bin/sh",
            "-c",
            "echo out-$RANK; echo err-$RANK >&2",
        ],
        &[],
    );
    assert_eq!(pod.code(LIMIT), 0, "{}", pod.stderr());
    assert!(!pod.stdout().contains("out-"), "stdout is redirected to files only");
    assert!(pod.stderr().contains("[default1]: err-1"), "stderr still reaches the console");
    let run_dir = std::fs::read_dir(dir.path()).expect("read").next().expect("run dir").expect("entry").path();
    assert!(run_dir.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("r1_")));
    for lr in 0..2 {
        let base = run_dir.join(format!("attempt_0/{lr}"));
        assert_eq!(std::fs::read_to_string(base.join("stdout.log")).expect("stdout.log"), format!("out-{lr}\n"));
        assert_eq!(std::fs::read_to_string(base.join("stderr.log")).expect("stderr.log"), format!("err-{lr}\n"));
    }
}

#[test]
fn the_book_exit_code_table_is_the_one_in_exit_rs() {
    let rows = |text: &str, strip: &str| -> Vec<String> {
        text.lines()
            .map(|l| l.strip_prefix(strip).unwrap_or(l).trim())
            .filter(|l| l.starts_with("| ") && !l.starts_with("| code"))
            .map(str::to_string)
            .collect()
    };
    let book = crate::docs::chapter("exit-codes");
    let section = book.split("\n## ").next().unwrap_or("");
    let code = std::fs::read_to_string(crate::util::repo().join("src/exit.rs")).expect("exit.rs");
    let want = rows(&code, "//!");
    assert!(want.len() > 10, "{want:?}");
    assert_eq!(rows(section, ""), want);
}

/// Run directories under `<tmp>/trainlet`.
fn run_dirs(tmp: &std::path::Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(tmp.join("trainlet"))
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default()
}

/// `/tmp/trainlet` used to grow by one directory per run: a successful
/// run with nothing asked to be kept removes its own; a failed run keeps
/// its report; `--tee` keeps the files it was asked for.
#[test]
fn a_successful_run_leaves_no_directory_behind_and_a_failed_one_keeps_its_report() {
    let tmp = tempfile::tempdir().expect("tmp");
    let t = tmp.path().display().to_string();
    let env = [("TMPDIR", t.as_str())];
    let mut ok = Pod::start(&["run", "--standalone", "--nproc-per-node", "2", "--no-python", "/bin/true"], &env);
    assert_eq!(ok.code(LIMIT), 0, "{}", ok.stderr());
    assert!(run_dirs(tmp.path()).is_empty(), "{:?}", run_dirs(tmp.path()));
    let mut failed =
        Pod::start(&["run", "--standalone", "--nproc-per-node", "1", "--no-python", "/bin/sh", "-c", "exit 3"], &env);
    assert_ne!(failed.code(LIMIT), 0);
    let dirs = run_dirs(tmp.path());
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    assert!(dirs[0].join("failure_report.json").is_file(), "{}", failed.stderr());
    let mut tee = Pod::start(&["run", "--standalone", "--tee", "3", "--no-python", "/bin/sh", "-c", "echo kept"], &env);
    assert_eq!(tee.code(LIMIT), 0, "{}", tee.stderr());
    assert_eq!(run_dirs(tmp.path()).len(), 2, "--tee asked for files: they stay");
}

/// The book's "Exit codes by mode" table is `cmd::CODES`, row for row, and
/// every single code it names is one the exit-code tables document
/// (trainlet's, and the initializers' for `init`).
#[test]
fn the_book_exit_codes_by_mode_are_the_ones_in_cmd() {
    let book = crate::docs::chapter("exit-codes");
    let section = book.split("\n## Exit codes by mode").nth(1).expect("section").split("\n## ").next().unwrap_or("");
    let rows: Vec<(String, String)> = section
        .lines()
        .filter_map(|l| l.strip_prefix("| ")?.strip_suffix(" |")?.split_once(" | "))
        .filter(|(m, _)| *m != "mode" && !m.starts_with("---"))
        .map(|(m, c)| (m.to_string(), c.to_string()))
        .collect();
    let want: Vec<(String, String)> =
        trainlet::cmd::CODES.iter().map(|(m, c)| ((*m).to_string(), (*c).to_string())).collect();
    assert_eq!(rows, want);
    let tables = book + &crate::docs::chapter("initializers");
    let documented =
        |code: u32| tables.contains(&format!("| {code} |")) || (1..=127).contains(&code) || (211..=255).contains(&code);
    for (mode, codes) in &want {
        for c in codes.split([',', ' ']).filter_map(|c| c.parse::<u32>().ok()) {
            assert!(documented(c), "{mode}: code {c} is in no exit-code table of the book");
        }
    }
}
