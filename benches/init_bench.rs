//! `trainlet init` against what Trainer's initializers run, on the same
//! bytes, side by side: a 1 GiB model repo (three safetensors shards, one of
//! 512 MiB, plus small JSON files) on the loopback Hub
//! (tests/fixtures/hub_server.py, sendfile) fetched by trainlet and by
//! `huggingface_hub.snapshot_download`; the same files on moto's S3 server
//! fetched by trainlet, by Python OpenDAL (Trainer's S3 initializer) and by
//! boto3's transfer manager; and a plain local copy of the same bytes
//! (`cp -r`, same filesystem) as the floor. Runs are interleaved; medians.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{Row, median, python, trainlet};

const RUNS: usize = 3;

/// The repo: (path, MiB).
const FILES: [(&str, usize); 5] = [
    ("model-00001-of-00003.safetensors", 512),
    ("model-00002-of-00003.safetensors", 320),
    ("model-00003-of-00003.safetensors", 192),
    ("config.json", 0),
    ("tokenizer.json", 0),
];

use crate::support::fixture_server::Server;

/// Start a fixture server (seeding 1 GiB into moto takes a while).
fn serve(script: &str, args: &[String]) -> Server {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(script);
    Server::start(&python(), &script, args, Duration::from_secs(600))
}

/// Write the repo's files under `dir` (xorshift bytes: incompressible).
fn write_repo(dir: &Path) -> u64 {
    std::fs::create_dir_all(dir).expect("mkdir");
    let mut total = 0;
    for (i, (name, mib)) in FILES.iter().enumerate() {
        let path = dir.join(name);
        if *mib == 0 {
            std::fs::write(&path, format!("{{\"file\": {i}}}")).expect("write");
            total += std::fs::metadata(&path).expect("meta").len();
            continue;
        }
        let mut f = std::io::BufWriter::with_capacity(8 << 20, std::fs::File::create(&path).expect("create"));
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15 ^ (i as u64 + 1);
        let mut block = vec![0u8; 1 << 20];
        for _ in 0..*mib {
            for chunk in block.chunks_exact_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                chunk.copy_from_slice(&x.to_le_bytes());
            }
            std::io::Write::write_all(&mut f, &block).expect("write");
        }
        total += (*mib as u64) << 20;
    }
    total
}

/// Time `cmd` (must exit 0) into a fresh `out`, which is removed after.
fn timed(mut cmd: Command, out: &Path) -> Duration {
    let _ = std::fs::remove_dir_all(out);
    let start = Instant::now();
    let o = cmd.stdin(Stdio::null()).output().expect("spawn");
    let took = start.elapsed();
    assert!(
        o.status.success(),
        "benchmark command failed: {:?}\n{}{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let _ = std::fs::remove_dir_all(out);
    took
}

fn throughput_row(name: String, bytes: u64, ours: Duration, theirs: Duration, goal: &'static str) -> Row {
    let rate =
        |d: Duration| format!("{:.2} s ({:.0} MiB/s)", d.as_secs_f64(), bytes as f64 / 1048576.0 / d.as_secs_f64());
    Row { name, ours: rate(ours), theirs: rate(theirs), ratio: theirs.as_secs_f64() / ours.as_secs_f64(), goal }
}

fn local_copy(src: &Path, out: &Path) -> Command {
    let mut c = Command::new("cp");
    c.arg("-r").arg(src).arg(out);
    c
}

/// trainlet vs `huggingface_hub.snapshot_download` on the loopback Hub.
pub fn hub(rows: &mut Vec<Row>) {
    let dir = tempfile::tempdir_in(std::env::var("TRAINLET_BENCH_DIR").unwrap_or_else(|_| "/tmp".into())).expect("tmp");
    let repo = dir.path().join("root/models/bench/model-1g");
    let bytes = write_repo(&repo);
    let hub = serve("hub_server.py", &["--root".into(), dir.path().join("root").display().to_string()]);
    let endpoint = format!("http://127.0.0.1:{}", hub.fields[0]);
    let out = dir.path().join("out");
    let ours = || {
        let mut c = Command::new(trainlet());
        c.args(["init", "model", "--output"])
            .arg(&out)
            .env("STORAGE_URI", "hf://bench/model-1g")
            .env("ENDPOINT", &endpoint)
            .env("TRAINLET_LOG", "warn");
        c
    };
    let script = "import sys\nfrom huggingface_hub import snapshot_download\nsnapshot_download(sys.argv[1], local_dir=sys.argv[2], endpoint=sys.argv[3], allow_patterns=['*.json','*.safetensors','*.model','*.txt','*.gguf'], ignore_patterns=['*.msgpack','*.h5','*.bin','*.pt','*.pth'])\n";
    let theirs = || {
        let mut c = Command::new(python());
        c.args(["-c", script, "bench/model-1g"])
            .arg(&out)
            .arg(&endpoint)
            .env("HF_HOME", dir.path().join("hf-home"))
            .env("HF_HUB_DISABLE_PROGRESS_BARS", "1")
            .env("HF_HUB_DISABLE_TELEMETRY", "1");
        c
    };
    let (mut a, mut b, mut cp) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..RUNS {
        a.push(timed(ours(), &out));
        b.push(timed(theirs(), &out));
        cp.push(timed(local_copy(&repo, &out), &out));
    }
    let (a, b, cp) = (median(a), median(b), median(cp));
    rows.push(throughput_row(
        "model repo of 1 GiB from the loopback Hub (3 safetensors shards): huggingface_hub.snapshot_download".into(),
        bytes,
        a,
        b,
        "2x",
    ));
    rows.push(throughput_row("the same 1 GiB: plain local copy (cp -r) as the floor".into(), bytes, a, cp, "report"));
}

/// trainlet vs Python OpenDAL and boto3 on moto's S3 server.
pub fn s3(rows: &mut Vec<Row>) {
    let dir = tempfile::tempdir_in(std::env::var("TRAINLET_BENCH_DIR").unwrap_or_else(|_| "/tmp".into())).expect("tmp");
    let data = dir.path().join("data/model");
    let bytes = write_repo(&data);
    let seed = format!("bench={}", dir.path().join("data").display());
    let s3 = serve("s3_server.py", &["--seed".into(), seed]);
    let endpoint = format!("http://127.0.0.1:{}", s3.fields[0]);
    let (key, secret) = (s3.fields[1].clone(), s3.fields[2].clone());
    let out = dir.path().join("out");
    let env = |c: &mut Command| {
        c.env("ENDPOINT", &endpoint)
            .env("ACCESS_KEY_ID", &key)
            .env("SECRET_ACCESS_KEY", &secret)
            .env("REGION", "us-east-1");
    };
    // Defaults (32 MiB ranges), and one GET per object as the Python
    // clients do: moto answers each ranged GET by copying the whole object
    // in Python, so ranges cost it O(object) each (boto3's 8 MiB parts show
    // it), unlike S3 itself.
    let ours = |chunk: &str, verify: &str| {
        let mut c = Command::new(trainlet());
        c.args(["init", "model", "--chunk-size", chunk, "--verify", verify, "--output"])
            .arg(&out)
            .env("STORAGE_URI", "s3://bench/model")
            .env("TRAINLET_LOG", "warn");
        env(&mut c);
        c
    };
    // What Trainer's S3 initializer does with OpenDAL: list, then stream
    // each object to its file. Listed from the bucket's root (the bucket
    // holds only these objects): OpenDAL sends a prefix's `/` raw in the
    // query, which moto's signature check refuses (trainlet's transport
    // sends it as signed, `%2F`; see s3.rs).
    let opendal = "import os, shutil, sys, opendal\nop = opendal.Operator('s3', bucket='bench', endpoint=os.environ['ENDPOINT'], region='us-east-1', access_key_id=os.environ['ACCESS_KEY_ID'], secret_access_key=os.environ['SECRET_ACCESS_KEY'])\nfor e in op.list('', recursive=True):\n    if e.path.endswith('/') or not e.path.startswith('model/'):\n        continue\n    dst = os.path.join(sys.argv[1], os.path.relpath(e.path, 'model'))\n    os.makedirs(os.path.dirname(dst), exist_ok=True)\n    with op.open(e.path, 'rb') as r, open(dst, 'wb') as w:\n        shutil.copyfileobj(r, w, 8 << 20)\n";
    let boto = "import os, sys, boto3\ns3 = boto3.client('s3', endpoint_url=os.environ['ENDPOINT'], aws_access_key_id=os.environ['ACCESS_KEY_ID'], aws_secret_access_key=os.environ['SECRET_ACCESS_KEY'], region_name='us-east-1')\nfor o in s3.list_objects_v2(Bucket='bench', Prefix='model/')['Contents']:\n    dst = os.path.join(sys.argv[1], os.path.relpath(o['Key'], 'model'))\n    os.makedirs(os.path.dirname(dst), exist_ok=True)\n    s3.download_file('bench', o['Key'], dst)\n";
    let py = |code: &'static str| {
        let mut c = Command::new(python());
        c.args(["-c", code]).arg(&out);
        env(&mut c);
        c
    };
    let (mut a, mut whole, mut sized, mut b, mut c3, mut cp) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..RUNS {
        a.push(timed(ours("32", "full"), &out));
        whole.push(timed(ours("1024", "full"), &out));
        sized.push(timed(ours("1024", "size"), &out));
        b.push(timed(py(opendal), &out));
        c3.push(timed(py(boto), &out));
        cp.push(timed(local_copy(&data, &out), &out));
    }
    let (a, whole, sized, b, c3, cp) = (median(a), median(whole), median(sized), median(b), median(c3), median(cp));
    rows.push(throughput_row(
        "the same 1 GiB from moto's S3 server, one GET per object (--chunk-size 1024): Python OpenDAL (Trainer's S3 initializer)".into(),
        bytes,
        whole,
        b,
        "2x",
    ));
    rows.push(throughput_row(
        "the same, trainlet with --verify size (no MD5; OpenDAL checks nothing): Python OpenDAL".into(),
        bytes,
        sized,
        b,
        "2x",
    ));
    rows.push(throughput_row(
        "the same, trainlet in 32 MiB ranges (its default): boto3's transfer manager (8 MiB ranges)".into(),
        bytes,
        a,
        c3,
        "2x",
    ));
    rows.push(throughput_row(
        "the same 1 GiB, one GET per object: plain local copy (cp -r) as the floor".into(),
        bytes,
        whole,
        cp,
        "report",
    ));
}
