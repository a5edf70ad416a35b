"""Hybrid models (vLLM's hybrid KV cache manager, HMA): KV cache groups in the connector's terms.

vLLM 0.32 gives a hybrid model (sliding-window layers next to full-attention ones) several KV cache
groups, each with its own block table, all drawing block ids from one pool. The groups hold equally
many layers (vLLM splits and pads them so) and alias one allocation: layer j of every group is a
view of the same bytes (`allocate_kv_cache`: "cache groups overlay each other"). Block b of group g
in that region is group g's layer j; a block id belongs to one group at a time, so the blocks of
different groups never overlap.

So the connector registers one region per layer position j (not one per layer: the sidecar would
see layers that overlap) and publishes a request as one sidecar record per group, `<request>#g<g>`,
with that group's blocks (a sliding-window group only its window: window.py). A pull of group g's
record copies group g's blocks of every region, i.e. exactly group g's layers, each byte once.
A decode engine pulls each group into its own blocks of the same group; the groups of the two
engines must correspond layer for layer (`mismatch`).

A Mamba group (issue 33, item 5) pages each request's state into the same regions: one block per
request, whose record is published as that block's tokens; its `state` arrays say where the state lies
in the block (mamba_state.py).

Pure: plain values, no vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

GROUPS_KEY = "kv_sidecar_groups"  # inside kv_transfer_params: one entry per group of a hybrid model


@dataclass(frozen=True)
class StateArray:
    """One array of a Mamba layer's per-request state on this rank: vLLM's MambaSpec shape and dtype, and
    its byte offset inside the block (mamba_state.py)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch's name without "torch."
    offset: int
    # How TP shards it (the sidecar's StateArray; empty: not described): dim `tp_dim` of `shape` is this
    # rank's share of each (model size, replicated) segment, in order (mamba_state.mamba2_sharding).
    tp_dim: int = 0
    segments: tuple[tuple[int, bool], ...] = ()

    def describe(self) -> str:
        return f"{self.name} {self.shape} {self.dtype} at byte {self.offset}"

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "offset": self.offset,
        }
        if self.segments:
            d["tp_dim"] = self.tp_dim
            d["segments"] = [{"size": n, "replicated": r} for n, r in self.segments]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StateArray:
        return cls(
            str(d["name"]),
            tuple(int(x) for x in d["shape"]),
            str(d["dtype"]),
            int(d["offset"]),
            int(d.get("tp_dim", 0)),
            tuple((int(g["size"]), bool(g.get("replicated", False))) for g in d.get("segments", ())),
        )

    def corresponds(self, other: StateArray) -> bool:
        """Whether the sidecar converts this array into `other` (plan/state.check_state_pair): the same
        array, or both sharded the same way over the model and alike beyond their TP-sharded dim."""
        if self == other:
            return True
        if not self.segments or not other.segments or len(self.shape) != len(other.shape):
            return False
        beyond = [i for i in range(len(self.shape)) if i != self.tp_dim]
        return (
            (self.name, self.dtype, self.tp_dim) == (other.name, other.dtype, other.tp_dim)
            and [n for n, _ in self.segments] == [n for n, _ in other.segments]
            and [self.shape[i] for i in beyond] == [other.shape[i] for i in beyond]
        )


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group: its layers (in vLLM's order) and its window (None: full attention). `state`
    set: a Mamba group, whose one block per request holds the request's recurrent state (these arrays)."""

    layers: tuple[str, ...]
    window: int | None  # tokens kept behind the next token (vLLM's window plus retained extras)
    state: tuple[StateArray, ...] = ()

    @property
    def kind(self) -> str:
        if self.state:
            return "Mamba state (" + ", ".join(a.describe() for a in self.state) + ")"
        return "full attention" if self.window is None else f"sliding window {self.window}"

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"layers": list(self.layers), "window": self.window}
        if self.state:
            d["state"] = [a.to_json() for a in self.state]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> KVGroup:
        window = d.get("window")
        return cls(
            tuple(str(n) for n in d.get("layers", ())),
            None if window is None else int(window),
            tuple(StateArray.from_json(a) for a in d.get("state", ())),
        )


def sub_request_id(request_id: str, group: int) -> str:
    """The sidecar record of one group of a hybrid model's request."""
    return f"{request_id}#g{group}"


def common_window(groups: Sequence[KVGroup]) -> int | None:
    """The window of the sliding-window groups (None if there are none). The prefill stops a request
    short so that the window start is aligned (window.prefill_tokens): one rule for every group needs
    one window; models with several windows (none in vLLM's hybrid families today) are refused."""
    windows = {g.window for g in groups if g.window is not None}
    if len(windows) > 1:
        raise ValueError(
            f"KVSidecarConnector supports hybrid models whose sliding-window groups share one window; "
            f"this one has windows {sorted(windows)}"
        )
    return windows.pop() if windows else None


def mismatch(prefill: Sequence[KVGroup], own: Sequence[KVGroup]) -> str | None:
    """Why a request published by an engine with `prefill`'s groups cannot be pulled into this
    engine's `own` groups, naming the first layer that does not correspond; None if they do."""
    if len(prefill) != len(own):
        return (
            f"the prefill engine has {len(prefill)} KV cache group(s) ({_layers_of(prefill)}) and this "
            f"engine {len(own)} ({_layers_of(own)}): is the hybrid KV cache manager on at one end only?"
        )
    for g, (theirs, mine) in enumerate(zip(prefill, own, strict=True)):
        for j in range(max(len(theirs.layers), len(mine.layers))):
            a = theirs.layers[j] if j < len(theirs.layers) else None
            b = mine.layers[j] if j < len(mine.layers) else None
            if a != b:
                return (
                    f"KV cache group {g}, position {j}: the prefill engine has layer {a} there, this "
                    f"engine {b}"
                )
        converts = len(theirs.state) == len(mine.state) and all(
            a.corresponds(b) for a, b in zip(theirs.state, mine.state, strict=True)
        )
        if theirs.window != mine.window or not converts:
            return (
                f"layer {mine.layers[0] if mine.layers else '?'} (KV cache group {g}) is {theirs.kind} on "
                f"the prefill engine and {mine.kind} on this engine"
            )
    return None


def token_group(groups: Sequence[KVGroup]) -> int:
    """The first group whose records count the request's tokens: a Mamba group's record is one state
    block, published as that block's tokens whatever the request's length."""
    return next((g for g, group in enumerate(groups) if not group.state), 0)


def region_layers(groups: Sequence[Sequence[str]]) -> list[list[str]]:
    """For each region (layer position j), the layers of every group at that position: the layers
    that share its bytes. Groups of fewer layers (vLLM's padding) leave positions empty."""
    width = max((len(g) for g in groups), default=0)
    return [[g[j] for g in groups if j < len(g)] for j in range(width)]


def _layers_of(groups: Sequence[KVGroup]) -> str:
    """Each group's layers, for messages: "l.0 l.3 | l.1 l.4", or "?" where unknown."""
    return " | ".join(" ".join(g.layers) or "?" for g in groups)
