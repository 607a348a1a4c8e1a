#!/usr/bin/env bash
# The records behind the gate's floors (benches/floors.toml, benches/gate.rs):
# N whole gate runs (default 10) with both CPUs kept busy by two other
# processes (shell loops at the default priority), every row measured
# whatever floors.toml holds (TRAINLET_GATE_RECORD_ONLY), then each row's
# ratios, lowest, lowest halved and goal (benches/floors.py). With --write,
# floors.toml takes the runs and the floors they allow (the lowest halved,
# or the goal where every run met it); review the `source` texts after.
#
#   bash benches/floor_runs.sh [N] [--write]
#
# Needs what the gate needs: the release binary (cargo build --release), the
# test venvs (tests/setup.sh) and the test cluster (it is started here when
# none is up, and left up).
set -euo pipefail
cd "$(dirname "$0")/.."
n=10
write=
for a in "$@"; do
  case $a in
    --write) write=--write ;;
    *[!0-9]* | '') echo "usage: bash benches/floor_runs.sh [N] [--write]" >&2; exit 2 ;;
    *) n=$a ;;
  esac
done
bash tests/cluster.sh ensure >/dev/null
runs=target/bench-gate-runs.jsonl
[ ! -e "$runs" ] || mv "$runs" "$runs.$(date +%s)"
busy=()
for _ in 1 2; do
  (while :; do :; done) &
  busy+=($!)
done
trap 'kill "${busy[@]}" 2>/dev/null || true' EXIT
export TRAINLET_BENCH_BINARY=$PWD/target/x86_64-unknown-linux-gnu/release/trainlet
export TRAINLET_TEST_PYTHON=$PWD/.venv/bin/python
for i in $(seq "$n"); do
  echo "floor_runs: gate run $i of $n (both CPUs kept busy)" >&2
  TRAINLET_GATE_RECORD_ONLY=1 RUSTC_WORKSPACE_WRAPPER=clippy-driver cargo test --locked --bench compare -- gate
done
kill "${busy[@]}" 2>/dev/null || true
python3 benches/floors.py "$runs" $write
