"""Which shard serves an engine (pure: no I/O, no gRPC).

An engine goes to one shard, all its ranks: a pull then reads either the engine's ranks on its own
shard (host-direct, gpu-direct) or those of another shard (staged), never a mix, which a pull cannot
do (routing.by_holder). A GPU engine goes to the shard of its rank 0's GPU: the visible GPUs, in
ordinal order, split into contiguous groups, one per shard, so that the engines of a GPU pair that
sit next to each other share a shard and their pulls stay gpu-direct. A host engine has no GPU to go
by: its engine id (CRC-32, stable across restarts and processes) picks the shard.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    shards: int
    devices: tuple[str, ...] = ()  # the visible GPUs' UUIDs, by driver ordinal

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise ValueError(f"shards must be at least 1, got {self.shards}")

    def shard_of(self, engine_id: str, device_uuid: str = "") -> int:
        """The shard of `engine_id`, whose rank 0's tensors are on `device_uuid` (empty: host memory)."""
        if device_uuid in self.devices:
            return self.devices.index(device_uuid) * self.shards // len(self.devices)
        return zlib.crc32(engine_id.encode()) % self.shards


class EngineShards:
    """Engine id -> its shard, set when its rank 0 is routed. A GPU engine's other ranks (and its own
    calls) may be routed before rank 0 is: the ranks of an engine start together, so they wait for
    rank 0 a while, as a member sidecar waits for its leader's ranks (`leader_wait_ms`). Bounded: the
    engines least recently routed are forgotten past `capacity` (a forgotten engine's rank 0 is routed
    again when it registers again)."""

    def __init__(self, capacity: int = 65536) -> None:
        self._shards: OrderedDict[str, int] = OrderedDict()
        self._capacity = capacity
        self._changed = threading.Condition()

    def set(self, engine_id: str, shard: int) -> None:
        with self._changed:
            self._shards[engine_id] = shard
            self._shards.move_to_end(engine_id)
            while len(self._shards) > self._capacity:
                self._shards.popitem(last=False)
            self._changed.notify_all()

    def wait(self, engine_id: str, timeout_s: float) -> int | None:
        """The shard of `engine_id`; None if its rank 0 was not routed within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while engine_id not in self._shards:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(left)
            self._shards.move_to_end(engine_id)
            return self._shards[engine_id]
