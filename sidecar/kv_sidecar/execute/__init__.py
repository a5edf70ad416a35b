"""Executors: apply a plan to real memory (host tensors, NIXL, GPU kernels)."""

from __future__ import annotations

import sys


def gpu_launch_counts() -> dict[str, int]:
    """The GPU copy kernel's launches in this process, by how they were made; none before its module
    (and Triton) is loaded, which the first GPU copy does: a scrape must not import Triton."""
    kernels = sys.modules.get("kv_sidecar.execute.gpu_kernels")
    return kernels.launch.counts() if kernels is not None else {}
