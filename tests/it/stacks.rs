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
    assert!(p.took_ms < 200.0, "{}", p.took_ms);
}

#[test]
fn every_python_thread_is_read_innermost_first_from_the_venvs_python() {
    let child = start_idle(&python());
    check_idle(&read_idle(&child));
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
