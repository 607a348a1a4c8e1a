#!/usr/bin/env bash
# Create .venv with PyTorch (CPU use, gloo backend) and the other real peers
# of the tests from PyPI, or add what an existing .venv lacks. Used by the
# main job, the tests (through tests/setup.sh) and the benchmarks.
#
# The check finds every module without importing it (importing torch, jax
# and transformers takes seconds), so a complete .venv costs a few ms.
set -euo pipefail
cd "$(dirname "$0")/.."
# torch and numpy: the workers. pyyaml: the runtime manifests' checks.
# prometheus_client: the metrics test's parser. ssh-audit: audits trainlet
# sshd's algorithms. The initializer tests' peers: the reference Hub client,
# moto's S3 server, boto3 and OpenDAL's Python binding (what Trainer's
# initializers run). The other Trainer runtimes' frameworks (JAX, XGBoost,
# DeepSpeed) and the progress reporters (transformers' KubeflowCallback,
# the Kubeflow SDK). torchft: replica groups, with its torchft_lighthouse.
# nbclient, nbformat and ipykernel: a real Jupyter kernel runs the notebook
# whose classes become actors. py-spy: the stacks benchmark's reference (a
# binary, .venv/bin/py-spy, no module).
packages="torch numpy pyyaml prometheus_client ssh-audit huggingface_hub moto[server] boto3 opendal jax[cpu] xgboost deepspeed transformers accelerate kubeflow torchft==0.2.0 nbclient nbformat ipykernel py-spy"
# The module each package installs (moto[server]: flask_cors comes with the
# extra; jax[cpu]: jaxlib).
modules="torch numpy yaml prometheus_client ssh_audit huggingface_hub moto flask_cors boto3 opendal jax jaxlib xgboost deepspeed transformers accelerate kubeflow torchft nbclient nbformat ipykernel"
complete() {
  [ -x .venv/bin/python ] && [ -x .venv/bin/py-spy ] && .venv/bin/python - $modules <<'EOF' 2>/dev/null
import importlib.util, sys
sys.exit(any(importlib.util.find_spec(m) is None for m in sys.argv[1:]))
EOF
}
complete && exit 0
if ! .venv/bin/python -c "import torch.distributed as d; assert d.is_gloo_available()" 2>/dev/null; then
  python=${PYTHON:-python3}
  echo "installing torch and the tests' Python peers into .venv (a few minutes) ..." >&2
  rm -rf .venv
  "$python" -m venv .venv
else
  echo "adding what .venv lacks ..." >&2
fi
# uv (tests/uv.sh) installs from its cache in a fraction of pip's time; the
# bytecode is compiled at install, as pip does, so that the pods, which
# mount this venv read-only, do not compile torch's modules at every start.
uv=$(bash tests/uv.sh)
"$uv" pip install --quiet --python .venv/bin/python --compile-bytecode $packages
complete || {
  echo "error: .venv still lacks one of: $modules" >&2
  exit 1
}
.venv/bin/python -c "import torch; print('torch', torch.__version__, 'ready in .venv')" >&2
