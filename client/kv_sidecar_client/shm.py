"""KV caches in POSIX shared memory, so the sidecar maps the very same pages.

The engine allocates its paged KV tensors here instead of with torch.empty;
`handles()` describes them for RegisterRank. Nothing is copied: the sidecar
opens /dev/shm/<name> and maps it.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import re
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kv_sidecar_client._proto.kvsidecar.v1 import common_pb2

if TYPE_CHECKING:
    import torch

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_ALIGN = 4096  # page-align every tensor: NIXL/UCX register whole pages


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class ShmKVCache:
    """One shared-memory object holding a list of tensors (e.g. one per layer)."""

    def __init__(self, shapes: Sequence[Sequence[int]], dtype: torch.dtype, name: str | None = None) -> None:
        import torch

        self.name = name or f"kvsidecar-{os.getpid()}-{secrets.token_hex(4)}"
        if not _NAME.match(self.name):
            raise ValueError(f"shared memory name {self.name!r} must match {_NAME.pattern}")
        elem = torch.empty((), dtype=dtype).element_size()
        self.dtype = dtype
        self.offsets: list[int] = []
        size = 0
        for shape in shapes:
            self.offsets.append(size)
            size += math.ceil(math.prod(shape) * elem / _ALIGN) * _ALIGN
        self.size = max(size, _ALIGN)
        fd = os.open(os.path.join(SHM_DIR, self.name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, self.size)
            self._mmap: mmap.mmap | None = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        flat = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.tensors: list[torch.Tensor] = [
            flat[off : off + math.prod(shape) * elem].view(dtype).view(tuple(shape))
            for off, shape in zip(self.offsets, shapes, strict=True)
        ]

    def handles(self) -> list[common_pb2.TensorHandle]:
        return [
            common_pb2.TensorHandle(
                shm=common_pb2.ShmTensor(name=self.name, offset=off),
                shape=list(t.shape),
                strides=list(t.stride()),
                dtype=_dtype_name(t.dtype),
            )
            for off, t in zip(self.offsets, self.tensors, strict=True)
        ]

    def close(self, unlink: bool = True) -> None:
        """Drop our mapping (tensors become invalid) and remove the object."""
        self.tensors = []
        if self._mmap is not None:
            # A tensor view is still alive somewhere; the OS unmaps at exit.
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, self.name))

    def __enter__(self) -> ShmKVCache:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
