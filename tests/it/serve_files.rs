//! Serve mode's files and output: a run cannot plant code for the next
//! through the file cache, and one endless line cannot grow an agent.

use std::io::BufRead;
use std::time::{Duration, Instant};

use crate::serve::{Served, TOKEN, http, json, start};

fn sha256_hex(data: &[u8]) -> String {
    data_encoding::HEXLOWER.encode(ring::digest::digest(&ring::digest::SHA256, data).as_ref())
}

/// Submit `body` (a run's JSON) and wait until it is over: its record and
/// every line it printed, from the control API.
fn run(s: &Served, body: &serde_json::Value) -> (serde_json::Value, String) {
    let (status, reply) = http(&s.url, "POST", "/v1/runs", Some(TOKEN), &body.to_string());
    assert_eq!(status, 201, "{reply}\n{}", s.pods[0].stderr());
    let id = json(&reply)["id"].as_str().expect("id").to_string();
    let deadline = Instant::now() + Duration::from_secs(300);
    let record = loop {
        let (_, reply) = http(&s.url, "GET", &format!("/v1/runs/{id}"), Some(TOKEN), "");
        let record = json(&reply);
        if ["succeeded", "failed", "stopped"].iter().any(|st| record["state"] == *st) {
            break record;
        }
        assert!(Instant::now() < deadline, "run {id} is not over: {record}\n{}", s.pods[0].stderr());
        std::thread::sleep(Duration::from_millis(200));
    };
    let (_, logs) = http(&s.url, "GET", &format!("/v1/runs/{id}/logs?follow=true"), Some(TOKEN), "");
    (record, logs)
}

fn with_files(command: &[&str], files: &[(&str, &str)]) -> serde_json::Value {
    let files: serde_json::Map<String, serde_json::Value> = files
        .iter()
        .map(|(path, text)| ((*path).to_string(), data_encoding::BASE64.encode(text.as_bytes()).into()))
        .collect();
    serde_json::json!({"command": command, "files": files, "nproc_per_node": 1})
}

fn succeeded(s: &Served, (record, logs): &(serde_json::Value, String)) {
    assert_eq!(record["state"], "succeeded", "{record}\n{logs}\npod 0:\n{}", s.pods[0].stderr());
}

/// Run A overwrites `../../blobs/<sha256 of B's file>` (its working
/// directory is `<serve dir>/runs/<id>/`) with other code of the same
/// size; run B still runs its own code on both pods, and each pod says
/// that its cached copy did not match.
#[test]
fn a_run_cannot_plant_code_for_the_next_in_the_file_cache() {
    let s = start(2, &[]);
    let own = "import os; print('OWN-CODE rank=' + os.environ['RANK'], flush=True)\n";
    let planted = "import os; print('PLANTED! rank=' + os.environ['RANK'], flush=True)\n";
    assert_eq!(own.len(), planted.len(), "the same size: the old cache took it as the blob");
    let sha = sha256_hex(own.as_bytes());
    let plant = format!("open('../../blobs/{sha}', 'w').write({planted:?})");
    succeeded(&s, &run(&s, &with_files(&["python", "-c", &plant], &[])));
    for node in 0..2 {
        let blob = s.dir.path().join(format!("pod{node}/blobs/{sha}"));
        assert_eq!(std::fs::read_to_string(&blob).expect("planted"), planted, "run A planted it on pod {node}");
    }
    let b = run(&s, &with_files(&["python", "b.py"], &[("b.py", own)]));
    succeeded(&s, &b);
    let logs = &b.1;
    assert!(!logs.contains("PLANTED"), "run A's code ran in run B:\n{logs}");
    for rank in 0..2 {
        assert!(logs.contains(&format!("OWN-CODE rank={rank}")), "rank {rank} ran run B's own code:\n{logs}");
    }
    for (node, pod) in s.pods.iter().enumerate() {
        let err = pod.stderr();
        assert!(err.contains("cached copy did not match"), "pod {node} says its cache was changed:\n{err}");
        let blob = s.dir.path().join(format!("pod{node}/blobs/{sha}"));
        assert_eq!(std::fs::read_to_string(&blob).expect("cached"), own, "pod {node} cached the store's copy again");
    }
}

/// A run replaces `runs` and `blobs` with symlinks to directories of its
/// choosing and plants `blobs/<sha>.part` as a link to a file: the agent
/// writes through none of them and prunes nothing they point to, and the
/// next runs still run their own code.
#[test]
fn a_run_cannot_redirect_the_cache_or_the_run_directories() {
    let s = start(2, &[]);
    let b_code = "import os; print('B-OWN rank=' + os.environ['RANK'], flush=True)\n\
        os.makedirs('../../victim-blobs'); open('../../victim-blobs/canary', 'w').write('alive')\n\
        os.rename('../../blobs', '../../blobs-old'); os.symlink('victim-blobs', '../../blobs')\n";
    let c_code = "import os; print('C-OWN rank=' + os.environ['RANK'], flush=True)\n";
    let b_sha = sha256_hex(b_code.as_bytes());
    // A: `runs` -> victim-runs/ (holding a canary), `blobs/<B's sha>.part`
    // -> victim-file.
    let a_code = format!(
        "import os\n\
         os.makedirs('../../victim-runs'); open('../../victim-runs/canary', 'w').write('alive')\n\
         os.rename('../../runs', '../../runs-old'); os.symlink('victim-runs', '../../runs')\n\
         open('../../victim-file', 'w').write('alive')\n\
         os.symlink('../victim-file', '../../blobs/{b_sha}.part')\n"
    );
    succeeded(&s, &run(&s, &with_files(&["python", "a.py"], &[("a.py", &a_code)])));
    let pod_dir = |node: usize| s.dir.path().join(format!("pod{node}"));
    for node in 0..2 {
        let runs = std::fs::symlink_metadata(pod_dir(node).join("runs")).expect("runs");
        assert!(runs.file_type().is_symlink(), "run A left its links on pod {node}");
    }
    let b = run(&s, &with_files(&["python", "b.py"], &[("b.py", b_code)]));
    succeeded(&s, &b);
    for rank in 0..2 {
        assert!(b.1.contains(&format!("B-OWN rank={rank}")), "{}", b.1);
    }
    let c = run(&s, &with_files(&["python", "c.py"], &[("c.py", c_code)]));
    succeeded(&s, &c);
    for rank in 0..2 {
        assert!(c.1.contains(&format!("C-OWN rank={rank}")), "{}", c.1);
    }
    // Every way it went wrong, not only the first.
    let mut wrong = Vec::new();
    for node in 0..2 {
        let dir = pod_dir(node);
        for victim in ["victim-runs/canary", "victim-blobs/canary", "victim-file"] {
            let kept = std::fs::read_to_string(dir.join(victim)).unwrap_or_else(|e| format!("({e})"));
            if kept != "alive" {
                wrong.push(format!("pod {node}: {victim} was written or pruned through a run's link: {kept:?}"));
            }
        }
        for plain in ["runs", "blobs"] {
            if !std::fs::symlink_metadata(dir.join(plain)).is_ok_and(|m| m.is_dir()) {
                wrong.push(format!("pod {node}: {plain} is not a plain directory"));
            }
        }
        for victim in ["victim-runs", "victim-blobs"] {
            let made: Vec<_> = std::fs::read_dir(dir.join(victim))
                .map(|d| d.flatten().map(|e| e.file_name()).filter(|n| n != "canary").collect())
                .unwrap_or_default();
            if !made.is_empty() {
                wrong.push(format!("pod {node}: the agent made {made:?} in {victim}"));
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// Resident set of process `pid` in bytes: (now, peak).
fn rss(pid: i32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// A worker prints 512 MiB without a newline: the agent's memory stays
/// bounded, and its console shows every byte, in prefixed lines of at
/// most 64 KiB.
#[test]
fn one_endless_line_does_not_grow_the_agent() {
    const TOTAL: u64 = 512 << 20;
    const LIMIT: u64 = 200 << 20;
    let s = start(1, &["--standalone"]);
    let pid = s.pods[0].pid();
    let writer = format!(
        "import os\n\
         b = b'x' * (1 << 20)\n\
         left = {TOTAL}\n\
         while left:\n    left -= os.write(1, b[:min(left, len(b))])\n\
         os.write(1, b'END\\n')\n"
    );
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (outcome, sampled) = std::thread::scope(|scope| {
        let sampler = scope.spawn(|| {
            let mut most = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                most = most.max(rss(pid).0);
                std::thread::sleep(Duration::from_millis(20));
            }
            most
        });
        let outcome = run(&s, &with_files(&["python", "w.py"], &[("w.py", &writer)]));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        (outcome, sampler.join().expect("sampler"))
    });
    succeeded(&s, &outcome);
    let (_, peak) = rss(pid);
    assert!(
        sampled < LIMIT && peak < LIMIT,
        "the agent grew to {} MiB resident (peak {} MiB)",
        sampled >> 20,
        peak >> 20
    );
    // Every byte on the console, in pieces.
    let out = std::io::BufReader::new(std::fs::File::open(&s.pods[0].out).expect("stdout"));
    let (mut xs, mut pieces, mut ended) = (0u64, 0u64, false);
    for line in out.split(b'\n') {
        let line = line.expect("read");
        let Some(piece) = line.strip_prefix(b"[default0]: ") else { continue };
        let body = piece.strip_suffix(b"END").unwrap_or(piece);
        if body.iter().all(|b| *b == b'x') {
            assert!(piece.len() <= 64 * 1024, "a piece of {} bytes", piece.len());
            xs += body.len() as u64;
            pieces += 1;
            ended |= body.len() < piece.len();
        }
    }
    assert_eq!(xs, TOTAL, "every byte reached the console");
    assert!(ended, "and the line's end");
    assert!(pieces >= TOTAL / (64 * 1024), "in pieces of at most 64 KiB: {pieces}");
}
