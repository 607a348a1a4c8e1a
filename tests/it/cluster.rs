//! trainlet on a real Kubernetes (`tests/cluster.sh`, built by
//! `tests/run.sh` before the tests): etcd, kube-apiserver,
//! kube-controller-manager, kube-scheduler and kubelets from their Go
//! modules, the real Trainer (v2.3.0, its status server on) and JobSet
//! (v0.12.0) controllers with their webhooks, CoreDNS, and two nodes with
//! Debian's containerd and runc running the images of `images/`.
//!
//! - Every runtime of `runtimes/` becomes, through Trainer and JobSet's
//!   webhook, a JobSet with its Jobs and pods that carry trainlet's
//!   contract (a cluster without nodes: the pods stay Pending).
//! - A TrainJob of `runtimes/torch-distributed.yaml` runs on the nodes with
//!   trainlet as PID 1 of its pods (its command is `torchrun`), posts its
//!   progress to Trainer's status server, completes, survives the deletion
//!   of a pod, and fails as the runtime's failure policy says on a worker bug.
//! - The Kubeflow SDK, the MPI, initializer, DeepSpeed and `trainlet-dev`
//!   runtimes run on the nodes too.
//! - A spare takes a deleted training pod's rank (`cluster/spares.rs`).
//! - Its verdicts are Kubernetes Events, one each: a counted restart, a
//!   failure, a hang, a pod that leaves with 207, a spare taking a rank, a
//!   straggler; repeats are counted, not a flood, and a missing
//!   permission is one warning (`cluster/events.rs`).
//!
//! PyTorch comes from the test venv through a read-only hostPath volume
//! (added with a TrainJob runtime patch), as the container tests bind-mount
//! it; checkpoints go to a hostPath directory, the shared storage of a real
//! cluster (both nodes are this machine).
//!
//! The tests share one cluster, brought up once per test run (by the test
//! command, or by the first cluster test) and stopped at its end; each works
//! in a namespace of its own. ClusterTrainingRuntimes are the repository's
//! files, applied as they are by whichever test needs them first
//! (`apply_file`), never changed or deleted by a test. The tests that
//! restart the API server have the cluster alone (`Take::Alone`).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use crate::support::cluster::{
    api_server, apply_file, cluster, cluster_runtimes, get_json, job_on, kubectl, kubectl_command, kubectl_stdin,
    logs_of, mounts_patch, pods_of, run_dir, set_namespace, shared,
};
use crate::util::repo;

mod driver;
mod events;
mod inplace;
mod spares;
mod stragglers;
mod torchft;

/// The cluster tests share one cluster (`support::cluster::shared`) and
/// run side by side, each in a namespace of its own; a test that stops a
/// component everyone uses (the API server) runs alone.
static CLUSTER: RwLock<()> = RwLock::new(());

/// Whether this test shares the cluster with others now or has it alone.
enum Hold {
    Beside { _guard: RwLockReadGuard<'static, ()> },
    Alone { _guard: RwLockWriteGuard<'static, ()> },
}

/// A test's part of the shared cluster: a namespace of its own, which this
/// thread's kubectl works in, deleted (with everything in it) when the test
/// ends; a failed test's name is noted so that the cluster's logs are kept
/// when it stops (tests/cluster.sh down).
struct Up {
    namespace: String,
    test: String,
    _hold: Hold,
}

/// How a test takes the cluster.
#[derive(Clone, Copy, PartialEq)]
enum Take {
    /// Beside the other tests.
    Beside,
    /// Alone: it restarts the API server.
    Alone,
    /// Beside the others, in a namespace whose pods no node takes (they stay Pending).
    Unscheduled,
}

/// The shared cluster for this test, in namespace `name`-PID.
fn up(name: &str, take: Take) -> Up {
    let hold = match take {
        Take::Alone => Hold::Alone { _guard: CLUSTER.write().unwrap_or_else(PoisonError::into_inner) },
        Take::Beside | Take::Unscheduled => {
            Hold::Beside { _guard: CLUSTER.read().unwrap_or_else(PoisonError::into_inner) }
        }
    };
    if let Err(e) = shared() {
        panic!("{e}");
    }
    let namespace = format!("{name}-{}", std::process::id());
    // The API server's PodNodeSelector plugin gives every pod of the
    // namespace this selector, which no node matches.
    let annotation = if take == Take::Unscheduled {
        "  annotations: {scheduler.alpha.kubernetes.io/node-selector: trainlet.dev/nowhere=true}\n"
    } else {
        ""
    };
    let manifest = format!("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {namespace}\n{annotation}");
    let (ok, out) = kubectl_stdin(&["create", "-f", "-"], &manifest);
    assert!(ok, "namespace {namespace}: {out}");
    set_namespace(Some(&namespace));
    let test = std::thread::current().name().unwrap_or(name).to_string();
    Up { namespace, test, _hold: hold }
}

impl Drop for Up {
    fn drop(&mut self) {
        if std::thread::panicking() {
            use std::io::Write;
            let noted = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(run_dir().join("failed"))
                .and_then(|mut f| writeln!(f, "{} (namespace {})", self.test, self.namespace));
            if let Err(e) = noted {
                eprintln!("cannot note the failure for tests/cluster.sh down: {e}");
            }
        }
        // Deleted in the background: its pods end with their grace period
        // while the next test starts.
        let (ok, out) = kubectl(&["delete", "namespace", &self.namespace, "--wait=false"]);
        set_namespace(None);
        assert!(ok || std::thread::panicking(), "delete namespace {}: {out}", self.namespace);
    }
}

/// `kubectl get KIND -o json` items, polled until `done` says so (120 s at most).
fn items_until(args: &[&str], done: impl Fn(&[serde_json::Value]) -> bool) -> Vec<serde_json::Value> {
    let until = Instant::now() + Duration::from_secs(120);
    loop {
        let mut all = vec!["get"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["-o", "json"]);
        let (ok, out) = kubectl(&all);
        assert!(ok, "kubectl {all:?}: {out}");
        let items = serde_json::from_str::<serde_json::Value>(&out).expect("json")["items"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if done(&items) || Instant::now() > until {
            return items;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn env_of(pod: &serde_json::Value) -> BTreeMap<String, serde_json::Value> {
    pod["spec"]["containers"][0]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| Some((e["name"].as_str()?.to_string(), e.get("value").or(e.get("valueFrom"))?.clone())))
        .collect()
}

#[test]
fn every_runtime_goes_through_the_real_trainer_and_jobset_to_pods_that_carry_trainlets_contract() {
    let _up = up("runtimes", Take::Unscheduled);

    let runtimes: Vec<String> = std::fs::read_dir(repo().join("runtimes"))
        .expect("runtimes/")
        .filter_map(|e| e.ok()?.path().to_str().map(str::to_string))
        .filter(|p| p.ends_with(".yaml"))
        .collect();
    assert!(runtimes.len() >= 8, "{runtimes:?}");
    let mut names = Vec::new();
    for file in &runtimes {
        let (ok, out) = apply_file(Path::new(file));
        assert!(ok, "Trainer refused {file}: {out}");
        let text = std::fs::read_to_string(file).expect("read");
        let name = cluster_runtimes(&text)
            .first()
            .and_then(|n| n.strip_prefix("trainlet-"))
            .unwrap_or_else(|| panic!("{file} names no trainlet-* runtime"))
            .to_string();
        let job = format!(
            "apiVersion: trainer.kubeflow.org/v1alpha1\nkind: TrainJob\nmetadata: {{name: t-{name}}}\nspec:\n  runtimeRef: {{name: trainlet-{name}}}\n  trainer: {{numNodes: 2, numProcPerNode: 2, command: [torchrun, /workspace/train.py]}}\n"
        );
        let (ok, out) = kubectl_stdin(&["apply", "-f", "-"], &job);
        assert!(ok, "TrainJob of {name}: {out}");
        names.push(name);
    }

    // Each TrainJob becomes a JobSet (JobSet's webhook accepted what Trainer
    // made of the runtime) with at least one Job and its pods.
    let all = names.len();
    let jobsets = items_until(&["jobsets"], |js| js.len() >= all);
    let made: Vec<&str> = jobsets.iter().filter_map(|j| j["metadata"]["name"].as_str()).collect();
    for name in &names {
        assert!(
            made.contains(&format!("t-{name}").as_str()),
            "no JobSet for runtime {name} ({made:?}); Trainer's log: {}",
            std::fs::read_to_string(run_dir().join("logs/trainer.log"))
                .unwrap_or_default()
                .lines()
                .rfind(|l| l.contains(name) && l.contains("error"))
                .unwrap_or("")
        );
    }

    // The torch pods: 2, Pending (no node), with what trainlet reads.
    let pods = items_until(&["pods", "-l", "jobset.sigs.k8s.io/jobset-name=t-torch-distributed"], |p| p.len() >= 2);
    assert_eq!(pods.len(), 2, "{pods:?}");
    for pod in &pods {
        let c = &pod["spec"]["containers"][0];
        assert_eq!(c["command"][0], "torchrun", "trainlet answers as torchrun: {c}");
        let env = env_of(pod);
        assert_eq!(env.get("PET_NNODES"), Some(&serde_json::json!("2")), "{env:?}");
        assert_eq!(env.get("PET_NPROC_PER_NODE"), Some(&serde_json::json!("2")), "{env:?}");
        assert_eq!(
            env.get("PET_MASTER_ADDR"),
            Some(&serde_json::json!("t-torch-distributed-node-0-0.t-torch-distributed")),
            "{env:?}"
        );
        let rank = env.get("PET_NODE_RANK").map(|v| v["fieldRef"]["fieldPath"].clone());
        assert!(rank.as_ref().and_then(|p| p.as_str()).is_some_and(|p| p.contains("job-completion-index")), "{env:?}");
        let restart = env.get("JOBSET_RESTART_ATTEMPT").map(|v| v["fieldRef"]["fieldPath"].clone());
        assert!(restart.as_ref().and_then(|p| p.as_str()).is_some_and(|p| p.contains("restart-attempt")), "{env:?}");
        assert!(
            env.get("KUBEFLOW_TRAINER_SERVER_URL").and_then(|v| v.as_str()).is_some_and(|u| u.ends_with("/status")),
            "Trainer's status server (TrainJobStatus) is on: {env:?}"
        );
        assert_eq!(pod["status"]["phase"], "Pending", "no node takes this namespace's pods");
    }

    // MPI: a launcher and the nodes.
    let jobs = items_until(&["jobs", "-l", "jobset.sigs.k8s.io/jobset-name=t-mpi-distributed"], |j| j.len() >= 2);
    let mut kinds: Vec<&str> =
        jobs.iter().filter_map(|j| j["metadata"]["labels"]["jobset.sigs.k8s.io/replicatedjob-name"].as_str()).collect();
    kinds.sort_unstable();
    assert_eq!(kinds, ["launcher", "node"], "{jobs:?}");

    // In-place restarts are on: JobSet's webhook refuses the strategy
    // while its InPlaceRestart gate is off, and the API server refuses
    // container restart rules without ContainerRestartRules.
    let in_place = "apiVersion: jobset.x-k8s.io/v1alpha2
kind: JobSet
metadata: {name: in-place}
spec:
  failurePolicy: {maxRestarts: 3, restartStrategy: InPlaceRestart}
  replicatedJobs:
  - name: node
    template:
      spec:
        completions: 2
        parallelism: 2
        backoffLimit: 2147483647
        podReplacementPolicy: Failed
        template:
          spec:
            restartPolicy: Never
            containers:
            - name: node
              image: ghcr.io/trainlet/torch-runtime:0.1.0
              restartPolicy: Never
              restartPolicyRules:
              - action: RestartAllContainers
                exitCodes: {operator: In, values: [42]}
";
    let (ok, out) = kubectl_stdin(&["apply", "--dry-run=server", "-f", "-"], in_place);
    assert!(ok && out.contains("jobset.jobset.x-k8s.io/in-place created (server dry run)"), "{out}");
}

/// A TrainJob of runtimes/torch-distributed.yaml: tests/fixtures/ckpt_train.py
/// on 2 pods x 2 workers (gloo), the image's python with the venv's torch
/// (a runtime patch mounts it), checkpoints in `ckpt`.
fn ddp_job(name: &str, ckpt: &Path, env: &[(&str, &str)]) -> String {
    ddp_job_on("trainlet-torch-distributed", name, ckpt, env)
}

/// `ddp_job` on another torch runtime.
fn ddp_job_on(runtime: &str, name: &str, ckpt: &Path, env: &[(&str, &str)]) -> String {
    let mut vars = vec![("CKPT_DIR", "/ckpt")];
    vars.extend_from_slice(env);
    job_on(runtime, name, "[torchrun, /fixtures/ckpt_train.py]", &vars, &[("ckpt", ckpt, "/ckpt", false)])
}

/// A container's log, followed (`kubectl logs -f`) until the container ends.
struct Followed {
    child: std::process::Child,
    reader: std::thread::JoinHandle<String>,
}

impl Followed {
    fn start(pod: &str) -> Followed {
        let mut child = kubectl_command(&["logs", "-f", pod])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("kubectl logs -f");
        let mut stdout = child.stdout.take().expect("stdout");
        let reader = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = std::io::Read::read_to_string(&mut stdout, &mut text);
            text
        });
        Followed { child, reader }
    }

    /// The log once the container ended (at most `limit` from now).
    fn end(mut self, limit: Duration) -> String {
        let until = Instant::now() + limit;
        while self.child.try_wait().expect("wait").is_none() {
            if Instant::now() > until {
                let _ = self.child.kill();
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        self.reader.join().expect("reader")
    }
}

/// The logs of all the job's pods, in node-rank order (ranks go to pods
/// in the order they joined, as with torchrun's c10d rendezvous).
fn all_logs(job: &str) -> String {
    pods_of(job).values().map(logs_of).collect::<Vec<_>>().join("\n")
}

/// Everything a failed wait should show: the TrainJob, its pods and their logs.
fn diagnose(job: &str) -> String {
    let mut out = kubectl(&["get", "trainjob,jobset,jobs,pods", "-o", "wide"]).1;
    out.push_str(&kubectl(&["get", "trainjob", job, "-o", "jsonpath={.status}"]).1);
    for (index, pod) in pods_of(job) {
        out.push_str(&format!("\n--- pod {index} ({}):\n{}", pod["metadata"]["name"], logs_of(&pod)));
    }
    out
}

/// Poll `check` every 500 ms until it gives a value; past `limit`, fail
/// naming `what`, with the job's state.
fn wait_for<T>(job: &str, what: &str, limit: Duration, mut check: impl FnMut() -> Option<T>) -> T {
    let until = Instant::now() + limit;
    loop {
        if let Some(v) = check() {
            return v;
        }
        assert!(Instant::now() < until, "{what}: not within {limit:?}:\n{}", diagnose(job));
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Wait until the TrainJob is Complete or Failed; which one.
fn finished(job: &str, limit: Duration) -> String {
    wait_for(job, &format!("TrainJob {job} finished"), limit, || {
        let tj = get_json(&["trainjob", job]);
        tj["status"]["conditions"].as_array().into_iter().flatten().find_map(|c| {
            let kind = c["type"].as_str()?;
            ((kind == "Complete" || kind == "Failed") && c["status"] == "True").then(|| kind.to_string())
        })
    })
}

/// Wait until `pred` holds for the job's pods (120 s at most).
fn pods_until(job: &str, what: &str, pred: impl Fn(&BTreeMap<String, serde_json::Value>) -> bool) {
    wait_for(job, what, Duration::from_secs(120), || pred(&pods_of(job)).then_some(()));
}

/// The Events trainlet wrote with `reason` about the pods of TrainJob
/// `job`, in this thread's namespace.
fn events_of(job: &str, reason: &str) -> Vec<serde_json::Value> {
    let prefix = format!("{job}-");
    get_json(&["events.v1.events.k8s.io"])["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| {
            e["reportingController"] == "trainlet"
                && e["reason"] == reason
                && e["regarding"]["name"].as_str().is_some_and(|n| n.starts_with(&prefix))
        })
        .cloned()
        .collect()
}

/// How many times an Event happened: its series' count, else once.
fn count_of(event: &serde_json::Value) -> u64 {
    event["series"]["count"].as_u64().unwrap_or(1)
}

/// The one Event trainlet writes with `reason` about TrainJob `job`'s
/// pods, once it counts `times` (60 s at most: a pod writes its last ones
/// as it exits): a single object, related to the TrainJob.
fn one_event(job: &str, reason: &str, times: u64) -> serde_json::Value {
    let events = wait_for(job, &format!("{times} {reason} Event(s)"), Duration::from_secs(60), || {
        let e = events_of(job, reason);
        (e.iter().map(count_of).sum::<u64>() >= times).then_some(e)
    });
    assert_eq!(events.len(), 1, "one {reason} Event, counted, not one per time: {events:#?}");
    let event = events.into_iter().next().unwrap_or_default();
    assert_eq!(count_of(&event), times, "{event:#}");
    assert_eq!(event["regarding"]["kind"], "Pod", "{event:#}");
    assert_eq!(event["related"]["kind"], "TrainJob", "{event:#}");
    assert_eq!(event["related"]["name"], job, "{event:#}");
    event
}

fn metric(tj: &serde_json::Value, name: &str) -> Option<String> {
    tj["status"]["trainerStatus"]["metrics"]
        .as_array()?
        .iter()
        .find(|m| m["name"] == name)
        .and_then(|m| m["value"].as_str())
        .map(str::to_string)
}

#[test]
fn a_trainjob_runs_on_real_nodes_under_trainlet_survives_a_deleted_pod_and_fails_on_a_worker_bug() {
    let _up = up("trainjob", Take::Beside);
    let (ok, out) = apply_file(&repo().join("runtimes/torch-distributed.yaml"));
    assert!(ok, "{out}");
    let limit = Duration::from_secs(300);

    // 1. A 2 x 2 job whose rank 2 fails twice (exit 1, restarted in place
    // by trainlet under PET_MAX_RESTARTS=2) completes with the parameters
    // of an uninterrupted run, and its progress, the restarts included,
    // reaches the TrainJob through Trainer's status server (the relay finds
    // it by cluster DNS and trusts Trainer's CA). The restarts are one
    // Event, counted.
    let ckpt = tempfile::tempdir().expect("tmp");
    let env = [("STEPS", "20"), ("FAIL_AT", "2@0,2@1"), ("FAIL_CODE", "1"), ("PET_MAX_RESTARTS", "2")];
    let (ok, out) = kubectl_stdin(&["apply", "-f", "-"], &ddp_job("ddp", ckpt.path(), &env));
    assert!(ok, "{out}");
    assert_eq!(finished("ddp", limit), "Complete", "{}", diagnose("ddp"));
    let pods = pods_of("ddp");
    assert_eq!(pods.len(), 2, "{pods:?}");
    let nodes: std::collections::BTreeSet<&str> =
        pods.values().filter_map(|p| p["spec"]["nodeName"].as_str()).collect();
    assert_eq!(nodes.len(), 2, "the scheduler spread the pods over both nodes: {nodes:?}");
    let master = logs_of(&pods["0"]);
    assert!(master.contains("round formed round=0 nnodes=2"), "the store's host, PET_MASTER_ADDR: {master}");
    let logs = all_logs("ddp");
    let (digest, world) = crate::fault::final_of(&logs);
    assert_eq!((digest.as_str(), world.as_str()), (crate::fault::reference_of("20").as_str(), "world=4"), "{logs}");
    let tj = get_json(&["trainjob", "ddp"]);
    assert_eq!(metric(&tj, "trainlet.world_size").as_deref(), Some("4"), "{tj}");
    assert_eq!(metric(&tj, "trainlet.restarts").as_deref(), Some("2"), "{tj}");
    assert!(logs.contains("FAILING rank=2"), "{logs}");
    let restarted = one_event("ddp", "Restarted", 2);
    assert_eq!(restarted["type"], "Normal", "{restarted:#}");
    let note = restarted["note"].as_str().unwrap_or_default();
    assert!(
        note.contains("restarting every pod's workers after rank 2 failed") && note.contains("--max-restarts 2"),
        "{note}"
    );

    // 2. A pod deleted mid-run: trainlet, its PID 1, stops its workers and
    // exits 143 (the runtime's podFailurePolicy ignores it), the Job makes
    // a new pod of the same index and name, and the surviving pod's
    // trainlet takes it into its next round: no JobSet restart, the job
    // resumes from its checkpoint and ends with the same parameters.
    let ckpt = tempfile::tempdir().expect("tmp");
    let steps = "400";
    let job = ddp_job("lost", ckpt.path(), &[("STEPS", steps), ("STEP_SLEEP", "0.05"), ("CKPT_EVERY", "5")]);
    let (ok, out) = kubectl_stdin(&["apply", "-f", "-"], &job);
    assert!(ok, "{out}");
    pods_until("lost", "both pods training", |p| {
        p.len() == 2 && p.values().all(|p| logs_of(p).contains("START rank="))
    });
    let before = pods_of("lost");
    let victim = before["1"]["metadata"]["name"].as_str().expect("name").to_string();
    let (ok, pid1) = kubectl(&["exec", &victim, "--", "cat", "/proc/1/cmdline"]);
    assert!(ok && pid1.starts_with("torchrun\0"), "PID 1 of the pod is trainlet as torchrun: {pid1:?}");
    wait_for("lost", "a checkpoint", Duration::from_secs(120), || {
        (std::fs::read_dir(ckpt.path()).map(|d| d.count()).unwrap_or(0) > 0).then_some(())
    });
    // Its log, followed to its end: the pod's last words go with it.
    let follow = Followed::start(&victim);
    let (ok, out) = kubectl(&["delete", "pod", &victim, "--wait=false"]);
    assert!(ok, "{out}");
    pods_until("lost", "a new pod for node rank 1", |p| {
        p.get("1").is_some_and(|p| p["metadata"]["uid"] != before["1"]["metadata"]["uid"])
    });
    // The kubelet's preStop hook (`trainlet stop`) and SIGTERM: trainlet
    // sends the runtime's checkpoint signal first and exits 143.
    let last = follow.end(Duration::from_secs(120));
    assert!(last.contains("stop signal; stopping workers signal=SIGTERM checkpoint=\"SIGUSR1\""), "{last}");
    assert_eq!(finished("lost", limit), "Complete", "{}", diagnose("lost"));
    let after = pods_of("lost");
    assert_eq!(after["0"]["metadata"]["uid"], before["0"]["metadata"]["uid"], "node rank 0's pod was never replaced");
    let master = logs_of(&after["0"]);
    assert!(master.contains("round formed round=1 nnodes=2"), "the new pod joined the next round:\n{master}");
    let logs = all_logs("lost");
    let (digest, _) = crate::fault::final_of(&logs);
    assert_eq!(digest, crate::fault::reference_of(steps), "{logs}");
    let jobset = get_json(&["jobset", "lost"]);
    assert_eq!(jobset["status"]["restarts"].as_u64().unwrap_or(0), 0, "no JobSet restart: {jobset}");
    let tj = get_json(&["trainjob", "lost"]);
    assert!(metric(&tj, "trainlet.round").is_some_and(|r| r != "0"), "{tj}");

    // 3. A worker bug: the admin's failure policy (the optional ConfigMap
    // the runtime mounts) maps exit 3 to `fail`, trainlet exits 205, the
    // runtime's podFailurePolicy fails the Job and its JobSet rule fails
    // the JobSet at once: the TrainJob is Failed, with no restart.
    let policy = format!("--from-file=policy.toml={}", repo().join("runtimes/failure-policy.toml").display());
    let (ok, out) = kubectl(&["create", "configmap", "trainlet-failure-policy", &policy]);
    assert!(ok, "{out}");
    let ckpt = tempfile::tempdir().expect("tmp");
    let job =
        ddp_job("bug", ckpt.path(), &[("STEPS", "40"), ("FAIL_AT", "1@0"), ("FAIL_STEP", "2"), ("FAIL_CODE", "3")]);
    let (ok, out) = kubectl_stdin(&["apply", "-f", "-"], &job);
    assert!(ok, "{out}");
    assert_eq!(finished("bug", limit), "Failed", "{}", diagnose("bug"));
    // Every pod's trainlet exits 205 with the job-wide verdict; the Job
    // controller deletes the pods left when the first one matches FailJob.
    let job = get_json(&["job", "bug-node-0"]);
    let failed = job["status"]["conditions"].as_array().into_iter().flatten().find(|c| c["type"] == "Failed");
    let message = failed.and_then(|c| c["message"].as_str()).unwrap_or_default();
    assert!(message.contains("failed with exit code 205 matching FailJob rule"), "{job}");
    let logs = all_logs("bug");
    assert!(logs.contains("worker rank 1 (exit code 3) matched a fail rule of the failure policy"), "{logs}");
    // The root cause is the failed pods' termination message: `kubectl
    // describe pod` and the pod's status show it.
    let messages: Vec<String> = pods_of("bug")
        .values()
        .filter_map(|p| p["status"]["containerStatuses"][0]["state"]["terminated"]["message"].as_str())
        .map(str::to_string)
        .collect();
    assert!(messages.iter().any(|m| m.contains("(exit code 3) matched a fail rule")), "{messages:?}");
    // One Event of the failure, on the root cause's pod, with its cause.
    let failed = one_event("bug", "JobFailed", 1);
    assert_eq!(failed["type"], "Warning", "{failed:#}");
    assert!(failed["note"].as_str().is_some_and(|n| n.contains("(exit code 3) matched a fail rule")), "{failed:#}");
    let jobset = get_json(&["jobset", "bug"]);
    assert_eq!(jobset["status"]["restarts"].as_u64().unwrap_or(0), 0, "{jobset}");

    // 4. The restricted runtime (uid 1000, read-only root, no
    // capabilities, RuntimeDefault seccomp) runs the same job to the end.
    let (ok, out) = apply_file(&repo().join("runtimes/torch-distributed-restricted.yaml"));
    assert!(ok, "{out}");
    let ckpt = tempfile::tempdir().expect("tmp");
    std::os::unix::fs::chown(ckpt.path(), Some(1000), Some(1000)).expect("chown");
    let job = ddp_job_on("trainlet-torch-distributed-restricted", "restricted", ckpt.path(), &[("STEPS", "20")]);
    let (ok, out) = kubectl_stdin(&["apply", "-f", "-"], &job);
    assert!(ok, "{out}");
    assert_eq!(finished("restricted", limit), "Complete", "{}", diagnose("restricted"));
    let logs = all_logs("restricted");
    let (digest, _) = crate::fault::final_of(&logs);
    assert_eq!(digest, crate::fault::reference_of("20"), "{logs}");

    // 5. A hang in the restricted runtime: rank 2 (on pod 1) stalls outside
    // the all_reduce the other ranks wait in, with no hook in its code.
    // Every pod's trainlet reads its workers' stacks before it stops them,
    // and the failed pods' termination messages and the TrainJob's status
    // name rank 2 and where it stalled.
    let env = [("STALL_RANK", "2"), ("TRAINLET_PROGRESS_TIMEOUT", "5"), ("PET_MAX_RESTARTS", "0")];
    let job = job_on("trainlet-torch-distributed-restricted", "hang", "[torchrun, /fixtures/stall_job.py]", &env, &[]);
    let (ok, out) = kubectl_stdin(&["apply", "-f", "-"], &job);
    assert!(ok, "{out}");
    let want = "rank 2 is not in the all_reduce the other 3 wait in: stall_job.py:";
    let messages = wait_for("hang", "a pod's termination message", limit, || {
        let m: Vec<String> = pods_of("hang")
            .values()
            .filter_map(|p| p["status"]["containerStatuses"][0]["state"]["terminated"]["message"].as_str())
            .map(str::to_string)
            .collect();
        m.iter().any(|m| m.contains(want)).then_some(m)
    });
    assert!(messages.iter().any(|m| m.contains("(exit 206)")), "{messages:?}");
    let status = wait_for("hang", "the TrainJob's last failure", limit, || {
        metric(&get_json(&["trainjob", "hang"]), "trainlet.last_failure").filter(|f| f.starts_with("hung: "))
    });
    assert!(want.starts_with(&status["hung: ".len()..]), "{status}");
    // One Event of the hang (the store host's), naming the stalled rank
    // and where, beside the job's failure.
    let hung = one_event("hang", "JobHung", 1);
    assert!(hung["note"].as_str().is_some_and(|n| n.contains(want)), "{hung:#}");
    assert!(one_event("hang", "JobFailed", 1)["note"].as_str().is_some_and(|n| n.contains(want)));
    let (ok, out) = kubectl(&["delete", "trainjob", "hang", "--wait=false"]);
    assert!(ok, "{out}");

    // 6. A pod that is not healthy (a /dev/shm smaller than --min-shm
    // asks for) leaves with 207 before its first round, says why in its
    // termination message and in one Event.
    let env = [("TRAINLET_MIN_SHM", "100000G")];
    let job = job_on("trainlet-torch-distributed", "sick", "[torchrun, /fixtures/all_reduce.py]", &env, &[])
        .replace("numNodes: 2", "numNodes: 1");
    let (ok, out) = kubectl_stdin(&["apply", "-f", "-"], &job);
    assert!(ok, "{out}");
    let left = one_event("sick", "LeftUnhealthy", 1);
    let note = left["note"].as_str().unwrap_or_default();
    assert!(note.contains("not healthy (exit 207): /dev/shm is") && note.contains("--min-shm"), "{note}");
    let pod = left["regarding"]["name"].as_str().unwrap_or_default().to_string();
    let state = wait_for("sick", "the unhealthy pod's end", limit, || {
        let p = get_json(&["pod", &pod]);
        p["status"]["containerStatuses"][0]["state"]["terminated"].is_object().then_some(p)
    });
    let terminated = &state["status"]["containerStatuses"][0]["state"]["terminated"];
    assert_eq!(terminated["exitCode"], 207, "{terminated:#}");
    assert!(terminated["message"].as_str().is_some_and(|m| m.contains("/dev/shm is")), "{terminated:#}");
    let (ok, out) = kubectl(&["delete", "trainjob", "sick", "--wait=false"]);
    assert!(ok, "{out}");
}

/// The Kubeflow SDK, unchanged, as a user drives it from a notebook
/// (tests/fixtures/sdk_cluster.py): `TrainerClient().train()` of a
/// `CustomTrainer` function through the API server, on the torch, JAX and
/// XGBoost runtimes of `runtimes/` (their images; the venv's frameworks
/// mounted). The SDK's own command (`bash -c "...; torchrun
/// sdk_train.py"`, or `python "sdk_train.py"` for JAX and XGBoost, which
/// the images' `python` link makes a trainlet job) runs under trainlet on
/// both pods; each job completes and the SDK reads its logs.
#[test]
fn the_kubeflow_sdk_trains_torch_jax_and_xgboost_functions_on_the_cluster_under_trainlet() {
    let up = up("sdk", Take::Beside);
    for runtime in ["torch", "jax", "xgboost"] {
        let file = repo().join(format!("runtimes/{runtime}-distributed.yaml"));
        let (ok, out) = apply_file(&file);
        assert!(ok, "{out}");
    }
    let sdk = |runtime: &str, function: &str| -> (String, [String; 2]) {
        let out = Command::new(crate::util::python())
            .arg(repo().join("tests/fixtures/sdk_cluster.py"))
            .arg(run_dir().join("admin.kubeconfig"))
            .arg(crate::containers::torch_site())
            .args([runtime, function, &up.namespace])
            .output()
            .expect("python");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{runtime}: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        let result: serde_json::Value = serde_json::from_str(stdout.trim()).expect("json");
        let name = result["name"].as_str().expect("name").to_string();
        assert_eq!(result["status"], "Complete", "{runtime}: {result}\n{}", diagnose(&name));
        let logs = |node: &str| result["logs"][node].as_str().unwrap_or_default().to_string();
        (name, [logs("node-0"), logs("node-1")])
    };
    let line = |logs: &str, tag: &str| -> String {
        logs.lines().find(|l| l.contains(tag)).unwrap_or_else(|| panic!("no {tag} line in:\n{logs}")).to_string()
    };

    let (name, logs) = sdk("trainlet-torch-distributed", "train_torch");
    assert!(logs[0].contains("round formed"), "node 0 hosts the rendezvous:\n{}", logs[0]);
    for l in &logs {
        let l = line(l, "SDKTORCH ");
        assert!(l.contains("world=2 sum=3 parent=torchrun"), "all-reduce of rank+1 under trainlet: {l}");
    }
    // Rank 0's report (the SDK's update_trainjob_status) went through
    // trainlet to Trainer, with trainlet's own facts beside it.
    let tj = get_json(&["trainjob", &name]);
    assert_eq!(tj["status"]["trainerStatus"]["progressPercentage"], 100, "{tj}");
    assert_eq!(metric(&tj, "sum").as_deref(), Some("3.0"), "{tj}");
    assert_eq!(metric(&tj, "trainlet.world_size").as_deref(), Some("2"), "{tj}");

    let (_, logs) = sdk("trainlet-jax-distributed", "train_jax");
    for (id, l) in logs.iter().enumerate() {
        let l = line(l, "SDKJAX ");
        assert!(l.contains(&format!("SDKJAX id={id} n=2 sum=3")), "psum over 2 processes: {l}");
    }

    let (_, logs) = sdk("trainlet-xgboost-distributed", "train_xgboost");
    for (rank, l) in logs.iter().enumerate() {
        let l = line(l, "SDKXGB ");
        assert!(l.contains(&format!("rank={rank} world=2")), "{l}");
        let model = l.split("model=").nth(1).and_then(|m| m.split_whitespace().next()).unwrap_or_default();
        assert!(l.ends_with(&format!("reference={model}")), "the federated model is the one-process model: {l}");
    }
}

/// The MPI runtime as Trainer runs it: a launcher and 2 node pods,
/// trainlet's sshd in the nodes (PID 1, as uid 1000), the SSH keys from
/// the Secret Trainer makes, Trainer's hostfile, and `mpirun` (Open MPI,
/// Debian's) over trainlet's ssh from the launcher: 2 x 2 ranks of mpi4py
/// all-reduce, and the TrainJob completes when the launcher does.
#[test]
fn the_mpi_runtime_runs_mpirun_over_trainlets_ssh_between_real_pods() {
    let _up = up("mpi", Take::Beside);
    let (ok, out) = apply_file(&repo().join("runtimes/mpi-distributed.yaml"));
    assert!(ok, "{out}");
    let fixtures = repo().join("tests/fixtures");
    let patch = mounts_patch(&["launcher", "node"], &[("fixtures", &fixtures, "/fixtures", true)]);
    let job = format!(
        "apiVersion: trainer.kubeflow.org/v1alpha1
kind: TrainJob
metadata: {{name: mpi}}
spec:
  runtimeRef: {{name: trainlet-mpi-distributed}}
  trainer:
    numNodes: 2
    numProcPerNode: 2
    command: [mpirun, python3, /fixtures/mpi_allreduce.py]
{patch}"
    );
    let (ok, out) = kubectl_stdin(&["apply", "-f", "-"], &job);
    assert!(ok, "{out}");
    // The launcher's log, read while its pod is there (JobSet's success
    // policy ends the other Jobs once it completes).
    let logs = wait_for("mpi", "mpirun's end in the launcher's log", Duration::from_secs(300), || {
        let launcher = get_json(&["pods", "-l", "jobset.sigs.k8s.io/replicatedjob-name=launcher"]);
        let logs = launcher["items"].as_array().into_iter().flatten().map(logs_of).collect::<Vec<_>>().join("\n");
        logs.contains("mpirun exited").then_some(logs)
    });
    assert_eq!(finished("mpi", Duration::from_secs(120)), "Complete", "{logs}");
    let results: Vec<&str> = logs.lines().filter(|l| l.starts_with("RESULT ")).collect();
    assert_eq!(results.len(), 4, "{logs}");
    let mut nodes = std::collections::BTreeSet::new();
    for line in &results {
        assert!(line.contains("size=4 sum=10"), "{line}");
        assert!(line.contains("ssh=/usr/local/bin/trainlet"), "trainlet's ssh, no OpenSSH: {line}");
        nodes.insert(line.split("node=").nth(1).and_then(|n| n.split_whitespace().next()).unwrap_or_default());
    }
    assert_eq!(nodes.len(), 2, "2 ranks on each node pod, started by its sshd: {results:?}");
    assert!(logs.contains("mpirun exited status=exit code 0"), "{logs}");
}

/// Every file under `root` (relative path) and its sha256, as
/// tests/fixtures/workspace_digest.py lists them.
fn tree(root: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read_dir").flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            let data = std::fs::read(&path).expect("read");
            let sum = ring::digest::digest(&ring::digest::SHA256, &data);
            let hex: String = sum.as_ref().iter().map(|b| format!("{b:02x}")).collect();
            out.insert(path.strip_prefix(root).expect("under root").display().to_string(), hex);
        }
    }
    out
}

/// The initializers' runtime (runtimes/torch-with-initializers.yaml,
/// unchanged but for the test's torch and fixtures mounts): its
/// dataset-initializer and model-initializer Jobs run `trainlet init`
/// against a Hugging Face Hub (tests/fixtures/hub_server.py, on the first
/// node's bridge address, where pods reach the host) onto the runtime's
/// ReadWriteMany claim (a hostPath PersistentVolume made here), and the
/// trainer's pods start only then (JobSet's dependsOn) and see the dataset
/// byte for byte and the model's weights without the formats Trainer's
/// initializer leaves out.
#[test]
fn the_initializers_fetch_from_a_hub_onto_the_shared_volume_before_the_trainer_starts() {
    let up = up("init", Take::Beside);
    let runtime = repo().join("runtimes/torch-with-initializers.yaml");
    let (ok, out) = apply_file(&runtime);
    assert!(ok, "{out}");
    let volume = tempfile::tempdir().expect("tmp");
    // Cluster-scoped: named after the test's namespace (no other test makes
    // a claim), and deleted at the end.
    let pv_name = format!("trainlet-test-initializer-{}", up.namespace);
    let pv = format!(
        "apiVersion: v1
kind: PersistentVolume
metadata: {{name: {pv_name}}}
spec:
  capacity: {{storage: 100Gi}}
  accessModes: [ReadWriteMany]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: \"\"
  hostPath: {{path: {}, type: Directory}}
",
        volume.path().display()
    );
    let (ok, out) = kubectl_stdin(&["apply", "-f", "-"], &pv);
    assert!(ok, "{out}");
    let node = get_json(&["node", "trainlet-node-0"]);
    let host = node["status"]["addresses"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|a| a["type"] == "InternalIP")
        .and_then(|a| a["address"].as_str())
        .expect("the node's InternalIP")
        .to_string();
    let root = tempfile::tempdir().expect("tmp");
    crate::init_remote::hub_repos(root.path());
    let hub = crate::support::fixture_server::Server::start(
        &crate::util::python(),
        Path::new(&crate::util::fixture("hub_server.py")),
        &["--root".to_string(), root.path().display().to_string(), "--host".to_string(), host.clone()],
        Duration::from_secs(120),
    );
    let endpoint = format!("http://{host}:{}", hub.fields[0]);
    let site = crate::containers::torch_site();
    let fixtures = repo().join("tests/fixtures");
    let patch =
        mounts_patch(&["node"], &[("torch", &site, "/opt/torch", true), ("fixtures", &fixtures, "/fixtures", true)]);
    let job = format!(
        "apiVersion: trainer.kubeflow.org/v1alpha1
kind: TrainJob
metadata: {{name: init}}
spec:
  runtimeRef: {{name: trainlet-torch-with-initializers}}
  initializer:
    dataset:
      storageUri: hf://tatsu/alpaca-mini
      env: [{{name: ENDPOINT, value: \"{endpoint}\"}}]
    model:
      storageUri: hf://meta/llama-mini
      env: [{{name: ENDPOINT, value: \"{endpoint}\"}}]
  trainer:
    numNodes: 2
    numProcPerNode: 1
    command: [torchrun, /fixtures/workspace_digest.py]
    env: [{{name: PYTHONPATH, value: /opt/torch}}]
{patch}"
    );
    let (ok, out) = kubectl_stdin(&["apply", "-f", "-"], &job);
    assert!(ok, "{out}");
    assert_eq!(finished("init", Duration::from_secs(300)), "Complete", "{}", diagnose("init"));

    let dataset = tree(&root.path().join("datasets/tatsu/alpaca-mini"));
    let model = tree(&root.path().join("models/meta/llama-mini"));
    let logs = all_logs("init");
    let seen: Vec<serde_json::Value> = logs
        .lines()
        .filter_map(|l| l.split("WORKSPACE ").nth(1))
        .map(|j| serde_json::from_str(j).expect("json"))
        .collect();
    assert_eq!(seen.len(), 2, "one line per rank:\n{logs}");
    for s in &seen {
        assert_eq!(s["world"], 2, "{s}");
        let got: BTreeMap<String, String> = serde_json::from_value(s["dataset"].clone()).expect("map");
        assert_eq!(got, dataset, "the dataset, byte for byte");
        let got: BTreeMap<String, String> = serde_json::from_value(s["model"].clone()).expect("map");
        for f in
            ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "tokenizer.model"]
        {
            assert_eq!(got.get(f), model.get(f), "{f} in {got:?}");
        }
        for f in ["pytorch_model.bin", "flax_model.msgpack"] {
            assert!(!got.contains_key(f), "{f} is left out, as by Trainer's initializer: {got:?}");
        }
    }
    let (ok, out) = kubectl(&["delete", "pv", &pv_name, "--wait=false"]);
    assert!(ok, "{out}");
}

fn uids(job: &str) -> BTreeMap<String, String> {
    pods_of(job).into_iter().map(|(i, p)| (i, p["metadata"]["uid"].as_str().unwrap_or_default().to_string())).collect()
}

/// The two runtimes the other tests leave: runtimes/deepspeed-distributed.yaml
/// (ZeRO stage 1 on CPU, DeepSpeed building its shared-memory op with the
/// image's g++ on first use, no launcher, no SSH) completes on 2 pods x 2
/// workers; runtimes/trainlet-dev.yaml's warm pods, reached through the pod
/// that examples/trainlet-dev.yaml's Service selects, run two submissions
/// of new code with the token from their Secret, without new pods, and end
/// the TrainJob Complete at their idle timeout.
#[test]
fn deepspeed_trains_and_warm_dev_pods_take_new_code_on_real_nodes() {
    let _up = up("ds-dev", Take::Beside);
    for runtime in ["deepspeed-distributed", "trainlet-dev"] {
        let file = repo().join(format!("runtimes/{runtime}.yaml"));
        let (ok, out) = apply_file(&file);
        assert!(ok, "{out}");
    }
    // The first step compiles DeepSpeed's op with g++ (two objects at once)
    // while the other cluster tests and the rest of the suite share the 2
    // CPUs. Both pods (both nodes are this machine) build into one
    // directory, as pods sharing a node's cache would, so it is compiled
    // once, not once per pod: each build took 90 s of CPU, and the four
    // compilers at 17% of a CPU each under the suite's load kept the job
    // past 600 s (seen in CI and here). torch 2.15 locks the build with
    // fcntl (filelock), which holds across containers on one file system.
    // A pod's agent also missed its 10 s heartbeat deadline while the
    // compiler ran (seen: 4 rounds of false deaths): heartbeats are not
    // what this test is about.
    let extensions = tempfile::tempdir().expect("tmp");
    let ds = job_on(
        "trainlet-deepspeed-distributed",
        "ds",
        "[torchrun, /fixtures/ds_train.py]",
        &[("DS_ACCELERATOR", "cpu"), ("TRAINLET_HEARTBEAT_TIMEOUT", "120"), ("TORCH_EXTENSIONS_DIR", "/extensions")],
        &[("extensions", extensions.path(), "/extensions", false)],
    );
    let (ok, out) = kubectl_stdin(&["apply", "-f", "-"], &ds);
    assert!(ok, "{out}");
    // 20 minutes: the compiler ran at 12-17% of a CPU beside the suite
    // here (38 s of CPU in 5 minutes), and needs about 90 s.
    let state = finished("ds", Duration::from_secs(1200));
    let logs = all_logs("ds");
    assert_eq!(state, "Complete", "{}", diagnose("ds"));
    let seen: Vec<&str> = logs.lines().filter(|l| l.contains("DEEPSPEED rank=")).collect();
    assert_eq!(seen.len(), 4, "{logs}");
    for l in &seen {
        for fact in ["world=4", "zero_stage=1", "identical=True", "learned=True"] {
            assert!(l.contains(fact), "{fact}: {l}");
        }
    }
    assert!(logs.contains("deepspeed_shm_comm_op built successfully"), "the op was compiled in the pods:\n{logs}");

    // Warm pods: the example's Service (its selector names the JobSet
    // `dev`), the test's token, and the TrainJob.
    let token = "cluster-test-token-0123456789abcdef";
    let dir = tempfile::tempdir().expect("tmp");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, token).expect("token");
    let example = std::fs::read_to_string(repo().join("examples/trainlet-dev.yaml")).expect("example");
    let service = example.split("\n---\n").find(|d| d.contains("kind: Service")).expect("a Service in the example");
    let (ok, out) = kubectl_stdin(&["apply", "-f", "-"], service);
    assert!(ok, "{out}");
    let (ok, out) =
        kubectl(&["create", "secret", "generic", "trainlet-control", &format!("--from-literal=token={token}")]);
    assert!(ok, "{out}");
    let dev = job_on("trainlet-dev", "dev", "[trainlet, run, --serve]", &[("TRAINLET_SERVE_IDLE_TIMEOUT", "20")], &[]);
    let (ok, out) = kubectl_stdin(&["apply", "-f", "-"], &dev);
    assert!(ok, "{out}");
    let ip = wait_for("dev", "the Service's one endpoint, ready", Duration::from_secs(300), || {
        let slices = get_json(&["endpointslices", "-l", "kubernetes.io/service-name=trainlet-dev-control"]);
        let ready: Vec<String> = slices["items"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|s| s["endpoints"].as_array().cloned().unwrap_or_default())
            .filter(|e| e["conditions"]["ready"] == true)
            .filter_map(|e| e["addresses"][0].as_str().map(str::to_string))
            .collect();
        (ready.len() == 1).then(|| ready[0].clone())
    });
    let pods = pods_of("dev");
    assert_eq!(pods["0"]["status"]["podIP"].as_str(), Some(ip.as_str()), "the Service selects node rank 0");
    let before = uids("dev");
    wait_for("dev", "pod 0's control API", Duration::from_secs(120), || {
        logs_of(&pods["0"]).contains("control API listening").then_some(())
    });
    let out = Command::new(crate::util::python())
        .arg(repo().join("tests/fixtures/serve_driver.py"))
        .arg(format!("http://{ip}:29400"))
        .arg(&token_file)
        .arg(repo().join("tests/fixtures/serve_train.py"))
        .args(["v1", "v2:tar"])
        .output()
        .expect("driver");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}\n{}", String::from_utf8_lossy(&out.stderr), diagnose("dev"));
    let steps: Vec<serde_json::Value> = stdout.lines().map(|l| serde_json::from_str(l).expect("json")).collect();
    assert_eq!(steps.len(), 2, "{stdout}");
    for (step, version) in steps.iter().zip(["v1", "v2"]) {
        assert_eq!(step["state"], "succeeded", "{step}");
        let results = crate::serve::results(step["lines"].as_array().expect("lines"));
        assert_eq!(results.len(), 4, "every rank's line came back: {step}");
        let params: std::collections::BTreeSet<&str> = results.values().map(|kv| kv["params"].as_str()).collect();
        assert_eq!(params.len(), 1, "{results:?}");
        for kv in results.values() {
            assert_eq!((kv["version"].as_str(), kv["world"].as_str()), (version, "4"), "{kv:?}");
            assert_eq!(kv["preloaded"], "True", "forked from the pod's torch zygote: {kv:?}");
        }
    }
    assert_eq!(uids("dev"), before, "the same pods ran both submissions");
    assert_eq!(finished("dev", Duration::from_secs(120)), "Complete", "the idle timeout ends the TrainJob");
    assert_eq!(uids("dev"), before);
}
