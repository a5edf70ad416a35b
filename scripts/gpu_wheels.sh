#!/usr/bin/env bash
# Wheels that the lent GPU machine lacks, for Python 3.12 manylinux x86_64, into .whl/ (git-ignored).
# The GPU image has torch (CUDA 13), triton and pytest, but grpcio 1.84 (the generated protos need
# 1.85.1) and no NIXL. The device tool carries at most 64 MiB, so nixl-cu13 is repacked without its
# nixl_ep extension, headers and every plugin but UCX (~20 MB instead of ~100 MB).
#
#   bash scripts/gpu_wheels.sh            # then, on the device:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl
mkdir -p "$dest"
py=${PYTHON:-python3}
get() {
  "$py" -m pip download -q --no-deps --dest "$dest" --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any "$@"
}
get grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 grpcio-tools==1.85.1 \
  protobuf==7.35.1 nixl==1.5.1 prometheus-client pyyaml cryptography cffi pycparser \
  hypothesis sortedcontainers attrs pytest-timeout pytest-xdist execnet py-spy

# nixl-cu13: download to a scratch dir, drop what the sidecar never loads, zip again.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
get --dest "$tmp" nixl-cu13==1.5.1
wheel=$(ls "$tmp"/nixl_cu13-*.whl)
mkdir "$tmp/x"
(cd "$tmp/x" && unzip -q "$wheel")
rm -rf "$tmp"/x/nixl_ep_cu13* "$tmp"/x/*/include
find "$tmp/x" -path '*plugins*' -name '*.so*' ! -name '*UCX*' ! -name '*ucx*' -delete
rm -f "$dest"/nixl_cu13-*.whl
# RECORD's hashes no longer match the dropped files; pip --no-deps --target does not check them.
(cd "$tmp/x" && zip -q -r -9 "$OLDPWD/$dest/$(basename "$wheel")" .)
du -sh "$dest"
ls "$dest"
