//! Rendezvous timing under tokio's paused clock: the agents, the store and
//! the store host's round service all run in one current-thread runtime
//! over loopback TCP, and time only moves when every task waits, so a 30 s
//! last call or a 10 s heartbeat timeout takes milliseconds and is
//! measured exactly (never shorter than configured; later only by the
//! timers in between).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use trainlet::rendezvous::host::{ServeFn, serve_rounds};
use trainlet::rendezvous::{Joined, Known, Member, Session, Timing};
use trainlet::store::{Budget, Endpoint, StoreServer, bind_listener};

const TIMING: Timing = Timing {
    last_call: Duration::from_secs(30),
    heartbeat: Duration::from_secs(1),
    heartbeat_timeout: Duration::from_secs(10),
    lost_grace: Duration::from_millis(500),
};

fn listener() -> tokio::net::TcpListener {
    bind_listener(Some("127.0.0.1".parse().expect("ip")), 0).expect("bind")
}

/// The agents' store and the round service of its host, in this runtime;
/// `tie`: heartbeats tied to their connections, as the store host's are.
fn store_host(cancel: &CancellationToken, tie: bool) -> (StoreServer, Endpoint) {
    let budget = Arc::new(Budget::new(64 << 20));
    let store = StoreServer::start(listener(), Arc::clone(&budget), cancel.child_token()).expect("store");
    if tie {
        store.state().tie(trainlet::rendezvous::heartbeat_tie);
    }
    let tok = cancel.child_token();
    let serve: ServeFn = Box::new(move || {
        StoreServer::start(listener(), Arc::clone(&budget), tok.child_token())
            .map_err(|source| trainlet::store::ServerError::Bind { port: 0, source })
    });
    let addr = store.local_addr();
    tokio::spawn(serve_rounds(
        trainlet::store::Dial { addr, guard: None },
        "trainlet/t/j0".into(),
        TIMING,
        serve,
        Some(store.state().losses()),
        cancel.child_token(),
    ));
    (store, Endpoint { host: "127.0.0.1".into(), port: addr.port() })
}

fn member(node_rank: u32, nnodes: (u32, u32)) -> Member {
    Member {
        uid: String::new(),
        host: format!("pod-{node_rank}"),
        pid: node_rank,
        node_rank,
        nproc: 1,
        min_nodes: nnodes.0,
        max_nodes: nnodes.1,
        max_restarts: 0,
        spares: 0,
        last_rank: None,
    }
}

/// One pod (node rank `i`, `--nnodes MIN:MAX`) connects and joins the
/// next round, on a task of its own; it returns the round, its session
/// (dropping the session stops its heartbeat) and how long joining took.
fn join(
    endpoint: &Endpoint,
    cancel: &CancellationToken,
    i: u32,
    nnodes: (u32, u32),
    deadline: Instant,
) -> tokio::task::JoinHandle<(trainlet::rendezvous::Round, Session, Duration)> {
    let (endpoint, cancel) = (endpoint.clone(), cancel.clone());
    tokio::spawn(async move {
        let mut s = Session::connect((&endpoint, None), "t", 0, member(i, nnodes), TIMING, deadline, &cancel)
            .await
            .expect("connect");
        let started = Instant::now();
        let Ok(Joined::Round(r)) = s.next_round(&mut Known::default(), deadline).await else { panic!("no round") };
        (r, s, started.elapsed())
    })
}

/// An elastic `1:2` job with one pod: the round closes when the last call
/// ends, not a moment earlier, with the one pod in it.
#[tokio::test(start_paused = true)]
async fn an_elastic_round_closes_at_the_end_of_the_last_call() {
    let cancel = CancellationToken::new();
    let (_store, endpoint) = store_host(&cancel, true);
    let deadline = Instant::now() + Duration::from_secs(600);
    let (r, _s, waited) = join(&endpoint, &cancel, 0, (1, 2), deadline).await.expect("pod");
    assert_eq!(r.nnodes, 1);
    assert!(waited >= TIMING.last_call, "closed after {waited:?}, before the last call ended");
    assert!(waited < TIMING.last_call + Duration::from_secs(3), "closed {waited:?} after joining");
    cancel.cancel();
}

/// A full elastic round (MAX pods) closes at once: no last call.
#[tokio::test(start_paused = true)]
async fn a_full_round_closes_without_waiting_for_the_last_call() {
    let cancel = CancellationToken::new();
    let (_store, endpoint) = store_host(&cancel, true);
    let deadline = Instant::now() + Duration::from_secs(600);
    let started = Instant::now();
    let pods: Vec<_> = (0..2).map(|i| join(&endpoint, &cancel, i, (1, 2), deadline)).collect();
    let mut sessions = Vec::new();
    for p in pods {
        let (r, s, _) = p.await.expect("pod");
        assert_eq!(r.nnodes, 2);
        sessions.push(s);
    }
    assert!(started.elapsed() < Duration::from_secs(2), "waited {:?}", started.elapsed());
    cancel.cancel();
}

/// A member that stops heartbeating is declared dead by the store host
/// once the heartbeat timeout has passed since its last beat: not before,
/// and not much after. Its machine vanished: its connections never close
/// (no FIN or reset reaches the store), which a store that ties no key
/// stands for here, as the session is dropped (a death its connection
/// shows is `liveness.rs`'s).
#[tokio::test(start_paused = true)]
async fn a_silent_member_is_dead_after_the_heartbeat_timeout() {
    let cancel = CancellationToken::new();
    let (store, endpoint) = store_host(&cancel, false);
    let deadline = Instant::now() + Duration::from_secs(600);
    let joins: Vec<_> = (0..2).map(|i| join(&endpoint, &cancel, i, (2, 2), deadline)).collect();
    let mut sessions = Vec::new();
    for j in joins {
        sessions.push(j.await.expect("pod"));
    }
    let round = sessions[0].0.number;
    // Pod 1 goes silent: its session (and with it the heartbeat task) is dropped.
    let silent = sessions.pop().expect("pod 1");
    drop(silent);
    let silenced = Instant::now();
    let mut c = trainlet::store::Client::connect(store.local_addr()).await.expect("client");
    c.wait(&[format!("trainlet/t/j0/r{round}/dead")]).await.expect("dead key");
    let after = silenced.elapsed();
    assert!(after + TIMING.heartbeat >= TIMING.heartbeat_timeout, "declared dead after {after:?}");
    assert!(after <= TIMING.heartbeat_timeout + 3 * TIMING.heartbeat, "declared dead only after {after:?}");
    cancel.cancel();
}
