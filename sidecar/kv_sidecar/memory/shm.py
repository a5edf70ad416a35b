"""Map an engine's shared-memory KV tensors into the sidecar, validating every field."""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kv_sidecar.plan.spec import DTYPE_SIZES

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


class HandleError(ValueError):
    """A tensor handle that does not describe valid memory (INVALID_ARGUMENT)."""


def contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return strides[::-1]


@dataclass
class ShmSegment:
    """One mapped /dev/shm object; tensors are views of it."""

    name: str
    mm: mmap.mmap
    flat: torch.Tensor

    @property
    def size(self) -> int:
        return len(self.mm)


class ShmMapper:
    """Maps shm objects once each, reference-counted by the tensors that use them."""

    def __init__(self, shm_dir: str = SHM_DIR) -> None:
        self._dir = shm_dir
        self._segments: dict[str, tuple[ShmSegment, int]] = {}

    def _open(self, name: str) -> ShmSegment:
        if name in self._segments:
            seg, refs = self._segments[name]
            self._segments[name] = (seg, refs + 1)
            return seg
        if not _NAME.match(name):
            raise HandleError(f"shared memory name {name!r} is not valid (must match {_NAME.pattern})")
        path = os.path.join(self._dir, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise HandleError(f"shared memory object {name!r} does not exist in {self._dir}") from None
        except PermissionError:
            raise HandleError(f"no permission to open shared memory object {name!r}") from None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise HandleError(f"shared memory object {name!r} is empty")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        seg = ShmSegment(name, mm, torch.frombuffer(mm, dtype=torch.uint8))
        self._segments[name] = (seg, 1)
        return seg

    def map_tensor(
        self, name: str, offset: int, shape: Sequence[int], strides: Sequence[int], dtype: str
    ) -> torch.Tensor:
        if dtype not in DTYPE_SIZES:
            raise HandleError(f"dtype {dtype!r} is not supported")
        if not shape or any(s <= 0 for s in shape):
            raise HandleError(f"shape {list(shape)} must be non-empty with positive sizes")
        if list(strides) != contiguous_strides(shape):
            raise HandleError(
                f"strides {list(strides)} are not the contiguous strides {contiguous_strides(shape)} of shape {list(shape)}"
            )
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        elem = DTYPE_SIZES[dtype]
        if offset % elem:
            raise HandleError(f"offset {offset} is not aligned to the {elem}-byte element size")
        seg = self._open(name)
        size = seg.size
        if offset + nbytes > size:
            self.release(name)
            raise HandleError(
                f"tensor at offset {offset} with {nbytes} bytes overruns shared memory object {name!r} of {size} bytes"
            )
        return seg.flat[offset : offset + nbytes].view(getattr(torch, dtype)).view(tuple(shape))

    def release(self, name: str) -> None:
        seg, refs = self._segments[name]
        if refs > 1:
            self._segments[name] = (seg, refs - 1)
            return
        del self._segments[name]
        seg.flat = torch.empty(0, dtype=torch.uint8)
        # A view is still referenced (e.g. an in-flight copy); unmapped when collected.
        with contextlib.suppress(BufferError):
            seg.mm.close()

    @property
    def open_segments(self) -> int:
        return len(self._segments)
