//! The manifests in runtimes/ against the real Trainer and JobSet CRD
//! schemas (tests/fixtures/crds, copies of upstream's; see its README), and
//! the failure policy file they mount.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use crate::util::{Pod, python, repo};

fn crds() -> PathBuf {
    let dir = repo().join("tests/fixtures/crds");
    assert!(dir.is_dir(), "the CRD schemas are expected at {}", dir.display());
    dir
}

fn validate(files: &[PathBuf]) -> (bool, String) {
    let out = Command::new(python())
        .arg(repo().join("tests/validate_manifests.py"))
        .arg(crds())
        .args(files)
        .output()
        .expect("python");
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn runtimes_are_valid_cluster_training_runtimes() {
    let file = repo().join("runtimes/torch-distributed.yaml");
    let (ok, out) = validate(std::slice::from_ref(&file));
    assert!(ok, "{out}");
    assert!(out.contains("ClusterTrainingRuntime trainlet-torch-distributed valid"), "{out}");
    // The exit codes the runtime routes are trainlet's documented ones.
    let text = std::fs::read_to_string(&file).expect("read");
    assert!(text.contains("values: [200, 205, 208]") && text.contains("values: [143, 204]"), "{text}");
}

/// The spares variant: valid; numNodes counts the spare, the pods get
/// TRAINLET_SPARES, and an unhealthy pod's 207 replaces the pod without
/// counting against the Job (a spare takes its place). Every container of
/// every runtime falls back to its log's tail for its termination message.
#[test]
fn the_spares_runtime_is_valid_and_every_container_reports_its_reason() {
    let file = repo().join("runtimes/torch-distributed-spares.yaml");
    let (ok, out) = validate(std::slice::from_ref(&file));
    assert!(ok, "{out}");
    assert!(out.contains("ClusterTrainingRuntime trainlet-torch-distributed-spares valid"), "{out}");
    let text = std::fs::read_to_string(&file).expect("read");
    assert!(text.contains("numNodes: 3") && text.contains("values: [143, 204, 207]"), "{text}");
    assert!(text.contains("- name: TRAINLET_SPARES\n                          value: \"1\""), "{text}");
    assert!(!text.contains("values: [200, 205, 207"), "207 must not fail the job: {text}");
    assert!(text.contains("succeededIndexes: \"0\""), "a late replacement must not hold the Job open: {text}");
    for entry in std::fs::read_dir(repo().join("runtimes")).expect("runtimes") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let text = std::fs::read_to_string(&path).expect("read");
            let images = text.lines().filter(|l| l.trim_start().starts_with("image: ")).count();
            let policies =
                text.lines().filter(|l| l.trim() == "terminationMessagePolicy: FallbackToLogsOnError").count();
            assert_eq!(images, policies, "{}: a container without terminationMessagePolicy", path.display());
        }
    }
}

/// The restricted variant: valid, non-root, read-only root, /tmp writable.
#[test]
fn the_restricted_runtime_is_valid_non_root_and_read_only() {
    let file = repo().join("runtimes/torch-distributed-restricted.yaml");
    let (ok, out) = validate(std::slice::from_ref(&file));
    assert!(ok, "{out}");
    assert!(out.contains("ClusterTrainingRuntime trainlet-torch-distributed-restricted valid"), "{out}");
    let text = std::fs::read_to_string(&file).expect("read");
    for needle in ["runAsNonRoot: true", "runAsUser: 1000", "readOnlyRootFilesystem: true", "mountPath: /tmp"] {
        assert!(text.contains(needle), "{needle}: {text}");
    }
}

#[test]
fn the_mpi_runtime_is_valid_and_runs_trainlet_on_both_ends() {
    let file = repo().join("runtimes/mpi-distributed.yaml");
    let (ok, out) = validate(std::slice::from_ref(&file));
    assert!(ok, "{out}");
    assert!(out.contains("ClusterTrainingRuntime trainlet-mpi-distributed valid"), "{out}");
    let text = std::fs::read_to_string(&file).expect("read");
    assert!(text.contains("- trainlet\n                        - sshd"), "node pods run trainlet sshd: {text}");
    assert!(text.contains("port: 2222") && !text.contains("/usr/sbin/sshd"), "{text}");
    assert!(text.contains("values: [200]"), "{text}");
}

/// JobSet in-place restarts: valid, with what JobSet's webhook requires,
/// the restart rules, the agent's downward-API env and its RBAC.
#[test]
fn the_in_place_runtime_is_valid_and_carries_the_agents_contract() {
    let file = repo().join("runtimes/torch-distributed-inplace.yaml");
    let (ok, out) = validate(std::slice::from_ref(&file));
    assert!(ok, "{out}");
    assert!(out.contains("ClusterTrainingRuntime trainlet-torch-distributed-inplace valid"), "{out}");
    let text = std::fs::read_to_string(&file).expect("read");
    for needed in [
        "restartStrategy: InPlaceRestart",
        "backoffLimit: 2147483647",
        "podReplacementPolicy: Failed",
        "action: RestartAllContainers",
        "values: [0, 143, 200, 205, 208]",
        "name: TRAINLET_IN_PLACE_RESTART",
        "fieldPath: metadata.annotations['jobset.sigs.k8s.io/jobset-name']",
        "fieldPath: metadata.name",
        "serviceAccountName: trainlet-in-place-restart",
        "verbs: [patch]",
        "verbs: [list, watch]",
        "kind: ValidatingAdmissionPolicyBinding",
    ] {
        assert!(text.contains(needed), "{needed} missing from {}", file.display());
    }
}

/// DeepSpeed without MPI: valid, one `node` job under the torch policy
/// (PET_* env), no launcher, no SSH, trainlet's exit codes routed.
#[test]
fn the_deepspeed_runtime_is_valid_and_needs_no_launcher_or_ssh() {
    let file = repo().join("runtimes/deepspeed-distributed.yaml");
    let (ok, out) = validate(std::slice::from_ref(&file));
    assert!(ok, "{out}");
    assert!(out.contains("ClusterTrainingRuntime trainlet-deepspeed-distributed valid"), "{out}");
    let text = std::fs::read_to_string(&file).expect("read");
    let doc: Vec<&str> = text.lines().filter(|l| !l.trim_start().starts_with('#')).collect();
    let doc = doc.join("\n");
    assert!(doc.contains("    torch: {}") && !doc.contains("mpi:"), "the torch policy, not MPI: {doc}");
    for absent in ["launcher", "sshd", "2222", "dependsOn", "sshAuthMountPath"] {
        assert!(!doc.contains(absent), "{absent} in {doc}");
    }
    assert!(doc.contains("values: [200, 205, 208]") && doc.contains("values: [143, 204]"), "{doc}");
}

/// MPI without SSH: valid, node pods only under the torch policy (PET_*
/// env), each running `trainlet run --framework mpi`; no launcher, no SSH
/// Secret or server, trainlet's exit codes routed.
#[test]
fn the_mpich_pmi_runtime_is_valid_and_needs_no_launcher_or_ssh() {
    let file = repo().join("runtimes/mpich-pmi.yaml");
    let (ok, out) = validate(std::slice::from_ref(&file));
    assert!(ok, "{out}");
    assert!(out.contains("ClusterTrainingRuntime trainlet-mpich-pmi valid"), "{out}");
    let text = std::fs::read_to_string(&file).expect("read");
    let doc: Vec<&str> = text.lines().filter(|l| !l.trim_start().starts_with('#')).collect();
    let doc = doc.join("\n");
    assert!(doc.contains("    torch: {}") && !doc.contains("mpi:"), "the torch policy, not Trainer's MPI: {doc}");
    assert!(doc.contains("- name: TRAINLET_FRAMEWORK\n                          value: mpi"), "{doc}");
    assert!(doc.contains("image: ghcr.io/trainlet/mpich-pmi-runtime:"), "{doc}");
    for absent in ["launcher", "sshd", "2222", "dependsOn", "sshAuthMountPath", "mpirun"] {
        assert!(!doc.contains(absent), "{absent} in {doc}");
    }
    assert!(doc.contains("values: [200, 205, 208]") && doc.contains("values: [143, 204]"), "{doc}");
}

/// JAX and XGBoost: Trainer's ML policies with trainlet as the agent.
#[test]
fn the_jax_and_xgboost_runtimes_are_valid_and_use_trainers_policies() {
    for (file, name, policy, image) in [
        ("jax-distributed.yaml", "trainlet-jax-distributed", "    jax: {}", "jax-runtime"),
        ("xgboost-distributed.yaml", "trainlet-xgboost-distributed", "    xgboost: {}", "xgboost-runtime"),
    ] {
        let path = repo().join("runtimes").join(file);
        let (ok, out) = validate(std::slice::from_ref(&path));
        assert!(ok, "{out}");
        assert!(out.contains(&format!("ClusterTrainingRuntime {name} valid")), "{out}");
        let text = std::fs::read_to_string(&path).expect("read");
        assert!(text.contains(policy) && !text.contains("    torch: {}"), "{file}: {text}");
        assert!(text.contains(&format!("image: ghcr.io/trainlet/{image}:")), "{file}");
        assert!(text.contains("values: [200, 205, 208]") && text.contains("values: [143, 204]"), "{file}");
    }
}

#[test]
fn the_initializer_runtime_wires_trainlet_init_as_trainer_expects() {
    let file = repo().join("runtimes/torch-with-initializers.yaml");
    let example = repo().join("examples/trainjob-with-initializers.yaml");
    let (ok, out) = validate(&[file.clone(), example]);
    assert!(ok, "{out}");
    assert!(out.contains("ClusterTrainingRuntime trainlet-torch-with-initializers valid"), "{out}");
    assert!(out.contains("TrainJob llama-finetune valid"), "{out}");
    // Each replicated job as JSON: name, container, command, mounts,
    // FailJob exit codes, dependsOn.
    let script = r#"
import json, sys, yaml
doc = next(d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d["kind"] == "ClusterTrainingRuntime")
out = []
for j in doc["spec"]["template"]["spec"]["replicatedJobs"]:
    spec = j["template"]["spec"]
    c = spec["template"]["spec"]["containers"][0]
    fail = [r["onExitCodes"]["values"] for r in spec.get("podFailurePolicy", {}).get("rules", [])
            if r["action"] == "FailJob" and "onExitCodes" in r]
    out.append({"name": j["name"], "container": c["name"], "command": c.get("command", []),
                "mounts": [[m["name"], m["mountPath"]] for m in c.get("volumeMounts", [])],
                "fail": fail[0] if fail else [],
                "depends": ["%s:%s" % (d["name"], d["status"]) for d in j.get("dependsOn", [])]})
print(json.dumps(out))
"#;
    let out = Command::new(python()).args(["-c", script]).arg(&file).output().expect("python");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let jobs: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).expect("json");
    let job =
        |name: &str| jobs.iter().find(|j| j["name"] == name).unwrap_or_else(|| panic!("{name} missing: {jobs:?}"));
    let mounted = |j: &serde_json::Value| {
        j["mounts"].as_array().is_some_and(|m| m.contains(&serde_json::json!(["initializer", "/workspace"])))
    };
    // Trainer finds the initializers by these names: a container of the same
    // name with a volumeMount named `initializer` (reference/kubeflow.md 4.1).
    for (name, kind) in [("dataset-initializer", "dataset"), ("model-initializer", "model")] {
        let j = job(name);
        assert_eq!(j["container"], name, "{j}");
        assert_eq!(j["command"], serde_json::json!(["trainlet", "init", kind]), "{j}");
        assert!(mounted(j), "{j}");
        assert_eq!(j["fail"], serde_json::json!([200, 221, 222, 224, 225]), "{j}");
    }
    let node = job("node");
    assert_eq!(node["depends"], serde_json::json!(["dataset-initializer:Complete", "model-initializer:Complete"]));
    assert!(mounted(node), "{node}");
    // The FailJob codes are the documented initializer codes.
    for code in [200, 221, 222, 224, 225] {
        assert!(u8::try_from(code).is_ok_and(|c| initializer_codes().contains(&c)), "{code}");
    }
}

/// The codes in initializers' exit module (the book's table is checked
/// against it in the init_remote tests).
fn initializer_codes() -> Vec<u8> {
    use initializers::exit::*;
    vec![SUCCESS, CONFIG, IO, NOT_FOUND, NO_FILES, CHECKSUM, NO_SPACE, DENIED, UNAVAILABLE]
}

#[test]
fn the_validator_rejects_a_broken_runtime_by_path() {
    let text = std::fs::read_to_string(repo().join("runtimes/torch-distributed.yaml")).expect("read");
    let broken = text.replace("backoffLimit: 4", "backoffLimit: four\n              bogusField: 1");
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("broken.yaml");
    std::fs::write(&path, broken).expect("write");
    let (ok, out) = validate(&[path]);
    assert!(!ok, "{out}");
    assert!(out.contains("replicatedJobs[0].template.spec.backoffLimit: expected integer"), "{out}");
    assert!(out.contains("unknown field bogusField"), "{out}");
}

#[test]
fn the_shipped_failure_policy_parses() {
    let mut pod = Pod::start(&["doctor", "--policy", "runtimes/failure-policy.toml"], &[]);
    assert_eq!(pod.code(Duration::from_secs(30)), 0, "{}", pod.stderr());
    let out = pod.stdout();
    assert!(out.contains("failure-policy.toml rule 1: 3=fail"), "{out}");
    assert!(out.contains("rule 2: 137,SIGSEGV,SIGBUS=restart"), "{out}");
}

/// Every image a runtime names is one that `images/` builds, under the
/// documented tag scheme `ghcr.io/trainlet/<Dockerfile name>:<crate version>`;
/// every Dockerfile takes its bases as build args with fully qualified
/// defaults (podman and buildah refuse short names) and offers the
/// prebuilt-binary path; the build context leaves out build outputs and
/// virtualenvs.
#[test]
fn every_runtime_names_an_image_the_repository_builds() {
    let version = env!("CARGO_PKG_VERSION");
    let mut named = Vec::new();
    for entry in std::fs::read_dir(repo().join("runtimes")).expect("runtimes") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("read");
        for image in text.lines().filter_map(|l| l.trim().strip_prefix("image: ")) {
            let rest = image.strip_prefix("ghcr.io/trainlet/").unwrap_or_else(|| panic!("{}: {image}", path.display()));
            let (name, tag) = rest.split_once(':').unwrap_or_else(|| panic!("{}: {image} has no tag", path.display()));
            assert_eq!(tag, version, "{}: {image}", path.display());
            assert!(
                repo().join(format!("images/{name}.Dockerfile")).is_file(),
                "{}: no images/{name}.Dockerfile",
                path.display()
            );
            named.push(name.to_string());
        }
    }
    assert!(named.iter().any(|n| n == "torch-runtime") && named.iter().any(|n| n == "mpi-runtime"), "{named:?}");
    for entry in std::fs::read_dir(repo().join("images")).expect("images") {
        let path = entry.expect("entry").path();
        let text = std::fs::read_to_string(&path).expect("read");
        let args: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("ARG ")).collect();
        for arg in &args {
            if let Some((_, default)) = arg.split_once('=').filter(|(k, _)| k.ends_with("_IMAGE")) {
                let registry = default.split('/').next().unwrap_or("");
                assert!(
                    registry.contains('.') && default.contains(':'),
                    "{}: {arg} is not fully qualified",
                    path.display()
                );
            }
        }
        assert!(args.iter().any(|a| a.starts_with("RUST_IMAGE=")), "{}", path.display());
        assert!(args.iter().any(|a| a.starts_with("TRAINLET_BINARY=")), "{}", path.display());
        for from in text.lines().filter_map(|l| l.strip_prefix("FROM ")) {
            let image = from.split_whitespace().next().unwrap_or("");
            assert!(image.starts_with("${") || image == "scratch", "{}: FROM {from}", path.display());
        }
    }
    let ignore = std::fs::read_to_string(repo().join(".dockerignore")).expect(".dockerignore");
    for left_out in ["target", ".venv", ".venv-*", ".git"] {
        assert!(ignore.lines().any(|l| l == left_out), ".dockerignore must leave out {left_out}");
    }
}

/// The JAX and XGBoost images, whose runtimes the Kubeflow SDK drives with
/// `bash -c "...; python "file.py""`: `python` and `python3` are links to
/// trainlet in the directory trainlet's `python` mode documents, first on
/// PATH, so the SDK's entry runs under trainlet (tests/it/frameworks.rs runs
/// the SDK's commands so).
#[test]
fn the_jax_and_xgboost_images_put_trainlets_python_link_first_on_path() {
    let dir = trainlet::cmd::python::LINK_DIR;
    for image in ["jax-runtime", "xgboost-runtime"] {
        let text = std::fs::read_to_string(repo().join(format!("images/{image}.Dockerfile"))).expect("read");
        for name in ["python", "python3"] {
            let link = format!("ln -sf /usr/local/bin/trainlet {dir}/{name}");
            assert!(text.contains(&link), "{image}: no `{link}`");
        }
        let path = text.lines().rev().find_map(|l| l.strip_prefix("ENV PATH=")).unwrap_or_default();
        assert!(path.starts_with(&format!("{dir}:")), "{image}: PATH={path} must start with {dir}");
    }
}

/// For every container of every shipped runtime: /tmp is an emptyDir
/// (trainlet and `import torch` need it writable under
/// readOnlyRootFilesystem); every trainer container (torch nodes, the MPI
/// launcher) runs `trainlet stop` as its preStop hook; the pod's
/// termination grace covers trainlet's grace period plus its kill timeout,
/// and the checkpoint time fits in the grace period; every exit code a
/// podFailurePolicy names is one the book's exit-code tables document.
#[test]
fn every_runtime_stops_gracefully_whatever_pid_1_is_and_routes_documented_codes() {
    let files: Vec<PathBuf> = std::fs::read_dir(repo().join("runtimes"))
        .expect("runtimes")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    let out = Command::new(python()).arg(repo().join("tests/runtime_facts.py")).args(&files).output().expect("python");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).expect("json");
    assert!(rows.len() >= 6, "{rows:?}");
    // The exit-code tables: trainlet's and the initializers'.
    let tables = crate::docs::chapter("exit-codes") + &crate::docs::chapter("initializers");
    let documented = |code: u64| {
        tables.lines().filter(|l| l.starts_with("| ")).any(|l| {
            let cell = l.split('|').nth(1).unwrap_or("").trim();
            cell == code.to_string()
                || cell.split(" / ").any(|c| c.trim() == code.to_string())
                || (code > 128 && cell == "128+N")
                || cell.split(", ").any(|r| {
                    r.split_once('-')
                        .and_then(|(a, b)| Some((a.parse::<u64>().ok()?, b.parse::<u64>().ok()?)))
                        .is_some_and(|(a, b)| (a..=b).contains(&code))
                })
        })
    };
    let secs = |row: &serde_json::Value, name: &str, default: u64| -> u64 {
        row["env"][name].as_str().map_or(default, |v| v.parse().expect("seconds"))
    };
    for row in &rows {
        let what = format!("{} {}/{}", row["file"], row["job"], row["container"]);
        assert!(row["tmp_volume"].as_bool().unwrap_or(false), "{what}: /tmp is not an emptyDir");
        let image = row["image"].as_str().unwrap_or("");
        let command: Vec<&str> =
            row["command"].as_array().expect("command").iter().filter_map(|c| c.as_str()).collect();
        let trainer = (["torch-runtime", "deepspeed-runtime", "jax-runtime", "xgboost-runtime"]
            .iter()
            .any(|i| image.contains(i))
            && !command.contains(&"init"))
            || (image.contains("mpi-runtime") && !command.contains(&"sshd"));
        if trainer {
            assert_eq!(row["pre_stop"], serde_json::json!(["trainlet", "stop"]), "{what}");
            let grace = secs(row, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 25);
            let kill = secs(row, "TRAINLET_KILL_TIMEOUT", 3);
            let ckpt = secs(row, "TRAINLET_CHECKPOINT_TIMEOUT", 0);
            let pod = row["grace"].as_u64().expect("grace");
            assert!(grace + kill <= pod, "{what}: grace {grace} + kill {kill} > terminationGracePeriodSeconds {pod}");
            assert!(ckpt < grace, "{what}: checkpoint {ckpt} >= grace {grace}");
        }
        for code in row["exit_codes"].as_array().expect("codes").iter().filter_map(serde_json::Value::as_u64) {
            assert!(documented(code), "{what}: exit code {code} is in no exit-code table of the book");
        }
    }
}

/// The warm-pod runtime: valid, serving on the control port with the
/// Secret's token and an idle timeout; its example's TrainJob is valid
/// and its Service and Secret match the runtime (port, key, file).
#[test]
fn the_dev_runtime_serves_with_a_secret_token_and_its_example_matches() {
    let runtime = repo().join("runtimes/trainlet-dev.yaml");
    let (ok, out) = validate(std::slice::from_ref(&runtime));
    assert!(ok && out.contains("ClusterTrainingRuntime trainlet-dev valid"), "{out}");
    let dir = tempfile::tempdir().expect("tmp");
    let script = r#"
import json, sys, yaml
rt = next(d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d["kind"] == "ClusterTrainingRuntime")
docs = {d["kind"]: d for d in yaml.safe_load_all(open(sys.argv[2]))}
yaml.safe_dump(docs["TrainJob"], open(sys.argv[3], "w"))
pod = rt["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
c = pod["containers"][0]
env = {e["name"]: e.get("value") for e in c["env"]}
mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
secret_vol = [v for v in pod["volumes"] if "secret" in v][0]
print(json.dumps({
    "command": c["command"], "env": env, "ports": [p["containerPort"] for p in c["ports"]],
    "secret": secret_vol["secret"]["secretName"], "secret_mount": mount[secret_vol["name"]],
    "example_secret": docs["Secret"]["metadata"]["name"], "example_keys": list(docs["Secret"]["stringData"]),
    "service_port": docs["Service"]["spec"]["ports"][0]["targetPort"],
    "selector": docs["Service"]["spec"]["selector"], "job": docs["TrainJob"]["metadata"]["name"],
    "runtime_ref": docs["TrainJob"]["spec"]["runtimeRef"]["name"], "runtime": rt["metadata"]["name"],
}))
"#;
    let trainjob = dir.path().join("trainjob.yaml");
    let out = Command::new(python())
        .args(["-c", script])
        .arg(&runtime)
        .arg(repo().join("examples/trainlet-dev.yaml"))
        .arg(&trainjob)
        .output()
        .expect("python");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let f: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(f["command"], serde_json::json!(["trainlet", "run", "--serve"]));
    let port: u64 = f["env"]["TRAINLET_CONTROL_PORT"].as_str().and_then(|p| p.parse().ok()).expect("port");
    assert!(f["ports"].as_array().is_some_and(|p| p.contains(&port.into())), "{f}");
    assert_eq!(f["service_port"], port, "{f}");
    assert!(f["env"]["TRAINLET_SERVE_IDLE_TIMEOUT"].as_str().is_some_and(|t| t.parse::<u64>().is_ok_and(|t| t > 0)));
    assert_eq!(f["secret"], f["example_secret"]);
    let token_file = f["env"]["TRAINLET_CONTROL_TOKEN_FILE"].as_str().expect("token file");
    let key = f["example_keys"][0].as_str().expect("key");
    assert_eq!(token_file, format!("{}/{key}", f["secret_mount"].as_str().expect("mount")), "{f}");
    assert_eq!(f["runtime_ref"], f["runtime"]);
    assert_eq!(f["selector"]["jobset.sigs.k8s.io/jobset-name"], f["job"], "the Service selects the TrainJob's pods");
    assert_eq!(f["selector"]["batch.kubernetes.io/job-completion-index"], "0", "and only the store host");
    let (ok, out) = validate(&[trainjob]);
    assert!(ok, "{out}");
}

/// Kubernetes Events: in every runtime, each trainer container's pod runs
/// under a service account that the same file binds to a Role granting
/// `events` create and patch in `events.k8s.io` (and, beside the in-place
/// agent's own rules, nothing more), and the container gets who its pod
/// is from the downward API (name, namespace, uid, the TrainJob), so
/// trainlet needs no `get` on pods.
#[test]
fn every_runtime_lets_trainlet_write_its_events_and_nothing_more() {
    let script = r#"
import json, sys, yaml
out = []
for path in sys.argv[1:]:
    docs = [d for d in yaml.safe_load_all(open(path)) if d]
    rt = next(d for d in docs if d["kind"] == "ClusterTrainingRuntime")
    roles = {d["metadata"]["name"]: d["rules"] for d in docs if d["kind"] == "Role"}
    bound = {}
    for b in (d for d in docs if d["kind"] == "RoleBinding"):
        for s in b["subjects"]:
            bound.setdefault(s["name"], []).extend(roles.get(b["roleRef"]["name"], []))
    for j in rt["spec"]["template"]["spec"]["replicatedJobs"]:
        pod = j["template"]["spec"]["template"]["spec"]
        for c in pod["containers"]:
            if c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command") != ["trainlet", "stop"]:
                continue
            env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in c.get("env", [])}
            sa = pod.get("serviceAccountName")
            out.append({"file": path, "job": j["name"], "sa": sa, "rules": bound.get(sa, []), "env": env,
                        "accounts": [d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"]})
print(json.dumps(out))
"#;
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo().join("runtimes"))
        .expect("runtimes")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    let out = Command::new(python()).args(["-c", script]).args(&files).output().expect("python");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(rows.len(), files.len(), "one trainer container per runtime: {rows:?}");
    let events_rule =
        serde_json::json!({"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]});
    for row in &rows {
        let what = format!("{} {}", row["file"], row["job"]);
        let sa = row["sa"].as_str().unwrap_or_else(|| panic!("{what}: no serviceAccountName"));
        assert!(row["accounts"].as_array().is_some_and(|a| a.contains(&sa.into())), "{what}: {sa} is not in the file");
        let rules = row["rules"].as_array().expect("rules");
        assert!(rules.contains(&events_rule), "{what}: {rules:?}");
        if sa != "trainlet-in-place-restart" {
            assert_eq!(rules, std::slice::from_ref(&events_rule), "{what}: events create and patch, nothing more");
        }
        for (name, path) in [
            ("POD_NAME", "metadata.name"),
            ("POD_NAMESPACE", "metadata.namespace"),
            ("POD_UID", "metadata.uid"),
            ("TRAIN_JOB_NAME", "metadata.labels['jobset.sigs.k8s.io/jobset-name']"),
        ] {
            assert_eq!(row["env"][name], path, "{what}: {name}");
        }
    }
}
