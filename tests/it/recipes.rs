//! Every launch recipe of torchrun's documentation (the docstring of
//! torch/distributed/run.py, which its docs page renders) runs under trainlet
//! answering to `torchrun` as under torch's own torchrun, side by side in
//! one directory: the same exit code, and for every worker the same
//! variables torchrun sets (tests/fixtures/recipe_worker.py prints them).
//!
//! Values that are a run's own differ by nature and are checked for what
//! they mean instead: MASTER_PORT (a free port: a number > 0),
//! TORCHELASTIC_ERROR_FILE (a directory of the run's own, ending
//! `attempt_0/<local rank>/error.json` in both), a standalone run's id
//! (random in both) and MASTER_ADDR (torch gives the store host's fully
//! qualified name, trainlet the address its store is dialled at: both must
//! name this machine). The recipes that need several machines (fault
//! tolerant and elastic with `$NUM_NODES` > 1) run with one node here;
//! the elastic one adds `--rdzv-conf=last_call_timeout=1` to both, so that
//! neither waits torch's 30 s last call for nodes that never come.

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::util::{bin, fixture, free_port, python};

const LIMIT: Duration = Duration::from_secs(240);

/// One run of a launcher: its exit code, stdout and stderr.
struct Ran {
    code: i32,
    out: String,
    err: String,
}

/// Start `torchrun ARGS` (torch's, or trainlet through a link named
/// `torchrun`) in `dir`; `{py}` in ARGS is the test's python, `{port}` a
/// free port.
fn start(torch: bool, dir: &Path, args: &[&str], env: &[(&str, String)]) -> (std::process::Child, String) {
    let py = python();
    let port = free_port().to_string();
    let args: Vec<String> = args.iter().map(|a| a.replace("{py}", &py).replace("{port}", &port)).collect();
    let who = if torch { "torch" } else { "trainlet" };
    let mut cmd = if torch {
        let mut c = Command::new(&py);
        c.args(["-m", "torch.distributed.run"]);
        c
    } else {
        Command::new(dir.join("torchrun"))
    };
    let out = std::fs::File::create(dir.join(format!("{who}.out"))).expect("out");
    let err = std::fs::File::create(dir.join(format!("{who}.err"))).expect("err");
    cmd.args(&args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HOME", std::env::var("HOME").unwrap_or_else(|_| "/tmp".into()))
        .env("TRAINLET_PYTHON", &py)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(0);
    (cmd.spawn().expect("spawn the launcher"), who.to_string())
}

/// Wait for a launcher started by [`start`]; past [`LIMIT`], kill its group and fail.
fn wait(mut child: std::process::Child, dir: &Path, who: &str) -> Ran {
    let until = Instant::now() + LIMIT;
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st;
        }
        if Instant::now() > until {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid")),
                nix::sys::signal::Signal::SIGKILL,
            );
            let _ = child.wait();
            panic!(
                "{who}'s torchrun did not end in {LIMIT:?}:\n{}",
                std::fs::read_to_string(dir.join(format!("{who}.err"))).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let read = |ext: &str| std::fs::read_to_string(dir.join(format!("{who}.{ext}"))).unwrap_or_default();
    Ran { code: status.code().unwrap_or(-1), out: read("out"), err: read("err") }
}

/// Both launchers at once, each in the same directory (with the worker
/// script, and the `torchrun` link to trainlet).
fn both(dir: &Path, args: &[&str], env: &[(&str, String)], label: &str) -> (Ran, Ran) {
    let with = |who: &str| {
        let mut e = env.to_vec();
        e.push(("TORCHELASTIC_ERROR_FILE", dir.join(format!("{label}.{who}.launcher.json")).display().to_string()));
        e
    };
    let (t, tw) = start(true, dir, args, &with("torch"));
    let (l, lw) = start(false, dir, args, &with("trainlet"));
    (wait(t, dir, &tw), wait(l, dir, &lw))
}

/// Every worker's `ENV` line, by global rank (trainlet prefixes lines with
/// the worker's role and local rank, torch does not: both are read).
fn workers(out: &str) -> BTreeMap<String, Value> {
    out.lines()
        .filter_map(|l| l.split_once("ENV ").map(|(_, j)| j))
        .map(|j| serde_json::from_str::<Value>(j).expect("an ENV line is JSON"))
        .map(|v| (v["RANK"].as_str().unwrap_or("?").to_string(), v))
        .collect()
}

/// Whether `host` names this machine: it resolves, and a socket binds to
/// what it resolves to.
fn names_this_machine(host: &str) -> bool {
    use std::net::ToSocketAddrs;
    (host, 0).to_socket_addrs().is_ok_and(|mut a| a.any(|a| std::net::TcpListener::bind(a).is_ok()))
}

/// The workers of both runs of `label` set the same variables, up to what a
/// run owns (this module's doc).
fn same_workers(label: &str, standalone: bool, torch: &Ran, ours: &Ran) {
    let (t, o) = (workers(&torch.out), workers(&ours.out));
    assert!(!t.is_empty(), "{label}: torch's workers printed nothing:\n{}\n{}", torch.out, torch.err);
    let ranks = |m: &BTreeMap<String, Value>| m.keys().cloned().collect::<Vec<_>>();
    assert_eq!(
        ranks(&t),
        ranks(&o),
        "{label}: the ranks\n--- torch:\n{}\n--- trainlet:\n{}\n{}",
        torch.out,
        ours.out,
        ours.err
    );
    for (rank, tv) in &t {
        let ov = &o[rank];
        let (Some(tm), Some(om)) = (tv.as_object(), ov.as_object()) else { panic!("{label}: not objects") };
        assert_eq!(tm.keys().collect::<Vec<_>>(), om.keys().collect::<Vec<_>>(), "{label} rank {rank}");
        for (k, want) in tm {
            let got = &om[k];
            let lr = tm["LOCAL_RANK"].as_str().unwrap_or("?");
            match k.as_str() {
                "MASTER_PORT" => {
                    for v in [want, got] {
                        assert!(
                            v.as_str().and_then(|p| p.parse::<u16>().ok()).is_some_and(|p| p > 0),
                            "{label} rank {rank}: MASTER_PORT {v}"
                        );
                    }
                }
                "MASTER_ADDR" => {
                    for v in [want, got] {
                        assert!(
                            v.as_str().is_some_and(names_this_machine),
                            "{label} rank {rank}: MASTER_ADDR {v} is not this machine"
                        );
                    }
                }
                "TORCHELASTIC_ERROR_FILE" => {
                    let tail = format!("attempt_0/{lr}/error.json");
                    for v in [want, got] {
                        assert!(v.as_str().is_some_and(|p| p.ends_with(&tail)), "{label} rank {rank}: error file {v}");
                    }
                }
                "TORCHELASTIC_RUN_ID" if standalone => {
                    assert!(
                        want.as_str().is_some_and(|v| !v.is_empty()) && got.as_str().is_some_and(|v| !v.is_empty())
                    );
                }
                _ => assert_eq!(want, got, "{label} rank {rank}: {k}\n--- torch: {tv}\n--- trainlet: {ov}"),
            }
        }
    }
}

/// A directory with the worker script and a `torchrun` link to trainlet.
fn workdir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::copy(fixture("recipe_worker.py"), dir.path().join("recipe_worker.py")).expect("copy the worker");
    std::os::unix::fs::symlink(bin(), dir.path().join("torchrun")).expect("link torchrun");
    dir
}

/// The recipes: (label, torchrun's arguments, a gloo all-reduce too).
const RECIPES: &[(&str, &[&str], bool)] = &[
    (
        "single-node multi-worker",
        &["--standalone", "--nnodes=1", "--nproc-per-node=2", "recipe_worker.py", "--arg1", "x"],
        true,
    ),
    (
        "stacked single-node multi-worker",
        &[
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=localhost:0",
            "--nnodes=1",
            "--nproc-per-node=2",
            "recipe_worker.py",
            "--arg1",
        ],
        true,
    ),
    (
        "fault tolerant (one node)",
        &[
            "--nnodes=1",
            "--nproc-per-node=2",
            "--max-restarts=3",
            "--rdzv-id=job7",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:{port}",
            "recipe_worker.py",
        ],
        false,
    ),
    (
        "elastic min 1, max 4 (one node)",
        &[
            "--nnodes=1:4",
            "--nproc-per-node=2",
            "--max-restarts=3",
            "--rdzv-id=job8",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-conf=last_call_timeout=1",
            "recipe_worker.py",
        ],
        false,
    ),
    ("--nproc-per-node=cpu", &["--standalone", "--nproc-per-node=cpu", "recipe_worker.py"], false),
    ("--nproc-per-node=auto", &["--standalone", "--nproc-per-node=auto", "recipe_worker.py"], false),
    ("--nproc_per_node 2, underscores", &["--standalone", "--nproc_per_node", "2", "recipe_worker.py"], false),
    ("-m", &["--standalone", "--nproc-per-node=2", "-m", "recipe_worker", "a"], false),
    ("--no-python", &["--standalone", "--nproc-per-node=2", "--no-python", "{py}", "recipe_worker.py"], false),
    ("--run-path", &["--standalone", "--nproc-per-node=2", "--run-path", "recipe_worker.py"], false),
];

#[test]
fn every_torchrun_recipe_runs_as_under_torchs_own_torchrun() {
    let dir = workdir();
    for (i, (label, args, gloo)) in RECIPES.iter().enumerate() {
        let env: Vec<(&str, String)> = if *gloo { vec![("RECIPE_GLOO", "1".into())] } else { vec![] };
        let (torch, ours) = both(dir.path(), args, &env, &format!("r{i}"));
        assert_eq!(torch.code, 0, "{label}: torch's torchrun:\n{}\n{}", torch.out, torch.err);
        assert_eq!(ours.code, torch.code, "{label}: trainlet:\n{}\n{}", ours.out, ours.err);
        same_workers(label, args.contains(&"--standalone"), &torch, &ours);
        if *gloo {
            for ran in [&torch, &ours] {
                assert_eq!(ran.out.matches("SUM 3").count(), 2, "{label}: both workers all-reduce 1+2:\n{}", ran.out);
            }
        }
    }
}

/// A worker's `@record` exception reaches the launcher's own
/// TORCHELASTIC_ERROR_FILE with the fields torchrun writes: the worker's
/// message, traceback and timestamp, and `errorCode` (its exit code).
#[test]
fn a_workers_record_reaches_the_launchers_error_file_as_torchrun_writes_it() {
    let dir = workdir();
    let args = ["--standalone", "--nproc-per-node=2", "recipe_worker.py"];
    let (torch, ours) = both(dir.path(), &args, &[("RECIPE_FAIL_RANK", "1".into())], "fail");
    assert_eq!(torch.code, 1, "torch's torchrun exits 1 for a failed worker:\n{}", torch.err);
    assert_eq!(ours.code, 1, "trainlet exits with the worker's code, 1 here:\n{}", ours.err);
    let read = |who: &str| -> Value {
        let path = dir.path().join(format!("fail.{who}.launcher.json"));
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{who}: no launcher error file {}: {e}", path.display()));
        serde_json::from_str(&text).expect("JSON")
    };
    let (t, o) = (read("torch"), read("trainlet"));
    let (tm, om) = (&t["message"], &o["message"]);
    assert_eq!(tm["message"], om["message"], "--- torch: {t}\n--- trainlet: {o}");
    assert!(tm["message"].as_str().is_some_and(|m| m.contains("boom from rank 1")), "{t}");
    assert_eq!(tm["errorCode"], om["errorCode"], "--- torch: {t}\n--- trainlet: {o}");
    assert_eq!(om["errorCode"], 1, "{o}");
    assert_eq!(tm["extraInfo"]["py_callstack"], om["extraInfo"]["py_callstack"], "--- torch: {t}\n--- trainlet: {o}");
    for v in [tm, om] {
        assert!(v["extraInfo"]["timestamp"].as_str().and_then(|s| s.parse::<u64>().ok()).is_some(), "{v}");
    }
}

/// Port 0 where torchrun takes a port: the stacked recipe's
/// `--rdzv-endpoint=localhost:0` is above; a static `--master-port 0`
/// works under trainlet too (torch's own gives its workers MASTER_PORT=0
/// there, and they hang), and the port picked is in the log.
#[test]
fn master_port_0_on_one_node_runs_a_gloo_job_on_a_free_port() {
    let dir = workdir();
    let (child, who) = start(
        false,
        dir.path(),
        &["--master-port", "0", "--nnodes", "1", "--nproc-per-node", "2", "recipe_worker.py"],
        &[("RECIPE_GLOO", "1".into()), ("TRAINLET_LOG", "info".into())],
    );
    let ran = wait(child, dir.path(), &who);
    assert_eq!(ran.code, 0, "{}\n{}", ran.out, ran.err);
    assert_eq!(ran.out.matches("SUM 3").count(), 2, "{}", ran.out);
    let line =
        ran.err.lines().find(|l| l.contains("serving the rendezvous store")).unwrap_or_else(|| panic!("{}", ran.err));
    let port: u16 = line
        .split("addr=")
        .nth(1)
        .and_then(|a| a.split_whitespace().next())
        .and_then(|a| a.rsplit(':').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!(port > 0, "{line}");
    for (_, w) in workers(&ran.out) {
        assert_ne!(w["MASTER_PORT"], "0", "{w}");
    }
}
