//! JobSet's in-place restarts on the real cluster (issue 28), with
//! trainlet as each pod's agent: `runtimes/torch-distributed-inplace.yaml`
//! unchanged (its ServiceAccount, Role and admission policy too), the real
//! JobSet controller with its `InPlaceRestart` gate, and the kubelets'
//! `RestartAllContainers` rule. The pods reach the API server as in-cluster
//! clients (the `kubernetes` Service's address, forwarded to the API server
//! by tests/cluster.sh).

use super::*;

/// SIGKILL one worker (a child of PID 1 running `script`) inside `pod`.
fn kill_a_worker(pod: &str, script: &str) -> String {
    let code = format!(
        "import os, signal\n\
         for p in sorted(os.listdir('/proc'), key=lambda s: (not s.isdigit(), s)):\n    \
             if not p.isdigit() or p == '1':\n        continue\n    \
             try:\n        cmd = open('/proc/%s/cmdline' % p).read()\n        ppid = open('/proc/%s/status' % p).read().split('PPid:')[1].split()[0]\n    \
             except (OSError, IndexError):\n        continue\n    \
             if '{script}' in cmd and ppid == '1':\n        os.kill(int(p), signal.SIGKILL)\n        print('killed', p)\n        break\n"
    );
    let (ok, out) = kubectl(&["exec", pod, "--", "python3", "-c", &code]);
    assert!(ok && out.contains("killed"), "no worker to kill in {pod}: {out}");
    out
}

/// The runtime (with its ServiceAccount, Role and admission policy) and a
/// TrainJob `name` of it on 2 pods x 2 workers: `job_on`'s arguments.
fn start_job(name: &str, command: &str, env: &[(&str, &str)], mounts: &[(&str, &Path, &str, bool)]) {
    let file = repo().join("runtimes/torch-distributed-inplace.yaml");
    let (ok, out) = kubectl(&["apply", "-f", file.to_str().expect("path")]);
    assert!(ok, "{out}");
    let job = job_on("trainlet-torch-distributed-inplace", name, command, env, mounts);
    let (ok, out) = kubectl_stdin(&["apply", "-f", "-"], &job);
    assert!(ok, "{out}");
}

fn attempt_of(pod: &serde_json::Value) -> Option<String> {
    pod["metadata"]["annotations"]["jobset.sigs.k8s.io/in-place-restart-attempt"].as_str().map(str::to_string)
}

fn restarts_of(pod: &serde_json::Value) -> i64 {
    pod["status"]["containerStatuses"][0]["restartCount"].as_i64().unwrap_or(-1)
}

/// A worker killed on one pod (trainlet's own budget is 0): every trainlet
/// exits, the kubelet restarts each pod's container in place, each new
/// trainlet writes attempt 1 and waits at the barrier until the JobSet's
/// current attempt is 1, then they rendezvous again and the job resumes
/// from its checkpoint to the parameters of an uninterrupted run. Same pods
/// (UIDs), no JobSet restart.
#[test]
fn a_killed_worker_restarts_every_pod_in_place_through_jobsets_protocol() {
    let _up = up("2");
    let ckpt = tempfile::tempdir().expect("tmp");
    std::fs::set_permissions(ckpt.path(), std::os::unix::fs::PermissionsExt::from_mode(0o777)).expect("chmod");
    start_job(
        "ip",
        "[torchrun, /fixtures/ckpt_train.py]",
        &[("CKPT_DIR", "/ckpt"), ("STEPS", "80"), ("STEP_SLEEP", "0.25")],
        &[("ckpt", ckpt.path(), "/ckpt", false)],
    );

    // Attempt 0: both pods wrote it, the JobSet made it current, the barrier lifted.
    wait_for("ip", "a checkpoint after both pods passed the barrier", Duration::from_secs(300), || {
        ckpt.path().join("ckpt.json").exists().then_some(())
    });
    let before = pods_of("ip");
    assert_eq!(before.len(), 2);
    for pod in before.values() {
        assert_eq!(attempt_of(pod).as_deref(), Some("0"), "{pod}");
        let log = logs_of(pod);
        assert!(log.contains("the barrier is down lifted=Attempt(0)"), "{log}");
        let (past, joined) = (log.find("past the JobSet's barrier"), log.find("joined the rendezvous"));
        assert!(past.zip(joined).is_some_and(|(p, j)| p < j), "the barrier comes before the rendezvous: {log}");
    }
    let uids_before = uids("ip");
    let victim = before["1"]["metadata"]["name"].as_str().expect("name").to_string();
    kill_a_worker(&victim, "ckpt_train.py");

    assert_eq!(finished("ip", Duration::from_secs(300)), "Complete", "{}", diagnose("ip"));
    assert_eq!(uids("ip"), uids_before, "no pod was recreated");
    let js = get_json(&["jobset", "ip"]);
    assert_eq!(js["status"]["currentInPlaceRestartAttempt"], 1, "{}", js["status"]);
    assert_eq!(js["status"]["restarts"], 0, "no JobSet restart: {}", js["status"]);
    let logs = all_logs("ip");
    for pod in pods_of("ip").values() {
        assert_eq!(restarts_of(pod), 1, "the kubelet restarted the container once: {}", pod["status"]);
        assert_eq!(attempt_of(pod).as_deref(), Some("1"), "{}", pod["metadata"]);
        let log = logs_of(pod);
        assert!(log.contains("wrote this pod's attempt; waiting until the JobSet's current attempt is 1"), "{log}");
        assert!(log.contains("the barrier is down lifted=Attempt(1)"), "{log}");
    }
    let (digest, world) = crate::fault::final_of(&logs);
    assert_eq!(
        (digest.as_str(), world.as_str()),
        (crate::fault::reference_of("80").as_str(), "world=4"),
        "resumed from its checkpoint to the uninterrupted run's parameters:\n{logs}"
    );
}

/// The host's pid of PID 1 of `pod`'s container: the process whose
/// environment names the pod and that is 1 in its own PID namespace.
fn host_pid_of_pid1(pod: &str) -> i32 {
    let want = format!("POD_NAME={pod}");
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|p| p.parse::<i32>().ok()) else { continue };
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else { continue };
        if !env.split(|b| *b == 0).any(|kv| kv == want.as_bytes()) {
            continue;
        }
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let nspid = status.lines().find_map(|l| l.strip_prefix("NSpid:")).unwrap_or_default();
        if nspid.split_whitespace().last() == Some("1") {
            return pid;
        }
    }
    panic!("no PID 1 of pod {pod} on this machine");
}

/// The JobSet asks: one pod's trainlet dies (SIGKILL from the node, which
/// trainlet's own verdict never sees), its container restarts in place and
/// writes attempt 1, the JobSet raises its previous attempt to 0, and the
/// other pod's trainlet, whose watch began before the API server was
/// restarted, stops its workers with the runtime's checkpoint signal and
/// exits 1; its container restarts too, and attempt 1 runs to the end.
#[test]
fn the_jobset_restarts_a_healthy_pod_in_place_through_a_watch_that_outlived_the_api_server() {
    let _up = up("2");
    let marks = tempfile::tempdir().expect("tmp");
    std::fs::set_permissions(marks.path(), std::os::unix::fs::PermissionsExt::from_mode(0o777)).expect("chmod");
    start_job(
        "asked",
        "[torchrun, /fixtures/await_signal.py]",
        // Only the JobSet may end the healthy pod's round: trainlet's own
        // notice of the dead pod (its heartbeat timeout) comes too late.
        &[("MARK_DIR", "/marks"), ("TRAINLET_HEARTBEAT_TIMEOUT", "300")],
        &[("marks", marks.path(), "/marks", false)],
    );
    let pods = pods_until_ready("asked");
    wait_for("asked", "every worker READY", Duration::from_secs(120), || {
        (all_logs("asked").matches("READY rank=").count() == 4).then_some(())
    });
    let uids_before = uids("asked");

    let (ok, out) = cluster(&["restart-apiserver"]);
    assert!(ok, "{out}");
    // A change of the JobSet after the restart: the healthy pod's watch,
    // which lost the API server, sees it (a watch resumed without a 410
    // says nothing until then).
    let (ok, out) = kubectl(&["annotate", "jobset", "asked", "trainlet.dev/touched=1"]);
    assert!(ok, "{out}");
    wait_for("asked", "pod 0's watch back after the API server's restart", Duration::from_secs(120), || {
        let log = logs_of(&pods["0"]);
        let failed = log.rfind("the JobSet's watch failed")?;
        (log.rfind("the JobSet's watch is back")? > failed).then_some(())
    });
    let healthy = Followed::start(pods["0"]["metadata"]["name"].as_str().expect("name"));
    let victim = pods["1"]["metadata"]["name"].as_str().expect("name").to_string();
    let pid = host_pid_of_pid1(&victim);
    let killed = Command::new("kill").args(["-KILL", &pid.to_string()]).status().expect("kill");
    assert!(killed.success());

    // The healthy pod's first container, to its end: asked by the JobSet,
    // trainlet stopped the workers as on SIGTERM and exited 1.
    let first = healthy.end(Duration::from_secs(120));
    assert!(first.contains("in-place restarts: the JobSet restarts its pods in place"), "{first}");
    assert!(first.contains("stopping workers signal=SIGTERM checkpoint=\"SIGUSR1\""), "{first}");
    assert_eq!(finished("asked", Duration::from_secs(300)), "Complete", "{}", diagnose("asked"));
    assert_eq!(uids("asked"), uids_before, "no pod was recreated");
    let js = get_json(&["jobset", "asked"]);
    assert_eq!(
        (&js["status"]["previousInPlaceRestartAttempt"], &js["status"]["currentInPlaceRestartAttempt"]),
        (&serde_json::json!(0), &serde_json::json!(1)),
        "{}",
        js["status"]
    );
    for pod in pods_of("asked").values() {
        assert_eq!(restarts_of(pod), 1, "{}", pod["status"]);
        assert_eq!(attempt_of(pod).as_deref(), Some("1"));
    }
    // Node rank 0's workers were stopped with the checkpoint signal when the
    // JobSet asked; node rank 1's died with their trainlet.
    let signals = std::fs::read_to_string(marks.path().join("signals")).expect("signals");
    let mut lines: Vec<&str> = signals.lines().collect();
    lines.sort_unstable();
    assert_eq!(lines, ["rank=0 signal=SIGUSR1", "rank=1 signal=SIGUSR1"], "{}", diagnose("asked"));
    assert_eq!(all_logs("asked").matches("DONE rank=").count(), 4, "{}", diagnose("asked"));
}

/// The job's pods, once both run.
fn pods_until_ready(job: &str) -> BTreeMap<String, serde_json::Value> {
    wait_for(job, "both pods running", Duration::from_secs(300), || {
        let pods = pods_of(job);
        (pods.len() == 2 && pods.values().all(|p| p["status"]["phase"] == "Running")).then_some(pods)
    })
}

/// The JobSet's `disable-in-place-restart` annotation: the barrier lifts
/// at once, so the restarted containers do not wait for each other. A
/// worker killed (trainlet's own budget 0) ends every trainlet; the kubelet
/// restarts each container once. The non-host pod's new trainlet may reach
/// the previous store host while it still lingers on the failed job: it
/// waits for that store to close and joins the new one instead of failing
/// again (which spent the JobSet's `maxRestarts` in a crash loop). The job
/// resumes from its checkpoint to the uninterrupted run's parameters.
#[test]
fn with_in_place_restarts_disabled_the_uncoordinated_restart_rejoins_the_new_store_not_the_old() {
    let _up = up("2");
    let ckpt = tempfile::tempdir().expect("tmp");
    std::fs::set_permissions(ckpt.path(), std::os::unix::fs::PermissionsExt::from_mode(0o777)).expect("chmod");
    start_job(
        "dis",
        "[torchrun, /fixtures/ckpt_train.py]",
        &[("CKPT_DIR", "/ckpt"), ("STEPS", "80"), ("STEP_SLEEP", "0.25")],
        &[("ckpt", ckpt.path(), "/ckpt", false)],
    );
    wait_for("dis", "a checkpoint", Duration::from_secs(300), || ckpt.path().join("ckpt.json").exists().then_some(()));
    let (ok, out) = kubectl(&["annotate", "jobset", "dis", "jobset.sigs.k8s.io/disable-in-place-restart=true"]);
    assert!(ok, "{out}");
    let before = pods_of("dis");
    let uids_before = uids("dis");
    // Pod 1 is not the store host: its new trainlet is the one that may
    // find the old host still up.
    let victim = before["1"]["metadata"]["name"].as_str().expect("name").to_string();
    // The agents see the annotation before the kill (their watch is live).
    std::thread::sleep(Duration::from_secs(2));
    kill_a_worker(&victim, "ckpt_train.py");

    assert_eq!(finished("dis", Duration::from_secs(300)), "Complete", "{}", diagnose("dis"));
    assert_eq!(uids("dis"), uids_before, "no pod was recreated");
    for pod in pods_of("dis").values() {
        assert_eq!(restarts_of(pod), 1, "one restart, no crash loop: {}\n{}", pod["status"], diagnose("dis"));
        let log = logs_of(pod);
        assert!(log.contains("the barrier is down lifted=Disabled"), "{log}");
    }
    let logs = all_logs("dis");
    // Whether this run hit the race (it is timing: the old host may be gone already).
    eprintln!("a restarted pod found the previous store: {}", logs.contains("the store still holds the job"));
    let (digest, world) = crate::fault::final_of(&logs);
    assert_eq!(
        (digest.as_str(), world.as_str()),
        (crate::fault::reference_of("80").as_str(), "world=4"),
        "resumed from its checkpoint to the uninterrupted run's parameters:\n{logs}"
    );
}
