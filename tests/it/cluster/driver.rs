//! Warm pods from the driver on the real cluster (issue 42): a Python
//! process outside the cluster, holding only a kubeconfig of a service
//! account bound to `examples/trainlet-driver-rbac.yaml`, runs
//! `tests/fixtures/cluster_driver.py`, which brings warm pods up with
//! `trainlet_client.up` on `runtimes/trainlet-dev.yaml`, deploys a class of
//! its own `__main__`, loses a pod, is joined by a second process, takes
//! everything down, and then tries the bad inputs. The assertions are here.

use std::collections::HashMap;
use std::path::Path;

use super::*;

/// A kubeconfig for the cluster that authenticates with `token`.
fn token_kubeconfig(dir: &Path, name: &str, token: &str) -> String {
    let (port, ca) = api_server();
    let ca = data_encoding::BASE64.encode(&std::fs::read(ca).expect("ca"));
    let file = dir.join(format!("{name}.kubeconfig"));
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: https://127.0.0.1:{port}\n    certificate-authority-data: {ca}\nusers:\n- name: {name}\n  user:\n    token: {token}\ncontexts:\n- name: {name}\n  context: {{cluster: test, user: {name}}}\ncurrent-context: {name}\n"
    );
    std::fs::write(&file, text).expect("kubeconfig");
    file.display().to_string()
}

/// A service account's kubeconfig, bound to `role` when one is given.
fn account(dir: &Path, ns: &str, name: &str, role: Option<&str>) -> String {
    let (ok, out) = kubectl(&["create", "serviceaccount", name]);
    assert!(ok, "{out}");
    if let Some(role) = role {
        let sa = format!("--serviceaccount={ns}:{name}");
        let (ok, out) = kubectl(&["create", "rolebinding", name, &format!("--role={role}"), &sa]);
        assert!(ok, "{out}");
    }
    let (ok, token) = kubectl(&["create", "token", name, "--duration=2h"]);
    assert!(ok, "{token}");
    token_kubeconfig(dir, name, token.trim())
}

#[test]
fn the_driver_brings_warm_pods_up_reaches_them_and_takes_them_down_from_python() {
    let up = up("driver", Take::Beside);
    let (ok, out) = apply_file(&repo().join("runtimes/trainlet-dev.yaml"));
    assert!(ok, "{out}");
    let (ok, out) = kubectl(&["apply", "-f", &repo().join("examples/trainlet-driver-rbac.yaml").display().to_string()]);
    assert!(ok, "{out}");
    let dir = tempfile::tempdir().expect("tmp");
    let driver = account(dir.path(), &up.namespace, "driver", Some("trainlet-driver"));
    let nobody = account(dir.path(), &up.namespace, "nobody", None);
    let admin = run_dir().join("admin.kubeconfig").display().to_string();
    let out = Command::new("timeout")
        .args(["1500", &crate::util::python()])
        .arg(repo().join("tests/fixtures/cluster_driver.py"))
        .args([
            driver.as_str(),
            up.namespace.as_str(),
            admin.as_str(),
            &crate::support::cluster::mounts_patch_json(),
            nobody.as_str(),
        ])
        .output()
        .expect("driver");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let all = format!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let steps: HashMap<String, serde_json::Value> = stdout
        .lines()
        .filter(|l| l.starts_with('{'))
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|v| (v["step"].as_str().unwrap_or("").to_string(), v))
        .collect();
    let step = |name: &str| steps.get(name).unwrap_or_else(|| panic!("no step {name}:\n{all}"));
    assert!(out.status.success(), "{all}");

    // Up: it said what it waited for, then an actor of the driver's own
    // __main__ answered on every rank of the 2 pods.
    let first = step("up");
    let said = first["said"].as_array().expect("said");
    assert!(said.iter().any(|s| s.as_str().is_some_and(|s| s.contains("waiting for"))), "{first}");
    assert!(said.last().and_then(|s| s.as_str()).is_some_and(|s| s.contains("ready: 2 pods")), "{first}");
    let totals: Vec<u64> =
        first["first"].as_array().expect("ranks").iter().filter_map(|r| r["total"].as_u64()).collect();
    assert_eq!(totals, [11, 11], "one worker per pod: {first}");
    assert_eq!(first["status"]["world"]["nnodes"], 2, "{first}");

    // A second actor beside it (its own workers, one per pod) read the
    // first one's total on each pod, handed over through the pod.
    let beside = step("beside");
    let read = beside["read"].as_array().unwrap_or_else(|| panic!("{beside}"));
    let hosts = |v: &serde_json::Value| -> Vec<String> {
        v.as_array().into_iter().flatten().map(|r| r["host"].as_str().unwrap_or("").to_string()).collect()
    };
    assert_eq!(hosts(&beside["read"]), hosts(&beside["first"]), "rank r of each on the same pod: {beside}");
    for r in read {
        assert_eq!((r["total"].as_u64(), r["world"].as_u64()), (Some(11), Some(2)), "{beside}");
        assert_ne!(r["pid"], r["writer"], "another process wrote it: {beside}");
    }

    // A lost pod: the actor came back; node rank 0's ranks kept their state
    // (survivors mode), the replacement's started afresh.
    let lost = step("lost_pod");
    let after: Vec<(u64, u64)> = lost["after"]
        .as_array()
        .unwrap_or_else(|| panic!("no answer after the lost pod: {lost}"))
        .iter()
        .map(|r| (r["rank"].as_u64().unwrap_or(99), r["total"].as_u64().unwrap_or(0)))
        .collect();
    assert_eq!(after, [(0, 13), (1, 12)], "{lost}");
    let read: Vec<u64> =
        lost["read"].as_array().into_iter().flatten().map(|r| r["total"].as_u64().unwrap_or(0)).collect();
    assert_eq!(read, [13, 12], "the actor beside came back too: {lost}");

    // A second process reattached by name; a wrong token is refused; ls lists it.
    let second = step("second");
    assert_eq!(second["second"]["value"]["total"], 13, "{second}");
    assert_eq!(second["wrong_token"], 401, "{second}");
    let listed = second["ls"].as_array().expect("ls");
    assert!(
        listed
            .iter()
            .any(|j| j["name"] == "warm" && j["ready"] == 2 && j["idle_seconds"].as_f64().is_some_and(|s| s >= 0.0)),
        "{second}\n{all}"
    );

    // Down: the TrainJob, its Secret and its pods are gone.
    assert_eq!(step("down")["left"], serde_json::json!([]), "{all}");

    // Bad input: the cluster's reason, and nothing left behind.
    for (name, words) in [
        ("bad-runtime", vec!["no-such-runtime"]),
        ("bad-image", vec!["cannot pull image", "registry.invalid/trainlet/none:0"]),
        ("bad-resources", vec!["a node for pod", "Insufficient cpu"]),
        ("no-rights", vec!["403", "forbidden"]),
    ] {
        let s = step(name);
        let error = s["error"].as_str().unwrap_or_default();
        assert!(words.iter().all(|w| error.contains(w)), "{name}: {s}\n{all}");
        assert_eq!(s["left"], serde_json::json!([]), "{name}: nothing left: {s}\n{all}");
    }
}
