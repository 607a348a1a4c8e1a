//! The store server and client in one process, as mini-redis's
//! `tests/server.rs`: a [`StoreServer`] on 127.0.0.1 port 0, trainlet's own
//! client against it, no binary and no python. (The byte-level and torch
//! client tests are in `store.rs`.)

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use trainlet::store::{Budget, Client, StoreServer, bind_listener};

const LIMIT: Duration = Duration::from_secs(30);

async fn server(cancel: &CancellationToken) -> StoreServer {
    let listener = bind_listener(Some("127.0.0.1".parse().expect("ip")), 0).expect("bind port 0");
    StoreServer::start(listener, Arc::new(Budget::new(64 << 20)), cancel.child_token()).expect("serve")
}

#[tokio::test]
async fn set_get_add_check_and_compare_set() {
    let cancel = CancellationToken::new();
    let s = server(&cancel).await;
    let mut c = Client::connect(s.local_addr()).await.expect("connect");
    c.set("k", b"v1").await.expect("set");
    assert_eq!(c.get("k").await.expect("get"), b"v1");
    assert_eq!(c.add("n", 5).await.expect("add"), 5);
    assert_eq!(c.add("n", -2).await.expect("add"), 3);
    assert!(c.check(&["k".into(), "n".into()]).await.expect("check"));
    assert!(!c.check(&["k".into(), "missing".into()]).await.expect("check"));
    // COMPARE_SET: a wrong expectation returns the current value and changes nothing.
    assert_eq!(c.compare_set("k", b"nope", b"v2").await.expect("cas"), b"v1");
    assert_eq!(c.compare_set("k", b"v1", b"v2").await.expect("cas"), b"v2");
    assert_eq!(c.get("k").await.expect("get"), b"v2");
    assert_eq!(c.num_keys().await.expect("num keys"), 2);
    assert!(c.delete_key("k").await.expect("delete"));
    assert!(!c.delete_key("k").await.expect("delete again"));
    s.shutdown().await;
}

/// A WAIT parks until another connection sets the key, and not before.
#[tokio::test]
async fn a_wait_returns_when_another_client_sets_the_key() {
    let cancel = CancellationToken::new();
    let s = server(&cancel).await;
    let addr = s.local_addr();
    let mut waiter = Client::connect(addr).await.expect("connect");
    let mut setter = Client::connect(addr).await.expect("connect");
    let wait = tokio::spawn(async move { waiter.wait(&["ready".to_string()]).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!wait.is_finished(), "WAIT returned before the key existed");
    setter.set("ready", b"1").await.expect("set");
    tokio::time::timeout(LIMIT, wait).await.expect("WAIT never returned").expect("task").expect("wait");
    s.shutdown().await;
}

/// Shutting the server down closes its connections: a parked client gets
/// an error instead of waiting forever.
#[tokio::test]
async fn shutdown_ends_parked_waits_with_an_error() {
    let cancel = CancellationToken::new();
    let s = server(&cancel).await;
    let mut waiter = Client::connect(s.local_addr()).await.expect("connect");
    let wait = tokio::spawn(async move { waiter.wait(&["never".to_string()]).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    s.shutdown().await;
    let r = tokio::time::timeout(LIMIT, wait).await.expect("the wait outlived the server").expect("task");
    assert!(r.is_err(), "{r:?}");
}
