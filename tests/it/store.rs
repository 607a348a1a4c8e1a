//! The store against real torch clients, and against hostile bytes.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use crate::util::{Pod, fixture, parse_kv, python};

fn store_port(pod: &mut Pod) -> u16 {
    let out = pod.wait_for_output("listening on", Duration::from_secs(30));
    out.lines()
        .find_map(|l| l.strip_prefix("trainlet store listening on "))
        .and_then(|a| a.rsplit(':').next())
        .and_then(|p| p.trim().parse().ok())
        .expect("port")
}

#[test]
fn every_torch_client_api_behaves_as_against_torchs_own_server() {
    let mut pod = Pod::start(&["store", "--port", "0", "--host", "127.0.0.1"], &[]);
    let port = store_port(&mut pod);
    let out = Command::new(python()).arg(fixture("store_compat.py")).arg(port.to_string()).output().expect("python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("IDENTICAL 35 operations"), "{stdout}");
    pod.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(pod.code(Duration::from_secs(10)), 0, "the store exits 0 on SIGTERM");
}

/// Send `bytes`, then expect the server to close the connection.
fn closed_after(port: u16, bytes: &[u8]) -> bool {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let _ = s.write_all(bytes);
    let mut buf = [0u8; 64];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

const VALIDATE: [u8; 5] = [0x00, 0xce, 0xf7, 0x85, 0x3c];

fn hostile_inputs() -> Vec<(&'static str, Vec<u8>)> {
    let mut oversized = VALIDATE.to_vec();
    oversized.push(3);
    oversized.extend_from_slice(&u64::MAX.to_le_bytes());
    let mut unknown = VALIDATE.to_vec();
    unknown.push(0x7f);
    let mut too_many = VALIDATE.to_vec();
    too_many.push(6);
    too_many.extend_from_slice(&(200_000u64).to_le_bytes());
    vec![
        ("http request", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()),
        ("wrong magic", vec![0x00, 1, 2, 3, 4]),
        ("no VALIDATE first", vec![0x0d, 1, 0, 0, 0]),
        ("unknown query type", unknown),
        ("oversized key length", oversized),
        ("too many keys", too_many),
    ]
}

#[test]
fn hostile_bytes_are_closed_and_other_clients_keep_working() {
    let mut pod = Pod::start(&["store", "--port", "0", "--host", "127.0.0.1"], &[]);
    let port = store_port(&mut pod);
    for (what, bytes) in hostile_inputs() {
        assert!(closed_after(port, &bytes), "{what}: connection must be closed");
    }
    // A frame cut mid-way, then the peer vanishes.
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.write_all(&VALIDATE).expect("write");
    s.write_all(&[1, 10, 0, 0, 0, 0, 0, 0, 0, b'/', b'k']).expect("write");
    drop(s);
    let script = "import sys, torch.distributed as d; s = d.TCPStore('127.0.0.1', int(sys.argv[1]), is_master=False); \
                  s.set('k', 'v'); print('GOT', s.get('k').decode(), s.add('n', 2))";
    let out = Command::new(python()).args(["-c", script, &port.to_string()]).output().expect("python");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "GOT v 2", "{}", String::from_utf8_lossy(&out.stderr));
    let err = pod.stderr();
    assert!(err.contains("did not start with VALIDATE"), "{err}");
    assert!(err.contains("unknown query type 127"), "{err}");
    assert!(err.contains("closed mid-frame"), "{err}");
}

#[test]
fn garbage_at_both_store_ports_does_not_disturb_a_running_job() {
    let port = crate::util::free_port();
    let script = fixture("all_reduce.py");
    // Workers sleep a moment first so the garbage lands while they run.
    let mut pod = Pod::start(
        &[
            "run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--master-port",
            &port.to_string(),
            "--log-dir",
            "/tmp/trainlet-it",
            &script,
        ],
        &[],
    );
    // The agents' store is on `port`; the workers' store port is in the log.
    let start = std::time::Instant::now();
    let worker_port = loop {
        if let Some(p) = pod
            .stderr()
            .lines()
            .find(|l| l.contains("starting workers"))
            .and_then(|l| parse_kv(l).get("master_port").cloned())
        {
            break p.parse::<u16>().expect("port");
        }
        assert!(start.elapsed() < Duration::from_secs(60), "{}", pod.stderr());
        std::thread::sleep(Duration::from_millis(20));
    };
    for p in [port, worker_port] {
        for (what, bytes) in hostile_inputs() {
            assert!(closed_after(p, &bytes), "{what} at port {p}");
        }
    }
    assert_eq!(pod.code(Duration::from_secs(240)), 0, "stderr:\n{}", pod.stderr());
    assert_eq!(pod.stdout().matches("ok=True").count(), 2, "{}", pod.stdout());
}

fn frame_set(key: &str, value: &[u8]) -> Vec<u8> {
    let mut f = vec![1u8];
    put(&mut f, key.as_bytes());
    put(&mut f, value);
    f
}

fn put(f: &mut Vec<u8>, bytes: &[u8]) {
    f.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    f.extend_from_slice(bytes);
}

/// A validated raw connection to the store on `port`.
fn raw(port: u16) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    s.write_all(&VALIDATE).expect("validate");
    s
}

/// PING on `s`: true when the nonce comes back, false when the server
/// closed the connection instead.
fn pings(s: &mut TcpStream) -> bool {
    if s.write_all(&[0x0d, 7, 0, 0, 0]).is_err() {
        return false;
    }
    let mut got = [0u8; 4];
    s.read_exact(&mut got).is_ok() && got == [7, 0, 0, 0]
}

/// torch's own client can still use the store on `port`.
fn torch_client_works(port: u16) {
    let script = "import sys, torch.distributed as d; s = d.TCPStore('127.0.0.1', int(sys.argv[1]), is_master=False); \
                  s.set('still', 'here'); print('GOT', s.get('still').decode())";
    let out = Command::new(python()).args(["-c", script, &port.to_string()]).output().expect("python");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "GOT here", "{}", String::from_utf8_lossy(&out.stderr));
}

/// One client cannot make the store hold more than `--store-memory`: the
/// write that would pass it closes that client's connection with a log
/// line, what was stored stays, and other clients (torch's) go on.
#[test]
fn a_client_cannot_store_more_than_the_memory_budget() {
    let mut pod = Pod::start(&["store", "--port", "0", "--host", "127.0.0.1", "--store-memory", "64M"], &[]);
    let port = store_port(&mut pod);
    let mut s = raw(port);
    let value = vec![b'x'; 4 << 20];
    let mut stored = 0;
    for i in 0..40 {
        if s.write_all(&frame_set(&format!("/big/{i}"), &value)).is_err() || !pings(&mut s) {
            break;
        }
        stored += 1;
    }
    assert!((10..16).contains(&stored), "{stored} values of 4 MiB fit in a 64 MiB budget");
    assert!(!pings(&mut s), "the connection that passed the budget is closed");
    // APPEND cannot grow a value past it either.
    let mut a = raw(port);
    let mut grew = 0;
    for _ in 0..40 {
        let mut f = vec![9u8];
        put(&mut f, b"/grow");
        put(&mut f, &value);
        if a.write_all(&f).is_err() || !pings(&mut a) {
            break;
        }
        grew += 1;
    }
    assert!(grew < 16, "APPEND grew one value by {grew} x 4 MiB");
    torch_client_works(port);
    assert!(pod.stderr().contains("store memory budget reached"), "{}", pod.stderr());
    assert!(pod.stderr().contains("the store is full"), "{}", pod.stderr());
}

/// A frame is refused as soon as its lengths add up past 64 MiB (before
/// its bytes arrive), and a large frame sent in small pieces is taken
/// whole while other clients are served.
#[test]
fn frames_are_bounded_and_taken_in_pieces() {
    let mut pod = Pod::start(&["store", "--port", "0", "--host", "127.0.0.1", "--store-memory", "256M"], &[]);
    let port = store_port(&mut pod);
    // MULTI_SET of 9 values of 8 MiB: refused at the 8th value's length.
    let mut s = raw(port);
    let mut f = vec![11u8];
    f.extend_from_slice(&9u64.to_le_bytes());
    let value = vec![0u8; 8 << 20];
    let mut refused = false;
    for i in 0..9 {
        put(&mut f, format!("/m/{i}").as_bytes());
        f.extend_from_slice(&(value.len() as u64).to_le_bytes());
        if s.write_all(&f).is_err() {
            refused = true;
            break;
        }
        f.clear();
        f.extend_from_slice(&value);
    }
    assert!(refused || !pings(&mut s), "a 72 MiB frame must be refused");
    assert!(pod.stderr().contains("exceeds the 64 MiB limit"), "{}", pod.stderr());
    // 20,000 pairs sent 1 KiB at a time, PINGs on another connection between the pieces.
    let mut f = vec![11u8];
    f.extend_from_slice(&20_000u64.to_le_bytes());
    for i in 0..20_000 {
        put(&mut f, format!("/p/{i}").as_bytes());
        put(&mut f, b"v");
    }
    f.extend_from_slice(&[3]);
    put(&mut f, b"/p/19999");
    let mut w = raw(port);
    let mut other = raw(port);
    for chunk in f.chunks(1024) {
        w.write_all(chunk).expect("piece");
        assert!(pings(&mut other), "another client is served while a frame arrives");
    }
    let mut reply = [0u8; 9];
    w.read_exact(&mut reply).expect("GET reply after the MULTI_SET");
    assert_eq!(reply, [1, 0, 0, 0, 0, 0, 0, 0, b'v']);
    torch_client_works(port);
}

/// WAIT registrations die with their connection: rounds of 32 clients
/// each waiting on 16,000 keys that never come, then closing, fit in a
/// budget that holds one round only; twice as many at once do not.
#[test]
fn waits_of_closed_connections_hold_nothing() {
    let mut pod = Pod::start(&["store", "--port", "0", "--host", "127.0.0.1", "--store-memory", "64M"], &[]);
    let port = store_port(&mut pod);
    let wait_frame = |conn: usize| {
        let mut f = vec![6u8];
        f.extend_from_slice(&16_000u64.to_le_bytes());
        for i in 0..16_000 {
            put(&mut f, format!("/never/{conn:03}/{i:06}").as_bytes());
        }
        f
    };
    // A client whose WAIT was refused tries again `tries` times, 100 ms
    // apart: the server frees a closed connection's registrations when it
    // reads the close, which may come a moment after the next client.
    let round = |n: usize, tries: usize| -> usize {
        let mut held = Vec::new();
        for i in 0..n {
            for _ in 0..=tries {
                let mut c = raw(port);
                if c.write_all(&wait_frame(i)).is_ok() && pings(&mut c) {
                    held.push(c);
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        held.len()
    };
    for r in 0..4 {
        assert_eq!(round(32, 50), 32, "round {r}: registrations of closed connections still held\n{}", pod.stderr());
    }
    assert!(round(64, 0) < 64, "64 waiting clients at once must pass a 64 MiB budget");
    torch_client_works(port);
}

/// One misbehaving peer opening many connections does not flood the log:
/// per-connection warnings are rate limited, and the number left out is
/// logged with the next one.
#[test]
fn warnings_about_bad_connections_are_rate_limited() {
    let mut pod = Pod::start(&["store", "--port", "0", "--host", "127.0.0.1"], &[]);
    let port = store_port(&mut pod);
    for _ in 0..300 {
        assert!(closed_after(port, &[0x00, 1, 2, 3, 4]));
    }
    let lines = pod.stderr().lines().filter(|l| l.contains("did not start with VALIDATE")).count();
    assert!((1..=10).contains(&lines), "{lines} warning lines for 300 bad connections");
    std::thread::sleep(Duration::from_secs(11));
    assert!(closed_after(port, &[0x00, 1, 2, 3, 4]));
    pod.wait_for_stderr("similar lines suppressed by the rate limit", Duration::from_secs(10));
    let err = pod.stderr();
    let line = err.lines().find(|l| l.contains("suppressed by the rate limit")).expect("line");
    let n: u64 = parse_kv(line).get("suppressed").and_then(|v| v.parse().ok()).expect("count");
    assert_eq!(n + lines as u64, 300, "{line}");
}
