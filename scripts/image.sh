#!/usr/bin/env bash
# Build the kv-sidecar image from the Dockerfile with whatever tool this machine has.
#
#   scripts/image.sh build cuda|cpu   build the production (CUDA) or the CPU smoke-test image; prints its size
#   scripts/image.sh check-cuda       inside the CUDA image: nixl, a UCX agent, UCX's CUDA modules, --version
#   scripts/image.sh tool             the build tool that would be used
#   scripts/image.sh name cuda|cpu    the image's name
#
# Tool: IMAGE_TOOL, else docker (if its daemon answers), podman, buildah, in that order. podman and
# buildah build with --isolation chroot (BUILDAH_ISOLATION overrides): the OCI runtime's isolation
# needs rights that sandboxes and some CI runners lack.
#
# Base image (PYTHON_IMAGE): as given, else python:3.11-slim-bookworm where it is present or can be
# pulled (Docker Hub), else a local stand-in made once with debootstrap by scripts/image_base.sh.
#
# Behind a TLS-intercepting proxy pip needs the proxy's CA: podman and buildah mount the host's CA
# bundle (BUILD_CA_BUNDLE, else PIP_CERT, else /etc/ssl/certs/ca-certificates.crt) over the build's
# /etc/ssl/certs/ca-certificates.crt for the RUN steps only; it is not in the image. (Debian's pip, in
# the local base, reads that file; the pip of python:3.11-slim reads its own bundle.)
#
# The CPU image takes torch from a local CPU wheel where one lies in TORCH_WHEELS, PIP_FIND_LINKS or
# pip's find-links setting (mounted the same way), else from PyTorch's CPU index.
set -euo pipefail
cd "$(dirname "$0")/.."

version=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | sed -n 1p)
repo=${IMAGE_REPO:-ghcr.io/kv-sidecar/kv-sidecar}
hub_base=python:3.11-slim-bookworm
local_base=localhost/kv-sidecar-python:3.11-bookworm

pick_tool() {
    if [ -n "${IMAGE_TOOL:-}" ]; then
        echo "$IMAGE_TOOL"
    elif command -v docker >/dev/null && docker info >/dev/null 2>&1; then
        echo docker
    elif command -v podman >/dev/null; then
        echo podman
    elif command -v buildah >/dev/null; then
        echo buildah
    else
        echo "scripts/image.sh: no image tool: install docker, podman or buildah" >&2
        echo "(Debian/Ubuntu: apt-get install buildah; docker's client alone is not enough, it needs a daemon)" >&2
        return 1
    fi
}

image_name() {
    case $1 in
    cuda) echo "${IMAGE:-$repo:$version}" ;;
    cpu) echo "${IMAGE_CPU:-$repo:$version-cpu}" ;;
    *) echo "scripts/image.sh: variant must be cuda or cpu, not '$1'" >&2; return 1 ;;
    esac
}

exists() { # tool image
    if [ "$1" = buildah ]; then buildah inspect --type image "$2" >/dev/null 2>&1; else "$1" image inspect "$2" >/dev/null 2>&1; fi
}

size_of() { # tool image -> "1.2 GB (1234567890 bytes)" or the tool's own words
    local bytes
    case $1 in
    buildah)
        # buildah prints only a rounded size; podman (same storage) gives bytes where it is installed.
        if command -v podman >/dev/null; then
            bytes=$(podman image inspect --format '{{.Size}}' "$2")
        else
            buildah images --format '{{.Size}}' "$2" | sed -n 1p
            return
        fi
        ;;
    *) bytes=$("$1" image inspect --format '{{.Size}}' "$2") ;;
    esac
    echo "$(numfmt --to=si --suffix=B --format='%.2f' "$bytes") ($bytes bytes, uncompressed)"
}

pick_base() { # tool -> base image name (builds the local stand-in if needed)
    if [ -n "${PYTHON_IMAGE:-}" ]; then
        echo "$PYTHON_IMAGE"
        return
    fi
    local hub=$hub_base
    [ "$1" = docker ] || hub=docker.io/library/$hub_base
    if exists "$1" "$hub" || timeout 300 "$1" pull "$hub" >/dev/null 2>&1; then
        echo "$hub"
        return
    fi
    echo "cannot pull $hub (no Docker Hub?): using a local bookworm base, $local_base" >&2
    ./scripts/image_base.sh "$1" "$local_base" >&2
    echo "$local_base"
}

torch_wheel() { # a local CPU torch wheel for this Python and machine, if any (the first place that has one)
    local d found pip_conf
    pip_conf=$(python3 -m pip config get global.find-links 2>/dev/null || true)
    for d in ${TORCH_WHEELS:-} ${PIP_FIND_LINKS:-} $pip_conf; do
        d=${d#file://}
        [ -d "$d" ] || continue
        # No `| head` after the loop: with pipefail, a later find writing into the closed pipe
        # (SIGPIPE, 141) failed the whole build whenever two places were configured.
        found=$(find "$d" -maxdepth 1 -name "torch-*+cpu-cp311-cp311-*_$(uname -m).whl" | sort -V | tail -n 1)
        if [ -n "$found" ]; then
            echo "$found"
            return
        fi
    done
}

build() {
    local variant=$1 tool image base t0 args=() wheel ca
    tool=$(pick_tool)
    image=$(image_name "$variant")
    base=$(pick_base "$tool")
    args=(build -t "$image" -f Dockerfile --build-arg "PYTHON_IMAGE=$base" --build-arg "VARIANT=$variant")
    if [ "$tool" != docker ]; then
        args+=(--isolation "${BUILDAH_ISOLATION:-chroot}" --layers)
        ca=${BUILD_CA_BUNDLE:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}
        if [ -f "$ca" ]; then
            args+=(-v "$(realpath "$ca"):/etc/ssl/certs/ca-certificates.crt:ro")
        fi
    elif [ -n "${BUILD_CA_BUNDLE:-${PIP_CERT:-}}" ]; then
        echo "note: docker build cannot mount ${BUILD_CA_BUNDLE:-$PIP_CERT}; pip in the build uses the image's CAs" >&2
    fi
    if [ "$variant" = cpu ]; then
        wheel=$(torch_wheel)
        if [ -n "$wheel" ] && [ "$tool" != docker ]; then
            # torch-2.13.0+cpu-cp311-... -> 2.13.0+cpu
            local v=${wheel##*/torch-}
            args+=(-v "$(dirname "$wheel"):/run/torch-wheels:ro" --build-arg TORCH_FIND_LINKS=/run/torch-wheels
                --build-arg "TORCH_VERSION=${v%%-*}")
        else
            args+=(--build-arg "TORCH_INDEX_URL=${TORCH_CPU_INDEX_URL:-https://download.pytorch.org/whl/cpu}")
        fi
    fi
    # shellcheck disable=SC2206  # BUILD_ARGS: extra words for the build command, split on spaces
    args+=(${BUILD_ARGS:-} .)
    echo "+ $tool ${args[*]}"
    t0=$(date +%s)
    "$tool" "${args[@]}"
    echo "built $image with $tool in $(($(date +%s) - t0)) s; size $(size_of "$tool" "$image")"
}

case ${1:-} in
build) build "${2:?usage: image.sh build cuda|cpu}" ;;
check-cuda) exec ./scripts/image_check_cuda.sh "$(pick_tool)" "$(image_name cuda)" ;;
tool) pick_tool ;;
name) image_name "${2:?usage: image.sh name cuda|cpu}" ;;
*)
    sed -n '2,8p' "$0" >&2
    exit 2
    ;;
esac
