"""Sidecar-owned staging rings for the staged protocol, registered with NIXL once.

DESIGN.md section 1: NIXL moves memory the sidecar owns ~400x faster than memory it imported over
CUDA IPC, so engine memory is never registered. The source sidecar gathers a request's tokens,
already in the reader's layout, into slots of its send ring and WRITEs each chunk over NIXL (one
descriptor) into a slot of the reader's receive ring, which scatters from there
(dataplane/receive.py, dataplane/send.py, dataplane/staged_protocol.py).

Each GPU has two rings, send and receive, each split into equal slots (`gpu_staging_bytes` / 2 /
`gpu_staging_slots` bytes). Every transfer on that GPU takes the slots it needs from the ring's
`SlotPool` and gives them back one by one as its last chunks need fewer, so concurrent transfers
share a ring; no one peer's transfers hold more than all but `gpu_staging_reserve` slots of a ring,
so a peer that hangs or dies with slots in hand leaves the others some. Separate send and receive
rings mean two sidecars pulling from each other cannot deadlock: a transfer holds receive slots on
one sidecar and send slots on the other, never waits for the same pool twice, and slots only wait
on local scatters and on the wire.

With `host_transfer: ring`, host-memory pulls run the same protocol through one pair of host rings
of the same size (device `HOST`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kv_sidecar.dataplane.jobs import HOST
from kv_sidecar.dataplane.staged_protocol import SlotPool
from kv_sidecar.metrics import Metrics
from kv_sidecar.transport.nixl_driver import NixlDriver

ALIGN = 4096  # slot starts aligned for the copy kernel's vector accesses and for RDMA


@dataclass
class Ring:
    device: int  # CUDA ordinal, or HOST
    buffer: torch.Tensor
    slots: int
    slot_bytes: int
    pool: SlotPool
    nixl_key: int
    metadata: bytes = field(default=b"", repr=False)  # NIXL partial metadata: what a peer needs to WRITE here

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def mem_type(self) -> str:
        return "DRAM" if self.device == HOST else "VRAM"

    @property
    def nixl_device(self) -> int:
        return 0 if self.device == HOST else self.device

    def slot_address(self, slot: int) -> int:
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} out of range [0, {self.slots})")
        return self.buffer.data_ptr() + slot * self.slot_bytes


def slot_bytes_for(total_bytes: int, slots: int) -> int:
    """A slot of a ring of `slots` (at least 1) when both rings share `total_bytes`: what a ring that
    process or another (a staged worker's) allocates from the same settings."""
    return (total_bytes // 2 // max(1, slots)) // ALIGN * ALIGN


def new_ring(
    device: int,
    role: str,
    total_bytes: int,
    slots: int,
    nixl: NixlDriver,
    metrics: Metrics,
    reserve: int = 0,
) -> Ring:
    """Allocate and register one ring of `device` ("send" or "recv": only a receive ring's metadata
    goes to peers). `total_bytes` is both rings' share: each ring gets half. `reserve`: slots no one
    peer may hold (SlotPool)."""
    slots = max(1, slots)
    slot_bytes = slot_bytes_for(total_bytes, slots)
    if slot_bytes <= 0:
        raise ValueError(f"gpu_staging_bytes {total_bytes} is too small for {slots} slots")
    where = torch.device("cpu") if device == HOST else torch.device("cuda", device)
    buf = torch.empty(slots * slot_bytes, dtype=torch.uint8, device=where)
    mem = "DRAM" if device == HOST else "VRAM"
    key = nixl.register([(buf.data_ptr(), buf.numel(), max(device, 0))], mem_type=mem)
    in_use = metrics.staging_in_use
    pool = SlotPool(slots, on_change=lambda n: in_use.inc(n * slot_bytes), reserve=reserve)
    ring = Ring(device, buf, slots, slot_bytes, pool, key)
    if role == "recv":
        ring.metadata = nixl.partial_metadata(key)
    metrics.staging_capacity.inc(ring.nbytes)
    return ring
