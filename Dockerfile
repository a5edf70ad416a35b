# kv-sidecar image.
#
#   docker build -t ghcr.io/kv-sidecar/kv-sidecar:0.1.0 .
#   # CUDA 12 nodes (driver < 580):
#   docker build --build-arg CUDA_MAJOR=12 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t ... .
#
# Base image: python:3.11-slim, not an nvidia/cuda image. The GPU paths need a
# CUDA *runtime* (libcudart, NVRTC, ...) of the same major version as torch and
# NIXL, plus the *driver* (libcuda.so.1, libnvidia-ml.so.1). The runtime comes
# as pip wheels that torch depends on (cuda-toolkit / nvidia-*-cuXX), exactly
# the version torch was built against; an nvidia/cuda:*-runtime base would add
# a second, possibly different, copy (~2-3 GB) and, on Ubuntu 24.04, a Python
# other than 3.11. The driver is never in the image: the NVIDIA container
# runtime injects it at start (NVIDIA_DRIVER_CAPABILITIES=compute,utility).
# One trap: NIXL's bundled UCX CUDA modules (libucm_cuda, libuct_cuda) and
# plugins dlopen libcudart.so.<major> through the normal loader path, where the
# pip wheels' lib directory is not; if NIXL initialises before torch has loaded
# libcudart, UCX silently loses its CUDA transports. The builder therefore
# registers that directory with ldconfig in the final image.
#
# CUDA_MAJOR picks torch's CUDA build and the matching NIXL backend
# (nixl-cu12 / nixl-cu13). CUDA 13 needs NVIDIA driver >= 580.
#
# VARIANT=cpu builds the same image around a CPU build of torch, for smoke
# tests on machines without GPUs (`make image-cpu`, `make image-smoke`):
#   docker build --build-arg VARIANT=cpu \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t ...-cpu .
# NIXL keeps its CUDA ${CUDA_MAJOR} backend there (its UCX loads without CUDA)
# and no CUDA runtime is registered. TORCH_FIND_LINKS names a directory of
# wheels (mounted at build time) that pip may take torch from, for a machine
# with its torch wheel on disk; `scripts/image.sh` uses it where it finds one.
#
# Without Docker Hub, PYTHON_IMAGE can name any Debian bookworm image with
# python3.11 as `python` (venv, pip), groupadd/useradd and ldconfig;
# `scripts/image_base.sh` makes one with debootstrap (docs/operations.md, 6).
#
# The nixl-cuXX wheel bundles UCX, libibverbs and the mlx5 provider; do not
# install the distribution's rdma-core into this image: a second libibverbs in
# the process breaks provider registration.
#
# No `# syntax=` directive: docker would fetch that frontend from Docker Hub, which a build from a
# local base (PYTHON_IMAGE, docs/operations.md section 6) must not need; nothing here needs it.
#
# No HEALTHCHECK: Kubernetes ignores Docker HEALTHCHECKs; the pod uses native
# gRPC probes against grpc.health.v1 on the peer port (deploy/k8s).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --------------------------------------------------------------------------- builder
FROM ${PYTHON_IMAGE} AS builder

ARG CUDA_MAJOR=13
# cuda (the production image) or cpu (smoke tests; see the header).
ARG VARIANT=cuda
# Empty: PyPI (torch 2.11 on PyPI is the CUDA 13.0 build). For CUDA 12 use
# https://download.pytorch.org/whl/cu128 (or cu126); for VARIANT=cpu
# https://download.pytorch.org/whl/cpu.
ARG TORCH_INDEX_URL=
# Empty, or a directory of wheels for pip's --find-links (torch only).
ARG TORCH_FIND_LINKS=
ARG TORCH_VERSION=2.11.0
ARG NIXL_VERSION=1.5.1

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# 1. torch first: it decides the CUDA major version for everything else.
RUN case "$VARIANT" in cuda|cpu) ;; *) echo "VARIANT must be cuda or cpu, not '$VARIANT'" >&2; exit 1;; esac \
 && pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
      ${TORCH_FIND_LINKS:+--find-links "$TORCH_FIND_LINKS"} "torch==${TORCH_VERSION}" \
 && python -c "import sys, torch; v = torch.version.cuda or ''; \
print('torch', torch.__version__, 'CUDA', v or 'none'); \
want = '' if '${VARIANT}' == 'cpu' else '${CUDA_MAJOR}'; \
sys.exit(0 if v.split('.')[0] == want else 'torch CUDA ' + (v or 'none') + ' but VARIANT=${VARIANT} CUDA_MAJOR=${CUDA_MAJOR}')"

# 2. The NIXL backend for that CUDA major, then the `nixl` meta package (it
#    provides `import nixl` and selects the backend from torch.version.cuda)
#    without its deps, which would pull in BOTH backends.
RUN pip install "nixl-cu${CUDA_MAJOR}==${NIXL_VERSION}" \
 && pip install --no-deps "nixl==${NIXL_VERSION}"

# 3. The remaining runtime deps, read from pyproject.toml so there is one list;
#    minus torch/nixl (done above) and our own client (installed from ./client).
#    (No heredoc: buildah before 1.33 and podman 4 do not read them.)
COPY pyproject.toml /src/pyproject.toml
RUN python -c "import re, tomllib; \
deps = tomllib.load(open('/src/pyproject.toml', 'rb'))['project']['dependencies']; \
skip = {'torch', 'nixl', 'kv-sidecar-client'}; \
name = lambda dep: re.split(r'[\s<>=!~;\[]', dep, maxsplit=1)[0].lower().replace('_', '-'); \
print('\n'.join(dep for dep in deps if name(dep) not in skip))" > /tmp/requirements.txt \
 && cat /tmp/requirements.txt && pip install -r /tmp/requirements.txt

# 4. Our two packages, --no-deps (their deps are all in place; the sidecar's
#    `nixl` and `kv-sidecar-client==0.1.0` requirements are satisfied by the
#    steps above / the next line, not by PyPI).
COPY . /src
RUN pip install --no-deps /src/client \
 && pip install --no-deps /src \
 && kv-sidecar --version

# The CUDA runtime from the pip wheels, for the loader (see the header); an
# empty file in the CPU variant.
RUN : > /opt/venv/kv-sidecar-cuda.conf \
 && if [ "$VARIANT" = cuda ]; then \
      site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
      && lib="$(find "$site/nvidia" -name "libcudart.so.${CUDA_MAJOR}*" -print -quit)" \
      && { test -n "$lib" || { echo "libcudart.so.${CUDA_MAJOR} not found in the torch CUDA wheels" >&2; exit 1; }; } \
      && dirname "$lib" > /opt/venv/kv-sidecar-cuda.conf; \
    fi \
 && cat /opt/venv/kv-sidecar-cuda.conf

# --------------------------------------------------------------------------- runtime
FROM ${PYTHON_IMAGE}

ARG VARIANT=cuda
LABEL io.kv-sidecar.variant="${VARIANT}" \
      org.opencontainers.image.title="kv-sidecar" \
      org.opencontainers.image.description="Per-node gRPC sidecar that moves LLM KV-cache blocks between inference engines" \
      org.opencontainers.image.source="https://github.com/kv-sidecar/kv-sidecar" \
      org.opencontainers.image.licenses="Apache-2.0"

COPY --from=builder /opt/venv /opt/venv
RUN if [ -s /opt/venv/kv-sidecar-cuda.conf ]; then \
      cp /opt/venv/kv-sidecar-cuda.conf /etc/ld.so.conf.d/kv-sidecar-cuda.conf && ldconfig; \
    fi \
 && groupadd --system --gid 65532 kvsidecar \
 && useradd --system --uid 65532 --gid 65532 --home-dir /tmp --no-create-home \
      --shell /usr/sbin/nologin kvsidecar \
 && mkdir -p /etc/kv-sidecar /run/kv-sidecar \
 && chown 65532:65532 /run/kv-sidecar

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

USER 65532:65532
EXPOSE 50061 9464
ENTRYPOINT ["kv-sidecar"]
CMD ["serve", "--config", "/etc/kv-sidecar/config.yaml"]
