//! `--preload`: python workers forked from a Python zygote that imported
//! torch while the pod joined start exactly as exec'd workers do. Real
//! torch (CPU) in the zygote; the worker prints its whole starting state
//! (tests/fixtures/worker_state.py).

use std::time::Duration;

use crate::util::*;

const LIMIT: Duration = Duration::from_secs(180);

/// Each local rank's state, as printed by worker_state.py, from a
/// standalone job with or without `--preload torch`; and the agent's pid.
fn states(preload: bool, logs: &std::path::Path) -> (Vec<serde_json::Value>, i32, String) {
    let script = fixture("worker_state.py");
    let logs = logs.display().to_string();
    let mut args = vec!["run", "--standalone", "--nproc-per-node", "2", "--rdzv-id", "same", "--log-dir", &logs];
    if preload {
        args.extend(["--preload", "torch"]);
    }
    args.extend([script.as_str(), "a b", "lr=${local_rank}"]);
    let mut pod = Pod::start(&args, &[("TRAINLET_TEST_MARKER", "preload-state"), ("PYTHONHASHSEED", "0")]);
    assert_eq!(pod.code(LIMIT), 0, "{}", pod.stderr());
    let out = pod.stdout();
    let per_rank = (0..2)
        .map(|lr| {
            let line = out
                .lines()
                .find_map(|l| l.strip_prefix(&format!("[default{lr}]: ")))
                .unwrap_or_else(|| panic!("no line of local rank {lr}:\n{out}\n{}", pod.stderr()));
            serde_json::from_str(line).expect("json")
        })
        .collect();
    (per_rank, pod.pid(), pod.stderr())
}

/// What must be equal between a forked and an exec'd worker: everything
/// but the agent's pid (in its parent and its error file's path), the
/// round's random port, and the real-time signals threads of torch catch.
fn normalized(mut v: serde_json::Value, agent: i32) -> serde_json::Value {
    assert_eq!(v["ppid"], agent, "the agent is the worker's parent: {v}");
    let o = v.as_object_mut().expect("object");
    o.remove("ppid");
    o.remove("preloaded");
    let env = o.get_mut("env").and_then(|e| e.as_object_mut()).expect("env");
    assert!(env.remove("MASTER_PORT").is_some());
    let ef = env["TORCHELASTIC_ERROR_FILE"].as_str().expect("error file").replace(&format!("_{agent}/"), "_<agent>/");
    env.insert("TORCHELASTIC_ERROR_FILE".into(), ef.into());
    let cgt = o["status"]["SigCgt"].as_str().expect("SigCgt");
    let standard = cgt[cgt.len() - 8..].to_string();
    o.get_mut("status").and_then(|s| s.as_object_mut()).expect("status").insert("SigCgt".into(), standard.into());
    v
}

#[test]
fn preloaded_workers_start_as_execd_workers_do() {
    let dir = tempfile::tempdir().expect("tmp");
    let (execd, agent_e, _) = states(false, &dir.path().join("exec"));
    let (forked, agent_f, err) = states(true, &dir.path().join("fork"));
    assert!(err.contains("zygote ready"), "the zygote was used:\n{err}");
    for lr in 0..2 {
        assert_eq!(execd[lr]["preloaded"], false);
        assert_eq!(forked[lr]["preloaded"], true, "local rank {lr} was forked with torch loaded");
        assert_eq!(forked[lr]["status"]["Threads"], "1", "a forked worker starts with one thread");
        let (e, f) = (normalized(execd[lr].clone(), agent_e), normalized(forked[lr].clone(), agent_f));
        let (e, f) = (e.to_string(), f.to_string());
        assert_eq!(
            e.replace(&dir.path().join("exec").display().to_string(), "<logs>"),
            f.replace(&dir.path().join("fork").display().to_string(), "<logs>"),
            "local rank {lr}"
        );
    }
    assert_eq!(forked[1]["argv"], serde_json::json!([fixture("worker_state.py"), "a b", "lr=1"]));
}

/// A zygote that dies is not replaced: the next workers are exec'd, with
/// one warning, and the run succeeds.
#[test]
fn workers_are_execd_with_one_warning_when_the_zygote_dies() {
    let dir = tempfile::tempdir().expect("tmp");
    let token = dir.path().join("token");
    std::fs::write(&token, "tok").expect("token");
    let port = free_port().to_string();
    let serve_dir = dir.path().join("serve").display().to_string();
    let mut pod = Pod::start(
        &[
            "run",
            "--standalone",
            "--serve",
            "--control-port",
            &port,
            "--control-token-file",
            &token.display().to_string(),
            "--serve-dir",
            &serve_dir,
            "--preload",
            "torch",
            "--nproc-per-node",
            "2",
        ],
        &[],
    );
    pod.wait_for_stderr("zygote ready", LIMIT);
    let url = format!("http://127.0.0.1:{port}");
    let probe = r#"{"command": ["python", "-c", "import sys; print('PRELOADED', 'torch' in sys.modules)"]}"#;
    let run = |pod: &Pod| -> String {
        let (status, reply) = crate::serve::http(&url, "POST", "/v1/runs", Some("tok"), probe);
        assert_eq!(status, 201, "{reply}");
        let id =
            serde_json::from_str::<serde_json::Value>(&reply).expect("json")["id"].as_str().expect("id").to_string();
        let (_, logs) = crate::serve::http(&url, "GET", &format!("/v1/runs/{id}/logs?follow=true"), Some("tok"), "");
        let (_, rec) = crate::serve::http(&url, "GET", &format!("/v1/runs/{id}"), Some("tok"), "");
        assert!(rec.contains("\"state\":\"succeeded\""), "{rec}\n{}", pod.stderr());
        logs
    };
    assert_eq!(run(&pod).matches("PRELOADED True").count(), 2);
    let zygote: i32 = pod
        .stderr()
        .lines()
        .find(|l| l.contains("zygote ready"))
        .and_then(|l| parse_kv(l).get("pid").and_then(|p| p.parse().ok()))
        .expect("the zygote's pid in the log");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(zygote), nix::sys::signal::Signal::SIGKILL).expect("kill");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(run(&pod).matches("PRELOADED False").count(), 2, "exec'd after the zygote died");
    assert_eq!(run(&pod).matches("PRELOADED False").count(), 2);
    assert_eq!(pod.stderr().matches("the Python zygote is not used").count(), 1, "one warning:\n{}", pod.stderr());
}
