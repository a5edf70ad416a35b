"""Map an engine's shared-memory KV tensors into the sidecar, validating every field."""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import re
import threading
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


# An object's identity: a name names whichever object holds it now, and an engine that restarts may
# create its objects again under the names it had (vLLM's pool names them by pid, which a fresh
# container repeats).
SegmentId = tuple[int, int]  # (st_dev, st_ino)


class ShmMapper:
    """Maps shm objects once each, reference-counted by the tensors that use them; thread-safe.

    Keyed by the object, not its name: while a mapping of an engine's object is still held (a copy
    or a read that began before the engine left), its successor under the same name is another
    object, and must be mapped as one (else its rank would read and write the old object's pages)."""

    def __init__(self, shm_dir: str = SHM_DIR) -> None:
        self._dir = shm_dir
        self._lock = threading.Lock()
        self._segments: dict[SegmentId, tuple[ShmSegment, int]] = {}

    def _open(self, name: str) -> tuple[SegmentId, ShmSegment]:
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
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            # Looked up and mapped under one lock: registrations are rare, and two of one object then
            # share one mapping without a second look.
            with self._lock:
                if key in self._segments:
                    seg, refs = self._segments[key]
                    self._segments[key] = (seg, refs + 1)
                    return key, seg
                if st.st_size == 0:
                    raise HandleError(f"shared memory object {name!r} is empty")
                mm = mmap.mmap(fd, st.st_size)
                seg = ShmSegment(name, mm, torch.frombuffer(mm, dtype=torch.uint8))
                self._segments[key] = (seg, 1)
                return key, seg
        finally:
            os.close(fd)

    def map_tensor(
        self, name: str, offset: int, shape: Sequence[int], strides: Sequence[int], dtype: str
    ) -> tuple[torch.Tensor, SegmentId]:
        """A view of the object's bytes, and the object it maps (what `release` takes)."""
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
        key, seg = self._open(name)
        size = seg.size
        if offset + nbytes > size:
            self.release(key)
            raise HandleError(
                f"tensor at offset {offset} with {nbytes} bytes overruns shared memory object {name!r} of {size} bytes"
            )
        return seg.flat[offset : offset + nbytes].view(getattr(torch, dtype)).view(tuple(shape)), key

    def release(self, key: SegmentId) -> None:
        with self._lock:
            seg, refs = self._segments[key]
            if refs > 1:
                self._segments[key] = (seg, refs - 1)
                return
            del self._segments[key]
        seg.flat = torch.empty(0, dtype=torch.uint8)
        # A view is still referenced (e.g. an in-flight copy); unmapped when collected.
        with contextlib.suppress(BufferError):
            seg.mm.close()

    @property
    def open_segments(self) -> int:
        return len(self._segments)
