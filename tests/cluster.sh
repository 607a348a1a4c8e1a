#!/usr/bin/env bash
# A real Kubernetes control plane on loopback for the cluster tests
# (issue 27): etcd, kube-apiserver, kube-controller-manager and
# kube-scheduler, built from their Go modules at the versions
# tests/cluster/go.mod pins (one binary, `kube`, cached under
# target/cluster/bin), with certificates and service-account keys made
# here by openssl.
#
#   bash tests/cluster.sh build   build target/cluster/bin/kube when missing or stale
#   bash tests/cluster.sh up      build, then start everything and wait until it is ready
#   bash tests/cluster.sh down    stop everything this script started; no process is left
#   bash tests/cluster.sh status  what runs, and the API server's /readyz
#   bash tests/cluster.sh kubectl ARGS...   kubectl against the cluster
#
# State (certificates, kubeconfigs, etcd's data, logs, pids) lives in
# target/cluster/run; `down` removes it. Ports: CLUSTER_PORT_BASE (default
# 26400) + 0 etcd clients, +1 etcd peers, +2 the API server, +3 the
# controller manager, +4 the scheduler. KUBECONFIG for the admin is
# target/cluster/run/admin.kubeconfig.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BIN=$ROOT/target/cluster/bin
RUN=$ROOT/target/cluster/run
KUBE=$BIN/kube
BASE=${CLUSTER_PORT_BASE:-26400}
ETCD_PORT=$BASE
ETCD_PEER=$((BASE + 1))
API_PORT=$((BASE + 2))
CM_PORT=$((BASE + 3))
SCHED_PORT=$((BASE + 4))
K8S_VERSION=v1.36.3
# How long `up` waits for each component.
READY_TIMEOUT=${CLUSTER_READY_TIMEOUT:-120}

say() { echo "cluster: $*" >&2; }
die() { say "error: $*"; exit 1; }

need_tools() {
  local missing=()
  command -v go >/dev/null || missing+=("go (Go 1.26: https://go.dev/dl, or the golang-go Debian package where it is 1.26)")
  command -v openssl >/dev/null || missing+=("openssl (apt-get install -y openssl)")
  command -v curl >/dev/null || missing+=("curl (apt-get install -y curl)")
  if ((${#missing[@]})); then
    die "missing: ${missing[*]}"
  fi
}

# Build `kube` when it is missing or older than its sources.
build() {
  need_tools
  local src=$ROOT/tests/cluster
  if [[ -x $KUBE ]] && [[ -z $(find "$src" -newer "$KUBE" -type f | head -1) ]]; then
    return 0
  fi
  mkdir -p "$BIN"
  say "building Kubernetes $K8S_VERSION and etcd from their Go modules into $KUBE (about 8 minutes cold on 2 cores, seconds when cached)"
  local started=$SECONDS
  (cd "$src" && go build -trimpath \
    -ldflags "-s -w -X k8s.io/component-base/version.gitVersion=$K8S_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=36" \
    -o "$KUBE.tmp" ./kube)
  mv "$KUBE.tmp" "$KUBE"
  say "built in $((SECONDS - started)) s"
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
  openssl genrsa -out "$RUN/pki/sa.key" 2048 2>/dev/null
  openssl rsa -in "$RUN/pki/sa.key" -pubout -out "$RUN/pki/sa.pub" 2>/dev/null
  for n in admin controller-manager scheduler; do kubeconfig "$n"; done
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
  build
  if [[ -d $RUN/pids ]] && ls "$RUN/pids"/* >/dev/null 2>&1; then
    die "a cluster is up already (target/cluster/run/pids); run: bash tests/cluster.sh down"
  fi
  rm -rf "$RUN"
  mkdir -p "$RUN/logs" "$RUN/pids" "$RUN/etcd"
  pki
  local started=$SECONDS
  start etcd etcd --name trainlet-test --data-dir "$RUN/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER" \
    --initial-cluster "trainlet-test=http://127.0.0.1:$ETCD_PEER" --listen-metrics-urls "" \
    --unsafe-no-fsync --quota-backend-bytes 1073741824
  wait_ready etcd "http://127.0.0.1:$ETCD_PORT/health"
  start kube-apiserver kube-apiserver --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$API_PORT" \
    --tls-cert-file "$RUN/pki/apiserver.crt" --tls-private-key-file "$RUN/pki/apiserver.key" \
    --client-ca-file "$RUN/pki/ca.crt" \
    --kubelet-client-certificate "$RUN/pki/apiserver-kubelet.crt" --kubelet-client-key "$RUN/pki/apiserver-kubelet.key" \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-account-key-file "$RUN/pki/sa.pub" --service-account-signing-key-file "$RUN/pki/sa.key" \
    --service-cluster-ip-range 10.96.0.0/16 --authorization-mode Node,RBAC --allow-privileged=true \
    --enable-priority-and-fairness=false --profiling=false
  wait_ready kube-apiserver "https://127.0.0.1:$API_PORT/readyz" --cacert "$RUN/pki/ca.crt" \
    --cert "$RUN/pki/admin.crt" --key "$RUN/pki/admin.key"
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
  say "control plane ready in $((SECONDS - started)) s: KUBECONFIG=$RUN/admin.kubeconfig"
}

down() {
  [[ -d $RUN/pids ]] || return 0
  local pids=()
  for f in "$RUN"/pids/*; do
    [[ -e $f ]] || continue
    pids+=("$(cat "$f")")
  done
  if ((${#pids[@]})); then
    kill -TERM "${pids[@]}" 2>/dev/null || true
    local until=$((SECONDS + 20))
    while ((SECONDS < until)); do
      local left=0
      for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && left=1; done
      ((left)) || break
      sleep 0.2
    done
    kill -KILL "${pids[@]}" 2>/dev/null || true
    for p in "${pids[@]}"; do
      while kill -0 "$p" 2>/dev/null; do sleep 0.1; done
    done
  fi
  rm -rf "$RUN"
  say "down: ${#pids[@]} processes stopped"
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
  build) build ;;
  up) up ;;
  down) down ;;
  status) status ;;
  kubectl)
    shift
    exec "$KUBE" kubectl --kubeconfig "$RUN/admin.kubeconfig" "$@"
    ;;
  *)
    sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
