#!/usr/bin/env bash
# The test suite: lints with warnings denied, unit + integration tests with
# real PyTorch workers, the cluster tests on one real Kubernetes shared by
# all of them, a check that the release binary is static, and the
# benchmark gate. It first installs what the tests need where it is missing
# (tests/setup.sh: apt-get as root, else it stops at once naming the
# packages).
#
# At its end (also when a step fails) it prints where the time went, one
# row a step, and writes the same table to target/test-times.txt.
#
# TRAINLET_CLUSTER_TEST_THREADS (default 1): how many cluster tests run at
# once, in their own process beside the other tests. With 2, on 2 CPUs,
# the DeepSpeed job (its op compiled in each pod) did not finish in 600 s
# beside another cluster test and the suite's two threads, twice.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p target
times=target/test-times.txt
rows=()
run_started=$SECONDS
# Free disk under the repository (a full disk stalls podman's and the
# nodes' image stores): at the start, and again in the table.
disk_free() { df -h --output=avail . 2>/dev/null | tail -1 | tr -d ' '; }
disk_at_start=$(disk_free)
# step NAME COMMAND...: run it, time it, keep its row.
step() {
  local name=$1 started=$SECONDS status=0
  shift
  echo "=== $name" >&2
  "$@" || status=$?
  rows+=("$(printf '%-34s %6d s%s' "$name" $((SECONDS - started)) "$([ $status = 0 ] || echo "  FAILED (exit $status)")")")
  return $status
}
# A step's time when it ran beside others (started and ended elsewhere).
row() { rows+=("$(printf '%-34s %6d s%s' "$1" "$2" "${3:-}")"); }
table() {
  {
    echo "where the time went (tests/run.sh, $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs):"
    printf '%s\n' "${rows[@]}"
    printf '%-34s %6d s\n' "total" $((SECONDS - run_started))
    echo "disk free: $disk_at_start at the start, $(disk_free) at the end"
  } >"$times"
  echo >&2
  cat "$times" >&2
  echo "(also in $times)" >&2
}
cluster_up=
finish() {
  local status=$?
  set +e
  # A step that failed while another ran beside it (the release build, the
  # cluster tests): that one and what it started end with this script.
  local job
  for job in $(jobs -p); do
    pkill -TERM -P "$job" 2>/dev/null
    kill -TERM "$job" 2>/dev/null
  done
  if [ -n "$cluster_up" ]; then
    # A failed run keeps the cluster's logs (target/cluster/kept-logs).
    local keep=()
    [ "$status" = 0 ] || keep=(--keep-logs)
    step "cluster down" bash tests/cluster.sh down "${keep[@]}"
  fi
  table
  exit "$status"
}
trap finish EXIT

rm -f target/release-build.time target/cluster-build.time target/cluster-up.time target/cluster-tests.time
step setup bash tests/setup.sh
# The real Kubernetes, JobSet and Trainer of tests/it/cluster.rs are built
# from their Go modules (seconds when cached under target/cluster): from
# here on, beside the book, the builds and the other tests. On a machine
# with Go's caches empty this build sets the pace of the whole run: in the
# cold run of ac28f45 it started after the test build and took 3115 s
# beside the other tests, and the cluster tests waited for it (1151 s
# alone on 2 cores). cluster_part (below) waits for its end.
cluster_build() {
  local started=$SECONDS status=0
  bash tests/cluster.sh build >target/cluster-build.log 2>&1 || status=$?
  echo "$((SECONDS - started)) $([ $status = 0 ] || echo FAILED)" >target/cluster-build.time
  return $status
}
cluster_build &
# The book (docs/) builds; its links are checked by tests/it/docs.rs.
step book bash tests/book.sh
export TRAINLET_TEST_PYTHON="$PWD/.venv/bin/python"
# The Python client installs with pip from its path, with no dependency.
client_check() {
  rm -rf target/client-check
  .venv/bin/pip install -q --no-deps --target target/client-check ./clients/python
  PYTHONPATH=target/client-check .venv/bin/python -m trainlet_client --help >/dev/null
  rm -rf clients/python/build clients/python/*.egg-info
}
step "python client" client_check
# No RUSTFLAGS here: the main job (examples/run.sh) and a user's `cargo
# build --release` build with .cargo/config.toml's flags alone, so the
# release build is shared with them. Warnings are denied in the test build
# below, where clippy's lints run too.
unset RUSTFLAGS RUSTC_WORKSPACE_WRAPPER
step fmt cargo fmt --check
# The round's protocol under its seeded simulation (tests/sim.sh, the
# `round` crate; docs/src/tests.md): 20,000 schedules pass (about 20 s on
# 2 CPUs; a default run, 60,000, takes about a minute), and every bug
# --list-mutants names is found by a default run and replayed from its
# seed alone (about 45 s). It builds in target/sim with clippy's lints,
# warnings denied, before the builds below start (77 s in all in the
# clean-clone run of 2438811).
sim_check() {
  RUSTC_WORKSPACE_WRAPPER=clippy-driver bash tests/sim.sh --schedules 20000 &&
    RUSTC_WORKSPACE_WRAPPER=clippy-driver bash tests/sim.sh --check-mutants
}
step "round simulation" sim_check

# The builds at once: the release build runs beside the test build, which
# runs at a lower priority (nice 10), so that the release binary is ready
# when the tests start: the container tests and the cluster's nodes need it
# for their images (tests/images.sh waits on cargo's lock until it is
# built), and the gate measures it. In the clean-clone run of eedf57d, at
# the same priority, the release build ended 520 s after the tests began:
# the first container tests held both test threads for minutes, waiting
# for it, and the cluster tests started after it. The release build itself
# ends in about 230 s on one CPU (the trainlet crate with one codegen unit,
# then fat LTO), which the test build fills.
release_build() {
  local started=$SECONDS status=0
  cargo build --locked --release >target/release-build.log 2>&1 || status=$?
  echo "$((SECONDS - started)) $status" >target/release-build.time
  return $status
}
release_build &
release_pid=$!
# Clippy's lints run in the test build itself, with clippy-driver as the
# workspace's compiler (as `cargo clippy` runs it, but building, not only
# checking): a `cargo clippy` pass of its own type-checked every crate once
# more (157 s of a 2828 s run). Every target (`--all-targets`: the benches
# too) is built, and a warning of rustc or clippy fails the step, as
# `cargo clippy --all-targets -- -D warnings` did. Every cargo command below
# runs with the same wrapper, or cargo would build the workspace again
# (tests/images.sh builds the release binary without it).
export RUSTC_WORKSPACE_WRAPPER=clippy-driver
test_build() {
  local status=0
  nice -n 10 cargo test --locked --workspace --all-targets --no-run 2>&1 | tee target/test-build.log || status=$?
  [ "$status" = 0 ] || return "$status"
  # cargo's closing line for a crate that warned (also for a crate that was
  # already built: cargo shows its warnings again).
  if grep -E '^warning: `[^`]+` \(.*\) generated [0-9]+ warnings?' target/test-build.log >&2; then
    echo "error: the test build warned (rustc or clippy, target/test-build.log): warnings are denied" >&2
    return 1
  fi
}
step "test build (clippy's lints in it)" test_build || exit $?
# Every floor of the gate has its record (benches/floors.toml): checked
# now, in seconds, not when the gate runs after the tests.
step "the gate's floors" cargo test --locked --bench compare -- floors
# The release build's end, its row and its check come after the other
# tests (below): they start whether or not it has ended.
release_check() {
  local release_status=0 release_time
  wait "$release_pid" || release_status=$?
  read -r release_time _ <target/release-build.time || release_time=0
  row "release build (beside the builds, tests)" "$release_time" "$([ $release_status = 0 ] || echo "  FAILED")"
  if [ $release_status != 0 ]; then
    tail -40 target/release-build.log >&2
    echo "error: cargo build --release failed; its log: target/release-build.log" >&2
    exit 1
  fi
  local kind
  kind=$(file target/x86_64-unknown-linux-gnu/release/trainlet)
  echo "$kind"
  if ! grep -Eq "static-pie linked|statically linked" <<<"$kind"; then
    echo "error: the release binary is not statically linked" >&2
    exit 1
  fi
  echo "release binary is statically linked"
}

# The cluster tests (tests/it/cluster*, `cluster::`) run in a process of
# their own beside the others: they mostly wait on pods. The `it` binary is
# run directly (cargo would hold its build lock for the whole run).
it=$(cargo test --locked --test it --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "it" and m.get("executable"):
        print(m["executable"])')
[ -x "$it" ] || { echo "error: no executable for the it test binary" >&2; exit 1; }
# The two that restart the API server have the cluster alone (a lock in
# tests/it/cluster.rs): they run first, so none of them waits, idle, for
# the slowest of the others to end; then the others, side by side.
alone=(cluster::inplace::a_token_rotated_under_a_live_watch_is_used_when_it_comes_back_from_a_410
  cluster::inplace::the_jobset_restarts_a_healthy_pod_in_place_through_a_watch_that_outlived_the_api_server)
cluster_group() {
  local status=0
  "$it" --exact "${alone[@]}" --test-threads 1 || status=1
  # Both ran (a renamed test would silently drop out of this group).
  [ "$(grep -c '^test cluster::.* \.\.\. ' target/test-cluster.log)" = 2 ] || {
    echo "error: tests/run.sh names cluster tests that do not exist: ${alone[*]}" >&2
    status=1
  }
  "$it" cluster:: $(printf -- '--skip %s ' "${alone[@]}") --test-threads "${TRAINLET_CLUSTER_TEST_THREADS:-1}" || status=1
  return $status
}
# When the cluster's build (started after setup, above) has ended, the
# cluster every cluster test shares comes up, then the cluster tests run:
# all of it beside the other tests. The cluster stops at the end of this
# script, or when this script's process is gone however it ended (the
# keeper of `ensure --owner`).
cluster_part() {
  local started=$SECONDS build_failed=
  # Not `wait`: the build is this subshell's sibling, not its child.
  if [ ! -e target/cluster-build.time ]; then
    echo "cluster: waiting for the cluster's Go build to end (target/cluster-build.log)"
    while [ ! -e target/cluster-build.time ]; do sleep 2; done
    echo "cluster: the build ended after $((SECONDS - started)) s of waiting"
  fi
  read -r _ build_failed <target/cluster-build.time || build_failed=FAILED
  if [ -n "$build_failed" ]; then
    echo "0 FAILED" >target/cluster-up.time
    tail -40 target/cluster-build.log
    echo "error: the test cluster's binaries did not build; the log: target/cluster-build.log"
    return 1
  fi
  started=$SECONDS
  if ! bash tests/cluster.sh ensure --owner $$ >target/cluster-up.log 2>&1; then
    echo "$((SECONDS - started)) FAILED" >target/cluster-up.time
    tail -40 target/cluster-up.log
    echo "error: the test cluster did not come up; its log: target/cluster-up.log"
    return 1
  fi
  echo "$((SECONDS - started))" >target/cluster-up.time
  started=$SECONDS
  local status=0
  cluster_group || status=$?
  echo "$((SECONDS - started))" >target/cluster-tests.time
  return $status
}
cluster_up=1
cluster_part >target/test-cluster.log 2>&1 &
cluster_tests=$!
# Every test binary runs even when an earlier one fails; the exit is non-zero then.
tests_started=$SECONDS
status=0
cargo test --locked --workspace --no-fail-fast -- --skip cluster:: 2>&1 | tee target/test.log || status=$?
row "other tests (all binaries)" $((SECONDS - tests_started)) "$([ $status = 0 ] || echo "  FAILED")"
# Each binary's own time, from its closing line.
awk '/^ *Running /{ p = $NF; sub(/.*\//, "", p); sub(/-[0-9a-f]+\)$/, "", p); name = p " " (($2 == "unittests") ? $3 : $2) }
  /^ *Doc-tests /{ name = "doc-tests " $2 }
  /^test result:/{ t = $NF; sub(/s$/, "", t); printf "  %-32s %6.0f s\n", name, t }' target/test.log >target/test-binaries.txt
while IFS= read -r line; do rows+=("$line"); done <target/test-binaries.txt
release_check
cluster_status=0
wait "$cluster_tests" || cluster_status=$?
read -r build_time build_failed <target/cluster-build.time || { build_time=0; build_failed=FAILED; }
read -r up_time up_failed <target/cluster-up.time || { up_time=0; up_failed=FAILED; }
read -r cluster_tests_time <target/cluster-tests.time || cluster_tests_time=0
row "cluster build (from setup on, beside)" "$build_time" "${build_failed:+  FAILED}"
row "cluster up (after it and the test build)" "$up_time" "${up_failed:+  FAILED}"
row "cluster tests (after it, $(grep -c '^test .* \.\.\. ' target/test-cluster.log) tests)" "$cluster_tests_time" "$([ $cluster_status = 0 ] || echo "  FAILED")"
echo "=== the cluster tests (target/test-cluster.log)" >&2
cat target/test-cluster.log
if [ $status != 0 ] || [ $cluster_status != 0 ]; then
  echo "=== the failures again (full logs: target/test.log, target/test-cluster.log) ===" >&2
  awk '/^failures:$/{on=1} on' target/test.log target/test-cluster.log | grep -v '^ *[0-9]*: \|^ *at ' | tail -300 >&2
  echo "=== where each failing test panicked ===" >&2
  grep -h -A4 "panicked at" target/test.log target/test-cluster.log | cut -c1-400 | head -120 >&2
  if [ -n "$build_failed" ] && [ -f target/cluster-build.log ]; then
    echo "=== why the cluster's binaries did not build (target/cluster-build.log) ===" >&2
    tail -40 target/cluster-build.log | cut -c1-400 >&2
  elif [ -n "$up_failed" ] && [ -f target/cluster-up.log ]; then
    echo "=== why the cluster did not come up (target/cluster-up.log) ===" >&2
    grep -h -B16 "cluster: \[[0-9]* s\] error:" target/cluster-up.log | cut -c1-400 | tail -40 >&2
    grep -h "up failed" target/cluster-up.log >&2
  fi
  exit 101
fi
# The benchmark gate: a fast subset of the side-by-side benchmarks, each
# ratio against its floor in benches/floors.toml; its cluster rows use the
# cluster that is still up. It measures the release binary built above; the
# harness itself is built in the test profile on the test build's artefacts
# (seconds), not again with the bench profile's fat LTO (minutes).
TRAINLET_BENCH_BINARY=$PWD/target/x86_64-unknown-linux-gnu/release/trainlet \
  step "benchmark gate" cargo test --locked --bench compare -- gate
