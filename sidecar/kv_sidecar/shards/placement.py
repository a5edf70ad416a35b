"""Which shard serves an engine (pure: no I/O, no gRPC).

An engine goes to one shard, all its ranks (`control_shard_ranks: whole`), or each rank to its own
GPU's shard (`spread`, `rank_shard`). A GPU engine goes to the shard of its rank 0's GPU: the visible GPUs, in
ordinal order, split into contiguous groups, one per shard, so that the engines of a GPU pair that
sit next to each other share a shard and their pulls stay gpu-direct; or into the groups the operator
names (`control_shard_gpus`), for pairs that do not sit next to each other. A host engine has no GPU
to go by: its placement key, or else its engine id (CRC-32, stable across restarts and processes),
picks the shard, so that host engines that name one key (a P/D pair) share a shard.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass

GpuGroups = tuple[tuple[int, ...], ...]


def gpu_groups(text: str, shards: int) -> GpuGroups:
    """`control_shard_gpus` read: one group of GPU ordinals per shard, groups separated by ";" and GPUs by
    "," ("0,4;1,5"); empty: none named (contiguous groups). ValueError names what is wrong."""
    if not text.strip():
        return ()
    groups: list[tuple[int, ...]] = []
    for part in text.split(";"):
        try:
            group = tuple(int(g) for g in part.split(","))
        except ValueError:
            raise ValueError(
                f"control_shard_gpus {text!r}: {part.strip()!r} is not a list of GPU ordinals ('0,4;1,5')"
            ) from None
        if any(g < 0 for g in group):
            raise ValueError(f"control_shard_gpus {text!r}: GPU ordinals are not negative")
        groups.append(group)
    if len(groups) != shards:
        raise ValueError(
            f"control_shard_gpus {text!r} names {len(groups)} groups of GPUs; control_shards is {shards}: "
            "one group per shard"
        )
    named = [g for group in groups for g in group]
    twice = sorted({g for g in named if named.count(g) > 1})
    if twice:
        raise ValueError(f"control_shard_gpus {text!r} puts GPU {twice[0]} in more than one group")
    return tuple(groups)


@dataclass(frozen=True)
class Placement:
    shards: int
    devices: tuple[str, ...] = ()  # the visible GPUs' UUIDs, by driver ordinal
    groups: GpuGroups = ()  # each shard's GPU ordinals (gpu_groups); () for contiguous groups

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise ValueError(f"shards must be at least 1, got {self.shards}")
        if self.groups:
            if len(self.groups) != self.shards:
                raise ValueError(f"{len(self.groups)} groups of GPUs for {self.shards} shards")
            # Every GPU this node sees in a group, and no group naming one it does not: an engine on a
            # GPU left out would have no shard, and a group of GPUs not there none of its engines.
            named = {g for group in self.groups for g in group}
            seen = set(range(len(self.devices)))
            if named - seen:
                raise ValueError(
                    f"control_shard_gpus names GPU {min(named - seen)}, but this node sees "
                    f"{len(self.devices)} GPU(s) (ordinals as CUDA numbers them here)"
                )
            if seen - named:
                raise ValueError(f"control_shard_gpus leaves GPU {min(seen - named)} in no group")

    def gpus_of(self, shard: int) -> tuple[int, ...]:
        """The ordinals of the GPUs whose engines go to `shard` (as `shard_of` places them)."""
        if self.groups:
            return tuple(sorted(self.groups[shard]))
        n = len(self.devices)
        return tuple(o for o in range(n) if o * self.shards // n == shard)

    def rank_shard(self, engine_id: str, rank: int, device_uuid: str = "", key: str = "") -> int:
        """Where a rank goes when an engine's ranks are spread (control_shard_ranks "spread"): a GPU rank
        to its own GPU's shard, a host rank to the shard after its rank 0's, `rank` shards on (round
        robin): rank 0's is `shard_of`'s."""
        if device_uuid in self.devices:
            return self.shard_of(engine_id, device_uuid)
        return (self.shard_of(engine_id, key=key) + rank) % self.shards

    def shard_of(self, engine_id: str, device_uuid: str = "", key: str = "") -> int:
        """The shard of `engine_id`, whose rank 0's tensors are on `device_uuid` (empty: host memory);
        a host engine's by its placement `key` where it names one."""
        if device_uuid in self.devices:
            ordinal = self.devices.index(device_uuid)
            if self.groups:
                return next(k for k, group in enumerate(self.groups) if ordinal in group)
            return ordinal * self.shards // len(self.devices)
        return zlib.crc32((key or engine_id).encode()) % self.shards


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
