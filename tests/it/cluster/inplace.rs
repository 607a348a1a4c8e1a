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
    let (ok, out) = apply_file(&file);
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
    let _up = up("inplace", Take::Beside);
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

/// The host's pid of PID 1 of `pod`'s container: the process that is 1 in
/// its own PID namespace and whose environment names the pod (runtimes
/// that give POD_NAME) or whose cgroup is the pod's (the kubelet's cgroupfs
/// driver puts each pod's containers under `pod<uid>`).
pub(super) fn host_pid_of_pid1(pod: &str) -> i32 {
    let want = format!("POD_NAME={pod}");
    let uid = get_json(&["pod", pod])["metadata"]["uid"].as_str().unwrap_or_default().to_string();
    let cgroup = format!("/pod{uid}/");
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|p| p.parse::<i32>().ok()) else { continue };
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else { continue };
        let named = env.split(|b| *b == 0).any(|kv| kv == want.as_bytes());
        // (The pod's sandbox, the pause process, is PID 1 of its own
        // namespace in the same cgroup.)
        let ours = !uid.is_empty()
            && std::fs::read_to_string(format!("/proc/{pid}/cgroup")).is_ok_and(|c| c.contains(&cgroup))
            && std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() != "pause");
        if !named && !ours {
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
    let _up = up("asked", Take::Alone);
    let marks = tempfile::tempdir().expect("tmp");
    std::fs::set_permissions(marks.path(), std::os::unix::fs::PermissionsExt::from_mode(0o777)).expect("chmod");
    start_job(
        "asked",
        "[torchrun, /fixtures/await_signal.py]",
        // Only the JobSet may end the healthy pod's round: trainlet's own
        // notice of the dead pod comes too late, its closed connection
        // (the lost grace) as its silence (the heartbeat timeout).
        &[("MARK_DIR", "/marks"), ("TRAINLET_HEARTBEAT_TIMEOUT", "300"), ("TRAINLET_LOST_GRACE", "300")],
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
    let _up = up("disabled", Take::Beside);
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

/// A JobSet of two pods that no node takes (they stay Pending): the
/// in-place protocol needs only the pods' annotations, so trainlet can be
/// one pod's agent from this machine (`rotated_token`).
const PENDING_JOBSET: &str = r#"
apiVersion: jobset.x-k8s.io/v1alpha2
kind: JobSet
metadata: {name: rotated}
spec:
  failurePolicy: {maxRestarts: 3, restartStrategy: InPlaceRestart}
  replicatedJobs:
    - name: node
      replicas: 1
      template:
        spec:
          parallelism: 2
          completions: 2
          backoffLimit: 2147483647
          podReplacementPolicy: Failed
          template:
            spec:
              restartPolicy: Never
              serviceAccountName: trainlet-in-place-restart
              nodeSelector: {trainlet.dev/nowhere: "true"}
              containers: [{name: node, image: trainlet-nowhere}]
"#;

/// A token of the runtime's service account bound to `pod` (as the
/// kubelet's projected token is).
fn token_for(pod: &serde_json::Value) -> String {
    let name = pod["metadata"]["name"].as_str().expect("name");
    let uid = pod["metadata"]["uid"].as_str().expect("uid");
    let (ok, out) = kubectl(&[
        "create",
        "token",
        "trainlet-in-place-restart",
        "--bound-object-kind",
        "Pod",
        "--bound-object-name",
        name,
        "--bound-object-uid",
        uid,
        "--duration",
        "1h",
    ]);
    assert!(ok, "{out}");
    out.trim().to_string()
}

/// The HTTP status the API server gives `token` (401: not a valid token).
fn status_with(token: &str) -> String {
    let (port, ca) = api_server();
    let out = Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "--cacert"])
        .arg(&ca)
        .args(["-H", &format!("Authorization: Bearer {token}")])
        .arg(format!("https://127.0.0.1:{port}/api"))
        .output()
        .expect("curl");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Write `token` into `dir` as the kubelet's atomic writer does: a new
/// timestamped directory, then the `..data` link swapped by a rename, so
/// `token` (a link through `..data`) changes in one step.
fn project_token(dir: &Path, token: &str, namespace: &str, generation: u32) {
    let data = format!("..gen_{generation}");
    std::fs::create_dir(dir.join(&data)).expect("mkdir");
    std::fs::write(dir.join(&data).join("token"), token).expect("token");
    std::fs::copy(api_server().1, dir.join(&data).join("ca.crt")).expect("ca");
    std::fs::write(dir.join(&data).join("namespace"), namespace).expect("namespace");
    std::os::unix::fs::symlink(&data, dir.join("..data_tmp")).expect("link");
    std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).expect("swap");
    for file in ["token", "ca.crt", "namespace"] {
        if std::fs::symlink_metadata(dir.join(file)).is_err() {
            std::os::unix::fs::symlink(format!("..data/{file}"), dir.join(file)).expect("link");
        }
    }
}

/// The service account token rotates under a live watch, and the old one
/// stops working: the watch, broken by an API server restart during which
/// etcd's history is compacted, gets 410 Gone on resume, lists again and
/// comes back with the new token (kube's in-cluster client re-reads the
/// file once a minute); the JobSet's next attempt still reaches trainlet.
///
/// trainlet runs on this machine as the agent of a Pending pod (no node
/// takes the JobSet's pods), in a mount namespace of its own whose
/// `/var/run/secrets/kubernetes.io/serviceaccount` is a directory this test
/// writes as the kubelet's atomic writer does. The test plays the kubelet's
/// part of a rotation (the kubelet renews a projected token at 80% of its
/// lifetime, at the earliest after 8 minutes) and the other pod's agent
/// (it writes that pod's annotation); everything else is the real API
/// server, the real JobSet controller and the runtime's ServiceAccount,
/// Role and admission policy. The old token is revoked by replacing the
/// ServiceAccount (a new UID), which the API server checks on every request.
#[test]
fn a_token_rotated_under_a_live_watch_is_used_when_it_comes_back_from_a_410() {
    let up = up("rotated", Take::Alone);
    let file = repo().join("runtimes/torch-distributed-inplace.yaml");
    let (ok, out) = apply_file(&file);
    assert!(ok, "{out}");
    let (ok, out) = kubectl_stdin(&["apply", "-f", "-"], PENDING_JOBSET);
    assert!(ok, "{out}");
    let pods = wait_for("rotated", "the JobSet's two pods", Duration::from_secs(120), || {
        let pods = pods_of("rotated");
        (pods.len() == 2).then_some(pods)
    });
    let (mine, other) = (&pods["0"], pods["1"]["metadata"]["name"].as_str().expect("name"));
    let old = token_for(mine);
    assert_eq!(status_with(&old), "200");
    let sa = tempfile::tempdir().expect("tmp");
    project_token(sa.path(), &old, &up.namespace, 1);
    let home = tempfile::tempdir().expect("tmp");
    let script = format!(
        "set -e; mount -t tmpfs trainlet-run /run; mkdir -p /run/secrets/kubernetes.io/serviceaccount; \
         mount --bind '{}' /run/secrets/kubernetes.io/serviceaccount; \
         exec '{}' run --in-place-restart --no-python --nproc-per-node 1 /bin/sleep 900",
        sa.path().display(),
        crate::util::bin().display()
    );
    let port = api_server().0.to_string();
    let mut agent = crate::util::Pod::start_as(
        Path::new("unshare"),
        &["--mount", "--propagation", "private", "sh", "-c", &script],
        &[
            ("HOME", home.path().to_str().expect("home")),
            ("KUBERNETES_SERVICE_HOST", "127.0.0.1"),
            ("KUBERNETES_SERVICE_PORT", &port),
            ("JOBSET_NAME", "rotated"),
            ("POD_NAME", mine["metadata"]["name"].as_str().expect("name")),
            ("TRAINLET_LOG", "info,kube=warn"),
        ],
    );
    agent.wait_for_stderr("wrote this pod's attempt", Duration::from_secs(120));
    let (ok, out) = kubectl(&["annotate", "pod", other, "jobset.sigs.k8s.io/in-place-restart-attempt=0"]);
    assert!(ok, "{out}");
    agent.wait_for_stderr("the barrier is down", Duration::from_secs(120));

    // The rotation: the account replaced (the old token is refused from now
    // on), a new token for it in the file.
    let (ok, out) = kubectl(&["delete", "serviceaccount", "trainlet-in-place-restart"]);
    assert!(ok, "{out}");
    let (ok, out) = apply_file(&file);
    assert!(ok, "{out}");
    let new = token_for(mine);
    wait_for("rotated", "the old token refused", Duration::from_secs(60), || {
        (status_with(&old) == "401").then_some(())
    });
    assert_eq!(status_with(&new), "200");
    project_token(sa.path(), &new, &up.namespace, 2);

    // The watch breaks and must come back with the new token; etcd's
    // history is compacted meanwhile, so resuming from the last resource
    // version seen gets 410 Gone and the watch lists again.
    let (ok, out) = cluster(&["restart-apiserver", "--compact"]);
    assert!(ok, "{out}");
    let (ok, out) = kubectl(&["annotate", "jobset", "rotated", "trainlet.dev/touched=1"]);
    assert!(ok, "{out}");
    let until = Instant::now() + Duration::from_secs(180);
    loop {
        let log = agent.stderr();
        if log.rfind("the JobSet's watch is back") > log.rfind("the JobSet's watch failed") {
            break;
        }
        assert!(Instant::now() < until, "the watch is not back within 180 s (with the new token):\n{log}");
        std::thread::sleep(Duration::from_millis(500));
    }

    let seen = agent.stderr();
    let failures: Vec<&str> = seen.lines().filter(|l| l.contains("the JobSet's watch failed")).collect();
    eprintln!("the watch failed {} times before it came back; the last: {:?}", failures.len(), failures.last());
    assert!(
        failures.iter().any(|l| l.contains("too old resource version") || l.contains("Expired")),
        "no 410 on resume after the compaction: {failures:#?}"
    );

    // The JobSet's next attempt reaches trainlet through that watch.
    let (ok, out) =
        kubectl(&["annotate", "--overwrite", "pod", other, "jobset.sigs.k8s.io/in-place-restart-attempt=1"]);
    assert!(ok, "{out}");
    let code = agent.code(Duration::from_secs(120));
    let log = agent.stderr();
    assert_eq!(code, 1, "the in-place restart code:\n{log}");
    assert!(log.contains("the JobSet restarts its pods in place"), "{log}");
    let js = get_json(&["jobset", "rotated"]);
    assert_eq!(js["status"]["previousInPlaceRestartAttempt"], serde_json::json!(0), "{}", js["status"]);
}
