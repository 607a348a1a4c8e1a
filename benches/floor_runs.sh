#!/usr/bin/env bash
# The records behind the gate's floors (benches/floors.toml, benches/gate.rs):
# N whole gate runs (default 10) with both CPUs kept busy by two other
# processes (shell loops at the default priority), or with --idle on an
# otherwise idle machine, every row measured whatever floors.toml holds
# (TRAINLET_GATE_RECORD_ONLY), kept in target/bench-gate-runs-loaded.jsonl
# or target/bench-gate-runs-idle.jsonl; then each row's record, both kinds
# of runs (benches/floors.py). With --write, floors.toml takes the runs and
# the floors they allow (the lowest of all halved, or the goal where every
# run met it); review the `source` texts after. Some ratios are lower idle
# than under load (a cold torchrun, the reference of several rows, slows
# more under load than trainlet does): a record has both.
#
#   bash benches/floor_runs.sh [N] [--idle] [--write]
#
# Needs what the gate needs: the release binary (cargo build --release), the
# test venvs (tests/setup.sh) and the test cluster (it is started here when
# none is up, and left up).
set -euo pipefail
cd "$(dirname "$0")/.."
n=10
write=
idle=
for a in "$@"; do
  case $a in
    --write) write=--write ;;
    --idle) idle=1 ;;
    *[!0-9]* | '') echo "usage: bash benches/floor_runs.sh [N] [--idle] [--write]" >&2; exit 2 ;;
    *) n=$a ;;
  esac
done
bash tests/cluster.sh ensure >/dev/null
runs=target/bench-gate-runs.jsonl
[ ! -e "$runs" ] || mv "$runs" "$runs.$(date +%s)"
busy=()
kind=loaded
if [ -n "$idle" ]; then
  kind=idle
else
  for _ in 1 2; do
    (while :; do :; done) &
    busy+=($!)
  done
fi
trap '[ ${#busy[@]} = 0 ] || kill "${busy[@]}" 2>/dev/null || true' EXIT
export TRAINLET_BENCH_BINARY=$PWD/target/x86_64-unknown-linux-gnu/release/trainlet
export TRAINLET_TEST_PYTHON=$PWD/.venv/bin/python
for i in $(seq "$n"); do
  echo "floor_runs: gate run $i of $n ($kind)" >&2
  TRAINLET_GATE_RECORD_ONLY=1 RUSTC_WORKSPACE_WRAPPER=clippy-driver cargo test --locked --bench compare -- gate
done
[ ${#busy[@]} = 0 ] || kill "${busy[@]}" 2>/dev/null || true
mv "$runs" "target/bench-gate-runs-$kind.jsonl"
loaded=target/bench-gate-runs-loaded.jsonl
idle_runs=()
[ ! -s target/bench-gate-runs-idle.jsonl ] || idle_runs=(--idle target/bench-gate-runs-idle.jsonl)
[ -s "$loaded" ] || { echo "floor_runs: no runs under load yet ($loaded): bash benches/floor_runs.sh $n" >&2; exit 1; }
python3 benches/floors.py "$loaded" "${idle_runs[@]}" $write
