#!/usr/bin/env bash
# Build every image in images/ with podman, offline from any registry:
#   - a Debian bookworm base made with mmdebstrap from the Debian mirror,
#     imported as localhost/trainlet-test/debian:bookworm (kept between runs);
#   - for the DeepSpeed image, the same base with a C++ toolchain
#     (localhost/trainlet-test/debian-build:bookworm): DeepSpeed compiles its
#     ops with ninja and g++ on first use, as Trainer's deepspeed-runtime
#     image (a CUDA devel base) can;
#   - trainlet's own release binary (TRAINLET_BINARY=prebuilt), so no
#     builder image is pulled;
#   - for the MPICH image, MPICH's libraries from the test venv's PyPI wheel
#     (MPICH_LIBS=mpich-prebuilt), so nothing is fetched inside the build;
#   - tags localhost/trainlet/<image>:test.
# Podman 4.3 on these VMs needs runc (crun fails on the hybrid cgroup
# layout) and explicit default_ulimits (runc cannot raise rlimits without
# CAP_SYS_RESOURCE): this script writes target/containers/containers.conf
# with both and prints `export CONTAINERS_CONF=...` for the caller.
# Needs: podman, mmdebstrap, runc (Debian packages; tests/setup.sh installs them)
# and .venv-mpich-pypi (tests/mpi_venvs.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
for tool in podman mmdebstrap runc; do
  command -v "$tool" >/dev/null || {
    echo "error: $tool is missing: apt-get install -y podman mmdebstrap runc (bash tests/setup.sh does, as root)" >&2
    exit 1
  }
done
conf_dir="$PWD/target/containers"
mkdir -p "$conf_dir"
# One build at a time: the container tests and tests/cluster.sh both call
# this script, and may at once.
exec 9>"$conf_dir/images.lock"
flock 9
export CONTAINERS_CONF="$conf_dir/containers.conf"
base=localhost/trainlet-test/debian:bookworm
# The highest limits runc may set here: podman's own child processes run
# with lower hard limits than this shell, so probe them once.
if [ ! -s "$CONTAINERS_CONF" ]; then
  printf '[engine]\nruntime = "runc"\nevents_logger = "file"\n[containers]\ndefault_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]\n' > "$CONTAINERS_CONF"
fi
build_base=localhost/trainlet-test/debian-build:bookworm
# debootstrap IMAGE PACKAGES: a minimal Debian bookworm with PACKAGES, once.
debootstrap() {
  podman image exists "$1" && return
  echo "building $1 with mmdebstrap (about a minute) ..." >&2
  local tar="$conf_dir/debian-bookworm.tar"
  mmdebstrap --quiet --variant=minbase --include="$2" bookworm "$tar" http://deb.debian.org/debian
  podman import --quiet "$tar" "$1" >/dev/null
  rm -f "$tar"
}
debootstrap "$base" python3,ca-certificates
debootstrap "$build_base" python3,ca-certificates,g++,ninja-build,libpython3.11-dev
probe() { podman run --rm --network host --ulimit "nofile=$1:$1" --ulimit "nproc=$2:$2" "$base" true >/dev/null 2>&1; }
if ! grep -q '^# probed' "$CONTAINERS_CONF"; then
  nofile=1024
  for n in $(ulimit -Hn) 65536 32768 16384 8192 4096; do
    if [ "$n" -le "$(ulimit -Hn)" ] && probe "$n" 1024; then nofile=$n; break; fi
  done
  nproc=1024
  for n in $(ulimit -Hu) 65536 32768 16384 8192 4096; do
    if [ "$n" != unlimited ] && [ "$n" -le "$(ulimit -Hu)" ] && probe "$nofile" "$n"; then nproc=$n; break; fi
  done
  printf '# probed: the highest limits runc could set here\n[engine]\nruntime = "runc"\nevents_logger = "file"\n[containers]\ndefault_ulimits = ["nofile=%s:%s", "nproc=%s:%s"]\n' \
    "$nofile" "$nofile" "$nproc" "$nproc" > "$CONTAINERS_CONF"
fi
binary=target/x86_64-unknown-linux-gnu/release/trainlet
if [ ! -x "$binary" ] || [ -n "$(find src initializers Cargo.toml Cargo.lock -newer "$binary" -print -quit)" ]; then
  echo "building the release binary for the images ..." >&2
  # The release binary users build (tests/run.sh's test commands run with
  # clippy-driver as the workspace's compiler: not here).
  env -u RUSTC_WORKSPACE_WRAPPER cargo build --release --locked --quiet
fi
# The MPICH image's libraries: the wheel's, from the test venv
# (tests/mpi_venvs.sh), not fetched again inside the build.
mpich=.venv-mpich-pypi/lib
[ -f "$mpich/libmpi.so.12" ] || {
  echo "error: $mpich/libmpi.so.12 is missing: bash tests/mpi_venvs.sh (bash tests/setup.sh does)" >&2
  exit 1
}
rm -rf "$conf_dir/mpich"
mkdir -p "$conf_dir/mpich"
cp -a "$mpich/libmpi.so.12" "$mpich/mpich" "$conf_dir/mpich/"
cp -a .venv-mpich-pypi/lib/python3*/site-packages/mpich-5.0.2.dist-info/licenses "$conf_dir/mpich/"
for dockerfile in images/*.Dockerfile; do
  name=$(basename "$dockerfile" .Dockerfile)
  from=$base
  [ "$name" = deepspeed-runtime ] && from=$build_base
  podman build --quiet --network host -f "$dockerfile" \
    --build-arg TRAINLET_BINARY=prebuilt --build-arg MPICH_LIBS=mpich-prebuilt --build-arg BASE_IMAGE="$from" \
    -t "localhost/trainlet/$name:test" . >/dev/null
  echo "built localhost/trainlet/$name:test" >&2
done
echo "export CONTAINERS_CONF=$CONTAINERS_CONF"
