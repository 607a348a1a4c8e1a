//! Progress into TrainJob status, against a loopback stand-in for Trainer's
//! status endpoint made by the tests (tests/fixtures/status_server.py: HTTPS
//! with the test's own CA, a token file it rotates, the TrainJob CRD's
//! trainerStatus rules), with real reporters: transformers' Trainer and
//! its KubeflowCallback, and the Kubeflow SDK's
//! update_trainjob_status. Trainer's real server needs a cluster; this one
//! speaks its documented API (reference/kubeflow.md 2.3).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::support::fixture_server::{Server, status_server};
use crate::util::{Pod, fixture, free_port, pet_env, python, scrape, start_pods_with, tls_pair};

const LIMIT: Duration = Duration::from_secs(300);
const PATH: &str = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/team/trainjobs/job/status";

/// A status server with its own CA, and the files a pod gets.
struct Trainer {
    server: Server,
    dir: tempfile::TempDir,
    ca: PathBuf,
}

impl Trainer {
    fn start(rotate_after: u32) -> Trainer {
        let dir = tempfile::tempdir().expect("tmp");
        let (server, ca) = status_server(&python(), dir.path(), rotate_after, PATH);
        Trainer { server, dir, ca }
    }

    /// Trainer's three variables for a pod, with this CA (or `ca`).
    fn env(&self, ca: Option<&Path>) -> Vec<(String, String)> {
        vec![
            ("KUBEFLOW_TRAINER_SERVER_URL".into(), format!("https://127.0.0.1:{}{PATH}", self.server.fields[0])),
            ("KUBEFLOW_TRAINER_SERVER_CA_CERT".into(), ca.unwrap_or(&self.ca).display().to_string()),
            ("KUBEFLOW_TRAINER_SERVER_TOKEN".into(), self.dir.path().join("token").display().to_string()),
        ]
    }

    /// (requests, rotation time) as the server logged them.
    fn log(&self) -> (Vec<serde_json::Value>, Option<(f64, String)>) {
        let text = std::fs::read_to_string(self.dir.path().join("log")).unwrap_or_default();
        let mut requests = Vec::new();
        let mut rotated = None;
        for line in text.lines() {
            let v: serde_json::Value = serde_json::from_str(line).expect("log line");
            match v["rotated"].as_str() {
                Some(token) => rotated = Some((v["t"].as_f64().expect("t"), token.to_string())),
                None => requests.push(v),
            }
        }
        (requests, rotated)
    }
}

/// Two pods of one worker each, with `env` on both and `second` on pod 1.
fn two_pods(script: &str, env: &[(String, String)], second: &[(String, String)]) -> Vec<Pod> {
    let port = free_port();
    start_pods_with(2, &["run", script], |i| {
        let mut e = pet_env(2, 1, i, port);
        e.extend(env.iter().cloned());
        if i == 1 {
            e.extend(second.iter().cloned());
        }
        e
    })
}

/// A sample's value in Prometheus text (0 when absent).
fn gauge(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

fn metric<'a>(status: &'a serde_json::Value, name: &str) -> Option<&'a str> {
    status["metrics"].as_array()?.iter().find(|m| m["name"] == name)?["value"].as_str()
}

/// What every run must show: every request valid and accepted, at least
/// 5 s apart, the rotated token used once it exists, and the last status
/// the worker's final progress with trainlet's facts.
fn check(trainer: &Trainer, worker_metric: &str) -> Vec<serde_json::Value> {
    let (requests, rotated) = trainer.log();
    assert!(requests.len() >= 3, "{requests:#?}");
    for r in &requests {
        assert_eq!(r["status"], 200, "every post is valid and carries a valid token: {r}");
    }
    for pair in requests.windows(2) {
        let gap = pair[1]["t"].as_f64().expect("t") - pair[0]["t"].as_f64().expect("t");
        assert!(gap >= 4.9, "two posts {gap:.2} s apart: {pair:#?}");
    }
    let (at, token) = rotated.expect("the server rotated the token mid-run");
    let after: Vec<&serde_json::Value> = requests.iter().filter(|r| r["t"].as_f64().expect("t") > at + 1.0).collect();
    assert!(!after.is_empty(), "no post after the rotation: {requests:#?}");
    for r in &after {
        assert_eq!(r["token"].as_str(), Some(token.as_str()), "the token file is re-read: {r}");
    }
    let last = &requests.last().expect("a post")["body"]["trainerStatus"];
    assert_eq!(last["progressPercentage"], 100, "{last}");
    assert_eq!(metric(last, "trainlet.restarts"), Some("0"), "{last}");
    assert_eq!(metric(last, "trainlet.world_size"), Some("2"), "{last}");
    assert_eq!(metric(last, "trainlet.round"), Some("0"), "{last}");
    assert!(requests.iter().any(|r| metric(&r["body"]["trainerStatus"], worker_metric).is_some()), "{requests:#?}");
    requests
}

/// transformers' Trainer (DDP over gloo on 2 pods): rank 0's
/// KubeflowCallback posts to trainlet on pod 0, which posts to
/// Trainer once per 5 s with the token as the file holds it now.
#[test]
fn transformers_progress_reaches_trainer_once_per_5_s_with_the_current_token() {
    let trainer = Trainer::start(6);
    let mut env = trainer.env(None);
    env.push(("STEP_SLEEP".into(), "0.4".into()));
    let mut pods = two_pods(&fixture("hf_progress.py"), &env, &[]);
    for (i, pod) in pods.iter_mut().enumerate() {
        assert_eq!(pod.code(LIMIT), 0, "pod {i} stderr:\n{}", pod.stderr());
        assert!(pod.stdout().contains("url=http://127.0.0.1:"), "the worker got trainlet's endpoint");
    }
    let requests = check(&trainer, "loss");
    let steps = requests.iter().filter_map(|r| metric(&r["body"]["trainerStatus"], "current_step")).count();
    assert!(steps >= 1, "mid-run progress (current_step) was relayed: {requests:#?}");
    assert!(!pods[1].stderr().contains("posting the job's progress"), "only the store host posts");
}

/// The Kubeflow SDK on the second pod: its reports go to the store host
/// through the agents' store, and only the store host posts.
#[test]
fn sdk_reports_from_another_pod_reach_trainer_through_the_store() {
    let trainer = Trainer::start(6);
    let mut env = trainer.env(None);
    env.extend([("REPORT_RANK".into(), "1".into()), ("STEPS".into(), "12".into())]);
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut pods = two_pods(&fixture("sdk_progress.py"), &env, &[("TRAINLET_METRICS_ADDR".into(), metrics.clone())]);
    // Pod 1's Prometheus families show its worker's reports while it runs.
    let start = Instant::now();
    let mut seen = String::new();
    while !(seen.contains("trainlet_progress_reports_total ") && gauge(&seen, "trainlet_progress_percent") > 0.0) {
        assert!(start.elapsed() < LIMIT, "no progress in pod 1's metrics:\n{seen}\n{}", pods[1].stderr());
        seen = scrape(&metrics);
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(gauge(&seen, "trainlet_progress_reports_total") >= 1.0, "{seen}");
    for (i, pod) in pods.iter_mut().enumerate() {
        assert_eq!(pod.code(LIMIT), 0, "pod {i} stderr:\n{}", pod.stderr());
    }
    assert!(pods[1].stdout().contains("SDK rank=1 sent="), "{}", pods[1].stdout());
    assert!(!pods[1].stdout().contains("sent=0"), "the SDK's posts to trainlet succeeded: {}", pods[1].stdout());
    let requests = check(&trainer, "loss");
    assert!(
        requests
            .iter()
            .any(|r| r["body"]["trainerStatus"]["progressPercentage"].as_i64().is_some_and(|p| p > 0 && p < 100)),
        "mid-run progress from pod 1: {requests:#?}"
    );
}

/// A status server that cannot be trusted (its certificate is from
/// another CA) or is not there: warnings, and the job runs as without.
#[test]
fn an_untrusted_or_dead_status_server_costs_warnings_only() {
    let trainer = Trainer::start(0);
    let other = tempfile::tempdir().expect("tmp");
    let (other_ca, _, _) = tls_pair(other.path());
    let dead = vec![
        ("KUBEFLOW_TRAINER_SERVER_URL".into(), format!("https://127.0.0.1:{}{PATH}", free_port())),
        ("KUBEFLOW_TRAINER_SERVER_CA_CERT".into(), trainer.ca.display().to_string()),
        ("KUBEFLOW_TRAINER_SERVER_TOKEN".into(), trainer.dir.path().join("token").display().to_string()),
    ];
    for (what, env) in [("untrusted", trainer.env(Some(&other_ca))), ("dead", dead)] {
        let mut env = env;
        env.push(("STEPS".into(), "4".into()));
        let started = Instant::now();
        let pairs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let mut pod = Pod::start(&["run", &fixture("sdk_progress.py")], &pairs);
        assert_eq!(pod.code(LIMIT), 0, "{what}: {}", pod.stderr());
        let err = pod.stderr();
        assert!(err.contains("cannot post progress to Trainer; training goes on"), "{what}: {err}");
        assert!(pod.stdout().contains("SDK rank=0 sent=") && !pod.stdout().contains("sent=0"), "{what}");
        // The run (about 10 s of worker) is not held up beyond the final flush.
        assert!(started.elapsed() < Duration::from_secs(60), "{what}: {:?}", started.elapsed());
    }
    assert!(trainer.log().0.is_empty(), "nothing reached the server over untrusted TLS: {:?}", trainer.log().0);
}

/// The Kubeflow SDK's update_trainjob_status on every rank of 2 pods x 2
/// (tests/fixtures/sdk_all_ranks.py): Trainer sees one view of the job,
/// rank 0's report (8, 50, 91 %), never another rank's 3 or 4 % that
/// arrived after it; after a restart it sees the new round's facts with no
/// report of the failed attempt, then the new attempt's rank 0 (100 %).
#[test]
fn every_rank_reporting_gives_trainer_rank_0s_view_and_drops_a_failed_attempts_reports() {
    let trainer = Trainer::start(0);
    let port = free_port();
    let mut env = trainer.env(None);
    // The other ranks report after rank 0's mark, not after a fixed 0.5 s
    // from their own start (on a loaded machine rank 0 started later).
    let marks = tempfile::tempdir().expect("tmp");
    env.push(("REPORT_MARKS".into(), marks.path().display().to_string()));
    let mut pods = start_pods_with(2, &["run", "--max-restarts", "1", &fixture("sdk_all_ranks.py")], |i| {
        let mut e = pet_env(2, 2, i, port);
        e.extend(env.iter().cloned());
        e
    });
    for (i, pod) in pods.iter_mut().enumerate() {
        assert_eq!(pod.code(LIMIT), 0, "pod {i} stderr:\n{}\nstdout:\n{}", pod.stderr(), pod.stdout());
        assert!(!pod.stdout().contains("ok=False"), "every SDK report reached trainlet: {}", pod.stdout());
    }
    let (requests, _) = trainer.log();
    // (trainlet.restarts, progress, the report's attempt, the report's rank) per post.
    type Post<'a> = (&'a str, Option<i64>, Option<&'a str>, Option<&'a str>);
    let posted: Vec<Post<'_>> = requests
        .iter()
        .map(|r| {
            assert_eq!(r["status"], 200, "{r}");
            let s = &r["body"]["trainerStatus"];
            let restarts = metric(s, "trainlet.restarts").expect("trainlet.restarts");
            (restarts, s["progressPercentage"].as_i64(), metric(s, "attempt"), metric(s, "rank"))
        })
        .collect();
    let first: Vec<i64> = posted.iter().filter(|p| p.0 == "0").filter_map(|p| p.1).collect();
    for (restarts, progress, attempt, rank) in &posted {
        if progress.is_some() {
            assert_eq!(Some(*restarts), *attempt, "a report of this attempt only: {posted:?}");
        }
        if *restarts == "0" && progress.is_some() {
            assert_eq!(*rank, Some("0"), "rank 0 speaks for the job: {posted:?}");
        }
    }
    assert!(first.contains(&8) && first.contains(&50) && first.contains(&91), "rank 0's 8, 50, 91 %: {posted:?}");
    assert!(
        posted.iter().any(|p| p.0 == "1" && p.1.is_none()),
        "the new round's facts, without the failed attempt's report: {posted:?}"
    );
    let last = posted.last().expect("a post");
    assert_eq!((last.0, last.1, last.3), ("1", Some(100), Some("0")), "{posted:?}");
    let failure = metric(&requests.last().expect("a post")["body"]["trainerStatus"], "trainlet.last_failure");
    assert_eq!(failure, Some("rank 3 exit code 1"), "the first attempt's root cause: {posted:?}");
    eprintln!("posted (restarts, progress, attempt, rank): {posted:?}");
}
