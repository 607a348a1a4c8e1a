#!/usr/bin/env bash
# uv (from PyPI, pinned) in .venv-uv, for tests/venv.sh and
# tests/mpi_venvs.sh; prints the path of its binary. uv installs a venv's
# wheels from its cache (~/.cache/uv) by hard links, several at once: .venv
# (about 7 GB: the CUDA build of torch is the one PyPI has) took 35 s here
# where pip, unpacking every wheel again, took 187 s (2 CPUs, both caches
# warm, 2026-11-28). The venvs themselves are made by `python3 -m venv`, so
# they carry the interpreter's own pip as before (trainlet's serve setup
# runs `python -m pip`).
set -euo pipefail
cd "$(dirname "$0")/.."
version=0.13.9
uv=.venv-uv/bin/uv
mkdir -p target
exec 9>target/uv.lock
flock 9
case "$("$uv" --version 2>/dev/null || true)" in
"uv $version"*) ;;
*)
  echo "installing uv $version into .venv-uv ..." >&2
  rm -rf .venv-uv
  "${PYTHON:-python3}" -m venv .venv-uv
  .venv-uv/bin/python -m pip install --quiet --disable-pip-version-check "uv==$version"
  ;;
esac
echo "$PWD/$uv"
