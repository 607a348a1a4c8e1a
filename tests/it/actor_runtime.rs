//! The actor runtime (`src/serve/actor/runtime.py`) on its own: the test is the
//! agent, listening on a Unix socket and speaking the frames of
//! `src/serve/actor/wire.rs` by hand to one worker process.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::util::{python, repo};

/// Every wait is bounded by this: a hang fails the test, never stalls it.
const LIMIT: Duration = Duration::from_secs(30);

/// The user's module, in the worker's working directory.
const MODULE: &str = r#"
import time
import trainlet_actor

class Tensorish:
    def __init__(self, v):
        self.v = v
    def tolist(self):
        return self.v

class Counter:
    def __init__(self, base):
        self.total = base
    def add(self, x, times=1):
        self.total += x * times
        return self.total
    def state(self):
        return {"total": self.total, "call": trainlet_actor.current_call()}
    def slow(self, seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(0.01)
        return "slept"
    def boom(self):
        raise ValueError("boom")
    def tensor(self):
        return Tensorish([[1, 2], [3, 4]])
    def pair(self, a, b):
        return (a, b)
    def things(self):
        return {1, 2}
    def step(self, k):
        for _ in range(k):
            time.sleep(0.0002)
        self.total += 1
        return self.total
    def big(self, n):
        return "x" * n
    def torch(self):
        import torch
        return {"t": torch.tensor([[1.5, 2.5]]), "s": torch.tensor(3).sum()}
    def _private(self):
        return "secret"
    limit = 3

class Broken:
    def __init__(self):
        raise RuntimeError("cannot start")

class Outer:
    class Inner:
        def __init__(self, v):
            self.v = v
        def get(self):
            return self.v

def double(x):
    return 2 * x
"#;

fn write_frame(s: &mut UnixStream, frame: &Value) {
    let body = serde_json::to_vec(frame).expect("json");
    let len = u32::try_from(body.len()).expect("small frame");
    s.write_all(&len.to_be_bytes()).expect("write length");
    s.write_all(&body).expect("write frame");
}

/// The next frame; None at the end of the stream.
fn read_frame(s: &mut UnixStream) -> Option<Value> {
    let mut len = [0u8; 4];
    match s.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return None,
        Err(e) => panic!("reading a frame's length: {e}"),
    }
    let mut body = vec![0u8; usize::try_from(u32::from_be_bytes(len)).expect("usize")];
    s.read_exact(&mut body).expect("read frame");
    Some(serde_json::from_slice(&body).expect("a frame is JSON"))
}

/// One worker, started by the test as the agent starts it; killed on drop.
struct Worker {
    child: Child,
    conn: UnixStream,
    stderr: PathBuf,
    hello: Value,
    _dir: tempfile::TempDir,
}

impl Worker {
    /// Start the runtime (`python runtime.py`, or through `runpy` as a
    /// zygote runs it) and take its connection and hello.
    fn start(runpy: bool) -> Worker {
        let dir = tempfile::tempdir().expect("tmp");
        let cwd = dir.path().join("run");
        std::fs::create_dir(&cwd).expect("run dir");
        std::fs::write(cwd.join("actmod.py"), MODULE).expect("module");
        let socket = dir.path().join("actor.sock");
        let listener = UnixListener::bind(&socket).expect("bind");
        listener.set_nonblocking(true).expect("nonblocking");
        let stderr = dir.path().join("stderr");
        let mut child =
            runtime_command(runpy, &cwd, &stderr).env("TRAINLET_ACTOR_SOCKET", &socket).spawn().expect("spawn python");
        let start = Instant::now();
        let mut conn = loop {
            match listener.accept() {
                Ok((conn, _)) => break conn,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => panic!("accept: {e}"),
            }
            if let Some(st) = child.try_wait().expect("try_wait") {
                panic!("the worker exited ({st}) before connecting:\n{}", read(&stderr));
            }
            assert!(start.elapsed() < LIMIT, "the worker did not connect:\n{}", read(&stderr));
            std::thread::sleep(Duration::from_millis(20));
        };
        conn.set_nonblocking(false).expect("blocking");
        conn.set_read_timeout(Some(LIMIT)).expect("timeout");
        conn.set_write_timeout(Some(LIMIT)).expect("timeout");
        let hello = read_frame(&mut conn).expect("hello");
        Worker { child, conn, stderr, hello, _dir: dir }
    }

    /// Started and instantiated: `target` with `args` (JSON encoding).
    fn ready(target: &str, args: &Value) -> Worker {
        let mut w = Worker::start(false);
        w.send(&json!({"op": "init", "target": target, "encoding": "json", "args": args.to_string()}));
        let reply = w.recv();
        assert_eq!(reply, json!({"op": "ready"}), "stderr:\n{}", w.stderr());
        w
    }

    fn send(&mut self, frame: &Value) {
        write_frame(&mut self.conn, frame);
    }

    fn recv(&mut self) -> Value {
        read_frame(&mut self.conn).unwrap_or_else(|| panic!("the worker hung up:\n{}", self.stderr()))
    }

    /// Send call `id` of `method` with JSON `args` and `kwargs`.
    fn call(&mut self, id: u64, method: &str, args: &Value, kwargs: &Value) {
        let args = json!({"args": args, "kwargs": kwargs}).to_string();
        self.send(&json!({"op": "call", "id": id, "method": method, "encoding": "json", "args": args}));
    }

    /// Call and wait for its result frame.
    fn result(&mut self, id: u64, method: &str, args: &Value) -> Value {
        self.call(id, method, args, &json!({}));
        let r = self.recv();
        assert_eq!((r["op"].as_str(), r["id"].as_u64()), (Some("result"), Some(id)), "{r}");
        r
    }

    /// Call and return its JSON value, which must be there.
    fn value(&mut self, id: u64, method: &str, args: &Value) -> Value {
        let r = self.result(id, method, args);
        assert_eq!(r["ok"], true, "{method}: {r}");
        serde_json::from_str(r["value"].as_str().expect("value is text")).expect("value is JSON")
    }

    /// Call and return its fault, which must be there.
    fn fault(&mut self, id: u64, method: &str, args: &Value) -> Value {
        let r = self.result(id, method, args);
        assert_eq!(r["ok"], false, "{method}: {r}");
        r["error"].clone()
    }

    fn stderr(&self) -> String {
        read(&self.stderr)
    }

    fn wait(&mut self) -> ExitStatus {
        wait(&mut self.child, &self.stderr)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn runtime_command(runpy: bool, cwd: &Path, stderr: &Path) -> Command {
    let runtime = repo().join("src/serve/actor/runtime.py").display().to_string();
    let mut cmd = Command::new(python());
    if runpy {
        let code = "import runpy, sys; sys.argv = [sys.argv[1]]; runpy.run_path(sys.argv[0], run_name='__main__')";
        cmd.args(["-c", code, &runtime]);
    } else {
        cmd.arg(&runtime);
    }
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("RANK", "3")
        .env("LOCAL_RANK", "1")
        .env("WORLD_SIZE", "4")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .current_dir(cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(stderr).expect("stderr"));
    cmd
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

fn wait(child: &mut Child, stderr: &Path) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            return st;
        }
        assert!(start.elapsed() < LIMIT, "the worker did not exit:\n{}", read(stderr));
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Run `code` with the test's python, `arg` as `sys.argv[1]`; its stdout.
fn py(code: &str, arg: &str) -> String {
    let out = Command::new(python()).args(["-c", code, arg]).output().expect("python");
    assert!(out.status.success(), "{code}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8").trim().to_string()
}

#[test]
fn hello_init_and_state_kept_across_calls() {
    let mut w = Worker::ready("actmod:Counter", &json!({"args": [0], "kwargs": {}}));
    let pid = i64::from(w.child.id());
    assert_eq!(w.hello, json!({"op": "hello", "rank": 3, "local_rank": 1, "pid": pid}));
    assert_eq!(w.value(1, "add", &json!([2])), json!(2));
    assert_eq!(w.value(2, "add", &json!([3])), json!(5));
    w.call(3, "add", &json!([]), &json!({"x": 1, "times": 10}));
    let r = w.recv();
    assert_eq!((r["id"].as_u64(), r["ok"].as_bool(), r["value"].as_str()), (Some(3), Some(true), Some("15")), "{r}");
    assert_eq!(w.value(4, "state", &json!([])), json!({"total": 15, "call": 4}), "current_call() is the call's id");
    assert_eq!(w.value(5, "tensor", &json!([])), json!([[1, 2], [3, 4]]), "objects with tolist() are lists");
    assert_eq!(w.value(6, "pair", &json!(["a", null])), json!(["a", null]));
}

#[test]
fn init_arguments_go_by_keyword_too_and_the_target_may_be_dotted() {
    let mut w = Worker::ready("actmod:Counter", &json!({"kwargs": {"base": 40}}));
    assert_eq!(w.value(1, "add", &json!([2])), json!(42));
    let mut w = Worker::ready("actmod:Outer.Inner", &json!({"args": [[7]]}));
    assert_eq!(w.value(1, "get", &json!([])), json!([7]));
}

#[test]
fn calls_run_concurrently_and_a_cancelled_call_answers_call_cancelled() {
    let mut w = Worker::ready("actmod:Counter", &json!({"args": [7]}));
    let sent = Instant::now();
    w.call(1, "slow", &json!([5]), &json!({}));
    w.call(2, "state", &json!([]), &json!({}));
    let r = w.recv();
    assert_eq!((r["id"].as_u64(), r["ok"].as_bool()), (Some(2), Some(true)), "state answers first: {r}");
    assert!(sent.elapsed() < Duration::from_secs(4), "state() waited for slow() ({:?})", sent.elapsed());
    let cancelled = Instant::now();
    w.send(&json!({"op": "cancel", "id": 1}));
    w.send(&json!({"op": "cancel", "id": 99})); // no such call: ignored
    let r = w.recv();
    assert_eq!((r["id"].as_u64(), r["ok"].as_bool()), (Some(1), Some(false)), "{r}");
    assert_eq!(r["error"]["type"], "CallCancelled", "{r}");
    assert!(r["error"]["traceback"].as_str().expect("traceback").contains("slow"), "{r}");
    assert!(cancelled.elapsed() < Duration::from_secs(3), "the cancel took {:?}", cancelled.elapsed());
    // A second cancel of the finished call is ignored, and the actor goes on.
    w.send(&json!({"op": "cancel", "id": 1}));
    assert_eq!(w.value(3, "add", &json!([1])), json!(8));
}

#[test]
fn faults_carry_type_module_message_and_traceback_and_the_actor_goes_on() {
    let mut w = Worker::ready("actmod:Counter", &json!({"args": [0]}));
    let e = w.fault(1, "boom", &json!([]));
    assert_eq!((&e["type"], &e["module"], &e["message"]), (&json!("ValueError"), &json!("builtins"), &json!("boom")));
    let tb = e["traceback"].as_str().expect("traceback");
    assert!(tb.contains("actmod.py") && tb.contains("boom"), "{tb}");
    let e = w.fault(2, "_private", &json!([]));
    assert_eq!(e["type"], "AttributeError", "{e}");
    assert!(e["message"].as_str().expect("message").contains("private"), "{e}");
    let e = w.fault(3, "__init__", &json!([5]));
    assert_eq!(e["type"], "AttributeError", "dunder methods are private too: {e}");
    let e = w.fault(4, "nope", &json!([]));
    assert_eq!(e["type"], "AttributeError", "{e}");
    let message = e["message"].as_str().expect("message");
    assert!(message.contains("Counter") && message.contains("nope"), "{e}");
    let e = w.fault(5, "limit", &json!([]));
    assert_eq!(e["type"], "TypeError", "not callable: {e}");
    let e = w.fault(6, "add", &json!([1, 2, 3, 4]));
    assert_eq!(e["type"], "TypeError", "wrong arguments: {e}");
    let e = w.fault(7, "things", &json!([]));
    assert_eq!(e["type"], "BadResult", "a set is not JSON: {e}");
    let message = e["message"].as_str().expect("message");
    assert!(message.contains("things") && message.contains("JSON") && message.contains("pickle"), "{e}");
    assert_eq!(w.value(8, "add", &json!([4])), json!(4), "the actor still answers");
}

#[test]
fn pickle_encodes_arguments_and_results() {
    let mut w = Worker::ready("actmod:Counter", &json!({"args": [0]}));
    let args = py("import pickle, base64; print(base64.b64encode(pickle.dumps(((1, {2, 3}), {}))).decode())", "");
    w.send(&json!({"op": "call", "id": 1, "method": "pair", "encoding": "pickle", "args": args}));
    let r = w.recv();
    assert_eq!((r["id"].as_u64(), r["ok"].as_bool()), (Some(1), Some(true)), "{r}");
    let value = r["value"].as_str().expect("value");
    let back = py("import pickle, base64, sys; print(repr(pickle.loads(base64.b64decode(sys.argv[1]))))", value);
    assert_eq!(back, "(1, {2, 3})", "a tuple holding a set: no JSON could carry it");
    let args = py("import pickle, base64; print(base64.b64encode(pickle.dumps(([], {'x': 2}))).decode())", "");
    w.send(&json!({"op": "call", "id": 2, "method": "add", "encoding": "pickle", "args": args}));
    let r = w.recv();
    let value = r["value"].as_str().expect("value");
    assert_eq!(py("import pickle, base64, sys; print(pickle.loads(base64.b64decode(sys.argv[1])))", value), "2");
}

#[test]
fn a_failed_init_is_answered_and_the_worker_exits_1() {
    for (target, kind, message) in [
        ("actmod:Broken", "RuntimeError", "cannot start"),
        ("no_such_module:Thing", "ModuleNotFoundError", "no_such_module"),
        ("actmod:Missing", "AttributeError", "Missing"),
    ] {
        let mut w = Worker::start(false);
        w.send(&json!({"op": "init", "target": target, "encoding": "json", "args": "{\"args\": []}"}));
        let r = w.recv();
        assert_eq!(r["op"], "init_failed", "{target}: {r}");
        assert_eq!(r["error"]["type"], kind, "{target}: {r}");
        assert!(r["error"]["message"].as_str().expect("message").contains(message), "{target}: {r}");
        assert_eq!(w.wait().code(), Some(1), "{target}");
        assert!(w.stderr().contains(message), "the traceback is in the logs:\n{}", w.stderr());
    }
}

#[test]
fn a_function_actor_is_called_as_dunder_call() {
    let mut w = Worker::ready("actmod:double", &json!({}));
    assert_eq!(w.value(1, "__call__", &json!([21])), json!(42));
    assert_eq!(w.fault(2, "other", &json!([]))["type"], "AttributeError");
    assert_eq!(w.value(3, "__call__", &json!(["ab"])), json!("abab"), "still answers");
}

#[test]
fn runs_through_runpy_as_a_zygote_runs_it() {
    let mut w = Worker::start(true);
    assert_eq!(w.hello["rank"], 3);
    w.send(&json!({"op": "init", "target": "actmod:Counter", "encoding": "json", "args": "{\"args\": [1]}"}));
    assert_eq!(w.recv(), json!({"op": "ready"}), "{}", w.stderr());
    assert_eq!(w.value(1, "state", &json!([])), json!({"total": 1, "call": 1}));
    w.call(2, "slow", &json!([30]), &json!({}));
    w.send(&json!({"op": "cancel", "id": 2}));
    assert_eq!(w.recv()["error"]["type"], "CallCancelled", "trainlet_actor.Cancelled works under runpy too");
}

#[test]
fn closing_the_socket_ends_the_worker_with_0_even_during_a_call() {
    let mut w = Worker::ready("actmod:Counter", &json!({"args": [0]}));
    w.call(1, "slow", &json!([60]), &json!({}));
    std::thread::sleep(Duration::from_millis(200));
    w.conn.shutdown(std::net::Shutdown::Both).expect("shutdown");
    let closed = Instant::now();
    assert_eq!(w.wait().code(), Some(0), "stderr:\n{}", w.stderr());
    assert!(closed.elapsed() < Duration::from_secs(10), "took {:?}", closed.elapsed());
    assert!(!w.stderr().contains("Traceback"), "no traceback when the agent goes away:\n{}", w.stderr());
}

#[test]
fn without_the_socket_variable_it_says_so_and_exits_2() {
    let dir = tempfile::tempdir().expect("tmp");
    let stderr = dir.path().join("stderr");
    let mut child = runtime_command(false, dir.path(), &stderr).spawn().expect("spawn");
    assert_eq!(wait(&mut child, &stderr).code(), Some(2));
    assert!(read(&stderr).contains("TRAINLET_ACTOR_SOCKET"), "{}", read(&stderr));
}

#[test]
fn tensors_come_back_as_json_lists_and_numbers() {
    let mut w = Worker::ready("actmod:Counter", &json!({"args": [0]}));
    assert_eq!(w.value(1, "torch", &json!([])), json!({"t": [[1.5, 2.5]], "s": 3}));
}

#[test]
fn a_result_larger_than_a_frame_is_a_bad_result_and_a_larger_frame_in_ends_the_worker() {
    let mut w = Worker::ready("actmod:Counter", &json!({"args": [0]}));
    let e = w.fault(1, "big", &json!([64 * 1024 * 1024]));
    assert_eq!(e["type"], "BadResult", "{e}");
    assert_eq!(w.value(2, "add", &json!([1])), json!(1), "the actor still answers");
    let too_long = u32::try_from(64 * 1024 * 1024 + 1).expect("u32");
    w.conn.write_all(&too_long.to_be_bytes()).expect("write");
    assert_eq!(w.wait().code(), Some(1), "stderr:\n{}", w.stderr());
    assert!(w.stderr().contains("frame"), "{}", w.stderr());
}

/// A cancel that races the end of its call: every call still answers
/// once (its value, or CallCancelled), and no cancel lands in a later one.
#[test]
fn cancels_racing_the_end_of_their_calls_leave_one_answer_each() {
    let mut w = Worker::ready("actmod:Counter", &json!({"args": [0]}));
    let n: u64 = 300;
    // Calls of nothing to a few short sleeps, each cancelled at once: some
    // cancels land in the call, some before it starts, some after it ended.
    for id in 1..=n {
        w.call(id, "step", &json!([id % 4]), &json!({}));
        w.send(&json!({"op": "cancel", "id": id}));
    }
    let mut seen = std::collections::BTreeSet::new();
    let mut cancelled = 0;
    for _ in 1..=n {
        let r = w.recv();
        assert!(seen.insert(r["id"].as_u64().expect("id")), "two answers: {r}");
        if r["ok"] == false {
            assert_eq!(r["error"]["type"], "CallCancelled", "{r}");
            cancelled += 1;
        }
    }
    assert_eq!(seen.len(), usize::try_from(n).expect("usize"));
    let total = w.value(n + 1, "state", &json!([]))["total"].as_u64().expect("total");
    assert!(total >= n - cancelled && total <= n, "{total} of {n} steps, {cancelled} cancelled");
    for id in n + 2..n + 50 {
        assert_eq!(w.result(id, "state", &json!([]))["ok"], true, "no stray cancel lands in a later call");
    }
}
