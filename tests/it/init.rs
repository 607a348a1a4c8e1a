//! `trainlet init dataset|model` (issue 6, first part): Trainer's env
//! contract, file:// sources, atomic publication, the completion marker,
//! the heartbeat lock, and every error's exit code.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

use crate::util::{Pod, bin};

const LIMIT: Duration = Duration::from_secs(60);

fn init(kind: &str, out: &Path, env: &[(&str, &str)]) -> Pod {
    Pod::start(&["init", kind, "--output", out.to_str().expect("utf-8")], env)
}

fn write(root: &Path, rel: &str, bytes: &[u8]) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
    std::fs::write(p, bytes).expect("write");
}

fn model_tree() -> tempfile::TempDir {
    let d = tempfile::tempdir().expect("tmp");
    write(d.path(), "config.json", b"{}");
    write(d.path(), "model-00001-of-00002.safetensors", &[7u8; 4096]);
    write(d.path(), "sub/tokenizer.json", b"{\"t\":1}");
    write(d.path(), "pytorch_model.bin", b"old weights");
    d
}

#[test]
fn a_file_source_is_linked_in_once_with_a_marker() {
    let src = model_tree();
    let out = tempfile::tempdir().expect("tmp");
    let uri = format!("file://{}", src.path().display());
    let mut pod = init("model", out.path(), &[("STORAGE_URI", &uri)]);
    assert_eq!(pod.code(LIMIT), 0, "{}", pod.stderr());
    assert!(pod.stderr().contains("initializer done"), "{}", pod.stderr());
    // Trainer's model ignore patterns drop *.bin; the rest is hard-linked.
    assert!(!out.path().join("pytorch_model.bin").exists());
    for rel in ["config.json", "model-00001-of-00002.safetensors", "sub/tokenizer.json"] {
        let (a, b) = (
            std::fs::metadata(src.path().join(rel)).expect("src"),
            std::fs::metadata(out.path().join(rel)).expect("out"),
        );
        assert_eq!((a.ino(), a.dev()), (b.ino(), b.dev()), "{rel} is a hard link");
    }
    let marker: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.path().join(".trainlet-complete.json")).expect("marker"))
            .expect("json");
    assert_eq!(marker["uri"], uri.as_str());
    assert_eq!(marker["files"].as_array().expect("files").len(), 3);
    assert!(!out.path().join(".trainlet-init.lock").exists(), "the lock is released");
    // A second run (a retried pod) finds the marker and does nothing.
    let mut again = init("model", out.path(), &[("STORAGE_URI", &uri)]);
    assert_eq!(again.code(LIMIT), 0);
    assert!(again.stderr().contains("already in place"), "{}", again.stderr());
    // A marker for another URI is not "done": the new source replaces it.
    let other = tempfile::tempdir().expect("tmp");
    write(other.path(), "data.csv", b"a,b\n");
    let uri2 = format!("file://{}", other.path().display());
    let mut third = init("dataset", out.path(), &[("STORAGE_URI", &uri2)]);
    assert_eq!(third.code(LIMIT), 0, "{}", third.stderr());
    assert!(third.stderr().contains("initializer done"), "{}", third.stderr());
    let marker = std::fs::read_to_string(out.path().join(".trainlet-complete.json")).expect("marker");
    assert!(marker.contains(&uri2), "{marker}");
}

#[test]
fn pods_on_one_volume_fetch_once_and_a_dead_holder_is_taken_over() {
    let src = model_tree();
    let out = tempfile::tempdir().expect("tmp");
    let uri = format!("file://{}", src.path().display());
    let mut pods: Vec<Pod> = (0..3).map(|_| init("model", out.path(), &[("STORAGE_URI", &uri)])).collect();
    let mut fetched = 0;
    for p in &mut pods {
        assert_eq!(p.code(LIMIT), 0, "{}", p.stderr());
        fetched += usize::from(p.stderr().contains("initializer done"));
    }
    assert_eq!(fetched, 1, "exactly one pod fetches");

    // A lock left by a dead initializer (no heartbeat) is taken over once stale.
    let out = tempfile::tempdir().expect("tmp");
    std::fs::write(out.path().join(".trainlet-init.lock"), "pid 1 on gone-node").expect("lock");
    let start = std::time::Instant::now();
    let mut pod = init("model", out.path(), &[("STORAGE_URI", &uri), ("TRAINLET_INIT_STALE_SECS", "2")]);
    assert_eq!(pod.code(LIMIT), 0, "{}", pod.stderr());
    let err = pod.stderr();
    assert!(err.contains("another initializer is filling this volume") && err.contains("pid 1 on gone-node"), "{err}");
    assert!(err.contains("taking over"), "{err}");
    assert!(start.elapsed() >= Duration::from_secs(2), "it waited for the heartbeat to go stale");
    assert!(out.path().join(".trainlet-complete.json").exists());
}

#[test]
fn each_error_names_the_uri_and_exits_with_its_code() {
    let src = model_tree();
    let out = tempfile::tempdir().expect("tmp");
    let missing = format!("file://{}/nope", src.path().display());
    let filtered = format!("file://{}", src.path().display());
    type Case<'a> = (&'a str, Vec<(&'a str, &'a str)>, i32, String);
    let cases: [Case<'_>; 6] = [
        (
            "model",
            vec![("STORAGE_URI", "gs://bucket/x")],
            200,
            "storage URI \"gs://bucket/x\": unsupported scheme gs://".into(),
        ),
        ("model", vec![], 200, "no storage URI: set STORAGE_URI".into()),
        (
            "model",
            vec![("STORAGE_URI", "s3://bucket/p"), ("ACCESS_KEY_ID", "AKIAEXAMPLE")],
            200,
            "s3://bucket/p: ACCESS_KEY_ID is set but SECRET_ACCESS_KEY is not".into(),
        ),
        ("dataset", vec![("STORAGE_URI", &missing)], 221, format!("{missing}: ")),
        (
            "dataset",
            vec![("STORAGE_URI", &filtered), ("IGNORE_PATTERNS", "*")],
            222,
            format!("{filtered}: no file left after filtering (allow all, ignore *)"),
        ),
        (
            "model",
            vec![("STORAGE_URI", "hf://org"), ("ACCESS_TOKEN", "hf_SUPERSECRET")],
            200,
            "expected hf://ORG/NAME".into(),
        ),
    ];
    for (kind, env, code, want) in cases {
        let mut pod = init(kind, out.path(), &env);
        assert_eq!(pod.code(LIMIT), code, "{env:?}: {}", pod.stderr());
        let err = pod.stderr();
        assert!(err.contains(&want), "{env:?}: want {want:?} in\n{err}");
        assert!(!err.contains("SUPERSECRET"), "a token is never printed");
        assert!(!out.path().join(".trainlet-complete.json").exists(), "no marker after a failure");
    }
}

#[test]
fn a_full_volume_is_a_clear_error_and_publishes_nothing() {
    // A 256 KiB tmpfs in a private mount namespace; the source is elsewhere,
    // so the 1 MiB file is streamed (no hard link across filesystems).
    let src = tempfile::tempdir().expect("tmp");
    write(src.path(), "big.safetensors", &vec![1u8; 1 << 20]);
    write(src.path(), "config.json", b"{}");
    let mnt = tempfile::tempdir().expect("tmp");
    let script = format!(
        "mount -t tmpfs -o size=256k trainlet-test {m} && exec {bin} init model --output {m}/model",
        m = mnt.path().display(),
        bin = bin().display()
    );
    let uri = format!("file://{}", src.path().display());
    let mut pod = Pod::start_as(
        Path::new("unshare"),
        &["--mount", "--propagation", "private", "sh", "-c", &script],
        &[("STORAGE_URI", &uri)],
    );
    assert_eq!(pod.code(LIMIT), 224, "{}", pod.stderr());
    assert!(pod.stderr().contains("out of disk space writing"), "{}", pod.stderr());
    assert!(pod.stderr().contains("the marker was not written"), "{}", pod.stderr());
}

/// A file:// source never leaks what lies outside it: a symlink to
/// /etc/shadow, to /etc/ssh or to nothing is skipped with a warning;
/// symlinks inside the tree are recreated as symlinks; a copied file keeps
/// its mode without group/world write (it used to arrive as 644 content).
#[test]
fn file_sources_never_follow_symlinks_out_and_never_widen_permissions() {
    use std::os::unix::fs::{PermissionsExt, symlink};
    let src = tempfile::tempdir().expect("tmp");
    write(src.path(), "data.txt", b"payload");
    std::fs::set_permissions(src.path().join("data.txt"), std::fs::Permissions::from_mode(0o666)).expect("chmod");
    write(src.path(), "sub/keep.json", b"{}");
    symlink("/etc/shadow", src.path().join("shadow")).expect("link");
    symlink("/etc/ssh", src.path().join("sshkeys")).expect("link");
    symlink("no-such-target", src.path().join("dangling")).expect("link");
    symlink("data.txt", src.path().join("inner")).expect("link");
    symlink("../data.txt", src.path().join("sub/up")).expect("link");
    symlink(src.path().join("sub"), src.path().join("subdir-abs")).expect("link");
    // Another filesystem than the source (tmpfs), so files are copied.
    let out = tempfile::tempdir_in("/dev/shm").expect("tmpfs dir");
    let uri = format!("file://{}", src.path().display());
    let mut pod = init("dataset", out.path(), &[("STORAGE_URI", &uri)]);
    assert_eq!(pod.code(LIMIT), 0, "{}", pod.stderr());
    let err = pod.stderr();
    for name in ["shadow", "sshkeys", "dangling"] {
        assert!(std::fs::symlink_metadata(out.path().join(name)).is_err(), "{name} must not arrive:\n{err}");
    }
    assert_eq!(err.matches("points outside the source tree").count(), 3, "{err}");
    assert_eq!(std::fs::read_link(out.path().join("inner")).expect("inner"), Path::new("data.txt"));
    assert_eq!(std::fs::read_link(out.path().join("sub/up")).expect("up"), Path::new("../data.txt"));
    assert_eq!(std::fs::read_link(out.path().join("subdir-abs")).expect("abs"), Path::new("sub"));
    assert_eq!(std::fs::read(out.path().join("inner")).expect("through the link"), b"payload");
    let mode = std::fs::metadata(out.path().join("data.txt")).expect("data").permissions().mode() & 0o7777;
    assert_eq!(mode, 0o644, "copied with the source's mode less group/world write");
}
