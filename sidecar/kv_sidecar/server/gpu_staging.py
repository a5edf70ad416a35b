"""Sidecar-owned GPU staging rings for cross-sidecar transfers, registered with NIXL once.

DESIGN.md section 1: NIXL moves memory the sidecar owns ~400x faster than
memory it imported over CUDA IPC, so engine memory is never registered.
The source sidecar gathers a request's tokens, already in the reader's
layout, into its send ring; the reader READs whole slots over NIXL (one
descriptor per chunk) into its receive ring and scatters from there.

Each GPU has two rings, send and receive, each split into equal slots. Two
sidecars pulling from each other at once would deadlock on one shared ring;
with separate rings a sidecar's receive side never waits for its own send
side. A ring serves one transfer at a time (its lock); the slots pipeline
the chunks of that transfer.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kv_sidecar.server.sidecar import Sidecar

ALIGN = 4096  # slot starts aligned for the copy kernel's vector accesses and for RDMA


@dataclass
class Ring:
    device: int
    buffer: torch.Tensor
    slots: int
    slot_bytes: int
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def slot_address(self, slot: int) -> int:
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} out of range [0, {self.slots})")
        return self.buffer.data_ptr() + slot * self.slot_bytes


class GpuStaging:
    """Rings per (device, role), allocated on first use and kept until shutdown."""

    def __init__(self, sidecar: Sidecar) -> None:
        self._sc = sidecar
        self._lock = threading.Lock()
        self._rings: dict[tuple[int, str], Ring] = {}

    def ensure(self, device: int) -> None:
        """Allocate and register both rings of `device` (before any peer handshakes for its engines)."""
        self.ring(device, "send")
        self.ring(device, "recv")

    def ring(self, device: int, role: str) -> Ring:
        with self._lock:
            ring = self._rings.get((device, role))
            if ring is not None:
                return ring
            s = self._sc.settings
            slots = max(1, s.gpu_staging_slots)
            slot_bytes = (s.gpu_staging_bytes // 2 // slots) // ALIGN * ALIGN
            if slot_bytes <= 0:
                raise ValueError(f"gpu_staging_bytes {s.gpu_staging_bytes} is too small for {slots} slots")
            buf = torch.empty(slots * slot_bytes, dtype=torch.uint8, device=torch.device("cuda", device))
            self._sc.nixl.register([(buf.data_ptr(), buf.numel(), device)], mem_type="VRAM")
            ring = Ring(device, buf, slots, slot_bytes)
            self._rings[(device, role)] = ring
            self._sc.metrics.gpu_memory.set(self.nbytes_locked())
            self._sc.metrics.staging_capacity.inc(ring.nbytes)
            return ring

    @contextlib.contextmanager
    def hold(self, ring: Ring) -> Iterator[Ring]:
        """One transfer at a time per ring; counted in the staging-in-use gauge while held."""
        with ring.lock:
            self._sc.metrics.staging_in_use.inc(ring.nbytes)
            try:
                yield ring
            finally:
                self._sc.metrics.staging_in_use.dec(ring.nbytes)

    def nbytes_locked(self) -> int:
        return sum(r.buffer.numel() for r in self._rings.values())

    def close(self) -> None:
        with self._lock:
            self._rings.clear()
