//! GPU pinning, the NVML child probe and pre-flight checks, without a GPU:
//! a fake sysfs/procfs tree (`TRAINLET_SYSFS_ROOT`) and a fake
//! libnvidia-ml.so.1 built from `tests/fixtures/fake_nvml.c`, loaded by the
//! real nvml-wrapper code in trainlet's probe child (the static binary).
//!
//! The fake machine is an 8-GPU, 2-node box whose nodes are this machine's
//! CPUs 0 and 1, so the binding the planner computes can be applied for
//! real and read back from /proc: GPUs 0-3 are local to CPU 0, GPUs 4-7 to
//! CPU 1. trainlet runs under `taskset` so its cpuset is the same on any CI
//! machine.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use crate::util::{Pod, bin, fixture, parse_kv};

const LIMIT: Duration = Duration::from_secs(60);
const BUS: [&str; 8] = trainlet::gpu::sysfs::fake::DGX_BUS;

/// The fake libnvidia-ml.so.1, compiled once per test run.
fn fake_nvml() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("trainlet-fake-nvml-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let lib = dir.join("libnvidia-ml.so.1");
        let st = std::process::Command::new("gcc")
            .args(["-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-Wl,-soname,libnvidia-ml.so.1", "-o"])
            .arg(&lib)
            .arg(fixture("fake_nvml.c"))
            .status()
            .expect("gcc (apt-get install gcc)");
        assert!(st.success(), "cannot build the fake NVML");
        lib
    })
}

/// The fake machine: 2 NUMA nodes (CPU 0, CPU 1), 8 GPUs, 4 per node.
fn eight_gpu_box() -> tempfile::TempDir {
    let d = tempfile::tempdir().expect("tmp");
    trainlet::gpu::sysfs::fake::dgx_on_two_cpus(d.path()).expect("fake tree");
    d
}

/// Environment of a pod on `root` with the fake NVML configured by `nvml`.
fn env<'a>(root: &'a Path, nvml: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut e = vec![
        ("TRAINLET_SYSFS_ROOT", root.to_str().expect("utf-8")),
        ("TRAINLET_NVML_LIB", fake_nvml().to_str().expect("utf-8")),
        ("FAKE_NVML_COUNT", "8"),
    ];
    static BUS_LIST: OnceLock<String> = OnceLock::new();
    e.push(("FAKE_NVML_BUS", BUS_LIST.get_or_init(|| BUS.join(","))));
    e.extend_from_slice(nvml);
    e
}

/// `trainlet run` of 8 pinned workers under `taskset -c cpus`.
fn launch(cpus: &str, extra_args: &[&str], env: &[(&str, &str)]) -> Pod {
    let trainlet = bin();
    let mut args = vec!["-c", cpus, trainlet.to_str().expect("utf-8"), "run", "--nproc-per-node", "gpu"];
    args.extend_from_slice(extra_args);
    let worker = fixture("pinned_worker.sh");
    args.extend(["--no-python", worker.as_str()]);
    Pod::start_as(Path::new("taskset"), &args, env)
}

/// Each worker's `PIN` line, by local rank (from LOCAL_RANK unless single).
fn pins(out: &str) -> Vec<std::collections::HashMap<String, String>> {
    let mut v: Vec<_> = out.lines().filter(|l| l.contains("PIN ")).map(parse_kv).collect();
    v.sort_by_key(|kv| kv["rank"].parse::<u32>().expect("rank"));
    v
}

#[test]
fn eight_workers_get_their_gpu_and_its_cpus() {
    let root = eight_gpu_box();
    let mut pod = launch("0,1", &[], &env(root.path(), &[]));
    assert_eq!(pod.code(LIMIT), 0, "{}", pod.stderr());
    let got = pins(&pod.stdout());
    assert_eq!(got.len(), 8, "{}", pod.stdout());
    for (i, kv) in got.iter().enumerate() {
        assert_eq!(kv["local_rank"], i.to_string());
        assert_eq!(kv["order"], "PCI_BUS_ID");
        assert_eq!(kv["cuda"], "unset", "default visibility keeps CUDA_VISIBLE_DEVICES as it was");
        assert_eq!(kv["cpus"], if i < 4 { "0" } else { "1" }, "rank {i}: {kv:?}");
    }
    let err = pod.stderr();
    // Node 1 does not exist on this machine: memory binding is refused once.
    assert_eq!(err.matches("NUMA memory binding is off").count(), 1, "{err}");
    assert!(!err.contains("NVML is unavailable"), "{err}");
    assert!(!err.contains("leftover"), "the NVML probe is gone before the agent exits:\n{err}");
}

#[test]
fn a_restricted_cpuset_is_never_left() {
    let root = eight_gpu_box();
    let mut pod = launch("0", &[], &env(root.path(), &[]));
    assert_eq!(pod.code(LIMIT), 0, "{}", pod.stderr());
    let got = pins(&pod.stdout());
    assert_eq!(got.len(), 8);
    // The GPUs of node 1 are local to CPU 1, outside the cpuset: those ranks
    // fall back to the cpuset, logged, and nobody runs outside it.
    assert!(got.iter().all(|kv| kv["cpus"] == "0"), "{got:?}");
    let err = pod.stderr();
    assert_eq!(err.matches("binding to the whole cpuset").count(), 4, "{err}");
}

#[test]
fn single_visibility_gives_each_worker_its_own_gpu() {
    let root = eight_gpu_box();
    let mut pod = launch("0,1", &["--gpu-visibility", "single", "--pin", "cpu"], &env(root.path(), &[]));
    assert_eq!(pod.code(LIMIT), 0, "{}", pod.stderr());
    let got = pins(&pod.stdout());
    for (i, kv) in got.iter().enumerate() {
        assert_eq!(kv["cuda"], format!("GPU-0000000{i}-fake"));
        assert_eq!(kv["local_rank"], "0", "torchrun's --virtual-local-rank");
    }
    assert!(!pod.stderr().contains("NUMA memory binding"), "cpu mode binds no memory");
}

#[test]
fn nic_hints_point_each_rank_at_its_nodes_nics_unless_set() {
    let root = eight_gpu_box();
    use trainlet::gpu::sysfs::fake::nic;
    for (name, ib, numa) in [("mlx5_0", true, 0), ("mlx5_1", true, 1), ("eth0", false, 0), ("eth1", false, 1)] {
        nic(root.path(), name, ib, numa).expect("nic");
    }
    let mut pod = launch("0,1", &["--nic-hint"], &env(root.path(), &[]));
    assert_eq!(pod.code(LIMIT), 0, "{}", pod.stderr());
    for (i, kv) in pins(&pod.stdout()).iter().enumerate() {
        let node = usize::from(i >= 4);
        assert_eq!(
            (kv["ib"].clone(), kv["ifname"].clone()),
            (format!("=mlx5_{node}"), format!("=eth{node}")),
            "{kv:?}"
        );
    }
    let mut pod = launch("0,1", &["--nic-hint"], &env(root.path(), &[("NCCL_IB_HCA", "mine")]));
    assert_eq!(pod.code(LIMIT), 0, "{}", pod.stderr());
    assert!(pins(&pod.stdout()).iter().all(|kv| kv["ib"] == "mine"), "the user's setting stays");
    let mut pod = launch("0,1", &[], &env(root.path(), &[]));
    assert_eq!(pod.code(LIMIT), 0, "{}", pod.stderr());
    assert!(pins(&pod.stdout()).iter().all(|kv| kv["ib"] == "unset"), "off by default");
}

#[test]
fn pin_none_leaves_workers_alone() {
    let root = eight_gpu_box();
    let mut pod = launch("0,1", &["--pin", "none"], &env(root.path(), &[]));
    assert_eq!(pod.code(LIMIT), 0, "{}", pod.stderr());
    for kv in pins(&pod.stdout()) {
        assert_eq!((kv["cpus"].as_str(), kv["order"].as_str()), ("0-1", "unset"), "{kv:?}");
    }
}

#[test]
fn a_crashing_or_hung_nvml_costs_one_warning() {
    let root = eight_gpu_box();
    for (mode, why) in [
        ("abort", "_dl_call_libc_early_init: Assertion"),
        ("hang", "did not answer within 1s and was killed"),
        ("fail", "NVML init failed"),
    ] {
        let mut pod = launch("0,1", &["--nvml-timeout", "1"], &env(root.path(), &[("FAKE_NVML_INIT", mode)]));
        assert_eq!(pod.code(LIMIT), 0, "{mode}: {}", pod.stderr());
        let err = pod.stderr();
        assert_eq!(err.matches("NVML is unavailable").count(), 1, "{mode}: {err}");
        assert!(err.contains(why), "{mode}: {err}");
        assert_eq!(pins(&pod.stdout()).len(), 8, "{mode}: sysfs data is enough to launch");
        assert!(!err.contains("leftover"), "{mode}: the probe is gone before the agent exits:\n{err}");
    }
}

#[test]
fn each_preflight_failure_exits_with_its_code_and_names_the_gpu() {
    let root = eight_gpu_box();
    let gpu2 = "GPU 2 (0000:3a:00.0, GPU-00000002-fake)";
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], i32, String);
    let cases: [Case<'_>; 8] = [
        (&[], &[("FAKE_NVML_FAULTS", "2:ecc=4")], 207, format!("pre-flight check ecc failed: {gpu2}: 4 uncorrected ECC errors")),
        (&[], &[("FAKE_NVML_FAULTS", "2:remap_pending")], 207, format!("pre-flight check remap failed: {gpu2}: row remapping pending")),
        (&[], &[("FAKE_NVML_FAULTS", "2:remap_failed")], 207, format!("pre-flight check remap failed: {gpu2}: row remapping failed")),
        (&[], &[("FAKE_NVML_FAULTS", "2:lost")], 207, format!("pre-flight check lost failed: {gpu2}: not reachable through NVML (NVML index 2: device fell off the bus")),
        (&[], &[("FAKE_NVML_FAULTS", "2:mig_pending")], 207, format!("pre-flight check mig failed: {gpu2}: MIG mode change pending")),
        (&["--mig", "on"], &[], 208, "pre-flight check mig failed: GPU 0 (0000:18:00.0, GPU-00000000-fake): MIG is off but the job asks for MIG on".into()),
        (&["--expect-gpus", "9"], &[], 207, "given 9 GPUs (--expect-gpus) but 8 are usable".into()),
        (&[], &[("FAKE_NVML_COUNT", "7")], 207, "pre-flight check lost failed: GPU 7 (0000:db:00.0, GPU-00000007-fake): not reachable through NVML (the driver lists 7 GPUs, not this one)".into()),
    ];
    for (args, nvml, code, want) in cases {
        let mut pod = launch("0,1", args, &env(root.path(), nvml));
        assert_eq!(pod.code(LIMIT), code, "{args:?} {nvml:?}: {}", pod.stderr());
        assert!(pod.stderr().contains(&want), "{args:?} {nvml:?}: want {want:?} in\n{}", pod.stderr());
        assert!(pins(&pod.stdout()).is_empty(), "no worker may start after a failed pre-flight check");
    }
    // More workers than GPUs is the job's fault.
    let mut pod = Pod::start_as(
        Path::new("taskset"),
        &["-c", "0,1", bin().to_str().expect("utf-8"), "run", "--nproc-per-node", "9", "--no-python", "true"],
        &env(root.path(), &[]),
    );
    assert_eq!(pod.code(LIMIT), 208, "{}", pod.stderr());
    assert!(pod.stderr().contains("9 workers per node but only 8 GPUs are visible"), "{}", pod.stderr());
    // The checks can be turned off.
    let mut pod = launch("0,1", &["--preflight", "count"], &env(root.path(), &[("FAKE_NVML_FAULTS", "2:ecc=4")]));
    assert_eq!(pod.code(LIMIT), 0, "{}", pod.stderr());
}

#[test]
fn gpu_workers_on_a_machine_without_gpus_is_a_clear_error() {
    let empty = tempfile::tempdir().expect("tmp");
    let mut pod = Pod::start(
        &["run", "--nproc-per-node", "gpu", "--no-python", "true"],
        &[("TRAINLET_SYSFS_ROOT", empty.path().to_str().expect("utf-8"))],
    );
    assert_eq!(pod.code(LIMIT), 200);
    assert!(pod.stderr().contains("invalid --nproc-per-node value \"gpu\""), "{}", pod.stderr());
    assert!(pod.stderr().contains("no GPU is usable here"), "{}", pod.stderr());
}

#[test]
fn doctor_shows_the_topology_placement_and_checks() {
    let root = eight_gpu_box();
    let trainlet = bin();
    let args = ["-c", "0,1", trainlet.to_str().expect("utf-8"), "doctor", "--nproc-per-node", "auto"];
    let mut pod = Pod::start_as(Path::new("taskset"), &args, &env(root.path(), &[("FAKE_NVML_FAULTS", "5:ecc=1")]));
    assert_eq!(pod.code(LIMIT), 207, "doctor exits with the failed check's code: {}", pod.stderr());
    let out = pod.stdout();
    for want in [
        "gpus (8 usable",
        "0000:18:00.0",
        "GPU-00000005-fake",
        "agent cpus 0-1 (sched_getaffinity), numa nodes 2",
        "nvml: driver 580.95.05-fake, 8 GPUs",
        "ecc    FAIL  exit 207: pre-flight check ecc failed: GPU 5 (0000:ab:00.0, GPU-00000005-fake)",
        "count  pass  8 GPUs",
    ] {
        assert!(out.contains(want), "doctor output lacks {want:?}:\n{out}");
    }
    let row = out.lines().find(|l| l.contains("0000:ba:00.0")).expect("row of GPU 6");
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cols, ["6", "0000:ba:00.0", "GPU-00000006-fake", "1", "1", "6", "1", "1"], "{row}");
}

#[test]
fn metrics_scraped_during_a_run_parse_with_prometheus_client() {
    let root = eight_gpu_box();
    let dir = tempfile::tempdir().expect("tmp");
    let stop = dir.path().join("stop");
    let addr = format!("127.0.0.1:{}", crate::util::free_port());
    // Rank 0 runs until told to stop; the other seven exit 0 at once.
    let script = format!("if [ \"$LOCAL_RANK\" = 0 ]; then while [ ! -e {} ]; do sleep 0.1; done; fi", stop.display());
    let trainlet = bin();
    let args = [
        "-c",
        "0,1",
        trainlet.to_str().expect("utf-8"),
        "run",
        "--nproc-per-node",
        "gpu",
        "--metrics-addr",
        &addr,
        "--no-python",
        "/bin/sh",
        "-c",
        &script,
    ];
    // GPU 3 held down by a thermal slowdown, GPU 5's link replaying.
    let faults = [("FAKE_NVML_FAULTS", "3:thermal;5:replays=7")];
    let mut pod = Pod::start_as(Path::new("taskset"), &args, &env(root.path(), &faults));
    let deadline = std::time::Instant::now() + LIMIT;
    let text = loop {
        let t = crate::util::scrape(&addr);
        if t.contains("trainlet_worker_exits_total{code=\"0\"} 7") && t.contains("trainlet_gpu_nvml_up 1") {
            break t;
        }
        assert!(std::time::Instant::now() < deadline, "metrics never showed the run:\n{t}\n{}", pod.stderr());
        std::thread::sleep(Duration::from_millis(100));
    };
    let page = dir.path().join("metrics.txt");
    std::fs::write(&page, &text).expect("write");
    let parsed = std::process::Command::new(crate::util::python())
        .args([
            "-c",
            "import sys\nfrom prometheus_client.parser import text_string_to_metric_families as p\n\
             for f in p(open(sys.argv[1]).read()):\n    print(f.name, f.type, len(f.samples))",
        ])
        .arg(&page)
        .output()
        .expect("python");
    assert!(parsed.status.success(), "{}", String::from_utf8_lossy(&parsed.stderr));
    let families = String::from_utf8_lossy(&parsed.stdout).to_string();
    // prometheus_client names counter families without `_total`.
    for want in [
        "trainlet_workers_started counter",
        "trainlet_worker_exits counter",
        "trainlet_restarts counter",
        "trainlet_rendezvous_duration_seconds histogram",
        "trainlet_store_connections counter",
        "trainlet_store_operations counter",
        "trainlet_gpu_nvml_up gauge",
        "trainlet_gpu_utilization_ratio gauge 8",
        "trainlet_gpu_memory_used_bytes gauge 8",
        "trainlet_gpu_memory_total_bytes gauge 8",
        "trainlet_gpu_temperature_celsius gauge 8",
        "trainlet_gpu_ecc_errors counter 16",
        "trainlet_gpu_sm_clock_hertz gauge 8",
        "trainlet_gpu_sm_clock_max_hertz gauge 8",
        "trainlet_gpu_clock_event_reasons gauge 8",
        "trainlet_gpu_pcie_replays gauge 8",
    ] {
        assert!(families.contains(want), "{want:?} not parsed from the page:\n{families}\n{text}");
    }
    assert!(text.contains("trainlet_workers_started_total 8"), "{text}");
    assert!(
        text.contains(r#"trainlet_gpu_temperature_celsius{bus_id="0000:ba:00.0",gpu="6",uuid="GPU-00000006-fake"} 46"#),
        "{text}"
    );
    let of = |gpu: &str, metric: &str| {
        text.lines()
            .find(|l| l.starts_with(metric) && l.contains(&format!("gpu=\"{gpu}\"")))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
    };
    assert_eq!(of("3", "trainlet_gpu_sm_clock_hertz{"), Some(1.2e9), "{text}");
    assert_eq!(of("3", "trainlet_gpu_sm_clock_max_hertz{"), Some(1.98e9), "{text}");
    assert_eq!(of("3", "trainlet_gpu_clock_event_reasons{"), Some(64.0), "hardware thermal slowdown: {text}");
    assert_eq!(of("2", "trainlet_gpu_clock_event_reasons{"), Some(1.0), "idle: {text}");
    assert_eq!(of("5", "trainlet_gpu_pcie_replays{"), Some(7.0), "{text}");
    std::fs::write(&stop, "").expect("stop");
    assert_eq!(pod.code(LIMIT), 0, "{}", pod.stderr());
    assert!(!pod.stderr().contains("leftover"), "the sampler is stopped, not swept up:\n{}", pod.stderr());
}

/// Several actors at once (serve mode's lanes) on a pod with 8 GPUs and 2
/// worker slots: the main actor, from slot 0, sees every GPU as a run alone
/// always did; the actor beside it, on slot 1, sees slot 1's GPU alone (so
/// its LOCAL_RANK 0 is that GPU); one that names its GPUs in its env gets
/// those. Real actors through the repository's Python client.
#[test]
fn an_actor_beside_the_main_run_sees_its_slots_gpu_alone() {
    let root = eight_gpu_box();
    let dir = tempfile::tempdir().expect("tmp");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "t0ken\n").expect("token");
    let control = crate::util::free_port();
    let driver = dir.path().join("gpus_driver.py");
    let client = crate::util::repo().join("clients/python");
    std::fs::write(
        &driver,
        format!(
            "import json, os, sys\nsys.path.insert(0, {client:?})\nfrom trainlet_client import Trainlet\n\n\
             class Env:\n    def get(self):\n        return {{k: os.environ.get(k) for k in ('CUDA_VISIBLE_DEVICES', 'LOCAL_RANK', 'WORLD_SIZE')}}\n\n\
             t = Trainlet(sys.argv[1], open(sys.argv[2]).read())\n\
             a = t.actor(Env, nproc_per_node=1)\nb = t.actor(Env, nproc_per_node=1, beside=True)\n\
             got = {{'main': a.get()[0], 'beside': b.get()[0]}}\nb.close()\n\
             import time\nwhile t.get(b.id).state not in ('succeeded', 'failed', 'stopped'): time.sleep(0.2)\n\
             c = t.actor(Env, nproc_per_node=1, beside=True, env={{'CUDA_VISIBLE_DEVICES': '5'}})\n\
             got['asked'] = c.get()[0]\nprint(json.dumps(got))\n",
            client = client.display().to_string()
        ),
    )
    .expect("driver");
    let trainlet = bin();
    let serve_dir = dir.path().join("serve");
    let served = crate::serve::standalone_args(control, &token_file, &serve_dir);
    let mut args = vec!["-c", "0,1", trainlet.to_str().expect("utf-8")];
    args.extend(served.iter().map(String::as_str));
    let mut pod = Pod::start_as(Path::new("taskset"), &args, &env(root.path(), &[]));
    pod.wait_for_stderr("control API listening", LIMIT);
    let out = std::process::Command::new("timeout")
        .args(["300", &crate::util::python()])
        .arg(&driver)
        .args([format!("http://127.0.0.1:{control}"), token_file.display().to_string()])
        .output()
        .expect("driver");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr), pod.stderr());
    let got: serde_json::Value = serde_json::from_str(stdout.trim()).expect("json");
    assert_eq!(got["main"]["CUDA_VISIBLE_DEVICES"], serde_json::Value::Null, "{got}");
    assert_eq!(got["beside"]["CUDA_VISIBLE_DEVICES"], "GPU-00000001-fake", "slot 1's GPU: {got}");
    assert_eq!((got["beside"]["LOCAL_RANK"].as_str(), got["beside"]["WORLD_SIZE"].as_str()), (Some("0"), Some("1")));
    assert_eq!(got["asked"]["CUDA_VISIBLE_DEVICES"], "5", "asked for: {got}");
}

/// Health before every round (issue 43), 2 simulated pods on the fake
/// 8-GPU box with the fake NVML, elastic (`--nnodes 1:2`). The first
/// attempt's rank 1 breaks GPU 0 of its pod (a fault file the fake
/// libnvidia-ml.so.1 reads at each init) and fails (the other pod's waits to
/// be stopped); before the next round
/// that pod finds uncorrected ECC errors and leaves with 207 instead of
/// joining; the other pod goes on alone and succeeds.
#[test]
fn a_pod_whose_gpu_breaks_leaves_with_207_before_the_next_round() {
    let root = eight_gpu_box();
    let dir = tempfile::tempdir().expect("tmp");
    let faults = dir.path().join("faults");
    // Only the broken pod's worker fails, after it broke the GPU: the
    // other pod's waits to be stopped (had it failed too, its failure could
    // end the round before the broken pod's worker had written the fault).
    let script = "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then \
                  if [ -n \"$FAKE_NVML_FAULTS_FILE\" ]; then echo '0:ecc=3' > \"$FAKE_NVML_FAULTS_FILE\"; exit 1; fi; \
                  exec sleep 120; fi";
    let args = ["run", "--nnodes", "1:2", "--max-restarts", "1", "--no-python", "/bin/sh", "-c", script];
    let port = crate::util::free_port();
    let faults_env = faults.display().to_string();
    let mut pods = crate::util::start_pods_with(2, &args, |node| {
        let mut e: Vec<(String, String)> =
            env(root.path(), &[]).into_iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        e.extend(crate::util::pet_env(2, 1, node, port));
        e.push(("PET_NNODES".into(), "1:2".into()));
        if node == 1 {
            e.push(("FAKE_NVML_FAULTS_FILE".into(), faults_env.clone()));
        }
        e
    });
    let (c0, c1) = (pods[0].code(LIMIT * 2), pods[1].code(LIMIT * 2));
    let err1 = pods[1].stderr();
    assert_eq!(c1, 207, "the broken pod leaves with 207:\n{err1}");
    assert!(err1.contains("this pod is not healthy") && err1.contains("uncorrected ECC"), "{err1}");
    assert_eq!(c0, 0, "the other pod goes on alone:\n{}", pods[0].stderr());
}

/// A checkpoint directory that cannot be written, or a /dev/shm smaller
/// than `--min-shm`: the pod leaves with 207 before its first round, and
/// says what to fix.
#[test]
fn a_pod_without_a_writable_checkpoint_dir_or_enough_shm_leaves_with_207() {
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::write(dir.path().join("file"), b"x").expect("file");
    let under_a_file = dir.path().join("file/ckpt").display().to_string();
    for (flag, value, says) in
        [("--checkpoint-dir", under_a_file.as_str(), "is not writable"), ("--min-shm", "64T", "--min-shm asks for")]
    {
        let message = dir.path().join("termination-log");
        let env = [("TRAINLET_TERMINATION_LOG", message.to_str().expect("utf-8"))];
        let mut pod = Pod::start(&["run", "--standalone", flag, value, "--no-python", "/bin/true"], &env);
        let code = pod.code(LIMIT);
        let err = pod.stderr();
        assert_eq!(code, 207, "{flag}:\n{err}");
        assert!(err.contains(says), "{flag}:\n{err}");
        let said = std::fs::read_to_string(&message).expect("the termination message");
        assert!(said.starts_with("this pod is not healthy (exit 207)") && said.contains(says), "{said}");
    }
}
