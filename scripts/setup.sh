#!/usr/bin/env bash
# Set up a virtual environment with everything kv-sidecar needs (CPU machine).
# torch goes first: nixl's unpinned torch requirement would otherwise pull CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e ./client -e '.[dev]'
echo "kv-sidecar installed in .venv ($(.venv/bin/kv-sidecar --version))"
