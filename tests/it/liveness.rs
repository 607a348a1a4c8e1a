//! Death by connection, in one process: the real store server with the
//! agents' tie rule, the real store host's monitor (`host::serve_rounds`)
//! and a real agent session heartbeating to it, with a round formed by
//! hand (its members record written as the agents write it).
//!
//! The heartbeat timeout is a minute and every wait here is shorter, so a
//! member declared dead was declared so by its lost connection. The
//! session dials the store at 127.0.0.1 and the monitor at 127.0.0.2 (the
//! same listener), so that `ss -K` cuts the session's connections only: a
//! blip of the kind a network cut or a conntrack reset makes.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use trainlet::rendezvous::host;
use trainlet::rendezvous::{Member, Roster, Session, Timing, job_base};
use trainlet::store::{Budget, Client, Dial, Endpoint, StoreServer, bind_listener};

const LIMIT: Duration = Duration::from_secs(30);
const RUN: &str = "liveness";
/// The lost grace of these tests: `--lost-grace`'s default.
const LOST_GRACE: Duration = Duration::from_millis(500);

/// The store with the agents' tie rule, and the monitor of the job `RUN`.
struct Host {
    server: StoreServer,
    cancel: CancellationToken,
    timing: Timing,
}

impl Host {
    async fn start() -> Host {
        let cancel = CancellationToken::new();
        let listener = bind_listener(None, 0).expect("bind port 0");
        let server =
            StoreServer::start(listener, Arc::new(Budget::new(64 << 20)), cancel.child_token()).expect("serve");
        server.state().tie(trainlet::rendezvous::heartbeat_tie);
        let timing = Timing {
            last_call: Duration::from_secs(1),
            // Longer than the grace: a heartbeat that noticed its cut only
            // at its next beat would come back too late.
            heartbeat: LOST_GRACE * 4,
            heartbeat_timeout: Duration::from_secs(60),
            lost_grace: LOST_GRACE,
        };
        let port = server.local_addr().port();
        let dial = Dial { addr: ([127, 0, 0, 2], port).into(), guard: None };
        let worker_cancel = cancel.clone();
        let serve: host::ServeFn = Box::new(move || {
            let l = bind_listener(Some("127.0.0.1".parse().expect("ip")), 0)?;
            StoreServer::start(l, Arc::new(Budget::new(1 << 20)), worker_cancel.child_token())
                .map_err(|source| trainlet::store::ServerError::Bind { port: 0, source })
        });
        let losses = Some(server.state().losses());
        tokio::spawn(host::serve_rounds(dial, job_base(RUN, 0), timing, serve, losses, cancel.child_token()));
        Host { server, cancel, timing }
    }

    fn port(&self) -> u16 {
        self.server.local_addr().port()
    }

    /// A client on the monitor's address (a cut leaves it alone).
    async fn client(&self) -> Client {
        Client::connect(([127, 0, 0, 2], self.port()).into()).await.expect("connect")
    }

    /// An agent's session (heartbeating) in place 0 (it claims the place as it connects).
    async fn connect(&self) -> Result<Session, trainlet::rendezvous::Error> {
        let endpoint = Endpoint { host: "127.0.0.1".into(), port: self.port() };
        Session::connect((&endpoint, None), RUN, 0, me(), self.timing, Instant::now() + LIMIT, &self.cancel).await
    }

    /// An agent's session (heartbeating), and round 0 formed with it as its member.
    async fn member(&self) -> (Session, String) {
        let s = self.connect().await.expect("session");
        let hb = s.heartbeat_key();
        let uid = hb.rsplit('/').next().expect("uid").to_string();
        let mut c = self.client().await;
        wait_for(&mut c, &hb, |v| v.parse::<u64>().is_ok()).await;
        let record = serde_json::to_vec(&Member { uid: uid.clone(), ..me() }).expect("json");
        c.set(&format!("{}/r0/m/0", job_base(RUN, 0)), &record).await.expect("its slot");
        let roster = Roster::Slots(vec![0]).to_bytes();
        c.set(&format!("{}/r0/members", job_base(RUN, 0)), &roster).await.expect("form round 0");
        (s, hb)
    }
}

/// The agent of node rank 0 on 127.0.0.1, of a static job of one pod.
fn me() -> Member {
    Member {
        uid: String::new(),
        host: "127.0.0.1".into(),
        pid: std::process::id(),
        node_rank: 0,
        nproc: 1,
        min_nodes: 1,
        max_nodes: 1,
        max_restarts: 0,
        spares: 0,
        last_rank: None,
    }
}

/// Until `key` holds a value `ok` takes (a panic past [`LIMIT`]); the value.
async fn wait_for(c: &mut Client, key: &str, ok: impl Fn(&str) -> bool) -> String {
    let until = Instant::now() + LIMIT;
    loop {
        let v = String::from_utf8_lossy(&c.get(key).await.expect("get")).into_owned();
        if ok(&v) {
            return v;
        }
        assert!(Instant::now() < until, "{key} never took the value awaited (last {v:?})");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_whose_connection_closes_without_bye_is_dead_after_the_grace_not_the_timeout() {
    let host = Host::start().await;
    let (session, hb) = host.member().await;
    let uid = hb.rsplit('/').next().expect("uid").to_string();
    let mut c = host.client().await;
    // The monitor watches the formed round before the agent goes.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = Instant::now();
    // Its process gone: the session (and its heartbeat's connection) closes with no bye.
    drop(session);
    let end = wait_for(&mut c, &format!("{}/r0/end", job_base(RUN, 0)), |v| !v.is_empty()).await;
    let took = started.elapsed();
    assert_eq!(end, format!("dead:{uid}"));
    let dead = wait_for(&mut c, &format!("{}/r0/dead", job_base(RUN, 0)), |v| !v.is_empty()).await;
    assert_eq!(dead, format!("[\"{uid}\"]"));
    assert_eq!(c.get(&hb).await.expect("get"), b"lost");
    // Not before the grace: a blip would have been given it.
    assert!(took >= LOST_GRACE, "declared dead {took:?} after its connection closed, within the grace");
    host.cancel.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_connection_that_is_cut_reconnects_and_nobody_is_declared_dead() {
    let host = Host::start().await;
    let (session, hb) = host.member().await;
    let mut c = host.client().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let first: u64 = String::from_utf8_lossy(&c.get(&hb).await.expect("get")).parse().expect("a counter");
    // Cut just after a beat: the next is a whole period away.
    let before = wait_for(&mut c, &hb, |v| v.parse::<u64>().is_ok_and(|n| n > first)).await;
    let before: u64 = before.parse().expect("a counter");
    // Every connection the session dialled (127.0.0.1 to the store's port) is reset.
    let port = host.port().to_string();
    let out = std::process::Command::new("ss")
        .args(["-K", "dst", "127.0.0.1", "dport", "=", &port])
        .output()
        .expect("ss (iproute2; tests/setup.sh installs it)");
    assert!(out.status.success(), "ss -K: {}", String::from_utf8_lossy(&out.stderr));
    let cut = String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.contains("ESTAB")).count();
    assert!(cut >= 2, "the session's connections (its own and its heartbeat's) were cut: {cut}");
    // The store may read the close before the heartbeat's new connection
    // beats (the key reads `lost` meanwhile) or after (the key is tied to
    // the new connection already: no loss); either way the agent lives.
    // The heartbeat is back on a new connection, counting on.
    let back = wait_for(&mut c, &hb, |v| v.parse::<u64>().is_ok_and(|n| n > before)).await;
    // Well past the grace the round has not ended and nobody is dead.
    tokio::time::sleep(LOST_GRACE * 4).await;
    let base = job_base(RUN, 0);
    assert_eq!(c.get(&format!("{base}/r0/end")).await.expect("get"), b"", "the heartbeat came back at {back}");
    assert_eq!(c.get(&format!("{base}/r0/dead")).await.expect("get"), b"");
    assert_ne!(c.get(&hb).await.expect("get"), b"lost");
    drop(session);
    host.cancel.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_restarted_in_place_takes_its_place_over_once_its_dead_predecessors_connection_stays_closed() {
    let host = Host::start().await;
    let (session, hb) = host.member().await;
    let mut c = host.client().await;
    let started = Instant::now();
    // The predecessor's process is gone: no bye, its connections closed.
    drop(session);
    wait_for(&mut c, &hb, |v| v == "lost").await;
    // Its successor in the same place (a container restarted in place).
    let next = host.connect().await.expect("the successor takes the place over");
    let took = started.elapsed();
    let claim = c.get(&format!("{}/claim/0", job_base(RUN, 0))).await.expect("get");
    let next_uid = next.heartbeat_key().rsplit('/').next().expect("uid").to_string();
    assert_eq!(String::from_utf8_lossy(&claim), next_uid, "the place is the successor's");
    // After the grace, and well before its heartbeat would have stood
    // still for two periods (the only way before the store tied it).
    assert!(took >= LOST_GRACE, "taken over {took:?} after the predecessor died, within the grace");
    assert!(took < host.timing.heartbeat * 2, "taken over only {took:?} after the predecessor died");
    drop(next);
    host.cancel.cancel();
}
