#!/usr/bin/env bash
# Inside the CUDA image, without a GPU: scripts/image_check_cuda.py (kv-sidecar --version, import nixl,
# a NIXL agent with UCX, UCX's CUDA modules loadable through the image's loader cache).
#
#   scripts/image_check_cuda.sh TOOL IMAGE     (`make image-check`; TOOL podman or buildah, as root)
#
# The NVIDIA driver (libcuda.so.1, libnvidia-ml.so.1) is never in the image: the container runtime
# injects it. Here a stub of both is compiled from the symbols UCX's modules import, each returning
# "no device", so that the modules can be loaded at all. Then the same probe runs once more with an
# empty loader cache, which must lose libucm_cuda: the check sees the failure it exists for.
set -euo pipefail
cd "$(dirname "$0")/.."
tool=${1:?usage: image_check_cuda.sh TOOL IMAGE}
image=${2:?usage: image_check_cuda.sh TOOL IMAGE}
case $tool in
podman | buildah) ;;
*) echo "image_check_cuda.sh: runs the image with buildah (containers storage), not $tool" >&2; exit 1 ;;
esac
command -v buildah >/dev/null || { echo "image_check_cuda.sh: needs buildah" >&2; exit 1; }

work=$(mktemp -d "${TMPDIR:-/tmp}/kv-sidecar-check.XXXXXX")
ctr=""
cleanup() {
    if [ -n "$ctr" ]; then
        buildah umount "$ctr" >/dev/null 2>&1 || true
        buildah rm "$ctr" >/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT
ctr=$(buildah from --pull-never "$image")
mnt=$(buildah mount "$ctr")
site=$(echo "$mnt"/opt/venv/lib/python3*/site-packages)
ucx=$(echo "$site"/nixl_cu*.libs/ucx)
[ -d "$ucx" ] || { echo "no NIXL UCX modules in $image ($ucx)" >&2; exit 1; }
major=$(basename "$(dirname "$ucx")" | sed 's/^nixl_cu\([0-9]*\)\.libs$/\1/')
echo "image $image: NIXL backend nixl_cu$major; loader cache entry: $(cat "$mnt"/etc/ld.so.conf.d/kv-sidecar-cuda.conf 2>/dev/null || echo none)"

# The driver stub: every cu*/nvml* symbol the UCX modules import (CUDA_ERROR_NO_DEVICE = 100,
# NVML_ERROR_DRIVER_NOT_LOADED = 9).
mkdir -p "$work/stub"
nm -D --undefined-only "$ucx"/*.so* | awk '{print $2}' | sed 's/@.*//' | sort -u >"$work/syms"
{ grep '^cu' "$work/syms" | sed 's/.*/int &(void) { return 100; }/'; } >"$work/cuda.c"
{ grep '^nvml' "$work/syms" | sed 's/.*/int &(void) { return 9; }/'; } >"$work/nvml.c"
cc -shared -fPIC -o "$work/stub/libcuda.so.1" -Wl,-soname,libcuda.so.1 "$work/cuda.c"
cc -shared -fPIC -o "$work/stub/libnvidia-ml.so.1" -Wl,-soname,libnvidia-ml.so.1 "$work/nvml.c"
chmod -R a+rX "$work"
buildah umount "$ctr" >/dev/null

run=(buildah run --isolation "${BUILDAH_ISOLATION:-chroot}" --user 65532:65532 -e HOME=/tmp
    -v "$work/stub:/run/driver-stub:ro" -v "$PWD/scripts/image_check_cuda.py:/run/check.py:ro"
    -e LD_LIBRARY_PATH=/run/driver-stub)
"${run[@]}" "$ctr" -- python /run/check.py --cuda-major "$major"
: >"$work/empty-ld.so.cache"
"${run[@]}" -v "$work/empty-ld.so.cache:/etc/ld.so.cache:ro" "$ctr" -- \
    python /run/check.py --cuda-major "$major" --expect-cuda-modules-missing
echo "CUDA image checks passed: $image"
