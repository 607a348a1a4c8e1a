#!/usr/bin/env bash
# One node of the test cluster: containerd (Debian's) and a kubelet (the
# `kube` binary), run by tests/cluster.sh as
#
#   unshare --pid --fork --mount --mount-proc --propagation private bash node.sh DIR KUBE
#
# so that this script is PID 1 of a PID namespace of its own and every
# mount the node makes (the kubelet's rshared root, the pods' volumes and
# network-namespace handles, the containers' overlays) lives in a mount
# namespace of its own. Ending this script ends the namespace: the kernel
# kills every process in it (shims and containers included) and its mounts
# go with it, so `down` leaves nothing behind on the host.
#
# DIR holds containerd.toml, kubelet.yaml, kubelet.kubeconfig, args (the
# kubelet's extra flags, one per line) and images.tar (imported, then removed, before the
# kubelet starts); logs go to DIR/logs. As PID 1 this script reaps every
# orphan of the namespace, and SIGTERM stops the kubelet and containerd.
set -euo pipefail
dir=$1
kube=$2
# The kubelet and the CNI plugins also write to fixed paths (/var/lib/kubelet's
# device-plugin and pod-resources sockets, /var/lib/cni's cache,
# /var/log/containers): tmpfs here, so nothing of theirs reaches the host.
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /var/lib
mount -t tmpfs tmpfs /var/log
mkdir -p /run/netns
sock=$dir/containerd.sock
rm -f "$sock" "$sock.ttrpc"
containerd --config "$dir/containerd.toml" >"$dir/logs/containerd.log" 2>&1 &
containerd=$!
kubelet=
stop() {
  [[ -n $kubelet ]] && kill -TERM "$kubelet" 2>/dev/null
  kill -TERM "$containerd" 2>/dev/null
  wait
  exit 0
}
trap stop TERM INT
for _ in $(seq 300); do
  ctr --address "$sock" version >/dev/null 2>&1 && break
  kill -0 "$containerd" 2>/dev/null || { echo "containerd exited; see $dir/logs/containerd.log" >&2; exit 1; }
  sleep 0.1
done
ctr --address "$sock" -n k8s.io images import "$dir/images.tar" >"$dir/logs/import.log" 2>&1
# The images are containerd's now: the archive (a link to the one every
# node imports) is 1 GiB of disk no one reads again.
rm -f "$dir/images.tar"
mapfile -t args <"$dir/args"
"$kube" kubelet --config "$dir/kubelet.yaml" --kubeconfig "$dir/kubelet.kubeconfig" "${args[@]}" \
  >"$dir/logs/kubelet.log" 2>&1 &
kubelet=$!
# Either one ending ends the node (and `up`'s wait or the tests see it).
wait -n "$kubelet" "$containerd" || true
echo "the kubelet or containerd exited; see $dir/logs" >&2
stop
