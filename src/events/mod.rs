//! Kubernetes Events: every verdict of the agent (a failure and its root
//! cause, a hang, a restart, a spare taking a rank, an unhealthy pod
//! leaving, a straggler) as an `events.k8s.io/v1` Event regarding this pod,
//! related to its TrainJob, so that `kubectl get events` and
//! `kubectl describe` say what happened.
//!
//! The rest of trainlet calls [`Events::emit`] (on a handle it was given,
//! or on [`global`], the one the mode [`install`]ed) and never waits: the event
//! goes into a bounded queue ([`QUEUE`]; what does not fit is counted and
//! said once) that one background task drains. The task finds who the pod
//! is (`post`), lets the pure `core` decide what to write (a new object, a
//! raised series count, or nothing yet: deduplicated and rate limited) and
//! writes it through the kube client the project links. It is never an
//! error for Events not to work: without an API server configuration, a pod
//! name or `--events on`, [`Events`] is a no-op (one info line says why);
//! a 403 or 404 from the API server logs one warning naming the permission
//! and turns Events off for the life of the process; other failures are
//! retried with a backoff, a bounded number of times. [`Events::finish`]
//! (and the cancel token) writes what is queued within a bound, so a
//! failure's Event emitted just before the exit is not lost.
//!
//! This module must not decide what a verdict is: its callers do, and say
//! it in [`Event`]'s reason and note.

mod core;
mod post;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use k8s_openapi::api::events::v1::Event as K8sEvent;
use kube::api::Api;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use self::core::{Core, Observed, Outcome};
pub use self::core::{Event, NOTE_LIMIT, Type, clean_note};
use self::post::{Identity, Known, NameFrom, Refused};
use crate::env::{self, Env};
use crate::ratelimit::RateLimit;

/// Events queued for the background task at most.
pub const QUEUE: usize = 256;
/// How long a shutdown (the cancel token) may spend writing what is queued.
pub const FLUSH_BOUND: Duration = Duration::from_secs(2);
/// One request to the API server at most.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Warnings about writes given up, at most 3 a minute.
static WRITE_WARNINGS: RateLimit = RateLimit::new(3, Duration::from_secs(60));

/// What [`Events::start`] needs: whether Events are wanted (`--events`)
/// and what the environment says of the pod and the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    on: bool,
    known: Option<Known>,
    /// Why there is no API server to talk to, if that is known up front.
    no_api: Option<&'static str>,
}

impl Config {
    /// `on` from `--events`; the pod from `env` (POD_NAME, else the host
    /// name in a pod; POD_NAMESPACE; POD_UID; TRAIN_JOB_NAME or JOBSET_NAME).
    pub fn new(on: bool, env: &Env) -> Self {
        let in_pod = env.get(env::KUBERNETES_SERVICE_HOST).is_some();
        // Outside a pod (a KUBECONFIG) only a named pod: a laptop's host
        // name is no pod of the cluster its kubeconfig points at.
        let no_api = match (in_pod, env.get(env::KUBECONFIG).is_some(), env.get(env::POD_NAME).is_some()) {
            (true, _, _) => None,
            (false, true, true) => None,
            (false, true, false) => Some("KUBECONFIG is set but POD_NAME is not"),
            (false, false, _) => Some("not in a pod (no KUBERNETES_SERVICE_HOST) and no KUBECONFIG"),
        };
        Self { on, known: Known::read(env), no_api }
    }

    /// Events off.
    pub fn off() -> Self {
        Self { on: false, known: None, no_api: None }
    }
}

/// The handle every part of trainlet emits through: cheap to clone, never
/// blocks, a no-op when Events are off.
#[derive(Debug, Clone, Default)]
pub struct Events {
    shared: Option<Arc<Shared>>,
}

#[derive(Debug)]
struct Shared {
    tx: mpsc::Sender<Msg>,
    /// Set when the API server refused Events, or there is none.
    off: AtomicBool,
    /// Events that found the queue full.
    overflow: AtomicU64,
}

#[derive(Debug)]
enum Msg {
    Emit(Event),
    /// Write what is due before the deadline, then answer.
    Flush(Instant, oneshot::Sender<()>),
}

impl Events {
    /// Events off (tests, `--events off`).
    pub fn off() -> Self {
        Self { shared: None }
    }

    /// Start the background task (in the current tokio runtime) that
    /// writes the Events; never fails: when Events cannot work, one info
    /// line says why and the handle is a no-op. The task ends with
    /// `cancel`, after writing what is queued (at most [`FLUSH_BOUND`]).
    pub fn start(cfg: &Config, cancel: &CancellationToken) -> Self {
        let why = if !cfg.on {
            Some("--events off")
        } else if let Some(why) = cfg.no_api {
            Some(why)
        } else if cfg.known.is_none() {
            Some("no pod name: set POD_NAME (fieldRef metadata.name)")
        } else if tokio::runtime::Handle::try_current().is_err() {
            Some("no async runtime")
        } else {
            None
        };
        let (Some(known), None) = (cfg.known.clone(), why) else {
            tracing::info!("Kubernetes Events: off ({})", why.unwrap_or_default());
            return Self::off();
        };
        Self::spawn(known, None, cancel)
    }

    /// The task, with the API server's configuration given (tests) or
    /// inferred (None: in-cluster, else KUBECONFIG).
    fn spawn(known: Known, api: Option<kube::Config>, cancel: &CancellationToken) -> Self {
        let (tx, rx) = mpsc::channel(QUEUE);
        let shared = Arc::new(Shared { tx, off: AtomicBool::new(false), overflow: AtomicU64::new(0) });
        let cancel = cancel.child_token();
        tokio::spawn(Task { shared: Arc::clone(&shared), rx, seq: 0, cancel }.run(known, api));
        Self { shared: Some(shared) }
    }

    /// Whether events go anywhere (false: off from the start, or refused since).
    pub fn is_on(&self) -> bool {
        self.shared.as_ref().is_some_and(|s| !s.off.load(Ordering::Relaxed))
    }

    /// Queue `e` (its note cleaned and bounded); never waits.
    pub fn emit(&self, mut e: Event) {
        let Some(s) = self.shared.as_ref().filter(|s| !s.off.load(Ordering::Relaxed)) else { return };
        e.note = clean_note(&e.note);
        match s.tx.try_send(Msg::Emit(e)) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                if s.overflow.fetch_add(1, Ordering::Relaxed) == 0 {
                    tracing::warn!(
                        queue = QUEUE,
                        "Kubernetes Events: the queue is full; events are dropped (counted, said at the end)"
                    );
                }
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {}
        }
    }

    /// Write what is queued, waiting at most `timeout` (before the process
    /// exits). Returns at once when Events are off.
    pub async fn finish(&self, timeout: Duration) {
        let Some(s) = self.shared.as_ref().filter(|s| !s.off.load(Ordering::Relaxed)) else { return };
        let deadline = Instant::now() + timeout;
        let (reply, done) = oneshot::channel();
        let asked = tokio::time::timeout_at(deadline, s.tx.send(Msg::Flush(deadline, reply))).await;
        let answered = match asked {
            Ok(Ok(())) => tokio::time::timeout_at(deadline, done).await.is_ok(),
            // The task ended (refused, cancelled): nothing more to wait for.
            Ok(Err(_)) => true,
            Err(_) => false,
        };
        if !answered {
            tracing::warn!(?timeout, "Kubernetes Events: not every event was written before the deadline");
        }
    }
}

/// The process's Events, once installed.
static GLOBAL: std::sync::OnceLock<Events> = std::sync::OnceLock::new();

/// Make `events` the process's, what [`global`] returns from anywhere
/// (as `crate::metrics::global`); the first call wins: false when one was
/// installed already.
pub fn install(events: Events) -> bool {
    GLOBAL.set(events).is_ok()
}

/// The process's Events: the installed ones, else off.
pub fn global() -> &'static Events {
    static OFF: Events = Events { shared: None };
    GLOBAL.get().unwrap_or(&OFF)
}

/// The background task.
struct Task {
    shared: Arc<Shared>,
    rx: mpsc::Receiver<Msg>,
    /// Creates so far, part of each new object's name.
    seq: u64,
    /// The task's cancel token.
    cancel: CancellationToken,
}

/// The kube client and the pod's identity, or why Events are off.
async fn connect(known: Known, api: Option<kube::Config>) -> Result<(Api<K8sEvent>, Identity), String> {
    let config = match api {
        Some(c) => c,
        None => kube::Config::infer().await.map_err(|e| format!("no Kubernetes API configuration: {e}"))?,
    };
    let default_ns = config.default_namespace.clone();
    let client = kube::Client::try_from(config).map_err(|e| format!("cannot make a Kubernetes client: {e}"))?;
    let id = tokio::time::timeout(REQUEST_TIMEOUT * 2, post::identify(&client, known, &default_ns))
        .await
        .map_err(|_| "the API server did not answer".to_string())??;
    Ok((Api::namespaced(client, &id.namespace), id))
}

impl Task {
    async fn run(mut self, known: Known, api: Option<kube::Config>) {
        let cancel = self.cancel.clone();
        let guessed = known.name.1 == NameFrom::Hostname;
        let connected = tokio::select! {
            () = cancel.cancelled() => return self.stop(),
            c = connect(known, api) => c,
        };
        let (api, id) = match connected {
            Ok(c) => c,
            Err(why) => {
                tracing::info!("Kubernetes Events: off ({why})");
                return self.stop();
            }
        };
        tracing::info!(
            namespace = %id.namespace,
            pod = id.instance,
            pod_name_from = if guessed { "host name" } else { "POD_NAME" },
            related = ?id.related.as_ref().map(|r| format!("{}/{}", r.kind.as_deref().unwrap_or(""), r.name.as_deref().unwrap_or(""))),
            "Kubernetes Events: on"
        );
        let mut core = Core::new(Instant::now());
        let ended = loop {
            let wake = core.wake_at(Instant::now());
            let woke = tokio::select! {
                biased;
                () = cancel.cancelled() => Woke::Ended,
                m = self.rx.recv() => m.map_or(Woke::Ended, Woke::Msg),
                () = sleep_until(wake) => Woke::Due,
            };
            let result = match woke {
                Woke::Ended => break self.flush(&mut core, &api, &id, Instant::now() + FLUSH_BOUND).await,
                Woke::Msg(Msg::Emit(e)) => {
                    observe(&mut core, e);
                    match self.drain(&mut core) {
                        None => self.write_due(&mut core, &api, &id, None).await,
                        Some((deadline, reply)) => self.flush_and_answer(&mut core, &api, &id, deadline, reply).await,
                    }
                }
                Woke::Msg(Msg::Flush(deadline, reply)) => {
                    self.flush_and_answer(&mut core, &api, &id, deadline, reply).await
                }
                Woke::Due => self.write_due(&mut core, &api, &id, None).await,
            };
            if let Err(refused) = result {
                break Err(refused);
            }
        };
        if let Err(refused) = ended {
            tracing::warn!(error = %crate::error::error_chain(&refused), "{refused}");
        }
        let lost = core.dropped() + core.given_up() + self.shared.overflow.load(Ordering::Relaxed);
        if lost > 0 {
            tracing::warn!(
                dropped = core.dropped(),
                given_up = core.given_up(),
                queue_full = self.shared.overflow.load(Ordering::Relaxed),
                "Kubernetes Events: some events were never written"
            );
        }
        self.stop();
    }

    /// Events off for good: emits return at once from now on.
    fn stop(&self) {
        self.shared.off.store(true, Ordering::Relaxed);
    }

    /// Count what is queued, without waiting.
    fn drain(&mut self, core: &mut Core) -> Option<(Instant, oneshot::Sender<()>)> {
        let mut flush = None;
        while let Ok(m) = self.rx.try_recv() {
            match m {
                Msg::Emit(e) => observe(core, e),
                Msg::Flush(d, r) => flush = Some((d, r)),
            }
        }
        flush
    }

    /// Everything queued and pending, spacing and rate limit aside, until
    /// `deadline`.
    async fn flush(
        &mut self,
        core: &mut Core,
        api: &Api<K8sEvent>,
        id: &Identity,
        deadline: Instant,
    ) -> Result<(), Refused> {
        match self.drain(core) {
            None => self.write_due(core, api, id, Some(deadline)).await,
            Some((later, reply)) => self.flush_and_answer(core, api, id, deadline.min(later), reply).await,
        }
    }

    /// [`Task::flush`], then tell [`Events::finish`] it is done.
    async fn flush_and_answer(
        &mut self,
        core: &mut Core,
        api: &Api<K8sEvent>,
        id: &Identity,
        deadline: Instant,
        reply: oneshot::Sender<()>,
    ) -> Result<(), Refused> {
        let mut replies = vec![reply];
        replies.extend(self.drain(core).map(|(_, more)| more));
        let r = self.write_due(core, api, id, Some(deadline)).await;
        if core.pending() && r.is_ok() {
            tracing::debug!(
                "Kubernetes Events: writes still pending at the flush's deadline (retries wait their turn)"
            );
        }
        for reply in replies {
            let _ = reply.send(());
        }
        r
    }

    /// The writes due now (`flush`: everything, until the deadline).
    async fn write_due(
        &mut self,
        core: &mut Core,
        api: &Api<K8sEvent>,
        id: &Identity,
        flush: Option<Instant>,
    ) -> Result<(), Refused> {
        loop {
            let now = Instant::now();
            // A shutdown cuts ordinary writes short: the flush that
            // follows has the bound.
            if flush.is_some_and(|d| now >= d) || (flush.is_none() && self.cancel.is_cancelled()) {
                return Ok(());
            }
            let Some(w) = core.next(now, flush.is_some()) else { return Ok(()) };
            let bound = flush.map_or(REQUEST_TIMEOUT, |d| (d - now).min(REQUEST_TIMEOUT));
            self.seq += 1;
            let write = tokio::time::timeout(bound, post::write(api, id, &w, self.seq));
            let cancelled = async {
                match flush {
                    Some(_) => std::future::pending().await,
                    None => self.cancel.cancelled().await,
                }
            };
            let outcome = tokio::select! {
                r = write => match r {
                    Ok(r) => r?,
                    Err(_) => Outcome::Retry,
                },
                // Cut short, not failed: the flush writes it again at once.
                () = cancelled => return Ok(()),
            };
            let before = core.given_up();
            core.done(&w, outcome, Instant::now());
            if core.given_up() > before {
                crate::limited!(
                    WRITE_WARNINGS,
                    warn,
                    reason = w.reason,
                    attempts = self::core::MAX_ATTEMPTS,
                    "Kubernetes Events: an event could not be written; given up"
                );
            }
        }
    }
}

/// Why the task woke.
enum Woke {
    Msg(Msg),
    /// A write may be due.
    Due,
    /// Cancelled, or every handle is gone.
    Ended,
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

fn observe(core: &mut Core, e: Event) {
    if core.observe(e, Instant::now()) == Observed::Dropped && core.dropped() == 1 {
        tracing::warn!(
            "Kubernetes Events: too many different events are waiting to be written; more are dropped (counted)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

    /// What the fake API server does with every request.
    #[derive(Clone, Copy)]
    enum Answer {
        Ok,
        Forbidden,
        Silent,
    }

    type Seen = Arc<Mutex<Vec<(String, String, serde_json::Value)>>>;

    /// A fake API server on loopback: (method, path, body) of every request.
    async fn fake_api(answer: Answer) -> (kube::Config, Seen) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let seen: Seen = Arc::default();
        let log = Arc::clone(&seen);
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let log = Arc::clone(&log);
                tokio::spawn(async move {
                    let mut conn = BufReader::new(conn);
                    loop {
                        let mut head = String::new();
                        let mut len = 0;
                        loop {
                            let mut line = String::new();
                            if conn.read_line(&mut line).await.unwrap_or(0) == 0 {
                                return;
                            }
                            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                                len = v.trim().parse().unwrap_or(0);
                            }
                            if line == "\r\n" {
                                break;
                            }
                            head.push_str(&line);
                        }
                        let mut body = vec![0; len];
                        conn.read_exact(&mut body).await.expect("body");
                        let mut words = head.split_whitespace();
                        let (method, path) =
                            (words.next().unwrap_or("").to_string(), words.next().unwrap_or("").to_string());
                        let body: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                        log.lock().expect("log").push((method.clone(), path, body.clone()));
                        let (status, reply) = match answer {
                            Answer::Silent => return std::future::pending().await,
                            Answer::Forbidden => (
                                "403 Forbidden",
                                serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": "forbidden", "reason": "Forbidden", "code": 403}),
                            ),
                            Answer::Ok if method == "POST" => ("201 Created", body),
                            Answer::Ok => (
                                "200 OK",
                                serde_json::json!({"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": "x"}}),
                            ),
                        };
                        let reply = reply.to_string();
                        let out = format!(
                            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{reply}",
                            reply.len()
                        );
                        if conn.get_mut().write_all(out.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        let mut config = kube::Config::new(url.parse().expect("url"));
        config.default_namespace = "ns".into();
        (config, seen)
    }

    fn known() -> Known {
        Known {
            name: ("job-node-0-1-abcde".into(), NameFrom::Env),
            namespace: Some("team".into()),
            uid: Some("0000-1111".into()),
            trainjob: Some("job".into()),
            jobset: None,
        }
    }

    fn warning(note: &str) -> Event {
        Event { type_: Type::Warning, reason: "WorkerFailed", action: "Fail", note: note.into() }
    }

    #[tokio::test]
    async fn repeats_are_one_object_whose_series_is_patched_at_finish() {
        let (config, seen) = fake_api(Answer::Ok).await;
        let cancel = CancellationToken::new();
        let events = Events::spawn(known(), Some(config), &cancel);
        for _ in 0..5 {
            events.emit(warning("rank 3 exited with code 1"));
        }
        events.emit(warning("rank 5: \x1b[31mCUDA error\x1b[0m\nout of memory"));
        events.emit(warning("rank 7 is slow"));
        events.finish(Duration::from_secs(5)).await;
        let seen = seen.lock().expect("seen").clone();
        let posts: Vec<_> = seen.iter().filter(|(m, _, _)| m == "POST").collect();
        let patches: Vec<_> = seen.iter().filter(|(m, _, _)| m == "PATCH").collect();
        assert_eq!(posts.len(), 3, "{seen:#?}");
        assert!(posts.iter().all(|(_, p, _)| p == "/apis/events.k8s.io/v1/namespaces/team/events?"), "{posts:#?}");
        let notes: Vec<&str> = posts.iter().filter_map(|(_, _, b)| b["note"].as_str()).collect();
        assert!(notes.contains(&"rank 5: CUDA error out of memory"), "{notes:?}");
        let first = &posts.iter().find(|(_, _, b)| b["note"] == "rank 3 exited with code 1").expect("first").2;
        assert_eq!(
            first["regarding"],
            serde_json::json!({"apiVersion": "v1", "kind": "Pod", "name": "job-node-0-1-abcde", "namespace": "team", "uid": "0000-1111"})
        );
        assert_eq!(first["related"]["kind"], "TrainJob");
        assert_eq!(first["related"]["apiVersion"], "trainer.kubeflow.org/v1alpha1");
        assert_eq!(
            (first["reportingController"].as_str(), first["reportingInstance"].as_str()),
            (Some("trainlet"), Some("job-node-0-1-abcde"))
        );
        assert_eq!(
            (first["type"].as_str(), first["reason"].as_str(), first["action"].as_str()),
            (Some("Warning"), Some("WorkerFailed"), Some("Fail"))
        );
        let total: u64 = first["series"]["count"].as_u64().unwrap_or(1);
        let patched = patches.iter().filter_map(|(_, _, b)| b["series"]["count"].as_u64()).max();
        assert_eq!(patched.unwrap_or(total), 5, "{seen:#?}");
        if let Some((_, path, _)) = patches.first() {
            let name = first["metadata"]["name"].as_str().expect("name");
            assert!(path.starts_with(&format!("/apis/events.k8s.io/v1/namespaces/team/events/{name}")), "{path}");
        }
        assert!(events.is_on());
        cancel.cancel();
    }

    #[tokio::test]
    async fn a_403_turns_events_off_after_one_request() {
        let (config, seen) = fake_api(Answer::Forbidden).await;
        let cancel = CancellationToken::new();
        let events = Events::spawn(known(), Some(config), &cancel);
        events.emit(warning("a"));
        events.finish(Duration::from_secs(5)).await;
        let until = Instant::now() + Duration::from_secs(5);
        while events.is_on() && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!events.is_on());
        events.emit(warning("b"));
        events.finish(Duration::from_secs(1)).await;
        assert_eq!(seen.lock().expect("seen").len(), 1);
    }

    #[tokio::test]
    async fn a_silent_api_server_never_holds_up_the_caller() {
        let (config, seen) = fake_api(Answer::Silent).await;
        let cancel = CancellationToken::new();
        let events = Events::spawn(known(), Some(config), &cancel);
        let started = Instant::now();
        for i in 0..(QUEUE * 4) {
            events.emit(warning(&format!("{i}")));
        }
        assert!(started.elapsed() < Duration::from_secs(1), "emit waited: {:?}", started.elapsed());
        let started = Instant::now();
        events.finish(Duration::from_millis(300)).await;
        assert!(started.elapsed() < Duration::from_secs(1), "finish waited: {:?}", started.elapsed());
        assert!(events.shared.as_ref().is_some_and(|s| s.overflow.load(Ordering::Relaxed) > 0), "the queue is bounded");
        assert!(!seen.lock().expect("seen").is_empty());
        cancel.cancel();
    }

    #[tokio::test]
    async fn a_cancel_ends_the_task_within_the_flush_bound() {
        let (config, _seen) = fake_api(Answer::Silent).await;
        let cancel = CancellationToken::new();
        let events = Events::spawn(known(), Some(config), &cancel);
        events.emit(warning("a"));
        tokio::time::sleep(Duration::from_millis(200)).await;
        let started = Instant::now();
        cancel.cancel();
        while events.is_on() && started.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(!events.is_on());
        let took = started.elapsed();
        assert!(took >= FLUSH_BOUND - Duration::from_millis(100), "the write cut short is tried again: {took:?}");
        assert!(took < FLUSH_BOUND + Duration::from_millis(500), "{took:?}");
    }

    #[tokio::test]
    async fn off_is_a_no_op() {
        let events = Events::off();
        events.emit(warning("a"));
        events.finish(Duration::from_secs(10)).await;
        assert!(!events.is_on());
        let cancel = CancellationToken::new();
        let env = Env::from_pairs([("POD_NAME", "p"), ("KUBERNETES_SERVICE_HOST", "10.0.0.1")]);
        assert!(!Events::start(&Config::new(false, &env), &cancel).is_on(), "--events off");
        let laptop = Env::from_pairs([("KUBECONFIG", "/k")]);
        assert!(!Events::start(&Config::new(true, &laptop), &cancel).is_on(), "a kubeconfig, no pod name");
        assert!(!Events::start(&Config::off(), &cancel).is_on());
        // Nothing installed in the unit tests: the global handle is off.
        global().emit(warning("nowhere"));
        assert!(!global().is_on());
    }
}
