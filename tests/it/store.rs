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
