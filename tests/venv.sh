#!/usr/bin/env bash
# Create .venv with PyTorch (CPU use, gloo backend) from PyPI unless it is
# already there. Used by the main job, the tests and the benchmarks.
set -euo pipefail
cd "$(dirname "$0")/.."
init_packages="huggingface_hub moto[server] boto3 opendal"
framework_packages="jax[cpu] xgboost deepspeed transformers accelerate kubeflow"
if .venv/bin/python -c "import yaml, torch.distributed as d; assert d.is_gloo_available()" 2>/dev/null; then
  # prometheus_client (the metrics test's parser) came later: add it to an
  # existing venv instead of rebuilding it.
  .venv/bin/python -c "import prometheus_client" 2>/dev/null ||
    .venv/bin/python -m pip install --quiet --disable-pip-version-check prometheus_client
  # The initializer tests' peers came later still: the reference Hub
  # client, moto's S3 server, boto3 and OpenDAL's Python binding (what
  # Trainer's initializers run).
  .venv/bin/python -c "import huggingface_hub, moto.server, boto3, opendal" 2>/dev/null ||
    .venv/bin/python -m pip install --quiet --disable-pip-version-check $init_packages
  # The other Trainer runtimes' frameworks (JAX, XGBoost, DeepSpeed) and
  # the progress reporters (transformers' KubeflowTrainerCallback, the
  # Kubeflow SDK) came with issue 16.
  .venv/bin/python -c "import jax, xgboost, deepspeed, transformers, accelerate, kubeflow" 2>/dev/null ||
    .venv/bin/python -m pip install --quiet --disable-pip-version-check $framework_packages
  # ssh-audit audits trainlet sshd's algorithms.
  .venv/bin/python -c "import ssh_audit" 2>/dev/null ||
    .venv/bin/python -m pip install --quiet --disable-pip-version-check ssh-audit
  exit 0
fi
python=${PYTHON:-python3}
echo "installing torch into .venv (about a minute) ..." >&2
rm -rf .venv
"$python" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check torch numpy pyyaml prometheus_client ssh-audit $init_packages $framework_packages
.venv/bin/python -c "import torch; print('torch', torch.__version__, 'ready in .venv')" >&2
