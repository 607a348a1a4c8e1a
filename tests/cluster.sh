#!/usr/bin/env bash
# A real Kubernetes control plane on loopback for the cluster tests
# (issue 27): etcd, kube-apiserver, kube-controller-manager and
# kube-scheduler, built from their Go modules at the versions
# tests/cluster/go.mod pins (one binary, `kube`, cached under
# target/cluster/bin), with certificates and service-account keys made
# here by openssl; and the controllers users run, JobSet and Kubeflow
# Trainer (its status server on), built from the same module at the
# versions it pins, as processes on loopback: their CRDs come from those
# versions' module sources, their webhooks point at 127.0.0.1 with a
# certificate made here (their own cert rotation needs a Service in the
# cluster). Nodes: CLUSTER_NODES (default 2) kubelets, each with its own
# containerd (Debian's), runc and the CNI bridge plugin, in a PID and mount
# namespace of its own (tests/cluster/node.sh), running the images that
# tests/images.sh builds from images/ (imported into containerd; no
# registry); CoreDNS for the cluster's names, on the first node's bridge.
# Node n's pods get 10.X.n.0/24 on a bridge of their own in the host's
# network namespace (X from CLUSTER_PORT_BASE), the node itself 10.X.n.1.
#
#   bash tests/cluster.sh build   build target/cluster/bin (kube, the controllers, CoreDNS) when missing or stale
#   bash tests/cluster.sh up      build, then start everything and wait until it is ready
#   bash tests/cluster.sh ensure [--owner PID]   the cluster the tests share: reuse the
#                                 one that is up and ready, else start one (one process at a
#                                 time, under a lock); with --owner, it is stopped (`down`)
#                                 once process PID is gone, however that process ended
#   bash tests/cluster.sh down [--keep-logs]   stop everything this script started, in
#                                 order (nodes and controllers, then the API server, then
#                                 etcd); no process is left. The logs are kept (under
#                                 target/cluster/kept-logs) with --keep-logs or when a test
#                                 marked the run failed
#   bash tests/cluster.sh status  what runs, and the API server's /readyz
#   bash tests/cluster.sh restart-apiserver [--compact]   stop the API server and start it
#                                 again (--compact: compact etcd's history in between)
#   bash tests/cluster.sh kubectl ARGS...   kubectl against the cluster
#   bash tests/cluster.sh torch-patch   the runtimePatches entry (JSON) that mounts the test
#                                 venv's torch at /opt/torch (the test images carry none)
#
# Runs as root (bridges, iptables, cgroups, namespaces). State
# (certificates, kubeconfigs, etcd's data, logs, pids) lives in
# target/cluster/run (target/cluster/run-BASE for another port base);
# `down` removes it. Ports: CLUSTER_PORT_BASE (default 26400) + 0 etcd clients, +1 etcd peers, +2 the API server, +3 the
# controller manager, +4 the scheduler, +5/+6 JobSet's webhook/health,
# +7/+8 Trainer's webhook/health, +9 Trainer's status server, +10 CoreDNS's
# readiness, +20+2n/+21+2n node n's kubelet/its health. KUBECONFIG for the
# admin is target/cluster/run/admin.kubeconfig. One cluster per port base
# (each has its own state directory, bridges and cgroups); `down` also
# removes the bridges, the iptables rules and the nodes' cgroups.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BIN=$ROOT/target/cluster/bin
KUBE=$BIN/kube
BASE=${CLUSTER_PORT_BASE:-26400}
if [[ $BASE == 26400 ]]; then RUN=$ROOT/target/cluster/run; else RUN=$ROOT/target/cluster/run-$BASE; fi
LOCK=$ROOT/target/cluster/lock-$BASE
KEPT=$ROOT/target/cluster/kept-logs
ETCD_PORT=$BASE
ETCD_PEER=$((BASE + 1))
API_PORT=$((BASE + 2))
CM_PORT=$((BASE + 3))
SCHED_PORT=$((BASE + 4))
JOBSET_PORT=$((BASE + 5))
JOBSET_HEALTH=$((BASE + 6))
TRAINER_PORT=$((BASE + 7))
TRAINER_HEALTH=$((BASE + 8))
TRAINER_STATUS=$((BASE + 9))
DNS_READY=$((BASE + 10))
NODES=${CLUSTER_NODES:-2}
NET=10.$(((BASE / 10) % 200 + 20))
DNS_IP=$NET.0.1
K8S_VERSION=v1.36.3
# The controllers' and CoreDNS's versions are the ones the go.mod files
# pin (one place to change them).
pinned() { awk -v m="$1" '$1 == "require" { $1 = ""; $0 = $0 } $1 == m { print m "@" $2; exit }' "$2"; }
JOBSET_MODULE=$(pinned sigs.k8s.io/jobset "$ROOT/tests/cluster/go.mod")
TRAINER_MODULE=$(pinned github.com/kubeflow/trainer/v2 "$ROOT/tests/cluster/go.mod")
COREDNS_MODULE=$(pinned github.com/coredns/coredns "$ROOT/tests/cluster/dns/go.mod")
PAUSE_IMAGE=localhost/trainlet-test/pause:1
GOFLAGS_BUILD=(-trimpath -ldflags "-s -w")
# How long `up` waits for each component.
READY_TIMEOUT=${CLUSTER_READY_TIMEOUT:-120}

say() { echo "cluster: [$SECONDS s] $*" >&2; }
# What a failed start may have run out of: the disk under the run
# directory (the nodes' images) and memory.
resources() {
  local disk mem
  disk=$(df -h --output=avail "${RUN%/*}" 2>/dev/null | tail -1 | tr -d ' ')
  mem=$(awk '/^MemAvailable:/ { printf "%.1fG", $2 / 1048576 }' /proc/meminfo)
  echo "${disk:-?} of disk and $mem of memory free"
}
die() { say "error: $*"; exit 1; }

# What `build` needs (go, gcc), and with `up` also what running needs.
need_tools() {
  local missing=()
  command -v go >/dev/null || missing+=("go (Go 1.26: https://go.dev/dl, or the golang-go Debian package where it is 1.26)")
  command -v gcc >/dev/null || missing+=("gcc (apt-get install -y gcc)")
  if [[ ${1:-} == up ]]; then
    command -v openssl >/dev/null || missing+=("openssl (apt-get install -y openssl)")
    command -v curl >/dev/null || missing+=("curl (apt-get install -y curl)")
    command -v containerd >/dev/null || missing+=("containerd (apt-get install -y containerd)")
    command -v iptables >/dev/null || missing+=("iptables (apt-get install -y iptables)")
    command -v podman >/dev/null || missing+=("podman (apt-get install -y podman)")
    [[ -x /usr/lib/cni/bridge ]] || missing+=("the CNI plugins (apt-get install -y containernetworking-plugins)")
    [[ $(id -u) == 0 ]] || missing+=("root (bridges, iptables and cgroups: run as root)")
  fi
  if ((${#missing[@]})); then
    die "missing: ${missing[*]}"
  fi
}

# Build what the cluster runs when any of it is missing or older than its
# sources: `kube` and the JobSet and Trainer controllers in one `go build`
# of tests/cluster's module (they share its Kubernetes libraries, compiled
# once), CoreDNS from tests/cluster/dns (its own module: CoreDNS's versions
# of grpc and etcd's client are not the API server's), and the pause
# process.
build() {
  need_tools
  local src=$ROOT/tests/cluster bins=("$KUBE" "$BIN/jobset" "$BIN/trainer-controller-manager" "$BIN/coredns" "$BIN/pause")
  local b stale=
  for b in "${bins[@]}"; do
    if [[ ! -x $b ]] || [[ -n $(find "$src" -newer "$b" -type f \( -name '*.go' -o -name 'go.*' -o -name '*.c' \) | head -1) ]]; then
      stale=$b
      break
    fi
  done
  [[ -z $stale ]] && return 0
  mkdir -p "$BIN"
  say "building Kubernetes $K8S_VERSION, etcd, JobSet ${JOBSET_MODULE#*@} and Kubeflow Trainer ${TRAINER_MODULE#*@} from their Go modules into $BIN (${stale#"$BIN"/} is missing or stale; about 15 minutes cold on 2 cores, seconds when cached)"
  local started=$SECONDS out=$BIN/.building
  rm -rf "$out" && mkdir -p "$out"
  # One build: `-o DIR` names each command after its package. The -X
  # flags name variables of kube's and Trainer's packages alone.
  # (Trainer's status server reads its certificate from a directory fixed
  # at /tmp/k8s-webhook-server/serving-certs, pkg/util/cert.certDir; made
  # relative, it is found under the working directory `up` gives it.)
  (cd "$src" && go build -trimpath \
    -ldflags "-s -w -X k8s.io/component-base/version.gitVersion=$K8S_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=36 -X github.com/kubeflow/trainer/v2/pkg/util/cert.certDir=k8s-webhook-server/serving-certs" \
    -o "$out/" ./kube "${JOBSET_MODULE%@*}" "${TRAINER_MODULE%@*}/cmd/trainer-controller-manager")
  say "building CoreDNS ${COREDNS_MODULE#*@} with the plugins the cluster uses (tests/cluster/dns)"
  (cd "$src/dns" && go build "${GOFLAGS_BUILD[@]}" -o "$out/coredns" .)
  gcc -O2 -static -o "$out/pause" "$src/pause.c"
  for b in "${bins[@]}"; do
    mv "$out/${b##*/}" "$b"
  done
  rmdir "$out"
  say "built in $((SECONDS - started)) s"
}

# The directory of a module's source in Go's module cache (downloaded once).
module_dir() {
  go mod download -json "$1" | python3 -c 'import json, sys; d = json.load(sys.stdin); print(d.get("Dir") or sys.exit(d.get("Error", "no Dir")))'
}

# A key and a certificate signed by the cluster CA: NAME CN [O] [SANs].
cert() {
  local name=$1 cn=$2 org=${3:-} sans=${4:-}
  local subj="/CN=$cn"
  [[ -n $org ]] && subj="/O=$org$subj"
  openssl req -new -newkey rsa:2048 -nodes -keyout "$RUN/pki/$name.key" -subj "$subj" -out "$RUN/pki/$name.csr" 2>/dev/null
  local ext="$RUN/pki/$name.ext"
  {
    echo "basicConstraints=CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=serverAuth,clientAuth"
    [[ -n $sans ]] && echo "subjectAltName=$sans"
  } >"$ext"
  openssl x509 -req -in "$RUN/pki/$name.csr" -CA "$RUN/pki/ca.crt" -CAkey "$RUN/pki/ca.key" -CAcreateserial \
    -days 7 -sha256 -extfile "$ext" -out "$RUN/pki/$name.crt" 2>/dev/null
  rm -f "$RUN/pki/$name.csr" "$ext"
}

# A kubeconfig for NAME's client certificate.
kubeconfig() {
  local name=$1
  local b64="base64 -w0"
  cat >"$RUN/$name.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: trainlet-test
  cluster:
    server: https://127.0.0.1:$API_PORT
    certificate-authority-data: $($b64 <"$RUN/pki/ca.crt")
users:
- name: $name
  user:
    client-certificate-data: $($b64 <"$RUN/pki/$name.crt")
    client-key-data: $($b64 <"$RUN/pki/$name.key")
contexts:
- name: trainlet-test
  context: {cluster: trainlet-test, user: $name}
current-context: trainlet-test
EOF
}

pki() {
  mkdir -p "$RUN/pki"
  openssl req -x509 -new -newkey rsa:2048 -nodes -days 7 -subj "/CN=trainlet-test-ca" \
    -keyout "$RUN/pki/ca.key" -out "$RUN/pki/ca.crt" 2>/dev/null
  cert apiserver kube-apiserver "" \
    "DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:127.0.0.1,IP:10.96.0.1"
  cert admin admin system:masters
  cert controller-manager system:kube-controller-manager
  cert scheduler system:kube-scheduler
  cert apiserver-kubelet kube-apiserver-kubelet-client system:masters
  # The controllers' webhooks and Trainer's status server, on loopback.
  # The status server's name is the one Trainer gives the pods
  # (KUBEFLOW_TRAINER_SERVER_URL), resolved by CoreDNS to the host.
  cert webhook trainlet-test-webhooks "" \
    "IP:127.0.0.1,DNS:localhost,DNS:kubeflow-trainer-controller-manager.kubeflow-system.svc"
  openssl genrsa -out "$RUN/pki/sa.key" 2048 2>/dev/null
  openssl rsa -in "$RUN/pki/sa.key" -pubout -out "$RUN/pki/sa.pub" 2>/dev/null
  for n in admin controller-manager scheduler; do kubeconfig "$n"; done
}

# The API server (`up`, and `restart-apiserver` for the tests of watches
# that outlive it), ready when this returns.
start_apiserver() {
  start kube-apiserver kube-apiserver --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$API_PORT" \
    --tls-cert-file "$RUN/pki/apiserver.crt" --tls-private-key-file "$RUN/pki/apiserver.key" \
    --client-ca-file "$RUN/pki/ca.crt" \
    --kubelet-client-certificate "$RUN/pki/apiserver-kubelet.crt" --kubelet-client-key "$RUN/pki/apiserver-kubelet.key" \
    --service-account-issuer "https://127.0.0.1:$API_PORT" \
    --service-account-key-file "$RUN/pki/sa.pub" --service-account-signing-key-file "$RUN/pki/sa.key" \
    --service-cluster-ip-range 10.96.0.0/16 --authorization-mode Node,RBAC --allow-privileged=true \
    --kubelet-preferred-address-types InternalIP \
    --enable-priority-and-fairness=false --profiling=false \
    --enable-admission-plugins PodNodeSelector
  wait_ready kube-apiserver "https://127.0.0.1:$API_PORT/readyz" --cacert "$RUN/pki/ca.crt" \
    --cert "$RUN/pki/admin.crt" --key "$RUN/pki/admin.key"
}

# Start NAME: `kube ARGS...` in the background, its log and pid in $RUN.
start() {
  local name=$1
  shift
  "$KUBE" "$@" >"$RUN/logs/$name.log" 2>&1 &
  echo $! >"$RUN/pids/$name"
}

# Wait until `curl URL` succeeds (what NAME serves), or fail with its log.
wait_ready() {
  local name=$1 url=$2
  shift 2
  local until=$((SECONDS + READY_TIMEOUT))
  say "waiting for $name at $url (up to $READY_TIMEOUT s)"
  until curl -fsS --max-time 5 "$@" "$url" >/dev/null 2>&1; do
    if ! kill -0 "$(cat "$RUN/pids/$name")" 2>/dev/null; then
      tail -30 "$RUN/logs/$name.log" >&2
      die "$name exited; its log: $RUN/logs/$name.log"
    fi
    if ((SECONDS > until)); then
      tail -30 "$RUN/logs/$name.log" >&2
      die "$name was not ready within $READY_TIMEOUT s; its log: $RUN/logs/$name.log"
    fi
    sleep 0.5
  done
}

up() {
  need_tools up
  build
  if [[ -d $RUN/pids ]] && ls "$RUN/pids"/* >/dev/null 2>&1; then
    die "a cluster is up already ($RUN/pids); run: bash tests/cluster.sh down"
  fi
  rm -rf "$RUN"
  mkdir -p "$RUN/logs" "$RUN/pids" "$RUN/etcd"
  # A failed start leaves nothing running.
  # (In this shell only: the pipelines' subshells run it too otherwise.)
  trap '[[ $BASHPID == "$$" ]] && { say "up failed: $(resources); stopping what it started"; down; }' EXIT
  pki
  local started=$SECONDS
  start etcd etcd --name trainlet-test --data-dir "$RUN/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER" \
    --initial-cluster "trainlet-test=http://127.0.0.1:$ETCD_PEER" --listen-metrics-urls "" \
    --unsafe-no-fsync --quota-backend-bytes 1073741824
  wait_ready etcd "http://127.0.0.1:$ETCD_PORT/health"
  start_apiserver
  start kube-controller-manager kube-controller-manager --kubeconfig "$RUN/controller-manager.kubeconfig" \
    --authentication-kubeconfig "$RUN/controller-manager.kubeconfig" \
    --authorization-kubeconfig "$RUN/controller-manager.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$CM_PORT" --leader-elect=false \
    --service-account-private-key-file "$RUN/pki/sa.key" --root-ca-file "$RUN/pki/ca.crt" \
    --cluster-signing-cert-file "$RUN/pki/ca.crt" --cluster-signing-key-file "$RUN/pki/ca.key" \
    --use-service-account-credentials --service-cluster-ip-range 10.96.0.0/16 --profiling=false
  start kube-scheduler kube-scheduler --kubeconfig "$RUN/scheduler.kubeconfig" \
    --authentication-kubeconfig "$RUN/scheduler.kubeconfig" --authorization-kubeconfig "$RUN/scheduler.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$SCHED_PORT" --leader-elect=false --profiling=false
  wait_ready kube-controller-manager "https://127.0.0.1:$CM_PORT/healthz" -k
  wait_ready kube-scheduler "https://127.0.0.1:$SCHED_PORT/healthz" -k
  say "control plane ready in $((SECONDS - started)) s"
  controllers
  say "JobSet and Trainer ready in $((SECONDS - started)) s"
  if ((NODES > 0)); then
    images
    network
    dns
    local n
    for ((n = 0; n < NODES; n++)); do node "$n"; done
    for ((n = 0; n < NODES; n++)); do wait_node "$n"; done
    # Every node imported it (node.sh removes its own link).
    rm -f "$RUN/images.tar"
  fi
  say "$NODES nodes ready; all in $((SECONDS - started)) s: KUBECONFIG=$RUN/admin.kubeconfig"
  echo "$NODES" >"$RUN/ready"
  trap - EXIT
}

# JobSet and Trainer: CRDs, webhooks pointed at loopback, the managers.
controllers() {
  local jobset trainer k=("$KUBE" kubectl --kubeconfig "$RUN/admin.kubeconfig" --cache-dir "$RUN/kubectl-cache")
  jobset=$(module_dir "$JOBSET_MODULE")
  trainer=$(module_dir "$TRAINER_MODULE")
  mkdir -p "$RUN/webhook" "$RUN/trainer-tmp/k8s-webhook-server/serving-certs"
  cp "$RUN/pki/webhook.crt" "$RUN/webhook/tls.crt"
  cp "$RUN/pki/webhook.key" "$RUN/webhook/tls.key"
  # Trainer's webhook server reads controller-runtime's default directory
  # under its TMPDIR (its configuration has no certDir), its status server
  # the same path under its working directory (see build).
  cp "$RUN/webhook/tls.crt" "$RUN/webhook/tls.key" "$RUN/trainer-tmp/k8s-webhook-server/serving-certs/"
  "${k[@]}" apply --server-side -f "$jobset/config/components/crd/bases" >/dev/null
  "${k[@]}" apply --server-side $(printf -- '-f %s ' "$trainer"/manifests/base/crds/trainer.kubeflow.org_*.yaml) >/dev/null
  "${k[@]}" create namespace kubeflow-system >/dev/null
  "${k[@]}" wait --for condition=established --timeout 60s crd/jobsets.jobset.x-k8s.io \
    crd/trainjobs.trainer.kubeflow.org crd/trainingruntimes.trainer.kubeflow.org \
    crd/clustertrainingruntimes.trainer.kubeflow.org >/dev/null
  cat >"$RUN/jobset.yaml" <<YAML
apiVersion: config.jobset.x-k8s.io/v1alpha1
kind: Configuration
internalCertManagement: {enable: false}
leaderElection: {leaderElect: false}
webhook: {host: 127.0.0.1, port: $JOBSET_PORT, certDir: $RUN/webhook}
metrics: {bindAddress: "0"}
health: {healthProbeBindAddress: "127.0.0.1:$JOBSET_HEALTH"}
# JobSet's in-place restarts (KEP-467, alpha): the API server's container
# restart rules (RestartAllContainers) are beta and on by default in 1.36.
featureGates: {InPlaceRestart: true}
YAML
  cat >"$RUN/trainer.yaml" <<YAML
apiVersion: config.trainer.kubeflow.org/v1alpha1
kind: Configuration
certManagement: {enable: false}
leaderElection: {leaderElect: false}
webhook: {host: 127.0.0.1, port: $TRAINER_PORT}
metrics: {bindAddress: "0", secureServing: false}
health: {healthProbeBindAddress: "127.0.0.1:$TRAINER_HEALTH", readinessEndpointName: readyz, livenessEndpointName: healthz}
statusServer: {port: $TRAINER_STATUS}
featureGates: {TrainJobStatus: true}
YAML
  KUBECONFIG=$RUN/admin.kubeconfig "$BIN/jobset" --config "$RUN/jobset.yaml" >"$RUN/logs/jobset.log" 2>&1 &
  echo $! >"$RUN/pids/jobset"
  # Trainer's status server finds the token issuer (to check the pods'
  # projected tokens) in its own service-account token at the in-cluster
  # path, /var/run/secrets/kubernetes.io/serviceaccount: the manager runs
  # in a mount namespace of its own with a tmpfs on /run holding a token
  # of its service account. The issuer is the API server's address, so
  # its OIDC discovery reaches it without cluster DNS.
  "${k[@]}" -n kubeflow-system create serviceaccount kubeflow-trainer-controller-manager >/dev/null
  # Its status plugin hands the pods the CA of this Secret (the one its
  # own cert management would write).
  "${k[@]}" -n kubeflow-system create secret generic kubeflow-trainer-webhook-cert \
    --from-file ca.crt="$RUN/pki/ca.crt" --from-file tls.crt="$RUN/webhook/tls.crt" \
    --from-file tls.key="$RUN/webhook/tls.key" >/dev/null
  # What Trainer's install makes for its SDK (manifests/overlays/manager).
  "${k[@]}" -n kubeflow-system create configmap kubeflow-trainer-public \
    --from-literal "kubeflow_trainer_version=${TRAINER_MODULE#*@}" >/dev/null
  mkdir -p "$RUN/trainer-sa"
  "${k[@]}" -n kubeflow-system create token kubeflow-trainer-controller-manager --duration 24h >"$RUN/trainer-sa/token"
  echo kubeflow-system >"$RUN/trainer-sa/namespace"
  cp "$RUN/pki/ca.crt" "$RUN/trainer-sa/ca.crt"
  KUBECONFIG=$RUN/admin.kubeconfig TMPDIR=$RUN/trainer-tmp SA=$RUN/trainer-sa BIN_TRAINER=$BIN/trainer-controller-manager \
    unshare --mount --propagation private sh -c '
      mount -t tmpfs tmpfs /run &&
      mkdir -p /run/secrets/kubernetes.io/serviceaccount &&
      cp "$SA"/* /run/secrets/kubernetes.io/serviceaccount/ &&
      cd "$TMPDIR" && exec "$BIN_TRAINER" --config "$0"' "$RUN/trainer.yaml" >"$RUN/logs/trainer.log" 2>&1 &
  echo $! >"$RUN/pids/trainer"
  local name manifests port
  for spec in "jobset $jobset/config/components/webhook/manifests.yaml $JOBSET_PORT" \
    "trainer $trainer/manifests/base/webhook/manifests.yaml $TRAINER_PORT"; do
    read -r name manifests port <<<"$spec"
    "${k[@]}" create --dry-run=client -o json -f "$manifests" |
      python3 "$ROOT/tests/cluster/webhooks.py" "$name" "https://127.0.0.1:$port" "$RUN/pki/ca.crt" |
      "${k[@]}" apply -f - >/dev/null
  done
  wait_ready jobset "http://127.0.0.1:$JOBSET_HEALTH/readyz"
  wait_ready trainer "http://127.0.0.1:$TRAINER_HEALTH/readyz"
}

# The images the nodes run: those of images/ (tests/images.sh, cached) and
# the pause image, saved into one archive that each node's containerd
# imports.
images() {
  local conf names=() f
  conf=$(bash "$ROOT/tests/images.sh" | sed -n 's/^export CONTAINERS_CONF=//p')
  [[ -n $conf ]] || die "tests/images.sh did not print CONTAINERS_CONF"
  export CONTAINERS_CONF=$conf
  mkdir -p "$RUN/pause-image"
  cp "$BIN/pause" "$RUN/pause-image/pause"
  printf 'FROM scratch\nCOPY pause /pause\nENTRYPOINT ["/pause"]\n' >"$RUN/pause-image/Containerfile"
  podman build --quiet -t "$PAUSE_IMAGE" "$RUN/pause-image" >/dev/null
  # Also under the names runtimes/ give them (ghcr.io/trainlet/NAME:VERSION),
  # so the runtimes run unchanged (IfNotPresent finds them on the node).
  local version n
  version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/Cargo.toml" | head -1)
  for f in "$ROOT"/images/*.Dockerfile; do
    n=$(basename "$f" .Dockerfile)
    podman tag "localhost/trainlet/$n:test" "ghcr.io/trainlet/$n:$version"
    names+=("localhost/trainlet/$n:test" "ghcr.io/trainlet/$n:$version")
  done
  podman save --quiet --multi-image-archive -o "$RUN/images.tar" "$PAUSE_IMAGE" "${names[@]}"
  say "images for the nodes: $PAUSE_IMAGE ${names[*]}"
}

# Node n's bridge (its pods' network, $NET.n.0/24, the node at $NET.n.1),
# in the host's network namespace: the host routes between the nodes'
# bridges, and reaches the pods from loopback's side too.
bridge_name() { echo "tl${BASE}n$1"; }
network() {
  local n b
  [[ $(cat /proc/sys/net/ipv4/ip_forward) == 1 ]] || echo 1 >/proc/sys/net/ipv4/ip_forward
  for ((n = 0; n < NODES; n++)); do
    b=$(bridge_name "$n")
    # This cluster's etcd and API server hold the port base by now, so no
    # other cluster of this base runs: a bridge of this name is a leftover
    # of one that ended without `down` (another checkout's, or a machine
    # reused after a run was killed: seen in CI). It goes, with its DNAT.
    if ip link show "$b" >/dev/null 2>&1; then
      say "removing the bridge $b and its DNAT rules, left by a cluster of port base $BASE that no longer runs"
      local old
      while read -r -a old; do
        [[ ${old[0]:-} == -A ]] && iptables -t nat -D "${old[@]:1}" 2>/dev/null || true
      done < <(iptables -t nat -S PREROUTING 2>/dev/null | grep -F -- "-i $b " || true)
      ip link del "$b" || die "cannot remove the leftover bridge $b (ip link del $b)"
    fi
    ip link add "$b" type bridge
    echo "$b" >>"$RUN/bridges"
    # A MAC of its own: without one a bridge takes the lowest of its ports'
    # and changes it as pods come and go, and the pods' entry for their
    # gateway then names a MAC nobody has until it goes stale: their packets
    # to the other nodes are lost for tens of seconds (seen: a pod's agent
    # declared dead 3 s after a pod beside it was deleted).
    ip link set "$b" address "$(printf '02:74:6c:%02x:%02x:%02x' $((BASE >> 8 & 255)) $((BASE & 255)) "$n")"
    ip addr add "$NET.$n.1/24" dev "$b"
    ip link set "$b" up
    # The API server for pods (in-cluster clients: KUBERNETES_SERVICE_HOST
    # is the `kubernetes` Service's 10.96.0.1:443; there is no kube-proxy):
    # the pods' connections to it go to the API server on loopback, as
    # kube-proxy does for localhost node ports (route_localnet on the
    # bridge only). Its certificate names 10.96.0.1.
    echo 1 >"/proc/sys/net/ipv4/conf/$b/route_localnet"
    local rule=(PREROUTING -i "$b" -d 10.96.0.1/32 -p tcp --dport 443 -j DNAT --to-destination "127.0.0.1:$API_PORT")
    iptables -t nat -A "${rule[@]}"
    echo "${rule[*]}" >>"$RUN/dnat"
  done
}

# CoreDNS on the first node's bridge address, the nodes' clusterDNS:
# Services and pods by name (JobSet's headless Service gives each pod its
# name). Trainer's status server runs on the host: its Service has no
# selector and one endpoint, the host's address on that bridge.
dns() {
  local k=("$KUBE" kubectl --kubeconfig "$RUN/admin.kubeconfig" --cache-dir "$RUN/kubectl-cache")
  cat >"$RUN/Corefile" <<COREFILE
.:53 {
    bind $DNS_IP
    errors
    ready 127.0.0.1:$DNS_READY
    kubernetes cluster.local in-addr.arpa {
        kubeconfig $RUN/admin.kubeconfig trainlet-test
    }
}
COREFILE
  "$BIN/coredns" -conf "$RUN/Corefile" >"$RUN/logs/coredns.log" 2>&1 &
  echo $! >"$RUN/pids/coredns"
  "${k[@]}" apply -f - >/dev/null <<YAML
apiVersion: v1
kind: Service
metadata: {name: kubeflow-trainer-controller-manager, namespace: kubeflow-system}
spec:
  clusterIP: None
  ports: [{name: status, port: $TRAINER_STATUS}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: kubeflow-trainer-controller-manager-host
  namespace: kubeflow-system
  labels: {kubernetes.io/service-name: kubeflow-trainer-controller-manager}
addressType: IPv4
ports: [{name: status, port: $TRAINER_STATUS, protocol: TCP}]
endpoints: [{addresses: ["$DNS_IP"]}]
YAML
  wait_ready coredns "http://127.0.0.1:$DNS_READY/ready"
}

# Start node n: its certificate (system:node:NAME, for the Node
# authorizer), containerd's, the CNI's and the kubelet's configuration,
# its cgroup root in every hierarchy, then tests/cluster/node.sh in its
# own PID and mount namespaces.
node() {
  local n=$1
  local name=trainlet-node-$n dir=$RUN/node-$n ip=$NET.$n.1 cg=trainlet-$BASE-node-$n
  local port=$((BASE + 20 + 2 * n))
  mkdir -p "$dir/logs" "$dir/cni/net.d" "$dir/cni/ipam" "$dir/kubelet" "$dir/pod-logs"
  cert "node-$n" "system:node:$name" system:nodes
  kubeconfig "node-$n"
  mv "$RUN/node-$n.kubeconfig" "$dir/kubelet.kubeconfig"
  ln "$RUN/images.tar" "$dir/images.tar"
  cat >"$dir/containerd.toml" <<TOML
version = 2
root = "$dir/containerd/root"
state = "$dir/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs", "io.containerd.internal.v1.tracing", "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = "$dir/containerd.sock"
[ttrpc]
  address = "$dir/containerd.sock.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  # The VM's root may not lower oom_score_adj below its own.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$dir/cni/net.d"
TOML
  cat >"$dir/cni/net.d/10-trainlet-test.conflist" <<JSON
{"cniVersion": "1.0.0", "name": "trainlet-test", "plugins": [
  {"type": "bridge", "bridge": "$(bridge_name "$n")", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "dataDir": "$dir/cni/ipam",
            "ranges": [[{"subnet": "$NET.$n.0/24", "gateway": "$ip"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
JSON
  : >"$dir/resolv.conf"
  cat >"$dir/kubelet.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $ip
port: $port
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $((port + 1))
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $RUN/pki/ca.crt}
authorization: {mode: Webhook}
cgroupDriver: cgroupfs
cgroupRoot: /$cg
# The VMs here have cgroup v1 (hybrid) and swap may be on.
failCgroupV1: false
failSwapOn: false
makeIPTablesUtilChains: false
containerRuntimeEndpoint: unix://$dir/containerd.sock
clusterDomain: cluster.local
clusterDNS: [$DNS_IP]
resolvConf: $dir/resolv.conf
podLogsDir: $dir/pod-logs
enforceNodeAllocatable: []
# No eviction for disk on a shared test machine.
evictionHard: {memory.available: "100Mi", nodefs.available: "0%", imagefs.available: "0%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
shutdownGracePeriod: 0s
YAML
  printf '%s\n' --hostname-override "$name" --node-ip "$ip" --root-dir "$dir/kubelet" >"$dir/args"
  # cgroup v1: the kubelet wants its root in every hierarchy, and a cpuset
  # child starts with no CPUs and no memory nodes.
  local h
  for h in /sys/fs/cgroup/*/; do
    [[ $h == */unified/ ]] && continue
    mkdir -p "$h$cg"
  done
  if [[ -d /sys/fs/cgroup/cpuset/$cg ]]; then
    cat /sys/fs/cgroup/cpuset/cpuset.cpus >"/sys/fs/cgroup/cpuset/$cg/cpuset.cpus"
    cat /sys/fs/cgroup/cpuset/cpuset.mems >"/sys/fs/cgroup/cpuset/$cg/cpuset.mems"
  fi
  unshare --pid --fork --kill-child=KILL --mount --mount-proc --propagation private \
    bash "$ROOT/tests/cluster/node.sh" "$dir" "$KUBE" >"$dir/logs/node.log" 2>&1 &
  local outer=$! init=
  # The namespace's PID 1 (node.sh) takes SIGTERM; unshare ignores it.
  for _ in $(seq 100); do
    init=$(pgrep -P "$outer" || true)
    [[ -n $init ]] && break
    sleep 0.05
  done
  [[ -n $init ]] || die "node $n did not start; its log: $dir/logs/node.log"
  echo "$init" >"$RUN/pids/node-$n"
}

# Wait until node n is Ready, or fail with its logs.
wait_node() {
  local n=$1 dir=$RUN/node-$n until=$((SECONDS + READY_TIMEOUT))
  say "waiting for node trainlet-node-$n to be Ready (up to $READY_TIMEOUT s)"
  until [[ $("$KUBE" kubectl --kubeconfig "$RUN/admin.kubeconfig" --cache-dir "$RUN/kubectl-cache" get node "trainlet-node-$n" \
    -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null) == True ]]; do
    if ! kill -0 "$(cat "$RUN/pids/node-$n")" 2>/dev/null || ((SECONDS > until)); then
      tail -5 "$dir/logs/node.log" "$dir/logs/import.log" "$dir/logs/containerd.log" "$dir/logs/kubelet.log" >&2 || true
      die "node $n is not Ready; its logs: $dir/logs"
    fi
    sleep 0.5
  done
}

# Whether process p has ended: gone, or a zombie its parent has not reaped
# yet (the daemons' parent here is whatever adopted them, which may reap
# slowly).
ended() {
  local state
  state=$(awk '{ print $3 }' "/proc/$1/stat" 2>/dev/null) || return 0
  [[ -z $state || $state == Z || $state == X ]]
}

# Stop the processes of the named pid files: SIGTERM, up to `grace`
# seconds, then SIGKILL and up to 10 s more; says which did not end.
stop_group() {
  local grace=$1 f p pids=() names=()
  shift
  for f in "$@"; do
    [[ -f $RUN/pids/$f ]] || continue
    pids+=("$(cat "$RUN/pids/$f")")
    names+=("$f")
  done
  ((${#pids[@]})) || return 0
  kill -TERM "${pids[@]}" 2>/dev/null || true
  local until=$((SECONDS + grace)) left i
  for signal in TERM KILL; do
    while :; do
      left=0
      for p in "${pids[@]}"; do ended "$p" || left=1; done
      ((left)) && ((SECONDS < until)) || break
      sleep 0.1
    done
    ((left)) || break
    if [[ $signal == TERM ]]; then
      say "not ended $grace s after SIGTERM: $(for i in "${!pids[@]}"; do ended "${pids[$i]}" || printf '%s ' "${names[$i]}"; done)- sending SIGKILL"
      kill -KILL "${pids[@]}" 2>/dev/null || true
      until=$((SECONDS + 10))
    fi
  done
  for i in "${!pids[@]}"; do
    ended "${pids[$i]}" || say "warning: ${names[$i]} (pid ${pids[$i]}) did not end"
  done
  stopped=$((stopped + ${#pids[@]}))
}

down() {
  local keep=
  [[ ${1:-} == --keep-logs ]] && keep=1
  # The keeper (`ensure --owner`) first, unless it is the one asking.
  if [[ -f $RUN/keeper ]]; then
    local keeper
    keeper=$(cat "$RUN/keeper")
    [[ $keeper != "$$" ]] && kill -TERM "$keeper" 2>/dev/null || true
  fi
  [[ -d $RUN/pids ]] || return 0
  stopped=0
  local down_started=$SECONDS
  # Nodes and controllers first: they are the API server's clients, and the
  # API server and Trainer's manager wait on etcd while it is still there.
  # The nodes (each kubelet, its containerd and its pods) get up to 20 s,
  # from the same moment as the controllers' 3 s (Trainer's manager can
  # sit out its whole graceful-shutdown timeout; none of them keeps state).
  local n nodes=() f
  for f in "$RUN"/pids/node-*; do
    [[ -e $f ]] || continue
    nodes+=("$(basename "$f")")
    kill -TERM "$(cat "$f")" 2>/dev/null || true
  done
  stop_group 3 jobset trainer coredns kube-controller-manager kube-scheduler
  stop_group 20 "${nodes[@]}"
  stop_group 10 kube-apiserver
  stop_group 10 etcd
  # The pods' way to the API server, the nodes' bridges, and their cgroups
  # (empty once their namespaces are gone).
  if [[ -f $RUN/dnat ]]; then
    local r
    while read -r -a r; do iptables -t nat -D "${r[@]}" 2>/dev/null || true; done <"$RUN/dnat"
  fi
  if [[ -f $RUN/bridges ]]; then
    local b
    while read -r b; do ip link del "$b" 2>/dev/null || true; done <"$RUN/bridges"
  fi
  find /sys/fs/cgroup/*/ -maxdepth 1 -name "trainlet-$BASE-node-*" -type d 2>/dev/null | while read -r cg; do
    find "$cg" -depth -type d -exec rmdir {} + 2>/dev/null || true
  done
  # The empty chains every kubelet makes to watch for iptables flushes,
  # once no kubelet is left on this machine (-X removes only empty,
  # unreferenced chains).
  if ! pgrep -f ' kubelet --config ' >/dev/null; then
    local cmd t c
    for cmd in iptables ip6tables; do
      command -v "$cmd" >/dev/null || continue
      for t in mangle nat filter; do
        for c in KUBE-KUBELET-CANARY KUBE-IPTABLES-HINT; do "$cmd" -t "$t" -X "$c" 2>/dev/null || true; done
      done
    done
  fi
  # A failed run's logs (the components', the nodes', the pods') are kept.
  if [[ -n $keep || -f $RUN/failed ]]; then
    local to
    to=$KEPT/$(date +%Y%m%d-%H%M%S)-$BASE
    mkdir -p "$to"
    cp -r "$RUN/logs" "$to/" 2>/dev/null || true
    [[ -f $RUN/failed ]] && cp "$RUN/failed" "$to/failed-tests" 2>/dev/null
    for ((n = 0; n < 64; n++)); do
      [[ -d $RUN/node-$n ]] || break
      mkdir -p "$to/node-$n"
      cp -r "$RUN/node-$n/logs" "$RUN/node-$n/pod-logs" "$to/node-$n/" 2>/dev/null || true
    done
    say "the cluster's logs are kept in $to"
  fi
  # The nodes' pod logs and containerd's state can hold files of other uids
  # (the restricted runtime's); rm deals with them as root.
  # Each node's containerd holds every image unpacked: its files go in
  # parallel with the rest.
  local d
  for d in "$RUN"/node-*; do [[ -d $d ]] && rm -rf "$d" & done
  wait
  rm -rf "$RUN"
  say "down: $stopped processes stopped in $((SECONDS - down_started)) s"
}

# The shared cluster: reuse the one that is up and ready, else start one.
# Called under the lock (see `ensure`).
ensure_locked() {
  local owner=
  [[ ${1:-} == --owner ]] && owner=${2:?--owner PID}
  if [[ $(cat "$RUN/ready" 2>/dev/null) == "$NODES" ]] && curl -fsS --max-time 5 --cacert "$RUN/pki/ca.crt" --cert "$RUN/pki/admin.crt" \
    --key "$RUN/pki/admin.key" "https://127.0.0.1:$API_PORT/readyz" >/dev/null 2>&1; then
    say "reusing the cluster that is up (owner: $(cat "$RUN/owner" 2>/dev/null || echo none))"
    return 0
  fi
  # What a run that was killed may have left, or a cluster of another size.
  down
  up
  if [[ -n $owner ]]; then
    echo "$owner" >"$RUN/owner"
    # The keeper: in a session of its own (a ^C to the tests does not
    # reach it), with no descriptor of its caller's (its output pipes).
    setsid bash "$0" keep "$owner" </dev/null >"$RUN/logs/keeper.log" 2>&1 &
    say "the cluster stops when process $owner ends (or: bash tests/cluster.sh down)"
  fi
}

# Wait until process $1 is gone, then stop the cluster.
keep() {
  local owner=$1
  echo $$ >"$RUN/keeper"
  trap 'exit 0' TERM
  while ! ended "$owner"; do sleep 1; done
  say "process $owner ended: stopping the cluster"
  rm -f "$RUN/keeper"
  exec bash "$0" down
}

status() {
  [[ -d $RUN/pids ]] || { say "no cluster is up"; return 0; }
  for f in "$RUN"/pids/*; do
    local p
    p=$(cat "$f")
    if kill -0 "$p" 2>/dev/null; then say "$(basename "$f"): pid $p"; else say "$(basename "$f"): gone"; fi
  done
  curl -fsS --cacert "$RUN/pki/ca.crt" --cert "$RUN/pki/admin.crt" --key "$RUN/pki/admin.key" \
    "https://127.0.0.1:$API_PORT/readyz" && echo
}

case "${1:-}" in
  build)
    build
    ;;
  up) up ;;
  ensure)
    shift
    mkdir -p "$(dirname "$LOCK")"
    # One process at a time; -o: the cluster's processes do not inherit the lock.
    exec flock -o "$LOCK" bash "$0" ensure-locked "$@"
    ;;
  ensure-locked)
    shift
    ensure_locked "$@"
    ;;
  keep) keep "$2" ;;
  down)
    shift
    mkdir -p "$(dirname "$LOCK")"
    exec flock -o "$LOCK" bash "$0" down-locked "$@"
    ;;
  down-locked)
    shift
    down "$@"
    ;;
  restart-apiserver)
    [[ -f $RUN/pids/kube-apiserver ]] || die "no cluster is up"
    pid=$(cat "$RUN/pids/kube-apiserver")
    kill -TERM "$pid" 2>/dev/null || true
    while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
    say "kube-apiserver stopped"
    if [[ ${2:-} == --compact ]]; then
      # etcd's history up to now is compacted while no API server runs: a
      # watch resumed from an earlier resource version gets 410 Gone. Two
      # writes first (a key outside the API server's prefix): a watch's last
      # resource version may be etcd's newest (a bookmark), and resuming
      # from it starts one revision later, which a compaction at the
      # newest revision keeps.
      k=$(printf 'trainlet-test/compacted' | base64 -w0)
      for _ in 1 2; do
        curl -sS -X POST "http://127.0.0.1:$ETCD_PORT/v3/kv/put" -d "{\"key\": \"$k\", \"value\": \"$k\"}" >/dev/null
      done
      rev=$(curl -sS -X POST "http://127.0.0.1:$ETCD_PORT/v3/kv/range" -d '{"key": "AA=="}' |
        python3 -c 'import json, sys; print(json.load(sys.stdin)["header"]["revision"])')
      curl -sS -X POST "http://127.0.0.1:$ETCD_PORT/v3/kv/compaction" -d "{\"revision\": \"$rev\", \"physical\": true}" >/dev/null
      say "etcd compacted at revision $rev"
    fi
    start_apiserver
    ;;
  status) status ;;
  torch-patch)
    # The runtimePatches entry that mounts this machine's PyTorch (the test
    # venv's site-packages, read only) at /opt/torch in the `node` container
    # of a TrainJob: the test images carry no torch. For `trainlet-client up
    # --patch` (with --env PYTHONPATH=/opt/torch) and trainlet_client.up(patches=).
    site=$(ls -d "$ROOT"/.venv/lib/python3*/site-packages 2>/dev/null | head -1 || true)
    [[ -n $site && -d $site/torch ]] || die "no torch in $ROOT/.venv: bash tests/venv.sh"
    python3 -c 'import json, sys
site = sys.argv[1]
c = {"name": "node", "volumeMounts": [{"name": "torch", "mountPath": "/opt/torch", "readOnly": True}]}
v = [{"name": "torch", "hostPath": {"path": site, "type": "Directory"}}]
job = {"name": "node", "template": {"spec": {"template": {"spec": {"containers": [c], "volumes": v}}}}}
print(json.dumps({"manager": "trainlet.dev/tests", "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [job]}}}}))' "$site"
    ;;
  kubectl)
    shift
    exec "$KUBE" kubectl --kubeconfig "$RUN/admin.kubeconfig" --cache-dir "$RUN/kubectl-cache" "$@"
    ;;
  *)
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
