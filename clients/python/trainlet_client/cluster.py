"""Warm pods brought up, reached and torn down from Python (``up``,
``connect``, ``down``, ``ls``), through the Kubernetes API alone: no YAML
to write, no token to paste, no ``kubectl port-forward``.

    import trainlet_client as tc
    with tc.up("exp1", nodes=2, nproc_per_node=2) as t:   # a Trainlet
        a = t.actor(Trainer)
        a.train(steps=10)
    # the TrainJob, its Secret and its pods are gone

``up`` creates a TrainJob on a trainlet ClusterTrainingRuntime
(``trainlet-dev``) with a random control token in a Secret of its own (owned
by the TrainJob, so deleting the TrainJob removes it), waits until the pods'
rendezvous has formed, saying what it waits for, and returns a connected
:class:`Warm`. The connection is the API server's port-forward to node rank
0's pod, one per HTTP request, so it follows that pod when it is replaced.
When it cannot succeed it fails (:class:`UpError`) with the cluster's
reason within ``timeout`` and deletes what it created.

The Kubernetes client is an extra: ``pip install 'trainlet-client[k8s]'``.
The kubeconfig is found as kubectl finds it (``KUBECONFIG``, then
``~/.kube/config``), else the pod's service account inside a cluster. RBAC
the caller needs: ``docs/src/serve.md`` and ``examples/trainlet-driver-rbac.yaml``.
"""

import base64
import json
import os
import secrets
import socket
import sys
import threading
import time

from . import Trainlet, TrainletError

__all__ = ["up", "connect", "down", "ls", "Warm", "UpError"]

GROUP, VERSION, PLURAL = "trainer.kubeflow.org", "v1alpha1", "trainjobs"
# The label that marks a TrainJob as warm pods of this client (ls lists them).
LABEL = "trainlet.dev/warm"
CONTROL_PORT = 29400
# The runtime's volume that holds the control token (runtimes/trainlet-dev.yaml).
TOKEN_VOLUME = "trainlet-control"
# Image pull states that do not get better by waiting.
PULL_FAILURES = ("ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")
CONFIG_FAILURES = ("CreateContainerConfigError", "CreateContainerError", "RunContainerError")


class UpError(RuntimeError):
    """Warm pods could not be brought up or reached; the message says why, from the cluster."""


def _kubernetes():
    try:
        import kubernetes
    except ImportError:
        raise ImportError("trainlet_client.up/connect/down/ls talk to Kubernetes: "
                          "pip install 'trainlet-client[k8s]' (the official kubernetes client)") from None
    return kubernetes


class _Cluster:
    """The API clients and the namespace, from the kubeconfig kubectl would use."""

    def __init__(self, kubeconfig=None, context=None, namespace=None):
        k = _kubernetes()
        conf = k.client.Configuration()
        path = kubeconfig or os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
        in_cluster = kubeconfig is None and "KUBERNETES_SERVICE_HOST" in os.environ and not any(
            os.path.exists(p) for p in path.split(os.pathsep))
        if in_cluster:
            k.config.load_incluster_config(client_configuration=conf)
            if namespace is None:
                with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
                    namespace = f.read().strip()
        else:
            try:
                k.config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=conf)
                if namespace is None:
                    contexts, active = k.config.list_kube_config_contexts(config_file=kubeconfig)
                    if context is not None:
                        active = next(c for c in contexts if c["name"] == context)
                    namespace = (active.get("context") or {}).get("namespace")
            except (k.config.ConfigException, OSError, StopIteration) as e:
                raise UpError("no Kubernetes configuration (%s): set KUBECONFIG, give kubeconfig=, or run in a "
                              "pod with a service account" % e) from None
        self.k = k
        self.conf = conf
        self.api = k.client.ApiClient(conf)
        self.core = k.client.CoreV1Api(self.api)
        self.custom = k.client.CustomObjectsApi(self.api)
        self.namespace = namespace or "default"

    def job(self, name):
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)

    def pods(self, name):
        """The pods of the job's ``node`` replicatedJob (not an initializer's)."""
        selector = "jobset.sigs.k8s.io/jobset-name=%s,jobset.sigs.k8s.io/replicatedjob-name=node" % name
        return self.core.list_namespaced_pod(self.namespace, label_selector=selector).items

    def node0(self, name):
        """Node rank 0's pod that is running and not being deleted, or None."""
        for p in self.pods(name):
            labels = p.metadata.labels or {}
            if (labels.get("batch.kubernetes.io/job-completion-index") == "0" and p.status.phase == "Running"
                    and p.metadata.deletion_timestamp is None):
                return p.metadata.name
        return None

    def token(self, name):
        secret = self.core.read_namespaced_secret(_secret_name(name), self.namespace)
        return base64.b64decode(secret.data["token"]).decode()

    def why(self, e):
        """An ApiException in a few words: its status and the server's message."""
        try:
            body = json.loads(e.body)
            return "%s %s" % (e.status, body.get("message") or e.reason)
        except (TypeError, ValueError, AttributeError):
            return "%s %s" % (getattr(e, "status", ""), getattr(e, "reason", e))


def _secret_name(name):
    return "%s-trainlet-token" % name


class _Bridge:
    """A listener on 127.0.0.1 whose every connection becomes a port-forward
    to node rank 0's pod of ``name`` (looked up again each time)."""

    def __init__(self, cluster, name):
        self.cluster, self.name = cluster, name
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.closed = False
        self.last_error = None
        threading.Thread(target=self._accept, name="trainlet-bridge-" + name, daemon=True).start()

    def _accept(self):
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        try:
            pod = self.cluster.node0(self.name)
            if pod is None:
                self.last_error = "no running pod of node rank 0"
                return conn.close()
            # A client of its own: the kubernetes client's portforward swaps
            # its ApiClient's request function while it connects, which
            # another thread's call on a shared one would go through.
            core = self.cluster.k.client.CoreV1Api(self.cluster.k.client.ApiClient(self.cluster.conf))
            pf = self.cluster.k.stream.portforward(core.connect_get_namespaced_pod_portforward,
                                                   pod, self.cluster.namespace, ports=str(CONTROL_PORT))
            remote = pf.socket(CONTROL_PORT)
            remote.setblocking(True)
        except Exception as e:  # the pod went, the API refused: this request fails, the next tries again
            self.last_error = str(e)
            return conn.close()
        done = threading.Event()

        def pump(src, dst):
            try:
                while True:
                    data = src.recv(65536)
                    if not data:
                        break
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (dst, src):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                done.set()

        threading.Thread(target=pump, args=(remote, conn), daemon=True).start()
        pump(conn, remote)
        done.wait(30)
        for s in (conn, remote):
            s.close()
        try:
            # Why the pod's side refused, if it did ("connection refused"
            # while the control API is not up yet).
            self.last_error = pf.error(CONTROL_PORT)
            pf.close()
        except Exception:
            pass

    def close(self):
        """Stop listening (a thread blocked in accept() is woken) and let the
        connections in flight end."""
        if self.closed:
            return
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class Warm(Trainlet):
    """A :class:`~trainlet_client.Trainlet` on warm pods reached through the API
    server. As a context manager it deletes the TrainJob (and its Secret) on
    exit unless ``keep``; ``close()`` only drops the connection."""

    def __init__(self, cluster, name, token, keep=True, timeout=60.0):
        self.name = name
        self.namespace = cluster.namespace
        self.keep = keep
        self._cluster = cluster
        self._bridge = _Bridge(cluster, name)
        super().__init__("http://127.0.0.1:%d" % self._bridge.port, token, timeout)

    def down(self):
        """Delete the TrainJob, its Secret and so its pods; drop the connection."""
        self.close()
        _delete(self._cluster, self.name)

    def close(self):
        self._bridge.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.keep:
            self.close()
        else:
            self.down()

    def __repr__(self):
        return "Warm(name=%r, namespace=%r)" % (self.name, self.namespace)


def _say(progress, name, text):
    if progress is not None:
        progress.write("trainlet: %s: %s\n" % (name, text))
        progress.flush()


def _trainjob(name, nodes, nproc_per_node, runtime, image, resources, env, ttl, patches):
    trainer = {"numNodes": int(nodes), "numProcPerNode": nproc_per_node}
    if image:
        trainer["image"] = image
    if resources:
        trainer["resourcesPerNode"] = resources
    variables = [{"name": k, "value": str(v)} for k, v in sorted((env or {}).items())]
    if ttl is not None:
        variables.append({"name": "TRAINLET_SERVE_IDLE_TIMEOUT", "value": str(int(ttl))})
    if variables:
        trainer["env"] = variables
    # The runtime's token volume, pointed at this job's own Secret.
    patch = {"manager": "trainlet.dev/client", "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": "node", "template": {"spec": {"template": {"spec": {"volumes": [
            {"name": TOKEN_VOLUME, "secret": {"secretName": _secret_name(name)}}]}}}}}]}}}}
    return {
        "apiVersion": "%s/%s" % (GROUP, VERSION),
        "kind": "TrainJob",
        "metadata": {"name": name, "labels": {LABEL: "true"}},
        "spec": {"runtimeRef": {"name": runtime}, "trainer": trainer, "runtimePatches": [patch] + list(patches or [])},
    }


def up(name, nodes=1, nproc_per_node=1, runtime="trainlet-dev", image=None, resources=None, env=None,
       namespace=None, kubeconfig=None, context=None, ttl=None, keep=False, timeout=600.0, progress=sys.stderr,
       patches=None):
    """Bring up warm pods as TrainJob ``name`` and return a connected :class:`Warm`.

    ``nodes`` pods of ``nproc_per_node`` workers on ClusterTrainingRuntime ``runtime``;
    ``image``, ``resources`` (``{"limits": {"nvidia.com/gpu": 1}}``) and ``env`` override the
    runtime's; ``ttl``: the pods end after that many idle seconds and the TrainJob completes.
    ``keep``: leave them up when the ``with`` block ends. ``progress``: where each new thing
    waited for is said (None: nowhere). ``patches``: more ``runtimePatches`` entries of the
    TrainJob (Trainer's API), e.g. a volume to mount. Raises :class:`UpError` within ``timeout`` seconds with
    the cluster's reason, after deleting what it created."""
    cluster = _Cluster(kubeconfig, context, namespace)
    token = secrets.token_urlsafe(32)
    body = _trainjob(name, nodes, nproc_per_node, runtime, image, resources, env, ttl, patches)
    try:
        job = cluster.custom.create_namespaced_custom_object(GROUP, VERSION, cluster.namespace, PLURAL, body)
    except cluster.k.client.ApiException as e:
        raise UpError("cannot create TrainJob %s on runtime %s in namespace %s: %s"
                      % (name, runtime, cluster.namespace, cluster.why(e))) from None
    created = True
    try:
        owner = {"apiVersion": job["apiVersion"], "kind": "TrainJob", "name": name,
                 "uid": job["metadata"]["uid"], "blockOwnerDeletion": False}
        secret = cluster.k.client.V1Secret(
            metadata=cluster.k.client.V1ObjectMeta(name=_secret_name(name), labels={LABEL: name},
                                                   owner_references=[owner]),
            string_data={"token": token})
        try:
            cluster.core.create_namespaced_secret(cluster.namespace, secret)
        except cluster.k.client.ApiException as e:
            raise UpError("cannot create the token's Secret %s: %s" % (_secret_name(name), cluster.why(e))) from None
        warm = Warm(cluster, name, token, keep=keep)
        try:
            _wait_ready(cluster, warm, name, int(nodes), time.monotonic() + timeout, progress)
        except BaseException:
            warm.close()
            raise
        created = False
        return warm
    except BaseException as e:
        if created:
            try:
                _delete(cluster, name)
            except Exception as cleanup:  # the reason stays the first failure's
                if isinstance(e, UpError):
                    raise UpError("%s; and cleaning up failed: %s" % (e, cleanup)) from None
        raise


def _wait_ready(cluster, warm, name, nodes, deadline, progress):
    """Until every pod is in the rendezvous; UpError with the reason at the first
    state that cannot get better, or at the deadline."""
    said = None
    while True:
        waiting, fatal = _waiting_for(cluster, warm, name, nodes)
        if fatal:
            raise UpError("%s: %s" % (name, fatal))
        if waiting is None:
            _say(progress, name, "ready: %d pods in the rendezvous" % nodes)
            return
        if waiting != said:
            _say(progress, name, "waiting for " + waiting)
            said = waiting
        if time.monotonic() > deadline:
            raise UpError("%s: not ready in time; still waiting for %s" % (name, waiting))
        time.sleep(0.5)


def _waiting_for(cluster, warm, name, nodes):
    """(what is waited for, None) or (None, why it cannot succeed), or (None, None) when ready."""
    k = cluster.k
    try:
        job = cluster.job(name)
        pods = cluster.pods(name)
    except k.client.ApiException as e:
        if e.status == 404:
            return None, "the TrainJob is gone (%s)" % cluster.why(e)
        return "the API server (%s)" % cluster.why(e), None  # throttled, restarting: it may answer again
    except Exception as e:  # the connection to the API server broke
        return "the API server (%s)" % e, None
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Failed" and c.get("status") == "True":
            return None, "the TrainJob failed: %s" % (c.get("message") or c.get("reason"))
    pods = [p for p in pods if p.metadata.deletion_timestamp is None]
    if not pods:
        return "the TrainJob's pods to be created (JobSet %s)" % name, None
    for p in sorted(pods, key=lambda p: p.metadata.name):
        pod = p.metadata.name
        for c in p.status.conditions or []:
            if c.type == "PodScheduled" and c.status == "False":
                return "a node for pod %s: %s" % (pod, c.message or c.reason), None
        for cs in (p.status.init_container_statuses or []) + (p.status.container_statuses or []):
            w = cs.state.waiting if cs.state else None
            if w is not None and w.reason in PULL_FAILURES:
                return None, "pod %s cannot pull image %s: %s (%s)" % (pod, cs.image, w.reason, w.message)
            if w is not None and w.reason in CONFIG_FAILURES:
                return None, "pod %s cannot start its container: %s (%s)" % (pod, w.reason, w.message)
            term = (cs.state.terminated if cs.state else None) or (
                cs.last_state.terminated if cs.last_state else None)
            if term is not None and term.exit_code != 0:
                return None, "pod %s's container exited (%s, exit code %s); its last lines:\n%s" % (
                    pod, term.reason, term.exit_code, _last_lines(cluster, pod))
            if w is not None:
                return "pod %s's container %s (%s)" % (pod, cs.name, w.reason), None
        if p.status.phase != "Running":
            return "pod %s (%s)" % (pod, p.status.phase), None
    try:
        status = warm.status()
    except TrainletError as e:
        if e.status == 401:
            return None, "the control API refused the job's token (401): %s" % e
        return "the control API (%s)" % e, None
    except Exception as e:  # the connection through the port-forward broke
        return "the control API on node rank 0 (%s)" % (warm._bridge.last_error or e), None
    world = status.get("world") or {}
    have = len(world.get("pods") or world.get("members") or []) or world.get("nnodes") or 0
    if have < nodes:
        return "the rendezvous (%d of %d pods)" % (have, nodes), None
    return None, None


def _last_lines(cluster, pod, n=20):
    try:
        text = cluster.core.read_namespaced_pod_log(pod, cluster.namespace, container="node", tail_lines=n)
    except cluster.k.client.ApiException as e:
        return "(no log: %s)" % cluster.why(e)
    return text.rstrip() or "(empty log)"


def _delete(cluster, name):
    """Delete the TrainJob (its pods go with it) and its Secret; gone already is fine."""
    k = cluster.k
    try:
        cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, cluster.namespace, PLURAL, name,
                                                       propagation_policy="Background")
    except k.client.ApiException as e:
        if e.status != 404:
            raise UpError("cannot delete TrainJob %s: %s" % (name, cluster.why(e))) from None
    try:
        cluster.core.delete_namespaced_secret(_secret_name(name), cluster.namespace)
    except k.client.ApiException as e:
        if e.status != 404:
            raise UpError("cannot delete Secret %s: %s" % (_secret_name(name), cluster.why(e))) from None


def connect(name, namespace=None, kubeconfig=None, context=None, timeout=60.0, progress=sys.stderr):
    """Reattach to warm pods brought up earlier (by this or another process): a
    :class:`Warm` that leaves them up on exit (``keep=True``)."""
    cluster = _Cluster(kubeconfig, context, namespace)
    k = cluster.k
    try:
        job = cluster.job(name)
        token = cluster.token(name)
    except k.client.ApiException as e:
        raise UpError("no warm pods %s in namespace %s: %s" % (name, cluster.namespace, cluster.why(e))) from None
    if (job["metadata"].get("labels") or {}).get(LABEL) != "true":
        raise UpError("TrainJob %s was not brought up by trainlet_client.up" % name)
    warm = Warm(cluster, name, token, keep=True)
    try:
        _wait_ready(cluster, warm, name, int(job["spec"]["trainer"].get("numNodes") or 1),
                    time.monotonic() + timeout, progress)
    except BaseException:
        warm.close()
        raise
    return warm


def down(name, namespace=None, kubeconfig=None, context=None):
    """Delete warm pods ``name``: the TrainJob, its Secret, its pods."""
    _delete(_Cluster(kubeconfig, context, namespace), name)


def ls(namespace=None, kubeconfig=None, context=None):
    """The caller's warm pods in the namespace: ``[{"name", "state", "nodes", "ready", "idle_seconds",
    "created"}]``; ``idle_seconds`` from the control API (None when it does not answer or a run is active)."""
    cluster = _Cluster(kubeconfig, context, namespace)
    try:
        jobs = cluster.custom.list_namespaced_custom_object(GROUP, VERSION, cluster.namespace, PLURAL,
                                                            label_selector="%s=true" % LABEL)
    except cluster.k.client.ApiException as e:
        raise UpError("cannot list TrainJobs in namespace %s: %s" % (cluster.namespace, cluster.why(e))) from None
    out = []
    for job in jobs.get("items", []):
        name = job["metadata"]["name"]
        state = "Running"
        for c in (job.get("status") or {}).get("conditions") or []:
            if c.get("status") == "True" and c.get("type") in ("Complete", "Failed", "Suspended"):
                state = c["type"]
        pods = cluster.pods(name)
        ready = sum(1 for p in pods if p.status.phase == "Running")
        idle = None
        if state == "Running" and ready:
            try:
                warm = Warm(cluster, name, cluster.token(name), keep=True, timeout=10)
                try:
                    idle = warm.status().get("idle_seconds")
                finally:
                    warm.close()
            except (TrainletError, OSError, cluster.k.client.ApiException):
                pass
        out.append({"name": name, "state": state, "nodes": job["spec"]["trainer"].get("numNodes"),
                    "ready": ready, "idle_seconds": idle, "created": job["metadata"].get("creationTimestamp")})
    return out
