//! Dev-only support shared by the integration tests (`tests/it`) and the
//! benchmarks (`benches/`), included by both with `#[path]`: the repository,
//! the python with torch, free loopback ports, a test CA, and fixture servers.

pub mod cluster;
pub mod fixture_server;

use std::path::{Path, PathBuf};

/// The repository's root.
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The python with torch installed (`TRAINLET_TEST_PYTHON`, else
/// `.venv/bin/python`); panics with instructions when missing.
pub fn python() -> String {
    let p =
        std::env::var("TRAINLET_TEST_PYTHON").unwrap_or_else(|_| repo().join(".venv/bin/python").display().to_string());
    assert!(
        Path::new(&p).exists(),
        "no python with torch at {p}: run bash tests/setup.sh (or set TRAINLET_TEST_PYTHON) first"
    );
    p
}

/// A TCP port free on 127.0.0.1 now, below the kernel's ephemeral range
/// (32768-60999): a port the kernel picks for some other socket (a
/// client's, a store bound to port 0) is never handed out here, and no
/// two calls in one test process return the same port.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    // Each test process starts at its own place (two may run at once).
    let _ = NEXT.compare_exchange(
        u32::MAX,
        std::process::id().wrapping_mul(7919) % SPAN,
        Ordering::SeqCst,
        Ordering::SeqCst,
    );
    // The test cluster's ports (tests/cluster.sh, CLUSTER_PORT_BASE 26400 +
    // at most 99): a test beside the cluster tests must not take the API
    // server's port while `restart-apiserver` has it closed.
    let cluster = 26_400..26_500;
    for _ in 0..SPAN {
        let port = LOW + NEXT.fetch_add(1, Ordering::SeqCst) % SPAN;
        let port = u16::try_from(port).expect("below 32000");
        if cluster.contains(&port) {
            continue;
        }
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {LOW}..{}", LOW + SPAN)
}

/// A CA and a certificate it signed for 127.0.0.1, made with openssl in
/// `dir`: (CA, certificate, key).
pub fn tls_pair(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let (ca_key, ca, key, csr, cert) =
        (dir.join("ca.key"), dir.join("ca.pem"), dir.join("leaf.key"), dir.join("leaf.csr"), dir.join("leaf.pem"));
    let ext = dir.join("ext");
    std::fs::write(&ext, "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n").expect("ext");
    let run = |args: &[&str]| {
        let out = std::process::Command::new("openssl").args(args).output().expect("openssl");
        assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    let p = |p: &PathBuf| p.to_str().expect("utf-8").to_string();
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        &p(&ca_key),
        "-out",
        &p(&ca),
        "-days",
        "2",
        "-subj",
        "/CN=trainlet test CA",
    ]);
    run(&["req", "-newkey", "rsa:2048", "-nodes", "-keyout", &p(&key), "-out", &p(&csr), "-subj", "/CN=127.0.0.1"]);
    run(&[
        "x509",
        "-req",
        "-in",
        &p(&csr),
        "-CA",
        &p(&ca),
        "-CAkey",
        &p(&ca_key),
        "-CAcreateserial",
        "-out",
        &p(&cert),
        "-days",
        "2",
        "-extfile",
        &p(&ext),
    ]);
    (ca, cert, key)
}
