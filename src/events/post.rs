//! The API server side of Kubernetes Events: who this pod is (the
//! `regarding` object and the `related` TrainJob or JobSet), and the two
//! writes, a POST of a new `events.k8s.io/v1` Event and a merge PATCH of
//! its `series`. Each answer is sorted into what the core makes of it
//! ([`super::core::Outcome`]) or [`Refused`]: no permission, or no such API.

use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::api::events::v1::{Event as K8sEvent, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};

use super::core::{Outcome, Write, WriteKind};
use crate::env::{self, Env};

/// `reportingController` of every Event trainlet writes.
pub const CONTROLLER: &str = "trainlet";
/// Where a pod's service account namespace is.
const NAMESPACE_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace";
/// The label JobSet puts on its pods (with Trainer: the TrainJob's name).
const JOBSET_LABEL: &str = "jobset.sigs.k8s.io/jobset-name";
/// The API server's limit on `reportingInstance`.
const INSTANCE_LIMIT: usize = 128;

/// Who the Events are about, and who reports them.
#[derive(Debug, Clone, PartialEq)]
pub struct Identity {
    /// This pod (`regarding`).
    pub pod: ObjectReference,
    /// The TrainJob, or the JobSet, the pod belongs to (`related`).
    pub related: Option<ObjectReference>,
    /// The namespace the Events are written in (the pod's).
    pub namespace: String,
    /// `reportingInstance`: the pod's name, bounded.
    pub instance: String,
}

/// Where the pod's name came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameFrom {
    /// `POD_NAME` (the downward API).
    Env,
    /// The host name: a guess (JobSet gives pods a host name of their own).
    Hostname,
}

/// What the environment says of this pod, before any request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Known {
    /// The pod's name and where it came from.
    pub name: (String, NameFrom),
    /// `POD_NAMESPACE`, else the service account's namespace file.
    pub namespace: Option<String>,
    /// `POD_UID` (the downward API, `metadata.uid`).
    pub uid: Option<String>,
    /// `TRAIN_JOB_NAME`: the TrainJob.
    pub trainjob: Option<String>,
    /// `JOBSET_NAME`: the JobSet, when no TrainJob is named.
    pub jobset: Option<String>,
}

impl Known {
    /// Read from `env` (and the host name, and the namespace file); None
    /// when there is no pod name at all.
    pub fn read(env: &Env) -> Option<Self> {
        let get = |n: &str| env.get(n).map(str::trim).filter(|v| !v.is_empty()).map(str::to_string);
        let name = match get(env::POD_NAME) {
            Some(n) => (n, NameFrom::Env),
            None => (crate::sys::hostname().filter(|h| !h.is_empty())?, NameFrom::Hostname),
        };
        let namespace = get(env::POD_NAMESPACE).or_else(|| {
            std::fs::read_to_string(NAMESPACE_FILE).ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
        });
        Some(Self {
            name,
            namespace,
            uid: get(env::POD_UID),
            trainjob: get(env::TRAIN_JOB_NAME),
            jobset: get(env::JOBSET_NAME),
        })
    }
}

/// Why Events are off for good: the API server refused them.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// 403 on a write: the service account lacks the permission.
    #[error(
        "Kubernetes Events are off: the API server refused to write them (the pod's service account needs `create` and `patch` on `events` in API group `events.k8s.io`)"
    )]
    Forbidden(#[source] kube::Error),
    /// 404 on a create: the API server has no `events.k8s.io/v1` (or no such namespace).
    #[error("Kubernetes Events are off: the API server has no events.k8s.io/v1 Events in namespace {namespace}")]
    Missing {
        /// The namespace of the write.
        namespace: String,
        /// The answer.
        #[source]
        source: kube::Error,
    },
}

/// The status code of an API server's answer, if it was one.
fn status(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
    }
}

/// Who this pod is: `known`, and what a GET of the pod adds when the
/// downward API did not give its uid (allowed or not: the Events go on
/// without). Err: the pod's name was a guess from the host name and the
/// API server has no such pod.
pub async fn identify(client: &kube::Client, known: Known, default_ns: &str) -> Result<Identity, String> {
    let namespace = known.namespace.clone().unwrap_or_else(|| default_ns.to_string());
    let (name, from) = known.name;
    let (mut uid, mut jobset) = (known.uid, known.jobset);
    if uid.is_none() {
        let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
        match pods.get_metadata(&name).await {
            Ok(p) => {
                uid = p.metadata.uid;
                if jobset.is_none() {
                    jobset = p.metadata.labels.and_then(|mut l| l.remove(JOBSET_LABEL));
                }
            }
            Err(e) if status(&e) == Some(404) && from == NameFrom::Hostname => {
                return Err(format!(
                    "no pod {namespace}/{name} (the host name): give the pod's name in POD_NAME (fieldRef metadata.name)"
                ));
            }
            Err(e) => {
                tracing::debug!(error = %e, pod = %name, "events: the pod's uid is unknown (the Events name the pod without it)")
            }
        }
    }
    let related = match (known.trainjob, jobset) {
        (Some(t), _) => Some(reference("trainer.kubeflow.org/v1alpha1", "TrainJob", &t, &namespace)),
        (None, Some(j)) => Some(reference("jobset.x-k8s.io/v1alpha2", "JobSet", &j, &namespace)),
        (None, None) => None,
    };
    let mut pod = reference("v1", "Pod", &name, &namespace);
    pod.uid = uid;
    let mut instance = name;
    truncate(&mut instance, INSTANCE_LIMIT);
    Ok(Identity { pod, related, namespace, instance })
}

fn reference(api_version: &str, kind: &str, name: &str, namespace: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some(api_version.to_string()),
        kind: Some(kind.to_string()),
        name: Some(name.to_string()),
        namespace: Some(namespace.to_string()),
        ..ObjectReference::default()
    }
}

fn truncate(s: &mut String, max: usize) {
    let mut cut = max.min(s.len());
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    s.truncate(cut);
}

/// The Event object of a create: named after the pod and the time, as
/// client-go and kube-rs name theirs.
pub fn object(id: &Identity, w: &Write, now: Timestamp, seq: u64) -> K8sEvent {
    let mut prefix = id.instance.clone();
    // Names are at most 253 bytes; the suffix is at most 34.
    truncate(&mut prefix, 200);
    K8sEvent {
        metadata: ObjectMeta {
            name: Some(format!("{prefix}.{:x}.{seq}", now.as_nanosecond())),
            namespace: Some(id.namespace.clone()),
            ..ObjectMeta::default()
        },
        event_time: Some(MicroTime(now)),
        type_: Some(w.type_.as_str().to_string()),
        reason: Some(w.reason.to_string()),
        action: Some(w.action.to_string()),
        note: Some(w.note.clone()),
        regarding: Some(id.pod.clone()),
        related: id.related.clone(),
        reporting_controller: Some(CONTROLLER.to_string()),
        reporting_instance: Some(id.instance.clone()),
        series: series(w.count, now),
        ..K8sEvent::default()
    }
}

/// The API's series: only for two occurrences or more.
fn series(count: u32, now: Timestamp) -> Option<EventSeries> {
    (count >= 2)
        .then(|| EventSeries { count: i32::try_from(count).unwrap_or(i32::MAX), last_observed_time: MicroTime(now) })
}

/// Do the write `w`; what the core makes of the answer, or [`Refused`].
pub async fn write(api: &Api<K8sEvent>, id: &Identity, w: &Write, seq: u64) -> Result<Outcome, Refused> {
    let now = Timestamp::now();
    let answer = match &w.kind {
        WriteKind::Create => {
            let ev = object(id, w, now, seq);
            let name = ev.metadata.name.clone().unwrap_or_default();
            api.create(&PostParams::default(), &ev).await.map(|_| Outcome::Created(name))
        }
        WriteKind::Patch(name) => {
            let patch = serde_json::json!({ "series": series(w.count, now) });
            api.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await.map(|_| Outcome::Patched)
        }
    };
    match answer {
        Ok(o) => Ok(o),
        Err(e) => match (status(&e), &w.kind) {
            // (A 401 is retried: the client reads a rotated token again.)
            (Some(403), _) => Err(Refused::Forbidden(e)),
            (Some(404), WriteKind::Create) => Err(Refused::Missing { namespace: id.namespace.clone(), source: e }),
            (Some(404), WriteKind::Patch(_)) => Ok(Outcome::Gone),
            _ => {
                tracing::debug!(error = %e, reason = w.reason, "events: a write failed; it is retried");
                Ok(Outcome::Retry)
            }
        },
    }
}
