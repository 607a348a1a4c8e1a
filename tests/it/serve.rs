//! Serve mode: simulated pods (one trainlet per 127.0.0.N) that stay up
//! between runs submitted to the store host's control API. Runs are real
//! PyTorch DDP jobs (gloo, CPU); the main scenario is driven by the
//! repository's own Python client (`clients/python`), the hostile-request
//! test by raw HTTP.

use std::collections::{BTreeSet, HashMap};
use std::io::{Read, Write};
use std::time::Duration;

use crate::util::*;

/// The pods of a served job and what a client needs to reach it.
pub(crate) struct Served {
    pub(crate) pods: Vec<Pod>,
    pub(crate) url: String,
    pub(crate) token_file: std::path::PathBuf,
    pub(crate) dir: tempfile::TempDir,
    pub(crate) store_port: u16,
}

pub(crate) const TOKEN: &str = "t0ken-for-tests";

fn pod_env(n: u32, store_port: u16, node: u32) -> Vec<(String, String)> {
    let mut env = pet_env(n, 2, node, store_port);
    env.push(("TRAINLET_TEST_MARKER".into(), format!("serve-{store_port}")));
    env
}

fn pod_args(s: &Served, control: u16, node: u32, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "run",
        "--serve",
        "--control-bind",
        "127.0.0.1",
        "--control-port",
        &control.to_string(),
        "--control-token-file",
        &s.token_file.display().to_string(),
        "--serve-dir",
        &s.dir.path().join(format!("pod{node}")).display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

/// `trainlet run` of one standalone served pod of 2 worker slots, its
/// control API on `control`, its token in `token_file`, its runs in `dir`.
pub(crate) fn standalone_args(control: u16, token_file: &std::path::Path, dir: &std::path::Path) -> Vec<String> {
    let (control, token, dir) = (control.to_string(), token_file.display().to_string(), dir.display().to_string());
    ["run", "--standalone", "--serve", "--nproc-per-node", "2", "--control-port", &control]
        .into_iter()
        .chain(["--control-token-file", &token, "--serve-dir", &dir])
        .map(str::to_string)
        .collect()
}

pub(crate) fn start(n: u32, extra: &[&str]) -> Served {
    start_some(n, n, extra, None)
}

/// A served job of `n` pods of which only the first `up` are started, pod
/// 0 inside `cg` when one is given.
pub(crate) fn start_some(n: u32, up: u32, extra: &[&str], cg: Option<&crate::memcg::MemCgroup>) -> Served {
    let dir = tempfile::tempdir().expect("tmp");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).expect("token");
    let control = free_port();
    let store_port = free_port();
    let mut s = Served { pods: Vec::new(), url: format!("http://127.0.0.1:{control}"), token_file, dir, store_port };
    for node in 0..up {
        s.pods.push(start_pod_in(&s, (control, n), node, extra, cg.filter(|_| node == 0)));
    }
    s.pods[0].wait_for_stderr("control API listening", Duration::from_secs(30));
    s
}

pub(crate) fn start_pod(s: &Served, (control, n): (u16, u32), node: u32, extra: &[&str]) -> Pod {
    start_pod_in(s, (control, n), node, extra, None)
}

/// Pod `node`, inside `cg` when one is given.
fn start_pod_in(
    s: &Served,
    (control, n): (u16, u32),
    node: u32,
    extra: &[&str],
    cg: Option<&crate::memcg::MemCgroup>,
) -> Pod {
    let args = pod_args(s, control, node, extra);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut env = pod_env(n, s.store_port, node);
    env.push(("PET_LOCAL_ADDR".into(), format!("127.0.0.{}", node + 1)));
    let pairs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    match cg {
        Some(cg) => {
            let argv = cg.wrap(&bin(), &args);
            let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
            Pod::start_as(std::path::Path::new("/bin/sh"), &argv, &pairs)
        }
        None => Pod::start(&args, &pairs),
    }
}

/// One HTTP/1.1 request; (status, body) with a chunked body decoded.
pub fn http(url: &str, method: &str, path: &str, token: Option<&str>, body: &str) -> (u16, String) {
    try_http(url, method, path, token, body).unwrap_or_else(|e| panic!("{method} {url}{path}: {e}"))
}

/// [`http`], or the error when the server is not there (any more).
pub fn try_http(
    url: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> std::io::Result<(u16, String)> {
    let addr = url.trim_start_matches("http://");
    let mut c = std::net::TcpStream::connect(addr)?;
    c.set_read_timeout(Some(Duration::from_secs(120)))?;
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    write!(c, "{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: {}\r\n\r\n{body}", body.len())?;
    let mut raw = Vec::new();
    c.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    if !head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        return Ok((status, rest.to_string()));
    }
    let mut out = String::new();
    let mut rest = rest;
    while let Some((len, tail)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(len.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&tail[..n]);
        rest = &tail[n + 2..];
    }
    Ok((status, out))
}

pub(crate) fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

/// RESULT lines of a run's output: rank -> fields.
pub(crate) fn results(lines: &[serde_json::Value]) -> HashMap<String, HashMap<String, String>> {
    lines
        .iter()
        .filter_map(|l| l.as_str())
        .filter_map(|l| l.split_once("RESULT ").map(|(_, r)| parse_kv(r)))
        .map(|kv| (kv["rank"].clone(), kv))
        .collect()
}

/// Run the Python client driver for `steps`; one JSON document per step.
pub(crate) fn drive(s: &Served, steps: &[&str]) -> Vec<serde_json::Value> {
    let out = std::process::Command::new(python())
        .arg(fixture("serve_driver.py"))
        .args([s.url.as_str(), &s.token_file.display().to_string(), &fixture("serve_train.py")])
        .args(steps)
        .output()
        .expect("driver");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let pods: Vec<String> = s.pods.iter().enumerate().map(|(i, p)| format!("pod {i}:\n{}", p.stderr())).collect();
    assert!(
        out.status.success(),
        "driver failed: {}\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr),
        pods.join("\n")
    );
    stdout.lines().map(json).collect()
}

pub(crate) fn assert_ran_everywhere(step: &serde_json::Value, version: &str, agents: &BTreeSet<String>) {
    assert_eq!(step["state"], "succeeded", "{step}");
    let lines = step["lines"].as_array().expect("lines");
    let r = results(lines);
    assert_eq!(r.len(), 4, "every rank's line came back through the control API: {lines:?}");
    let params: BTreeSet<&str> = r.values().map(|kv| kv["params"].as_str()).collect();
    assert_eq!(params.len(), 1, "DDP left identical parameters on every rank: {r:?}");
    for kv in r.values() {
        assert_eq!(kv["version"], version, "the new code ran on every rank");
        assert_eq!(kv["world"], "4");
        assert_eq!(kv["in_run_dir"], "True", "the run's directory is its working directory");
        assert!(agents.contains(&kv["agent"]), "started by a pod's agent ({agents:?}): {kv:?}");
    }
    let ranks: Vec<String> = lines
        .iter()
        .filter_map(|l| l.as_str())
        .filter(|l| l.contains("RESULT"))
        .map(|l| l[..l.find(']').unwrap_or(0) + 1].to_string())
        .collect();
    assert!(ranks.iter().all(|p| p.starts_with("[default")), "lines keep their rank prefixes: {ranks:?}");
}

/// Serve mode with a spare (`--spares 1`, 3 pods): a run that succeeds
/// and one that fails end runs, not the job, so the spare keeps waiting
/// through them; at the idle timeout the members leave and the spare
/// leaves with them, every pod with 0.
#[test]
fn a_served_jobs_spare_outlives_its_runs_and_leaves_with_the_pods() {
    let mut s = start(3, &["--serve-idle-timeout", "4", "--spares", "1"]);
    let steps = drive(&s, &["v1", "v3:fail=1", "v4"]);
    let states: Vec<&str> = steps.iter().filter_map(|st| st["state"].as_str()).collect();
    assert_eq!(states, ["succeeded", "failed", "succeeded"], "{steps:?}");
    let spares: Vec<usize> = (0..3).filter(|&i| s.pods[i].stderr().contains("waiting as a spare")).collect();
    assert_eq!(spares.len(), 1, "one pod waits");
    for p in &mut s.pods {
        assert_eq!(p.code(Duration::from_secs(60)), 0, "{}", p.stderr());
    }
    let spare = s.pods[spares[0]].stderr();
    assert!(spare.contains("the members left the job; this spare leaves too"), "{spare}");
    assert!(!spare.contains("takes over"), "no pod was lost: {spare}");
}

/// Two pods in serve mode run a job, then a changed file, a failing run
/// and another run, all on the same agents, and exit 0 at the idle timeout.
#[test]
fn served_pods_take_new_code_and_outlive_a_failed_run() {
    let mut s = start(2, &["--serve-idle-timeout", "4"]);
    let agents: BTreeSet<String> = s.pods.iter().map(|p| p.pid().to_string()).collect();
    let steps = drive(&s, &["v1", "v2:tar", "v3:fail=1", "v4"]);
    assert_eq!(steps.len(), 4);
    assert_ran_everywhere(&steps[0], "v1", &agents);
    assert_ran_everywhere(&steps[1], "v2", &agents);
    let failed = &steps[2];
    assert_eq!(failed["state"], "failed", "{failed}");
    assert_eq!(failed["exit_codes"]["1"], 9, "rank 1's exit code: {failed}");
    assert_eq!(failed["report"]["root_cause"]["rank"], 1, "the failure report names rank 1: {failed}");
    assert_eq!(failed["report"]["root_cause"]["exit_code"], 9);
    assert_ran_everywhere(&steps[3], "v4", &agents);
    for p in &mut s.pods {
        assert!(p.child.try_wait().expect("try_wait").is_none(), "the pods stayed up:\n{}", p.stderr());
    }
    // Nothing submitted, only the status asked (a monitor, a driver's
    // `ls`), which is not use: the idle timeout ends the job, and the
    // status says how long the pods have been idle; however the status's
    // path is spelled (issue 53: `/v1/status/` and `//v1/status` were
    // served as the status but counted as use).
    let mut idle = Vec::new();
    let spellings = ["/v1/status", "/v1/status/", "//v1/status"];
    while s.pods[0].child.try_wait().expect("try_wait").is_none() && idle.len() < 120 {
        // The pod may exit between the check and the request.
        let path = spellings[idle.len() % spellings.len()];
        let Ok((status, body)) = try_http(&s.url, "GET", path, Some(TOKEN), "") else { break };
        if let Some(v) = (status == 200).then(|| json(&body)["idle_seconds"].as_f64()).flatten() {
            idle.push(v);
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(idle.windows(2).all(|w| w[0] <= w[1]), "asking the status does not reset the idle time: {idle:?}");
    assert!(idle.last().is_some_and(|&v| v >= 2.0), "idle up to the timeout (4 s): {idle:?}");
    for p in &mut s.pods {
        assert_eq!(p.code(Duration::from_secs(60)), 0, "{}", p.stderr());
    }
    assert!(s.pods[0].stderr().contains("--serve-idle-timeout"), "{}", s.pods[0].stderr());
    wait_until_gone(&format!("serve-{}", s.store_port), Duration::from_secs(10));
}

/// Without the token nothing answers and nothing changes; bad requests get
/// a 4xx that names what was wrong.
#[test]
fn the_control_api_answers_only_to_its_token() {
    let s = start(1, &["--standalone"]);
    let url = s.url.as_str();
    let run = r#"{"command": ["python", "-c", "print(1)"]}"#;
    for (method, path, body) in [
        ("POST", "/v1/runs", run),
        ("GET", "/v1/runs", ""),
        ("GET", "/v1/status", ""),
        ("DELETE", "/v1/runs/run-1", ""),
        ("GET", "/v1/nothing", ""),
    ] {
        for token in [None, Some("wrong"), Some(""), Some("t0ken-for-tests-and-more")] {
            let (status, body) = http(url, method, path, token, body);
            assert_eq!(status, 401, "{method} {path} with {token:?}: {body}");
            assert!(!body.contains("runs"), "a refusal says nothing more: {body}");
        }
    }
    let (status, body) = http(url, "GET", "/v1/status", Some(TOKEN), "");
    assert_eq!(status, 200, "{body}");
    assert_eq!(json(&body)["runs"].as_array().map(Vec::len), Some(0), "nothing was submitted: {body}");
    for (body, code, says) in [
        ("{", 400, "not a valid run"),
        (r#"{"command": ["python"], "env": {"RANK": "0"}}"#, 400, "RANK is set by trainlet"),
        (r#"{"command": ["python"], "files": {"../x.py": ""}}"#, 400, "stay inside"),
        (r#"{"command": ["python"], "nproc_per_node": 0}"#, 400, "nproc_per_node"),
    ] {
        let (status, reply) = http(url, "POST", "/v1/runs", Some(TOKEN), body);
        assert_eq!(status, code, "{body}: {reply}");
        assert!(json(&reply)["message"].as_str().is_some_and(|m| m.contains(says)), "{body}: {reply}");
    }
    assert_eq!(http(url, "GET", "/v1/runs/run-9-x", Some(TOKEN), "").0, 404);
    assert_eq!(http(url, "PUT", "/v1/runs", Some(TOKEN), "").0, 405);
    let sleeper = r#"{"command": ["python", "-c", "import time; print('up', flush=True); time.sleep(300)"], "nproc_per_node": 1}"#;
    let (status, reply) = http(url, "POST", "/v1/runs", Some(TOKEN), sleeper);
    assert_eq!(status, 201, "{reply}");
    let first = json(&reply)["id"].as_str().expect("id").to_string();
    let (status, reply) = http(url, "POST", "/v1/runs", Some(TOKEN), run);
    assert_eq!(status, 409, "a second run is refused while one runs: {reply}");
    assert!(reply.contains(&first) && reply.contains("replace"), "{reply}");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !http(url, "GET", &format!("/v1/runs/{first}/logs"), Some(TOKEN), "").1.contains("up") {
        assert!(std::time::Instant::now() < deadline, "the run's line never came:\n{}", s.pods[0].stderr());
        std::thread::sleep(Duration::from_millis(100));
    }
    let (status, reply) = http(url, "DELETE", &format!("/v1/runs/{first}"), Some(TOKEN), "");
    assert!(status == 202 || status == 200, "{status}: {reply}");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (_, body) = http(url, "GET", &format!("/v1/runs/{first}"), Some(TOKEN), "");
        if json(&body)["state"] == "stopped" {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the run was not stopped: {body}\n{}", s.pods[0].stderr());
        std::thread::sleep(Duration::from_millis(100));
    }
    let (_, logs) = http(url, "GET", &format!("/v1/runs/{first}/logs?follow=true"), Some(TOKEN), "");
    assert_eq!(logs, "[default0]: up\n", "a stopped run's lines stay readable, and following it ends");
}

/// A pod killed while serving is replaced, and the next run uses the new
/// world: the replacement's agent starts its ranks.
#[test]
fn a_pod_killed_while_serving_is_replaced_for_the_next_run() {
    // Found dead in 3 s rather than 10.
    let mut s = start(2, &["--heartbeat-timeout", "3"]);
    let first = drive(&s, &["v1"]);
    let old: BTreeSet<String> = s.pods.iter().map(|p| p.pid().to_string()).collect();
    assert_ran_everywhere(&first[0], "v1", &old);
    s.pods[1].signal(nix::sys::signal::Signal::SIGKILL);
    let _ = s.pods[1].child.wait();
    let control: u16 = s.url.rsplit(':').next().and_then(|p| p.parse().ok()).expect("port");
    let replacement = start_pod(&s, (control, 2), 1, &["--heartbeat-timeout", "3"]);
    s.pods[1] = replacement;
    // The idle wait ends on the change of members. Submitted before that,
    // the next run would start in the old round and regroup (right too, but
    // another path: on a loaded machine the test raced it).
    s.pods[0].wait_for_stderr("the idle round ended", Duration::from_secs(60));
    let agents: BTreeSet<String> = s.pods.iter().map(|p| p.pid().to_string()).collect();
    let next = drive(&s, &["v2"]);
    assert_ran_everywhere(&next[0], "v2", &agents);
    let by_new = results(next[0]["lines"].as_array().expect("lines"))
        .values()
        .filter(|kv| kv["agent"] == s.pods[1].pid().to_string())
        .count();
    assert_eq!(by_new, 2, "the replacement pod ran two of the four ranks");
}

/// With `--preload torch`, served runs' workers are forked from the zygote
/// (torch already imported), train DDP to identical parameters, and a
/// restart forks them again.
#[test]
fn preloaded_served_workers_train_and_restart_from_the_zygote() {
    let s = start(2, &["--preload", "torch"]);
    let agents: BTreeSet<String> = s.pods.iter().map(|p| p.pid().to_string()).collect();
    let steps = drive(&s, &["p1", "p2:once"]);
    for (step, version) in steps.iter().zip(["p1", "p2"]) {
        assert_ran_everywhere(step, version, &agents);
        for kv in results(step["lines"].as_array().expect("lines")).values() {
            assert_eq!(kv["preloaded"], "True", "forked from the zygote: {kv:?}");
        }
    }
    assert_eq!(steps[1]["restarts"], 1, "{}", steps[1]);
    assert!(results(steps[1]["lines"].as_array().expect("lines")).values().all(|kv| kv["restart"] == "1"));
}

/// The Python client's own tests (`clients/python/tests`, standard library
/// only): the actor client against a fake control API on loopback.
#[test]
fn the_python_clients_unit_tests_pass() {
    let out = std::process::Command::new(python())
        .args(["-m", "unittest", "discover", "-s", "clients/python/tests", "-v"])
        .current_dir(repo())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("python");
    assert!(
        out.status.success(),
        "python -m unittest discover -s clients/python/tests failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `GET /v1/stacks` (the Python client's `stacks()`): the store host asks
/// every pod through the store, each pod's agent reads its workers, and
/// the view names the rank the others wait for while the run still runs.
#[test]
fn the_control_api_gives_every_ranks_stacks_and_names_the_stalled_one() {
    let mut s = start(2, &["--serve-idle-timeout", "5"]);
    let out = std::process::Command::new(python())
        .arg(fixture("serve_stacks.py"))
        .args([s.url.as_str(), &s.token_file.display().to_string(), &fixture("stall_job.py")])
        .output()
        .expect("driver");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}\n{stdout}\npod 0:\n{}", String::from_utf8_lossy(&out.stderr), s.pods[0].stderr());
    let view = json(stdout.lines().last().unwrap_or_default());
    assert_eq!((view["pods"].as_u64(), view["answered"].as_u64()), (Some(2), Some(2)), "{view}");
    let summary = view["stall"]["summary"].as_str().unwrap_or_default();
    assert!(summary.starts_with("rank 2 is not in the all_reduce the other 3 wait in: stall_job.py:"), "{summary}");
    let hosts: BTreeSet<&str> =
        view["ranks"].as_array().expect("ranks").iter().filter_map(|r| r["host"].as_str()).collect();
    assert_eq!(hosts.len(), 2, "both pods answered: {view}");
    for p in &mut s.pods {
        assert_eq!(p.code(Duration::from_secs(120)), 0, "{}", p.stderr());
    }
}
