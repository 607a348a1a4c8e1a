#!/usr/bin/env bash
# The test suite: lints with warnings denied, unit + integration tests with
# real PyTorch workers, and a check that the release binary is static. It
# first installs what the tests need where it is missing (tests/setup.sh:
# apt-get as root, else it stops at once naming the packages).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tests/setup.sh
# The book (docs/) builds; its links are checked by tests/it/docs.rs.
bash tests/book.sh
export TRAINLET_TEST_PYTHON="$PWD/.venv/bin/python"
# The Python client installs with pip from its path, with no dependency.
rm -rf target/client-check
.venv/bin/pip install -q --no-deps --target target/client-check ./clients/python
PYTHONPATH=target/client-check .venv/bin/python -m trainlet_client --help >/dev/null
rm -rf clients/python/build clients/python/*.egg-info
# With [build] target set in .cargo/config.toml, RUSTFLAGS applies to the
# target only, so proc-macros still build; keep +crt-static in it because
# RUSTFLAGS replaces the config's rustflags.
export RUSTFLAGS="-D warnings -C target-feature=+crt-static"
cargo fmt --check
cargo clippy --locked --workspace --all-targets
# The release binary first: the container tests put it in the images.
cargo build --locked --release
# The real Kubernetes, JobSet and Trainer of tests/it/cluster.rs, from their
# Go modules (about 9 minutes cold on 2 cores, cached under target/cluster).
bash tests/cluster.sh build
# Every test binary runs even when an earlier one fails; the exit is non-zero then.
# A failure's details are printed again at the very end, where a CI log's
# tail shows them.
mkdir -p target
if ! cargo test --locked --workspace --no-fail-fast 2>&1 | tee target/test.log; then
  echo "=== the failures again (full log: target/test.log) ===" >&2
  awk '/^failures:$/{on=1} on' target/test.log | grep -v '^ *[0-9]*: \|^ *at ' | tail -300 >&2
  echo "=== where each failing test panicked ===" >&2
  grep -A4 "panicked at" target/test.log | cut -c1-400 | head -120 >&2
  exit 101
fi
kind=$(file target/x86_64-unknown-linux-gnu/release/trainlet)
echo "$kind"
if ! grep -Eq "static-pie linked|statically linked" <<<"$kind"; then
  echo "error: the release binary is not statically linked" >&2
  exit 1
fi
echo "release binary is statically linked"
# The benchmark gate: a fast subset of the side-by-side benchmarks, each
# ratio against its floor in benches/floors.toml (under 3 minutes).
cargo bench --locked --bench compare -- gate
