"""A reference engine's KV cache in GPU memory, shared with the sidecar over CUDA IPC."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kv_sidecar_client.cuda_ipc import tensor_handles


class GpuKVCache:
    """One rank's KV tensors allocated with plain cudaMalloc (torch's caching allocator), one per shape.

    Same interface as `kv_sidecar_client.shm.ShmKVCache` (tensors, handles(),
    close()), so the reference engine treats both alike.
    """

    def __init__(self, shapes: Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device) -> None:
        self.device = device
        self.tensors: list[torch.Tensor] = [torch.empty(tuple(s), dtype=dtype, device=device) for s in shapes]

    def handles(self) -> list[Any]:
        return tensor_handles(self.tensors)

    def close(self, unlink: bool = True) -> None:
        torch.cuda.synchronize(self.device)
        self.tensors = []
