#!/usr/bin/env bash
# What the tests need on this machine, installed where it is missing: the
# Debian packages (apt-get, as root), rustfmt and clippy (rustup), the
# Python venvs (PyPI); tests/book.sh installs mdBook for the book. tests/run.sh
# (which .ci/run runs) calls it; run again with everything there, it costs
# well under a second.
#
# Not root and a package missing: it stops before anything else, naming the
# packages and the one command that installs them. No test skips itself
# because a tool is absent; this is where a missing tool is found.
set -euo pipefail
cd "$(dirname "$0")/.."

# Real peers for the MPI/SSH tests (reference/mpi.md): Open MPI 4.1 with
# Debian's mpi4py, MPICH hydra, OpenSSH client and server for interop,
# openssl for Trainer-style SEC1 keys; `file` for the static-binary check;
# gcc and util-linux (taskset, unshare, setpriv) for the fake libnvidia-ml,
# cpuset and namespace tests; iproute2 for simulated pods in namespaces.
# podman, runc and mmdebstrap build images/ on a Debian base and run the
# container tests (tests/images.sh); containerd, the CNI plugins, procps
# (pgrep) and iptables run the test cluster's nodes (tests/cluster.sh).
# libpmi2-0 is Slurm's PMI-2 client library: Intel MPI speaks PMI-2 to
# trainlet's PMI server through it (tests/it/pmi.rs).
packages="file gcc util-linux iproute2 openmpi-bin libopenmpi-dev mpich libmpich-dev libpmi2-0 python3-mpi4py openssh-client openssh-server openssl podman runc mmdebstrap containerd containernetworking-plugins procps iptables"
installed=$(dpkg-query -W -f='${Package} ${Status}\n' $packages 2>/dev/null | awk '$4 == "installed" { print $1 }' || true)
missing=""
for p in $packages; do
  grep -qx "$p" <<<"$installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "error: the tests need Debian packages that are not installed:$missing" >&2
    echo "install them as root, then run the tests again:" >&2
    echo "  apt-get update && apt-get install -y$missing" >&2
    echo "(or run bash tests/run.sh as root: it installs them itself)" >&2
    exit 1
  fi
  echo "installing Debian packages:$missing ..." >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # Packages must not start services (no OpenSSH daemon during the tests).
  own_policy=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    own_policy=1
  fi
  status=0
  apt-get install -y -qq $missing >/dev/null || status=$?
  if [ -n "$own_policy" ]; then rm -f /usr/sbin/policy-rc.d; fi
  if [ "$status" != 0 ]; then
    echo "error: apt-get install$missing failed (exit $status)" >&2
    exit 1
  fi
fi

# A package can be installed and its program still not usable (removed by
# hand, or hidden by a mount): each package's program the tests run, checked
# as a regular executable file.
unusable=""
for pair in file:/usr/bin/file gcc:/usr/bin/gcc util-linux:/usr/bin/unshare iproute2:/usr/sbin/ip \
  openmpi-bin:/usr/bin/mpirun.openmpi mpich:/usr/bin/mpiexec.hydra libmpich-dev:/usr/bin/mpicc.mpich \
  python3-mpi4py:/usr/bin/python3 openssh-client:/usr/bin/ssh openssh-server:/usr/sbin/sshd \
  openssl:/usr/bin/openssl podman:/usr/bin/podman runc:/usr/sbin/runc mmdebstrap:/usr/bin/mmdebstrap; do
  program=${pair#*:}
  if [ ! -f "$program" ] || [ ! -x "$program" ]; then
    echo "error: $program (package ${pair%%:*}) is not a usable program" >&2
    unusable="$unusable ${pair%%:*}"
  fi
done
# A library is a regular file, not a program.
[ -f /usr/lib/x86_64-linux-gnu/libpmi2.so.0 ] || {
  echo "error: /usr/lib/x86_64-linux-gnu/libpmi2.so.0 (package libpmi2-0) is missing" >&2
  unusable="$unusable libpmi2-0"
}
if [ -n "$unusable" ]; then
  echo "reinstall as root, then run the tests again:" >&2
  echo "  apt-get install --reinstall -y$unusable" >&2
  exit 1
fi

command -v cargo >/dev/null || {
  echo "error: cargo is missing: install Rust with rustup (https://rustup.rs), then run the tests again" >&2
  exit 1
}
for component in rustfmt clippy; do
  if ! cargo "${component/rustfmt/fmt}" --version >/dev/null 2>&1; then
    echo "adding the $component component with rustup ..." >&2
    rustup component add "$component"
  fi
done

bash tests/venv.sh
bash tests/mpi_venvs.sh
