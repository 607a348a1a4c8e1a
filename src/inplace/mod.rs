//! JobSet's in-place restarts (KEP-467) with trainlet as its pod's agent:
//! the protocol of JobSet's `in-place-restart-agent`, without a sidecar or
//! a shell.
//!
//! trainlet watches its own JobSet through the API server (field selector
//! `metadata.name`; the watcher re-lists on a 410 and resumes from
//! bookmarks; the service account token is re-read from its file at least
//! once a minute), writes the pod annotation
//! `jobset.sigs.k8s.io/in-place-restart-attempt` with server-side apply
//! (field manager `in-place-restart-agent`, as JobSet's agent), and waits at
//! the barrier before its rendezvous. Once the barrier is down the watch
//! goes on: when the JobSet restarts its pods in place, trainlet stops its
//! workers as on SIGTERM (checkpoint signal, grace) and exits with
//! `IN_PLACE_RESTART_EXIT_CODE`, and the kubelet restarts the pod's
//! containers. The decisions are `protocol`'s.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use futures::StreamExt;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher;
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::config::InPlace;
use crate::process::signals::SysEvent;
pub use protocol::{Agent, Lifted, Step, View};

mod protocol;

/// The pod annotation that holds this pod's attempt.
pub const ATTEMPT_ANNOTATION: &str = "jobset.sigs.k8s.io/in-place-restart-attempt";
/// The JobSet annotation that turns in-place restarts off.
pub const DISABLE_ANNOTATION: &str = "jobset.sigs.k8s.io/disable-in-place-restart";
/// JobSet's agent's field manager: the ValidatingAdmissionPolicy of a
/// runtime may name it.
pub const FIELD_MANAGER: &str = "in-place-restart-agent";
/// Where a pod's service account namespace is.
const NAMESPACE_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace";

/// Why the agent could not start.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No kubeconfig and no in-cluster configuration.
    #[error(
        "--in-place-restart: no Kubernetes API configuration (in a pod: the service account token must be mounted; outside: KUBECONFIG)"
    )]
    Config(#[source] kube::config::InferConfigError),
    /// The client could not be built from the configuration.
    #[error("--in-place-restart: cannot make a Kubernetes client")]
    Client(#[source] kube::Error),
    /// Neither POD_NAMESPACE nor the service account's namespace file.
    #[error(
        "--in-place-restart: no namespace: set POD_NAMESPACE (fieldRef metadata.namespace) or mount the service account token ({NAMESPACE_FILE})"
    )]
    Namespace(#[source] std::io::Error),
    /// The API server refused the pod's attempt annotation for good.
    #[error(
        "--in-place-restart: the API server refused to write pod {pod}'s attempt annotation: {why} (the pod's service account needs `patch` on pods and list/watch on jobsets)"
    )]
    Refused {
        /// The pod.
        pod: String,
        /// The API server's answer.
        why: String,
    },
}

/// Where the barrier stands.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Gate {
    Up,
    Down(Lifted),
    Refused(String),
}

/// The running agent: the barrier, and whether the JobSet asked for a restart.
#[derive(Debug)]
pub struct InPlaceAgent {
    gate: watch::Receiver<Gate>,
    /// The code the agent asked the job to end with (0: none).
    asked: Arc<AtomicU8>,
    pod: String,
    stop: CancellationToken,
}

impl InPlaceAgent {
    /// Wait until the barrier is down (every pod wrote the same attempt, or
    /// in-place restarts are off), or the API server refused the attempt.
    /// If the JobSet restarts the pod first, the stop comes as an event.
    pub async fn barrier(&mut self) -> Result<Lifted, Error> {
        loop {
            match &*self.gate.borrow_and_update() {
                Gate::Up => {}
                Gate::Down(l) => return Ok(*l),
                Gate::Refused(why) => return Err(Error::Refused { pod: self.pod.clone(), why: why.clone() }),
            }
            if self.gate.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Stop watching; then the code the agent asked the job to end with:
    /// `IN_PLACE_RESTART_EXIT_CODE` when the JobSet restarts the pods, 200
    /// when the API server refused the attempt after the barrier.
    pub fn finish(&self) -> Option<u8> {
        self.stop.cancel();
        Some(self.asked.load(Ordering::SeqCst)).filter(|c| *c != 0)
    }
}

impl Drop for InPlaceAgent {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Start the agent: the watch of the JobSet and the annotation's writes.
/// When the JobSet restarts the pod, `stop` gets a stop as by SIGTERM (the
/// launch flow stops the workers gracefully) and `finish` gives the agent's code.
pub async fn start(
    cfg: &InPlace,
    stop: UnboundedSender<SysEvent>,
    cancel: &CancellationToken,
) -> Result<InPlaceAgent, Error> {
    let namespace = match &cfg.namespace {
        Some(ns) => ns.clone(),
        None => std::fs::read_to_string(NAMESPACE_FILE).map_err(Error::Namespace)?.trim().to_string(),
    };
    let config = kube::Config::infer().await.map_err(Error::Config)?;
    let client = kube::Client::try_from(config).map_err(Error::Client)?;
    let gvk = GroupVersionKind::gvk("jobset.x-k8s.io", "v1alpha2", "JobSet");
    let jobsets: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &namespace, &ApiResource::from_gvk_with_plural(&gvk, "jobsets"));
    let pods: Api<DynamicObject> = Api::namespaced_with(
        client,
        &namespace,
        &ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("", "v1", "Pod"), "pods"),
    );
    let (tx, gate) = watch::channel(Gate::Up);
    let asked = Arc::new(AtomicU8::new(0));
    let token = cancel.child_token();
    let task = Task {
        jobset: cfg.jobset.clone(),
        pod: cfg.pod.clone(),
        namespace,
        exit_code: cfg.exit_code,
        gate: tx,
        asked: Arc::clone(&asked),
        stop,
    };
    tokio::spawn(task.run(jobsets, pods, token.clone()));
    Ok(InPlaceAgent { gate, asked, pod: cfg.pod.clone(), stop: token })
}

struct Task {
    jobset: String,
    pod: String,
    namespace: String,
    exit_code: u8,
    gate: watch::Sender<Gate>,
    asked: Arc<AtomicU8>,
    stop: UnboundedSender<SysEvent>,
}

/// How often a wait at the barrier says so again.
const STILL_WAITING: std::time::Duration = std::time::Duration::from_secs(60);
/// How long 401 and 403 answers to the annotation's write are retried.
const AUTH_PATIENCE: std::time::Duration = std::time::Duration::from_secs(60);
/// Longest wait between two tries of the annotation's write.
const PATCH_RETRY_CAP: std::time::Duration = std::time::Duration::from_secs(10);

impl Task {
    async fn run(self, jobsets: Api<DynamicObject>, pods: Api<DynamicObject>, cancel: CancellationToken) {
        let config = watcher::Config::default().fields(&format!("metadata.name={}", self.jobset));
        let mut events = std::pin::pin!(watcher(jobsets, config).default_backoff());
        let mut agent = Agent::default();
        tracing::info!(
            jobset = %self.jobset,
            pod = %self.pod,
            namespace = %self.namespace,
            "in-place restarts: watching the JobSet; waiting at its barrier before the rendezvous"
        );
        let mut failing = false;
        let (mut listed, mut last) = (false, View::default());
        let mut every = tokio::time::interval_at(tokio::time::Instant::now() + STILL_WAITING, STILL_WAITING);
        loop {
            let event = tokio::select! {
                () = cancel.cancelled() => return,
                e = events.next() => e,
                _ = every.tick() => {
                    if agent.lifted().is_none() {
                        tracing::info!(
                            jobset = %self.jobset,
                            attempt = ?agent.attempt(),
                            current = ?last.current,
                            previous = ?last.previous,
                            "in-place restarts: still waiting at the JobSet's barrier for every pod to write this attempt"
                        );
                    }
                    continue;
                }
            };
            if failing && matches!(event, Some(Ok(_))) {
                failing = false;
                tracing::info!(jobset = %self.jobset, "in-place restarts: the JobSet's watch is back");
            }
            let obj = match event {
                None => return,
                Some(Err(e)) => {
                    failing = true;
                    tracing::warn!(jobset = %self.jobset, error = %crate::error::error_chain(&e), "in-place restarts: the JobSet's watch failed; retrying");
                    continue;
                }
                Some(Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o))) => o,
                Some(Ok(watcher::Event::Delete(_))) => {
                    tracing::info!(jobset = %self.jobset, "in-place restarts: the JobSet was deleted; waiting for the pod to be stopped");
                    continue;
                }
                Some(Ok(watcher::Event::Init)) => {
                    listed = false;
                    continue;
                }
                Some(Ok(watcher::Event::InitDone)) => {
                    if !listed {
                        tracing::info!(jobset = %self.jobset, namespace = %self.namespace, "in-place restarts: no such JobSet (yet); waiting for it");
                    }
                    continue;
                }
            };
            listed = true;
            let view = view_of(&obj);
            last = view;
            loop {
                match agent.step(&view) {
                    Step::Wait => break,
                    Step::Annotate(n) => {
                        match self.annotate(&pods, n, &cancel).await {
                            Written::Yes => {}
                            Written::Cancelled => return,
                            Written::Refused(why) => {
                                tracing::error!(pod = %self.pod, attempt = n, %why, "in-place restarts: the API server refused the pod's attempt annotation");
                                if agent.lifted().is_some() {
                                    // Past the barrier: the other pods would wait for this one for ever.
                                    let _ = self.asked.compare_exchange(
                                        0,
                                        crate::exit::CONFIG,
                                        Ordering::SeqCst,
                                        Ordering::SeqCst,
                                    );
                                    let _ = self.stop.send(SysEvent::StopAsked(libc::SIGTERM));
                                }
                                self.gate.send_replace(Gate::Refused(why));
                                return;
                            }
                        }
                        agent.annotated(n);
                        tracing::info!(
                            attempt = n,
                            current = ?view.current,
                            "in-place restarts: wrote this pod's attempt; waiting until the JobSet's current attempt is {n}"
                        );
                    }
                    Step::Lift => {
                        if let Some(lifted) = agent.lifted() {
                            tracing::info!(?lifted, "in-place restarts: the barrier is down");
                            self.gate.send_replace(Gate::Down(lifted));
                        }
                    }
                    Step::Restart => {
                        if self.asked.compare_exchange(0, self.exit_code, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
                            tracing::warn!(
                                attempt = ?agent.attempt(),
                                previous = ?view.previous,
                                exit_code = self.exit_code,
                                "in-place restarts: the JobSet restarts its pods in place; stopping the workers, then exiting for the kubelet to restart this pod's containers"
                            );
                            let _ = self.stop.send(SysEvent::StopAsked(libc::SIGTERM));
                        }
                        break;
                    }
                }
            }
        }
    }

    /// Write `attempt` to the pod's annotation, retrying what may pass
    /// (the API server unreachable, 409, 429, 5xx; 401 and 403 for
    /// `AUTH_PATIENCE`) until it is written.
    async fn annotate(&self, pods: &Api<DynamicObject>, attempt: i64, cancel: &CancellationToken) -> Written {
        let first = tokio::time::Instant::now();
        let body = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": self.pod,
                "namespace": self.namespace,
                "annotations": {ATTEMPT_ANNOTATION: attempt.to_string()},
            },
        });
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let mut wait = std::time::Duration::from_millis(100);
        loop {
            match pods.patch(&self.pod, &params, &Patch::Apply(&body)).await {
                Ok(_) => return Written::Yes,
                // 401 and 403 pass for a while: an API server that just
                // started refuses until its caches are warm.
                Err(kube::Error::Api(s))
                    if (400..500).contains(&s.code)
                        && ![409, 429].contains(&s.code)
                        && (![401, 403].contains(&s.code) || first.elapsed() >= AUTH_PATIENCE) =>
                {
                    return Written::Refused(format!("{} {}: {}", s.code, s.reason, s.message));
                }
                Err(e) => tracing::warn!(
                    pod = %self.pod,
                    attempt,
                    error = %crate::error::error_chain(&e),
                    retry_in_s = wait.as_secs_f64(),
                    "in-place restarts: cannot write the pod's attempt annotation; retrying"
                ),
            }
            tokio::select! {
                () = cancel.cancelled() => return Written::Cancelled,
                () = tokio::time::sleep(wait) => {}
            }
            wait = (wait * 2).min(PATCH_RETRY_CAP);
        }
    }
}

/// How a write of the attempt ended.
enum Written {
    Yes,
    Cancelled,
    Refused(String),
}

/// What the protocol reads of a JobSet.
pub fn view_of(js: &DynamicObject) -> View {
    let attempt = |name: &str| js.data.get("status").and_then(|s| s.get(name)).and_then(serde_json::Value::as_i64);
    View {
        in_place: js
            .data
            .get("spec")
            .and_then(|s| s.get("failurePolicy"))
            .and_then(|f| f.get("restartStrategy"))
            .and_then(serde_json::Value::as_str)
            == Some("InPlaceRestart"),
        disabled: js.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(DISABLE_ANNOTATION)),
        current: attempt("currentInPlaceRestartAttempt"),
        previous: attempt("previousInPlaceRestartAttempt"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jobset(json: serde_json::Value) -> DynamicObject {
        serde_json::from_value(json).expect("a JobSet")
    }

    #[test]
    fn a_jobsets_strategy_annotation_and_attempts_are_read() {
        let js = jobset(serde_json::json!({
            "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": {"name": "j", "annotations": {DISABLE_ANNOTATION: "true"}},
            "spec": {"failurePolicy": {"maxRestarts": 3, "restartStrategy": "InPlaceRestart"}},
            "status": {"currentInPlaceRestartAttempt": 2, "previousInPlaceRestartAttempt": 1},
        }));
        assert_eq!(view_of(&js), View { in_place: true, disabled: true, current: Some(2), previous: Some(1) });
        let js = jobset(serde_json::json!({
            "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": {"name": "j"},
            "spec": {"failurePolicy": {"restartStrategy": "Recreate"}},
        }));
        assert_eq!(view_of(&js), View::default());
    }
}
