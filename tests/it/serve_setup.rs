//! Serve mode's setup steps (issue 40, findings 1-3 and 5): a run that
//! fails on one pod while another is still in a setup step leaves every
//! pod serving, a step of any accepted size runs, a run cannot plant code
//! for the next in the setup's directories, and a new agent process
//! applies the steps its container lost. Simulated pods (one trainlet per
//! 127.0.0.N); the steps are real bash.
use std::time::Duration;

use crate::serve::{Served, TOKEN, http, json, start, start_pod};
use crate::serve_store::{submit, wait_over};

fn declare(s: &Served, steps: &serde_json::Value) {
    let body = serde_json::json!({ "steps": steps }).to_string();
    let (status, reply) = http(&s.url, "POST", "/v1/setup", Some(TOKEN), &body);
    assert_eq!(status, 200, "{reply}");
}

fn record(s: &Served, id: &str) -> serde_json::Value {
    json(&http(&s.url, "GET", &format!("/v1/runs/{id}"), Some(TOKEN), "").1)
}

fn logs(s: &Served, id: &str) -> String {
    http(&s.url, "GET", &format!("/v1/runs/{id}/logs"), Some(TOKEN), "").1
}

fn assert_serving(s: &mut Served) {
    for (n, p) in s.pods.iter_mut().enumerate() {
        assert!(p.child.try_wait().expect("try_wait").is_none(), "pod {n} exited:\n{}", p.stderr());
    }
}

const PRINT_OK: &str = r#"{"command": ["python", "-c", "print('ran-ok')"], "nproc_per_node": 1}"#;

/// Findings 1 and 2. A run fails on pod 0 (its setup step fails, then its
/// worker exits 5) while pod 1 is still in a slow step, which the round's
/// end cuts short: both pods stay up, pod 1 judges the round by the run's
/// restarts (one restart, then failed), and the next run, with a 200 KiB
/// step (over the 128 KiB an argument may hold), runs on both.
#[test]
fn a_run_that_fails_while_another_pod_is_in_a_setup_step_keeps_every_pod() {
    let mut s = start(2, &[]);
    declare(&s, &serde_json::json!([{ "bash": "[ \"$PET_NODE_RANK\" != 0 ] || exit 3; sleep 60" }]));
    let id = submit(&s, r#"{"command": ["python", "-c", "print(1)"], "nproc_per_node": 1, "max_restarts": 1}"#);
    assert_eq!(wait_over(&s, &id), "failed", "{}", s.pods[1].stderr());
    let rec = record(&s, &id);
    assert_eq!(rec["restarts"], 1, "the run's one restart was used, on every pod's judgement: {rec}");
    assert!(s.pods[1].stderr().contains("cut short"), "pod 1 was in its step:\n{}", s.pods[1].stderr());
    assert_serving(&mut s);

    declare(&s, &serde_json::json!([{ "bash": "[ \"$PET_NODE_RANK\" = 0 ] || sleep 60" }]));
    let id = submit(&s, r#"{"command": ["python", "-c", "import sys; sys.exit(5)"], "nproc_per_node": 1}"#);
    assert_eq!(wait_over(&s, &id), "failed");
    let rec = record(&s, &id);
    assert_eq!(rec["ranks"][0]["exit_code"], 5, "{rec}");
    assert_serving(&mut s);

    let big = format!("# {}\necho big-step-ran-on-$PET_NODE_RANK\n", "x".repeat(200 * 1024));
    declare(&s, &serde_json::json!([{ "bash": big }]));
    let id = submit(&s, PRINT_OK);
    assert_eq!(wait_over(&s, &id), "succeeded", "{}\n{}", logs(&s, &id), s.pods[0].stderr());
    let out = logs(&s, &id);
    for n in 0..2 {
        assert!(out.contains(&format!("big-step-ran-on-{n}")), "the 200 KiB step ran on pod {n}: {out}");
    }
    assert!(out.contains("ran-ok"), "{out}");
    assert_serving(&mut s);
}

/// A run that writes `sitecustomize.py` first on every worker's
/// `PYTHONPATH` (the setup's site directory), and leaves a FIFO where the
/// agent writes the next bash step (its open would block for ever) and the
/// setup directory read-only.
const PLANT_PY: &str = r#"
import os
site = os.environ['PYTHONPATH'].split(':')[0]
setup = os.path.dirname(site)
os.makedirs(site, exist_ok=True)
open(os.path.join(site, 'sitecustomize.py'), 'w').write("print('PLANTED')")
step = os.path.join(setup, 'step.sh')
if os.path.lexists(step):
    os.remove(step)
os.mkfifo(step)
os.chmod(setup, 0o500)
"#;

fn plant() -> String {
    serde_json::json!({ "command": ["python", "-c", PLANT_PY], "nproc_per_node": 1 }).to_string()
}

/// Findings 3 and 5. Only the setup steps write what later runs import: a
/// run that plants `sitecustomize.py` in the setup's site directory (with
/// no steps declared, and again with steps) does not reach the next run,
/// which finds the directories changed and applies the steps again in
/// fresh ones. A container restarted in place keeps its serve directory
/// but not what a bash step did outside it: the new agent process applies
/// the steps again, on that pod only.
#[test]
fn only_the_setup_steps_write_what_runs_import_and_a_new_agent_applies_them_again() {
    let mut s = start(2, &[]);
    let marks = s.dir.path().join("marks");
    std::fs::create_dir_all(&marks).expect("marks");
    let count = |n: u32| std::fs::read_to_string(marks.join(format!("pod-{n}"))).unwrap_or_default().lines().count();
    let clean = |s: &Served, what: &str| {
        let id = submit(s, PRINT_OK);
        assert_eq!(wait_over(s, &id), "succeeded", "{}", s.pods[0].stderr());
        let out = logs(s, &id);
        assert!(out.contains("ran-ok") && !out.contains("PLANTED"), "{what}: {out}");
    };
    let planted = |s: &Served| assert_eq!(wait_over(s, &submit(s, &plant())), "succeeded", "{}", s.pods[0].stderr());

    planted(&s);
    let step = format!("echo applied >> {}/pod-$PET_NODE_RANK", marks.display());
    declare(&s, &serde_json::json!([{ "env": { "A_SETUP_VAR": "1" } }, { "bash": step }]));
    clean(&s, "planted with no steps declared");
    assert_eq!((count(0), count(1)), (1, 1));
    planted(&s);
    clean(&s, "planted after the steps");
    assert_eq!((count(0), count(1)), (2, 2), "applied again in fresh directories");
    for p in &mut s.pods {
        p.wait_for_stderr("changed since the steps wrote them", Duration::from_secs(5));
        assert!(p.stderr().contains("added \"site/sitecustomize.py\""), "the change is named:\n{}", p.stderr());
    }
    clean(&s, "nothing planted");
    assert_eq!((count(0), count(1)), (2, 2), "the same agents apply nothing again");

    s.pods[1].signal(nix::sys::signal::Signal::SIGKILL);
    let _ = s.pods[1].child.wait();
    let control: u16 = s.url.rsplit(':').next().and_then(|p| p.parse().ok()).expect("port");
    s.pods[1] = start_pod(&s, (control, 2), 1, &[]);
    s.pods[0].wait_for_stderr("the idle round ended", Duration::from_secs(60));
    clean(&s, "after a new agent on pod 1");
    assert_eq!((count(0), count(1)), (2, 3), "the bash step ran again in the restarted container only");
    assert_serving(&mut s);
}

/// Issue 53, findings 5 and 6. Setup steps whose variables would not fit
/// a worker's exec (13 env steps, 25 variables of 120 KiB: every later run
/// failed E2BIG) are refused with the limit, and runs go on. A module a
/// bash step writes into the site directory, imported by two runs, makes
/// no pod apply the steps again: Python's `__pycache__` is not a run's
/// change.
#[test]
fn setups_past_a_workers_exec_are_refused_and_imports_change_nothing() {
    let mut s = start(2, &[]);
    let value = "x".repeat(120 * 1024);
    let steps: Vec<serde_json::Value> = (0..13)
        .map(|i| {
            let vars: serde_json::Map<String, serde_json::Value> =
                (2 * i..(2 * i + 2).min(25)).map(|k| (format!("V{k}"), value.clone().into())).collect();
            serde_json::json!({ "env": vars })
        })
        .collect();
    let body = serde_json::json!({ "steps": steps }).to_string();
    let (status, reply) = http(&s.url, "POST", "/v1/setup", Some(TOKEN), &body);
    assert!(status == 400 && reply.contains("at most 786432"), "{status}: {reply}");

    let marks = s.dir.path().join("marks");
    std::fs::create_dir_all(&marks).expect("marks");
    let count = |n: u32| std::fs::read_to_string(marks.join(format!("pod-{n}"))).unwrap_or_default().lines().count();
    let step = format!(
        "echo applied >> {}/pod-$PET_NODE_RANK\nsite=${{PYTHONPATH%%:*}}\nmkdir -p $site/helper\n\
         echo 'WORD = \"from-a-step\"' > $site/helper_mod.py\necho 'X = 1' > $site/helper/__init__.py",
        marks.display()
    );
    declare(&s, &serde_json::json!([{ "bash": step }]));
    let import = serde_json::json!({
        "command": ["python", "-c", "import helper, helper_mod; print(helper_mod.WORD)"],
        "nproc_per_node": 1,
    })
    .to_string();
    for _ in 0..2 {
        let id = submit(&s, &import);
        assert_eq!(wait_over(&s, &id), "succeeded", "{}\n{}", logs(&s, &id), s.pods[0].stderr());
        assert!(logs(&s, &id).contains("from-a-step"), "{}", logs(&s, &id));
    }
    assert_eq!((count(0), count(1)), (1, 1), "the step was applied once on each pod");
    for p in &mut s.pods {
        assert!(!p.stderr().contains("changed since the steps wrote them"), "{}", p.stderr());
    }
    assert_serving(&mut s);
}
