#!/usr/bin/env bash
# The main job: build trainlet and run a real 4-worker DDP training (gloo,
# CPU, synthetic data) launched by trainlet standalone on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tests/venv.sh
if [ ! -x target/x86_64-unknown-linux-gnu/release/trainlet ]; then
  echo "building trainlet (release, first time: about 8 minutes on 2 cores) ..." >&2
fi
cargo build --release --quiet
TRAINLET_PYTHON="$PWD/.venv/bin/python" \
  exec target/x86_64-unknown-linux-gnu/release/trainlet run --nproc-per-node 4 examples/train_ddp.py --steps 50 --check "$@"
