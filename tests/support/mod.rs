//! Dev-only support shared by the integration tests (`tests/it`) and the
//! benchmarks (`benches/`), included by both with `#[path]`: the repository,
//! the python with torch, free loopback ports, and fixture servers.

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
        "no python with torch at {p}: run .ci/run (or set TRAINLET_TEST_PYTHON, or bash tests/venv.sh) first"
    );
    p
}

/// A TCP port free on 127.0.0.1 now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}
