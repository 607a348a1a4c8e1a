//! Stacks read from outside a process (`trainlet::stacks`), against real
//! interpreters: the test venv's CPython and Debian's (the containers'),
//! which is built differently (a non-PIE executable with libpython linked
//! in). The reader runs in this test process, the readers' parent, as the
//! agent is its workers'.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use trainlet::stacks::{Limits, Process, read};

use crate::util::{fixture, line_of, python};

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_idle(interpreter: &str) -> Killed {
    let mut child = Command::new(interpreter)
        .arg(fixture("idle_threads.py"))
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .expect("python");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("read");
    assert_eq!(line.trim(), "READY");
    Killed(child)
}

fn pid_of(c: &Killed) -> i32 {
    i32::try_from(c.0.id()).expect("pid")
}

/// Read `c` once its main thread has gone into its last call (READY is
/// printed just before it does).
fn read_idle(c: &Killed) -> Process {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let p = read(pid_of(c), &Limits::default());
        let settled =
            p.threads.first().and_then(|t| t.python.first()).is_some_and(|f| f.function == "Holder.wait_here");
        if settled || Instant::now() > until {
            return p;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn check_idle(p: &Process) {
    let main_line = line_of("idle_threads.py", "MAIN_LINE");
    let thread_line = line_of("idle_threads.py", "THREAD_LINE");
    assert!(p.python.is_some(), "{p:#?}");
    assert_eq!(p.note, None, "{p:#?}");
    let main = &p.threads[0];
    assert!(main.main);
    let names: Vec<&str> = main.python.iter().map(|f| f.function.as_str()).collect();
    assert_eq!(names, ["Holder.wait_here", "outer", "<module>"], "{p:#?}");
    assert_eq!(main.python[0].line, Some(main_line));
    assert!(main.python[0].file.ends_with("idle_threads.py"));
    let other = p.threads.iter().find(|t| !t.main).expect("the second thread");
    assert!(!other.name.is_empty());
    assert_eq!((other.python[0].function.as_str(), other.python[0].line), ("in_c", Some(thread_line)));
    assert_eq!(other.kernel, "blocked in system call clock_nanosleep", "{other:#?}");
    let native = other.native.first().and_then(|n| n.function.as_deref()).unwrap_or_default();
    assert!(native.contains("nanosleep"), "{other:#?}");
    // Read whole within its own bounds (its time is the stacks bench's).
    assert!(p.unread.is_none(), "{p:#?}");
}

#[test]
fn every_python_thread_is_read_innermost_first_from_the_venvs_python() {
    let child = start_idle(&python());
    check_idle(&read_idle(&child));
}

/// The straggler sampler (`trainlet::stacks::sampler`) reads a real
/// interpreter's main thread: its frames, innermost first, and the system
/// call it sleeps in; the classifier calls that computing in its method.
#[test]
fn the_sampler_reads_the_main_thread_of_a_real_interpreter() {
    let child = start_idle(&python());
    read_idle(&child);
    let pid = pid_of(&child);
    let start = trainlet::sys::proc_start(pid).expect("start");
    let mut s = trainlet::stacks::sampler::Sampler::default();
    let one = s.sample(pid, start).expect("a sample");
    let names: Vec<&str> = one.frames.iter().map(|f| f.function.as_str()).collect();
    assert_eq!(names, ["Holder.wait_here", "outer", "<module>"], "{one:#?}");
    assert_eq!(one.blocked_in, Some(230), "clock_nanosleep: {one:#?}");
    let (state, at) = trainlet::stacks::straggle::classify(&one.frames, one.blocked_in);
    let main_line = line_of("idle_threads.py", "MAIN_LINE");
    assert_eq!(state, trainlet::stacks::straggle::State::Compute);
    assert_eq!(at, Some(format!("idle_threads.py:{main_line} in Holder.wait_here")));
    // The interpreter is found once: the next samples only walk the threads.
    let began = Instant::now();
    for _ in 0..100 {
        assert_eq!(s.sample(pid, start).as_ref().map(|o| o.frames.len()), Some(3));
    }
    eprintln!("100 samples in {:?}", began.elapsed());
}

#[test]
fn debians_python_is_read_too() {
    let child = start_idle("/usr/bin/python3");
    let p = read_idle(&child);
    check_idle(&p);
    assert!(p.python.as_deref().is_some_and(|v| v.starts_with("3.11.")), "{:?}", p.python);
}

#[test]
fn a_plain_binary_has_no_python_stack_and_a_gone_process_says_so() {
    let sleeper = Killed(Command::new("sleep").arg("60").spawn().expect("sleep"));
    let p = read(pid_of(&sleeper), &Limits::default());
    assert_eq!(p.note.as_deref(), Some("no Python stack: the process runs no CPython interpreter"));
    assert!(p.threads.is_empty());
    let mut gone = Command::new("true").spawn().expect("true");
    let pid = i32::try_from(gone.id()).expect("pid");
    gone.wait().expect("wait");
    assert_eq!(read(pid, &Limits::default()).note.as_deref(), Some("the process is gone"));
}

/// Processes that exit while they are read: every read ends, with a stack,
/// a partial one or a note, and never takes long.
#[test]
fn processes_exiting_while_read_never_crash_or_hang_the_reader() {
    let code = "import time, threading\nfor i in range(20): threading.Thread(target=time.sleep, args=(0.5,)).start()\ntime.sleep(0.05)";
    for _ in 0..10 {
        let mut child = Command::new(python()).args(["-c", code]).spawn().expect("python");
        let pid = i32::try_from(child.id()).expect("pid");
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let started = Instant::now();
            let p = read(pid, &Limits::default());
            assert!(started.elapsed() < Duration::from_secs(2), "{p:#?}");
            if child.try_wait().expect("try_wait").is_some() || Instant::now() > until {
                break;
            }
        }
        child.wait().expect("wait");
    }
}

/// A worker that crafts what the reader follows (tests/fixtures/hostile_code.py):
/// the read ends quickly with the frame's names cut and cleaned, and the
/// overflowing location table costs the line, nothing else.
#[test]
fn a_hostile_code_object_is_read_as_data() {
    let mut child =
        Command::new(python()).arg(fixture("hostile_code.py")).stdout(Stdio::piped()).spawn().expect("python");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("read");
    let child = Killed(child);
    let until = Instant::now() + Duration::from_secs(30);
    let frame = loop {
        let p = read(pid_of(&child), &Limits::default());
        assert!(p.took_ms < 1000.0, "{p:#?}");
        if let Some(f) = p.threads.first().and_then(|t| t.python.first()).filter(|f| f.function.starts_with("evil")) {
            break f.clone();
        }
        assert!(Instant::now() < until, "{p:#?}");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(frame.function.starts_with("evil?[2J?yyy"), "{frame:?}");
    assert_eq!(frame.function.chars().count(), 512);
    assert_eq!(frame.file, "/tmp/?fake.py");
}

/// Issue 53, finding 2: 8 workers that each map a crafted ELF file
/// (tests/fixtures/crafted_elf.py: a 256 MiB section-header table on even
/// ranks, 64 MiB string and unwind tables on odd ones, with a 64 MiB
/// symbol table on ranks 1 and 5) and park
/// threads in `pause` inside it, so that the reader opens the file to
/// name and unwind them. The agent runs in a 1 GiB memory cgroup, where
/// the unbounded reader was OOM-killed; here `trainlet stacks` is asked
/// three times, then the workers' silence (`--progress-timeout 8`, no
/// token needed) makes the hang capture read them once more. The agent
/// stays up, its pod under [`PEAK`], every worker's Python stacks are read
/// in full (the file cannot hide a worker), every odd rank's read says it
/// stopped at its memory budget or its time, and ranks 3 and 7 (whose
/// small symbol table leaves the time for the rest) at their budget, at
/// least once.
#[test]
fn crafted_elf_files_cost_the_agent_no_more_than_its_read_budget() {
    use crate::memcg::{MemCgroup, vm_hwm};
    use crate::util::{Pod, bin};
    const PEAK: u64 = 512 << 20;
    let cg = MemCgroup::new("stacks", 1 << 30);
    let files = tempfile::Builder::new().prefix("crafted").tempdir_in("/dev/shm").expect("tmpfs");
    let logs = tempfile::tempdir().expect("tmp");
    let (dir, log_dir) = (files.path().display().to_string(), logs.path().display().to_string());
    let script = fixture("crafted_elf.py");
    let args = [
        "run",
        "--nproc-per-node",
        "8",
        "--progress-timeout",
        "8",
        "--max-restarts",
        "0",
        "--log-dir",
        &log_dir,
        &script,
    ];
    let argv = cg.wrap(&bin(), &args);
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let mut pod = Pod::start_as(std::path::Path::new("/bin/sh"), &argv, &[("CRAFTED_DIR", &dir)]);
    let limit = Duration::from_secs(120);
    let started = Instant::now();
    while pod.stdout().matches("PARKED").count() < 8 {
        assert!(pod.child.try_wait().expect("try_wait").is_none(), "{}", pod.stderr());
        assert!(started.elapsed() < limit, "{}\n{}", pod.stdout(), pod.stderr());
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = pod.stdout();
    let pids: Vec<i64> =
        out.lines().filter_map(|l| l.split("pid=").nth(1)?.split_whitespace().next()?.parse().ok()).collect();
    assert_eq!(pids.len(), 8, "{out}");
    let ours = |ranks: &[serde_json::Value]| -> Vec<serde_json::Value> {
        ranks.iter().filter(|r| r["stacks"]["pid"].as_i64().is_some_and(|p| pids.contains(&p))).cloned().collect()
    };
    // Each of our ranks' reads: its Python stacks read in full, or said
    // not to be (a loaded machine can take a read's 200 ms). Counts the
    // full reads per rank and the reads of ranks 3 and 7 (small symbol
    // table, 64 MiB unwind tables) that stopped at their memory budget.
    let full = std::cell::RefCell::new([0u32; 8]);
    let check = |ranks: &[serde_json::Value], how: &str| -> usize {
        let ranks = ours(ranks);
        assert_eq!(ranks.len(), 8, "{how}: {ranks:#?}");
        let mut budget = 0;
        for r in ranks {
            let (s, rank) = (&r["stacks"], r["rank"].as_u64().expect("rank"));
            let note = s["note"].as_str().unwrap_or_default();
            if !s["unread"].is_null() {
                assert!(s["unread"] == "time" || s["unread"] == "budget", "{how}: {s:#}");
                assert!(note.contains("bound") || note.contains("budget") || note.contains("time"), "{how}: {s:#}");
                continue;
            }
            full.borrow_mut()[usize::try_from(rank).expect("rank")] += 1;
            let threads = s["threads"].as_array().expect("threads");
            assert_eq!(threads.len(), 3, "{how}: {s:#}");
            assert!(threads.iter().all(|t| !t["python"].as_array().expect("frames").is_empty()), "{how}: {s:#}");
            let parked = threads.iter().filter(|t| t["kernel"] == "blocked in system call 34").count();
            for t in threads.iter().filter(|t| t["kernel"] == "blocked in system call 34") {
                let inner = &t["native"][0];
                assert!(inner["object"].as_str().is_some_and(|o| o.starts_with("crafted-")), "{how}: {t:#}");
                assert!(inner["function"].is_null(), "{how}: {t:#}");
            }
            // (A thread read before it reached pause has no file to read.)
            if rank % 2 == 1 && parked > 0 {
                assert!(note.contains("memory budget") || note.contains("bound"), "{how}: rank {rank}: {s:#}");
            }
            if rank % 4 == 3 && note.contains("memory budget") {
                assert!(note.ends_with("native frames left out"), "{how}: {s:#}");
                budget += 1;
            }
        }
        budget
    };
    let (mut asked, mut over) = (0, 0);
    while asked < 3 && pod.child.try_wait().expect("try_wait").is_none() {
        let got = std::process::Command::new(bin()).args(["stacks", "--json"]).output().expect("trainlet stacks");
        let ranks = serde_json::from_slice::<Vec<serde_json::Value>>(&got.stdout).unwrap_or_default();
        if ours(&ranks).is_empty() && started.elapsed() < limit {
            // The attempt has not registered its workers with the door yet.
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        asked += 1;
        over += check(&ranks, &format!("trainlet stacks #{asked}"));
        let (peak, hwm) = (cg.peak(), vm_hwm(pod.pid()));
        eprintln!("trainlet stacks #{asked}: cgroup peak {} MiB, agent VmHWM {} MiB", peak >> 20, hwm >> 20);
    }
    assert!(asked >= 2, "trainlet stacks answered {asked} times before the hang\n{}", pod.stderr());
    assert_eq!(pod.code(limit), 206, "the hang ends the job (not the OOM killer):\n{}", pod.stderr());
    let peak = cg.peak();
    eprintln!("after the hang capture: cgroup peak {} MiB (workers included)", peak >> 20);
    assert_eq!(cg.oom_kills(), 0, "the OOM killer struck in the pod's cgroup");
    assert!(peak < PEAK, "the pod's cgroup reached {} MiB", peak >> 20);
    let run = std::fs::read_dir(logs.path()).expect("logs").next().expect("run dir").expect("entry").path();
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("failure_report.json")).expect("report")).expect("json");
    over += check(report["stacks"].as_array().expect("stacks"), "the hang capture");
    assert!(over > 0, "no read of rank 3 or 7 said it stopped at its memory budget");
    let full = full.into_inner();
    eprintln!("Python stacks read in full, per rank, of {} reads: {full:?}", asked + 1);
    assert!(full.iter().all(|n| *n > 0), "a worker hid its Python stacks from every read: {full:?}");
}
