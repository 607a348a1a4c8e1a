#!/usr/bin/env bash
# The round's seeded simulation (round/src/sim, docs/src/tests.md):
#   bash tests/sim.sh [--schedules N] [--seed S] [--mutant NAME] [--list-mutants]
# Each schedule draws a job and its faults from its seed and runs the
# agents' decisions (the `round` crate) against a simulated store,
# checking the invariants after every step. Its last line reads
# `N schedules, V violations`; a violation prints its seed, its trace and
# the command that replays it, and exits 1.
#
# `--check-mutants` (the test command's): every mutant --list-mutants
# names is found by a default run, and its seed alone replays it.
#
# The simulation builds in its own target directory (target/sim), so it
# neither waits for nor disturbs another cargo command on target/.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="$PWD/target/sim"
if ! command -v cargo >/dev/null; then
  echo "error: cargo is missing; install Rust with rustup (https://rustup.rs)" >&2
  exit 2
fi
# The library's lints (Cargo.toml) with warnings denied, as in the test build.
RUSTFLAGS="-D warnings" cargo build --locked --release --quiet -p trainlet-round --features sim --bin trainlet-sim
sim="$CARGO_TARGET_DIR/x86_64-unknown-linux-gnu/release/trainlet-sim"
[ -x "$sim" ] || sim="$CARGO_TARGET_DIR/release/trainlet-sim"
if [ "${1:-}" != --check-mutants ]; then
  exec "$sim" "$@"
fi
status=0
for m in $("$sim" --list-mutants | cut -d' ' -f1); do
  rc=0
  out=$("$sim" --mutant "$m") || rc=$?
  if [ "$rc" != 1 ]; then
    echo "error: a default run with mutant $m exited $rc; it must find it (exit 1)" >&2
    tail -3 <<<"$out" >&2
    status=1
    continue
  fi
  seed=$(sed -n 's/^violation in schedule [0-9]*, seed \([0-9]*\):.*/\1/p' <<<"$out")
  rc=0
  "$sim" --mutant "$m" --seed "$seed" --schedules 1 >/dev/null || rc=$?
  if [ "$rc" != 1 ]; then
    echo "error: seed $seed alone did not replay mutant $m (exit $rc)" >&2
    status=1
    continue
  fi
  echo "mutant $m: found at seed $seed ($(sed -n 's/^violation in schedule [0-9]*, seed [0-9]*: //p' <<<"$out")); its seed alone replays it"
done
exit $status
