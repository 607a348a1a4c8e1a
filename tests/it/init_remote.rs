//! `trainlet init` against real servers on 127.0.0.1 (issue 6): a loopback
//! Hugging Face Hub (tests/fixtures/hub_server.py, checked here against
//! the real `huggingface_hub.snapshot_download`), moto's S3 server with
//! signature checks, plain http and https; and the faults: a dropped
//! connection, a corrupt byte, SIGKILL and resume, two processes on one
//! volume, a full disk.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::support::fixture_server::Server;
use crate::util::{Pod, bin, fixture, free_port, python, tls_pair};

const LIMIT: Duration = Duration::from_secs(180);
const MARKER: &str = ".trainlet-complete.json";

fn server(script: &str, args: &[String]) -> Server {
    Server::start(&python(), Path::new(&fixture(script)), args, Duration::from_secs(120))
}

/// The loopback Hub serving `root`.
fn hub(root: &Path, extra: &[&str]) -> (Server, String) {
    let mut args = vec!["--root".to_string(), root.display().to_string()];
    args.extend(extra.iter().map(ToString::to_string));
    let s = server("hub_server.py", &args);
    let endpoint = format!("http://127.0.0.1:{}", s.fields[0]);
    (s, endpoint)
}

/// moto's S3 server with `bucket=dir` seeds: (server, endpoint, key id, secret).
fn s3(seeds: &[(&str, &Path)]) -> (Server, String, String, String) {
    let mut args = Vec::new();
    for (b, d) in seeds {
        args.push("--seed".to_string());
        args.push(format!("{b}={}", d.display()));
    }
    let s = server("s3_server.py", &args);
    let (endpoint, key, secret) =
        (format!("http://127.0.0.1:{}", s.fields[0]), s.fields[1].clone(), s.fields[2].clone());
    (s, endpoint, key, secret)
}

/// Deterministic bytes (xorshift), distinct per seed.
fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(n);
    out
}

fn put(root: &Path, rel: &str, data: &[u8]) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
    std::fs::write(p, data).expect("write");
}

/// Every file under `dir` (hidden names skipped: markers, caches), by path.
fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("read_dir").flatten() {
            if e.file_name().to_string_lossy().starts_with('.') {
                continue;
            }
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(dir).expect("under").to_string_lossy().into_owned();
                out.insert(rel, std::fs::read(&p).expect("read"));
            }
        }
    }
    out
}

/// Names of our temporary files anywhere under `dir`.
fn leftovers(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if e.path().is_dir() {
                stack.push(e.path());
            } else if name.ends_with(".trainlet-part")
                || name.ends_with(".trainlet-state")
                || name.ends_with(".journal")
            {
                out.push(name);
            }
        }
    }
    out
}

fn init(kind: &str, out: &Path, extra: &[&str], env: &[(&str, &str)]) -> Pod {
    let mut args = vec!["init", kind, "--output", out.to_str().expect("utf-8")];
    args.extend_from_slice(extra);
    Pod::start(&args, env)
}

/// Run an initializer that must fail: its code, `want` in its message,
/// none of `secrets` printed, and no marker left in `out`.
fn fails(kind: &str, out: &Path, args: &[&str], env: &[(&str, &str)], code: i32, want: &str, secrets: &[&str]) {
    let mut pod = init(kind, out, args, env);
    assert_eq!(pod.code(LIMIT), code, "{env:?}: {}", pod.stderr());
    let err = pod.stderr();
    assert!(err.contains(want), "{env:?}: want {want:?} in\n{err}");
    for s in secrets {
        assert!(!err.contains(s), "a secret is never printed: {s}");
    }
    assert!(!out.join(MARKER).exists(), "no marker after a failure");
}

fn marker(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join(MARKER)).expect("marker")).expect("json")
}

fn count(hay: &str, needle: &str) -> usize {
    hay.matches(needle).count()
}

/// A Llama-like model repo and an alpaca-like dataset repo.
pub(crate) fn hub_repos(root: &Path) {
    let m = root.join("models/meta/llama-mini");
    put(&m, "config.json", br#"{"architectures":["LlamaForCausalLM"]}"#);
    put(&m, "generation_config.json", b"{}");
    put(&m, "model-00001-of-00002.safetensors", &bytes(24 << 20, 1));
    put(&m, "model-00002-of-00002.safetensors", &bytes(3 << 20, 2));
    put(&m, "model.safetensors.index.json", br#"{"weight_map":{}}"#);
    put(&m, "tokenizer.model", &bytes(500_000, 3));
    put(&m, "tokenizer.json", b"{\"v\":1}");
    put(&m, "original/params.json", b"{\"dim\":64}");
    put(&m, "pytorch_model.bin", &bytes(1 << 20, 4));
    put(&m, "flax_model.msgpack", &bytes(1000, 5));
    put(&m, "README.md", b"# llama-mini\n");
    let d = root.join("datasets/tatsu/alpaca-mini");
    put(&d, "README.md", b"# alpaca\n");
    put(&d, "data/train-00000-of-00001.parquet", &bytes(2 << 20, 6));
    put(&d, "data/test.parquet", &bytes(70_000, 7));
    put(&d, "nested/deeper/notes.txt", b"n\n");
}

#[test]
fn hub_model_and_dataset_repos_match_huggingface_hub() {
    let root = tempfile::tempdir().expect("tmp");
    hub_repos(root.path());
    // Small pages: the tree listing takes several `Link: rel="next"` pages.
    let (_hub, endpoint) = hub(root.path(), &["--page-size", "3"]);
    let reference = tempfile::tempdir().expect("tmp");
    // The reference client, as Trainer's initializers call it.
    let script = format!(
        r#"
import json, sys
from huggingface_hub import HfApi, snapshot_download
ep = "{endpoint}"
snapshot_download("meta/llama-mini", local_dir=sys.argv[1] + "/model", endpoint=ep,
    allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.gguf"],
    ignore_patterns=["*.msgpack", "*.h5", "*.bin", "*.pt", "*.pth"])
snapshot_download("tatsu/alpaca-mini", repo_type="dataset", local_dir=sys.argv[1] + "/dataset", endpoint=ep)
api = HfApi(endpoint=ep)
print(json.dumps({{"model": api.repo_info("meta/llama-mini").sha,
    "dataset": api.repo_info("tatsu/alpaca-mini", repo_type="dataset").sha}}))
"#
    );
    let out = Command::new(python())
        .args(["-c", &script, reference.path().to_str().expect("utf-8")])
        .env("HF_HUB_DISABLE_TELEMETRY", "1")
        .env("HF_HOME", reference.path().join(".hf"))
        .output()
        .expect("python");
    assert!(out.status.success(), "huggingface_hub failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let shas: serde_json::Value = serde_json::from_slice(&out.stdout).expect("shas");

    let ours = tempfile::tempdir().expect("tmp");
    let env = [("ENDPOINT", endpoint.as_str()), ("TRAINLET_LOG", "info,initializers=debug")];
    let mut model = init(
        "model",
        &ours.path().join("model"),
        &["--chunk-size", "4"],
        &[env[0], env[1], ("STORAGE_URI", "hf://meta/llama-mini")],
    );
    assert_eq!(model.code(LIMIT), 0, "{}", model.stderr());
    // Trainer's dataset initializer takes the repo named by the first path
    // segment, whole.
    let mut dataset = init(
        "dataset",
        &ours.path().join("dataset"),
        &[],
        &[env[0], ("STORAGE_URI", "hf://tatsu/alpaca-mini/data/train-00000-of-00001.parquet")],
    );
    assert_eq!(dataset.code(LIMIT), 0, "{}", dataset.stderr());

    for kind in ["model", "dataset"] {
        let (want, got) = (files(&reference.path().join(kind)), files(&ours.path().join(kind)));
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>(),
            "{kind}: the same files as huggingface_hub"
        );
        assert!(want == got, "{kind}: the same bytes as huggingface_hub");
        assert_eq!(
            marker(&ours.path().join(kind))["commit"],
            shas[kind],
            "{kind}: the commit huggingface_hub resolved"
        );
        assert!(leftovers(&ours.path().join(kind)).is_empty());
    }
    let m = files(&ours.path().join("model"));
    for kept in ["config.json", "original/params.json", "tokenizer.model", "model-00001-of-00002.safetensors"] {
        assert!(m.contains_key(kept), "{kept} kept");
    }
    for dropped in ["pytorch_model.bin", "flax_model.msgpack", "README.md"] {
        assert!(!m.contains_key(dropped), "{dropped} filtered out by Trainer's defaults");
    }
    // The 24 MiB file came in six 4 MiB ranges.
    let err = model.stderr();
    assert_eq!(count(&err, "reading range file=model-00001-of-00002.safetensors"), 6, "{err}");
    let checks = marker(&ours.path().join("model"))["files"].to_string();
    assert!(checks.contains("sha256:") && checks.contains("git-sha1:"), "{checks}");
}

#[test]
fn hub_errors_name_the_repo_and_a_token_is_never_printed_nor_sent_to_the_cdn() {
    let root = tempfile::tempdir().expect("tmp");
    put(&root.path().join("models/org/gated"), "model.safetensors", &bytes(300_000, 8));
    put(&root.path().join("models/org/gated"), "config.json", b"{}");
    let (_hub, endpoint) = hub(root.path(), &["--gated", "org/gated=hf_RightToken"]);
    let out = tempfile::tempdir().expect("tmp");
    let ep = ("ENDPOINT", endpoint.as_str());
    type Case<'a> = (Vec<(&'a str, &'a str)>, i32, &'a str);
    let cases: [Case<'_>; 4] = [
        (vec![ep, ("STORAGE_URI", "hf://org/gated")], 225, "hf://org/gated: gated repository (401 Unauthorized)"),
        (
            vec![ep, ("STORAGE_URI", "hf://org/gated"), ("ACCESS_TOKEN", "hf_WrongSecret")],
            225,
            "hf://org/gated: gated repository (403 Forbidden): accept its terms on the Hub and set ACCESS_TOKEN",
        ),
        (vec![ep, ("STORAGE_URI", "hf://org/missing")], 221, "hf://org/missing: repository not found"),
        (
            vec![ep, ("STORAGE_URI", "hf://org/gated@v9")],
            221,
            "hf://org/gated@v9: revision \"v9\" not found in org/gated",
        ),
    ];
    for (env, code, want) in cases {
        fails("model", out.path(), &[], &env, code, want, &["WrongSecret"]);
    }
    // The revision as an option instead of @REV.
    let want = "hf://org/gated: revision \"v9\" not found in org/gated";
    fails("model", out.path(), &["--revision", "v9"], &[ep, ("STORAGE_URI", "hf://org/gated")], 221, want, &[]);
    // HF_TOKEN works too. The CDN refuses requests that carry an
    // Authorization header (as presigned URLs do): success means the token
    // stayed on the Hub's host.
    let mut pod =
        init("model", out.path(), &[], &[ep, ("STORAGE_URI", "hf://org/gated"), ("HF_TOKEN", "hf_RightToken")]);
    assert_eq!(pod.code(LIMIT), 0, "{}", pod.stderr());
    assert_eq!(files(out.path())["model.safetensors"], bytes(300_000, 8));
}

#[test]
fn s3_prefix_large_object_in_ranges_patterns_and_errors() {
    let data = tempfile::tempdir().expect("tmp");
    put(data.path(), "train/part-0.jsonl", b"{\"a\":1}\n");
    put(data.path(), "train/nested/deep/part-1.jsonl", b"{\"a\":2}\n");
    put(data.path(), "train/big.bin", &bytes(64 << 20, 10));
    put(data.path(), "train/shards-multipart.bin", &bytes(12 << 20, 11));
    put(data.path(), "train/logs/run.log", b"noise\n");
    put(data.path(), "other/unrelated.txt", b"x\n");
    let (_s3, endpoint, key, secret) = s3(&[("datasets", data.path())]);
    let out = tempfile::tempdir().expect("tmp");
    let base = [("ENDPOINT", endpoint.as_str()), ("ACCESS_KEY_ID", key.as_str())];
    let mut pod = init(
        "dataset",
        out.path(),
        &["--chunk-size", "8"],
        &[
            base[0],
            base[1],
            ("SECRET_ACCESS_KEY", secret.as_str()),
            ("STORAGE_URI", "s3://datasets/train"),
            ("IGNORE_PATTERNS", "*.log"),
            ("TRAINLET_LOG", "info,initializers=debug"),
        ],
    );
    assert_eq!(pod.code(LIMIT), 0, "{}", pod.stderr());
    let got = files(out.path());
    assert_eq!(
        got.keys().map(String::as_str).collect::<Vec<_>>(),
        ["big.bin", "nested/deep/part-1.jsonl", "part-0.jsonl", "shards-multipart.bin"],
        "keys under the prefix, relative to it, without the ignored log"
    );
    assert!(got["big.bin"] == bytes(64 << 20, 10) && got["shards-multipart.bin"] == bytes(12 << 20, 11));
    let err = pod.stderr();
    assert_eq!(count(&err, "reading range file=big.bin"), 8, "64 MiB in 8 MiB ranges:\n{err}");
    let m = marker(out.path())["files"].to_string();
    // A single PUT's ETag is its MD5 (checked); a multipart one is not.
    assert!(m.contains("md5:") && m.contains("etag:"), "{m}");

    let fresh = tempfile::tempdir().expect("tmp");
    type Case<'a> = (Vec<(&'a str, &'a str)>, i32, &'a str);
    let cases: [Case<'_>; 5] = [
        (
            vec![base[0], base[1], ("SECRET_ACCESS_KEY", "WrongSecretKey"), ("STORAGE_URI", "s3://datasets/train")],
            225,
            "s3://datasets/train: listing s3://datasets/train/: access denied (SignatureDoesNotMatch)",
        ),
        (
            vec![base[0], base[1], ("SECRET_ACCESS_KEY", secret.as_str()), ("STORAGE_URI", "s3://nope/train")],
            221,
            "s3://nope/train: bucket \"nope\" does not exist",
        ),
        (
            vec![base[0], base[1], ("SECRET_ACCESS_KEY", secret.as_str()), ("STORAGE_URI", "s3://datasets/absent")],
            221,
            "s3://datasets/absent: no object under s3://datasets/absent",
        ),
        (
            vec![base[0], base[1], ("STORAGE_URI", "s3://datasets/train")],
            200,
            "ACCESS_KEY_ID is set but SECRET_ACCESS_KEY is not",
        ),
        (
            vec![
                base[0],
                base[1],
                ("SECRET_ACCESS_KEY", secret.as_str()),
                ("STORAGE_URI", "s3://datasets/train"),
                ("IGNORE_PATTERNS", "*"),
            ],
            222,
            "s3://datasets/train: no file left after filtering",
        ),
    ];
    for (env, code, want) in cases {
        fails("dataset", fresh.path(), &[], &env, code, want, &["WrongSecretKey", &secret]);
    }
}

#[test]
fn a_dropped_connection_resumes_by_range_and_a_corrupt_byte_is_never_published() {
    let root = tempfile::tempdir().expect("tmp");
    put(&root.path().join("models/org/flaky"), "model.safetensors", &bytes(16 << 20, 12));
    put(&root.path().join("models/org/bad"), "bad.safetensors", &bytes(3 << 20, 13));
    put(&root.path().join("models/org/bad"), "config.json", b"{}");
    let (_hub, endpoint) = hub(root.path(), &["--drop", "model.safetensors=5000000:2", "--corrupt", "bad.safetensors"]);
    let ep = ("ENDPOINT", endpoint.as_str());
    let out = tempfile::tempdir().expect("tmp");
    // One 64 MiB range: the file is one stream, cut twice after 5 MB.
    let mut pod = init("model", out.path(), &["--chunk-size", "64"], &[ep, ("STORAGE_URI", "hf://org/flaky")]);
    assert_eq!(pod.code(LIMIT), 0, "{}", pod.stderr());
    let err = pod.stderr();
    assert_eq!(count(&err, "read failed; retrying"), 2, "{err}");
    assert!(
        err.contains("offset=5000000") && err.contains("offset=10000000"),
        "each retry resumed where the cut was:\n{err}"
    );
    assert!(files(out.path())["model.safetensors"] == bytes(16 << 20, 12));

    let out = tempfile::tempdir().expect("tmp");
    let mut pod = init("model", out.path(), &[], &[ep, ("STORAGE_URI", "hf://org/bad")]);
    assert_eq!(pod.code(LIMIT), 223, "{}", pod.stderr());
    let err = pod.stderr();
    assert!(
        err.contains("hf://org/bad: bad.safetensors does not match the source (expected sha256 ")
            && err.contains("it was not published"),
        "{err}"
    );
    assert!(!out.path().join("bad.safetensors").exists() && !out.path().join(MARKER).exists());
    assert!(leftovers(out.path()).iter().all(|n| !n.contains("bad.safetensors")), "{:?}", leftovers(out.path()));
    // `--verify size` trades the hash for speed: the same bytes pass, and
    // the marker says only sizes were checked.
    let mut pod = init("model", out.path(), &["--verify", "size"], &[ep, ("STORAGE_URI", "hf://org/bad")]);
    assert_eq!(pod.code(LIMIT), 0, "{}", pod.stderr());
    assert_eq!(marker(out.path())["verified"], "size");
}

fn state_lines(dir: &Path, name: &str) -> usize {
    std::fs::read_to_string(dir.join(format!(".{name}.trainlet-state"))).map_or(0, |s| s.lines().count())
}

fn slow_repo() -> (tempfile::TempDir, Server, String) {
    let root = tempfile::tempdir().expect("tmp");
    put(&root.path().join("models/org/slow"), "weights.safetensors", &bytes(24 << 20, 14));
    put(&root.path().join("models/org/slow"), "config.json", b"{\"slow\":true}");
    // 2 MB/s per response, two at once: about 6 s for the 24 MiB.
    let (hub, endpoint) = hub(root.path(), &["--throttle", "2000000"]);
    (root, hub, endpoint)
}

#[test]
fn sigkill_mid_run_leaves_no_marker_and_the_rerun_resumes_with_progress_and_metrics() {
    let (_root, _hub, endpoint) = slow_repo();
    let out = tempfile::tempdir().expect("tmp");
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let env = [("ENDPOINT", endpoint.as_str()), ("STORAGE_URI", "hf://org/slow")];
    let args = ["--chunk-size", "4", "--concurrency", "2", "--progress-interval", "0.5", "--metrics-addr", &addr];
    let mut first = init("model", out.path(), &args, &env);
    // Three of six ranges written (the state file: a header, then ranges).
    let start = Instant::now();
    let mut metrics = String::new();
    while state_lines(out.path(), "weights.safetensors") < 4 {
        assert!(start.elapsed() < LIMIT, "no progress:\n{}", first.stderr());
        if !metrics.contains("trainlet_init_files_total 2") {
            metrics = crate::util::scrape(&format!("127.0.0.1:{}", port));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    first.signal(nix::sys::signal::Signal::SIGKILL);
    first.wait(LIMIT);
    assert!(metrics.contains("trainlet_init_files_total 2"), "{metrics}");
    assert!(metrics.contains(&format!("trainlet_init_bytes_total {}", (24 << 20) + 13)), "{metrics}");
    let err = first.stderr();
    assert!(err.contains("progress: files 0/2, "), "a progress line every interval:\n{err}");
    assert!(!err.contains('\x1b'), "no terminal control codes in logs");
    assert!(!out.path().join(MARKER).exists(), "no marker after a kill");
    assert!(!out.path().join("weights.safetensors").exists(), "nothing that looks complete");

    // The killed run's lock is taken over once stale: after 3 s, not the
    // default 30 s (the take-over itself is the next test's).
    let stale = [env[0], env[1], ("TRAINLET_INIT_STALE_SECS", "3")];
    let mut again = init("model", out.path(), &args[..4], &stale);
    assert_eq!(again.code(LIMIT), 0, "{}", again.stderr());
    let err = again.stderr();
    assert!(err.contains("resuming:") && err.contains("of partial files kept"), "{err}");
    let received: u64 = err
        .split("received=")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .expect("received= in the final line");
    assert!(received <= (24 << 20) - (12 << 20) + 13, "only the missing ranges were fetched again: {received}");
    assert!(files(out.path())["weights.safetensors"] == bytes(24 << 20, 14));
    assert!(leftovers(out.path()).is_empty(), "{:?}", leftovers(out.path()));
    assert!(!out.path().join(".trainlet-init.lock").exists());
}

#[test]
fn two_processes_on_one_volume_fetch_once_and_a_killed_downloader_is_taken_over() {
    let (_root, _hub, endpoint) = slow_repo();
    let env = [("ENDPOINT", endpoint.as_str()), ("STORAGE_URI", "hf://org/slow"), ("TRAINLET_INIT_STALE_SECS", "3")];
    let out = tempfile::tempdir().expect("tmp");
    let fast = ["--chunk-size", "4"];
    let mut pods: Vec<Pod> = (0..2).map(|_| init("model", out.path(), &fast, &env)).collect();
    let mut fetched = 0;
    for p in &mut pods {
        assert_eq!(p.code(LIMIT), 0, "{}", p.stderr());
        fetched += usize::from(p.stderr().contains("initializer done"));
    }
    assert_eq!(fetched, 1, "one downloads, the other waits for the marker");

    let out = tempfile::tempdir().expect("tmp");
    let mut first = init("model", out.path(), &["--chunk-size", "4", "--concurrency", "2"], &env);
    let start = Instant::now();
    while state_lines(out.path(), "weights.safetensors") < 2 {
        assert!(start.elapsed() < LIMIT, "no progress:\n{}", first.stderr());
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut second = init("model", out.path(), &fast, &env);
    second.wait_for_stderr("another initializer is filling this volume", LIMIT);
    first.signal(nix::sys::signal::Signal::SIGKILL);
    first.wait(LIMIT);
    assert_eq!(second.code(LIMIT), 0, "{}", second.stderr());
    let err = second.stderr();
    assert!(err.contains("taking over") && err.contains("initializer done"), "{err}");
    assert!(files(out.path())["weights.safetensors"] == bytes(24 << 20, 14));
}

#[test]
fn a_volume_too_small_is_a_clear_error_before_anything_is_written() {
    let root = tempfile::tempdir().expect("tmp");
    put(&root.path().join("models/org/m"), "model.safetensors", &bytes(3 << 20, 15));
    let (_hub, endpoint) = hub(root.path(), &[]);
    let mnt = tempfile::tempdir().expect("tmp");
    let script = format!(
        "mount -t tmpfs -o size=1m trainlet-test {m} && {bin} init model --output {m}/model; rc=$?; ls -a {m}/model; exit $rc",
        m = mnt.path().display(),
        bin = bin().display()
    );
    let mut pod = Pod::start_as(
        Path::new("unshare"),
        &["--mount", "--propagation", "private", "sh", "-c", &script],
        &[("ENDPOINT", &endpoint), ("STORAGE_URI", "hf://org/m")],
    );
    assert_eq!(pod.code(LIMIT), 224, "{}", pod.stderr());
    let err = pod.stderr();
    assert!(err.contains("3.0 MiB left to fetch but") && err.contains("free; nothing was written"), "{err}");
    let listing = pod.stdout();
    assert!(!listing.contains("trainlet-part") && !listing.contains(MARKER), "{listing}");
}

#[test]
fn http_and_https_files_in_ranges_with_the_query_kept_out_of_logs() {
    let root = tempfile::tempdir().expect("tmp");
    put(root.path(), "files/weights/blob.safetensors", &bytes(3 << 20, 16));
    let (_hub, endpoint) = hub(root.path(), &[]);
    let out = tempfile::tempdir().expect("tmp");
    let url = format!("{endpoint}/files/weights/blob.safetensors?X-Amz-Signature=SecretSig123");
    let mut pod = init(
        "model",
        out.path(),
        &["--chunk-size", "1"],
        &[("STORAGE_URI", &url), ("TRAINLET_LOG", "info,initializers=debug")],
    );
    assert_eq!(pod.code(LIMIT), 0, "{}", pod.stderr());
    let err = pod.stderr();
    assert_eq!(count(&err, "reading range file=blob.safetensors"), 3, "{err}");
    assert!(files(out.path())["blob.safetensors"] == bytes(3 << 20, 16));
    let m = std::fs::read_to_string(out.path().join(MARKER)).expect("marker");
    assert!(!m.contains("SecretSig123") && !err.contains("SecretSig123"), "a presigned URL's signature stays private");

    let missing = format!("{endpoint}/files/nope.bin");
    let mut pod = init("model", tempfile::tempdir().expect("tmp").path(), &[], &[("STORAGE_URI", &missing)]);
    assert_eq!(pod.code(LIMIT), 221, "{}", pod.stderr());
    assert!(pod.stderr().contains(&format!("{missing}: 404 Not Found for {missing}")), "{}", pod.stderr());

    // https, with a CA this test made (SSL_CERT_FILE), through rustls in the
    // static binary; an unknown CA is refused at once, not retried.
    let pki = tempfile::tempdir().expect("tmp");
    let (ca, cert, key) = tls_pair(pki.path());
    let (_tls, endpoint) = hub(root.path(), &["--tls", cert.to_str().expect("utf-8"), key.to_str().expect("utf-8")]);
    let url = format!("{}/files/weights/blob.safetensors", endpoint.replace("http://", "https://"));
    let out = tempfile::tempdir().expect("tmp");
    let mut pod =
        init("model", out.path(), &[], &[("STORAGE_URI", &url), ("SSL_CERT_FILE", ca.to_str().expect("utf-8"))]);
    assert_eq!(pod.code(LIMIT), 0, "{}", pod.stderr());
    assert!(files(out.path())["blob.safetensors"] == bytes(3 << 20, 16));
    let mut pod = init("model", tempfile::tempdir().expect("tmp").path(), &[], &[("STORAGE_URI", &url)]);
    assert_eq!(pod.code(Duration::from_secs(30)), 226, "{}", pod.stderr());
    assert!(pod.stderr().contains("certificate"), "{}", pod.stderr());
}

#[test]
fn sigterm_stops_at_once_keeps_partial_files_and_releases_the_lock() {
    let (_root, _hub, endpoint) = slow_repo();
    let out = tempfile::tempdir().expect("tmp");
    let env = [("ENDPOINT", endpoint.as_str()), ("STORAGE_URI", "hf://org/slow")];
    let mut pod = init("model", out.path(), &["--chunk-size", "4", "--concurrency", "2"], &env);
    let start = Instant::now();
    while state_lines(out.path(), "weights.safetensors") < 2 {
        assert!(start.elapsed() < LIMIT, "no progress:\n{}", pod.stderr());
        std::thread::sleep(Duration::from_millis(50));
    }
    let stopping = Instant::now();
    pod.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(pod.code(LIMIT), 143, "{}", pod.stderr());
    assert!(stopping.elapsed() < Duration::from_secs(5), "stopped at once, not after the download");
    assert!(pod.stderr().contains("partial files were kept for the next run to resume"), "{}", pod.stderr());
    assert!(!out.path().join(".trainlet-init.lock").exists(), "the lock is released for the next pod");
    assert!(out.path().join(".weights.safetensors.trainlet-part").exists() && !out.path().join(MARKER).exists());
}

#[test]
fn the_book_lists_every_initializer_exit_code() {
    let book = crate::docs::chapter("initializers");
    let section = book.split("\n## Exit codes").nth(1).expect("section");
    let section = section.split("\n## ").next().expect("section end");
    let listed: Vec<u8> =
        section.lines().filter_map(|l| l.strip_prefix("| ")?.split(" |").next()?.trim().parse().ok()).collect();
    use initializers::exit::*;
    let mut want = vec![SUCCESS, 143, CONFIG, IO, NOT_FOUND, NO_FILES, CHECKSUM, NO_SPACE, DENIED, UNAVAILABLE];
    want.sort_unstable();
    assert_eq!(listed, want, "the book's initializer exit table and initializers::exit agree");
}

/// A tree listing whose `Link: rel="next"` names another host (here
/// `localhost` for an endpoint at 127.0.0.1: another origin) gets the page
/// request without the token; the loopback Hub refuses any Authorization
/// header on that host, so a success proves the token stayed home.
#[test]
fn hub_tokens_never_follow_a_pagination_link_to_another_host() {
    let root = tempfile::tempdir().expect("tmp");
    for i in 0..5 {
        put(&root.path().join("models/org/paged"), &format!("f{i}.json"), format!("{{\"i\":{i}}}").as_bytes());
    }
    let (_hub, endpoint) = hub(root.path(), &["--page-size", "2", "--next-host", "localhost"]);
    let out = tempfile::tempdir().expect("tmp");
    let mut pod = init(
        "model",
        out.path(),
        &[],
        &[("ENDPOINT", endpoint.as_str()), ("STORAGE_URI", "hf://org/paged"), ("ACCESS_TOKEN", "hf_SecretToken")],
    );
    assert_eq!(pod.code(LIMIT), 0, "{}", pod.stderr());
    assert_eq!(files(out.path()).len(), 5);
    let err = pod.stderr();
    assert!(err.contains("following it without the token"), "{err}");
    assert!(!err.contains("hf_SecretToken"), "{err}");
}

/// Names from a listing are data: one with a newline (it forged a log
/// line) or an escape sequence is skipped with a warning that shows it
/// escaped, and one whose temporary name would pass 255 bytes is skipped
/// instead of failing the run with 202; the rest arrives.
#[test]
fn hub_names_with_control_characters_or_too_long_are_skipped_and_logged_escaped() {
    let root = tempfile::tempdir().expect("tmp");
    let repo = root.path().join("models/org/names");
    put(&repo, "config.json", b"{}");
    put(&repo, "evil\n2026-01-01T00:00:00Z  INFO forged line", b"x");
    put(&repo, "bell\u{7}.json", b"x");
    put(&repo, &format!("{}.json", "n".repeat(240)), b"x");
    let (_hub, endpoint) = hub(root.path(), &[]);
    let out = tempfile::tempdir().expect("tmp");
    let mut pod = init(
        "model",
        out.path(),
        &[],
        &[("ENDPOINT", endpoint.as_str()), ("STORAGE_URI", "hf://org/names"), ("IGNORE_PATTERNS", "")],
    );
    assert_eq!(pod.code(LIMIT), 0, "{}", pod.stderr());
    let err = pod.stderr();
    assert_eq!(files(out.path()).keys().cloned().collect::<Vec<_>>(), vec!["config.json".to_string()], "{err}");
    assert!(!err.lines().any(|l| l.contains("INFO forged line") && !l.contains("skipping")), "a forged line:\n{err}");
    assert!(err.contains("evil\\n2026-01-01T00:00:00Z  INFO forged line"), "{err}");
    assert!(err.contains("its name holds control characters"), "{err}");
    assert!(err.contains("too long for its temporary name"), "{err}");
    assert!(!err.contains('\u{7}'), "{err}");
}
