"""Mamba state converted between engines of different TP sizes, through real sidecars (host memory):
two sidecars (host-nixl-state: each decode rank READs its runs from the prefill ranks) and one
(host-direct). Each decode rank's state block must hold the model's state sharded as vLLM shards it at
the decode TP size (tests/plan/test_state_tp.py's reference), and nothing else of its cache is written.
(Real vLLM engines: tests/vllm/test_hybrid_ssm.py.)"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import SidecarProcess
from kv_sidecar_client import SidecarClient
from kv_sidecar_client.shm import ShmKVCache
from tests.plan.state_oracle import mamba2_state, model_state, shard

from .conftest import spec_dict

BLOCK = 16  # tokens; a block of one region is 16 x 4 KV heads / tp x (K, V) x 16 x float16
SRC, DST = 3, 5  # the state block published, and the one it is pulled into


def mamba2(tp: int) -> list[dict[str, Any]]:
    """A small Mamba-2 state as vLLM shards it: 4 heads of 4, state size 8."""
    return mamba2_state(tp, heads=4, head_dim=4, d_state=8)


def spec(tp: int, state: list[dict[str, Any]] | None = None, **over: Any) -> EngineSpec:
    groups = [
        {"layers": ["m.0", "m.2"], "state": mamba2(tp) if state is None else state},
        {"layers": ["a.1", "a.3"]},
    ]
    return EngineSpec.from_dict(spec_dict(tp_size=tp, layout="packed", groups=groups) | over)


def page(t: torch.Tensor, block: int) -> np.ndarray:
    """One block of a region (layout packed: blocks outermost) as bytes."""
    return t.view(torch.uint8).reshape(t.shape[0], -1)[block].numpy()


def state_bytes(state: list[dict[str, Any]]) -> int:
    return sum(int(np.prod(a["shape"])) * 4 for a in state)


class Engines:
    """A prefill engine of `ts` ranks on sidecar `a`, its state block SRC holding the model's state
    sharded at ts (random elsewhere), and a decode engine of `td` ranks on `b`, random."""

    def __init__(
        self, a: SidecarProcess, b: SidecarProcess, ts: int, td: int, name: str, kv: int = 4, **decode: Any
    ) -> None:
        self.a, self.b, self.ts, self.td, self.name = a, b, ts, td, name
        self.ps, self.ds = spec(ts, num_kv_heads=kv), spec(td, num_kv_heads=kv, **decode)
        # Each layer position (region) its own model state: a run copied into the wrong one shows.
        self.models = [model_state(mamba2(1), seed=ts * 10 + td + 100 * j) for j in range(self.ps.num_layers)]
        self.p = [ShmKVCache(self.ps.rank_tensor_shapes(), torch.float16) for _ in range(ts)]
        self.d = [ShmKVCache(self.ds.rank_tensor_shapes(), torch.float16) for _ in range(td)]
        page_bytes = page(self.p[0].tensors[0], 0).size
        for q, cache in enumerate(self.p):
            for t, model in zip(cache.tensors, self.models, strict=True):
                t.copy_(torch.randn(t.shape))
                page(t, SRC)[:] = shard(mamba2(ts), model, ts, q, page_bytes)
        for cache in self.d:
            for t in cache.tensors:
                t.copy_(torch.randn(t.shape))
        self.before = [[t.clone() for t in c.tensors] for c in self.d]

    def register(self, pc: SidecarClient, dc: SidecarClient) -> None:
        for q, c in enumerate(self.p):
            pc.register_rank(f"{self.name}-p", q, self.ps.to_dict(), c.handles())
        for r, c in enumerate(self.d):
            dc.register_rank(f"{self.name}-d", r, self.ds.to_dict(), c.handles())

    def assert_converted(self) -> None:
        """Each decode rank's block DST: the state sharded at td, its padding as it was; every other
        block as it was."""
        want_state = mamba2(self.td)
        n = state_bytes(want_state)
        for r, (cache, old) in enumerate(zip(self.d, self.before, strict=True)):
            for t, o, model in zip(cache.tensors, old, self.models, strict=True):
                got, was = page(t, DST), page(o, DST)
                want = shard(want_state, model, self.td, r, got.size)
                assert (got[:n] == want[:n]).all(), r
                assert (got[n:] == was[n:]).all(), r  # page padding untouched
                rest = [i for i in range(t.shape[0]) if i != DST]
                assert torch.equal(t[rest], o[rest])

    def assert_untouched(self) -> None:
        for cache, old in zip(self.d, self.before, strict=True):
            assert all(torch.equal(t, o) for t, o in zip(cache.tensors, old, strict=True))

    def close(self) -> None:
        for c in (*self.p, *self.d):
            c.close()


@pytest.mark.parametrize(("ts", "td", "kv"), [(1, 2, 4), (2, 1, 4), (2, 4, 4), (4, 2, 1)])
def test_two_sidecars_convert_the_state_block_between_tp_sizes(
    sidecar_pair: tuple[SidecarProcess, SidecarProcess], ts: int, td: int, kv: int
) -> None:
    """(4, 2, 1): one KV head, so decode rank 0 reads attention from prefill rank 0 only but state from
    ranks 0 and 1 (plan/pair.py makes rank 1 wait for it)."""
    a, b = sidecar_pair
    e = Engines(a, b, ts, td, f"tp{ts}{td}{kv}", kv)
    try:
        with SidecarClient(a.socket) as pc, SidecarClient(b.socket) as dc:
            e.register(pc, dc)
            params = pc.publish(f"{e.name}-p", "s#g0", [SRC], BLOCK)  # one state block, as its tokens
            # A converting pairing: a pull that does not name its group could be a state block moved as
            # tokens; refused, nothing written.
            refused = dc.pull(params, f"{e.name}-d", [DST])
            assert not refused.ok and refused.error_code == "FAILED_PRECONDITION", refused
            assert "must name its KV cache group" in refused.error and "layer m.0" in refused.error, refused
            e.assert_untouched()
            result = dc.pull(params, f"{e.name}-d", [DST], group=0)
            assert result.ok and result.path == "host-nixl-state", result
            # Each decode rank's arrays in both layer positions of the group, nothing more.
            assert result.bytes == td * 2 * state_bytes(mamba2(td)), result
            e.assert_converted()
    finally:
        e.close()


def test_one_sidecar_converts_the_state_block_host_direct(
    sidecar_pair: tuple[SidecarProcess, SidecarProcess],
) -> None:
    a, _ = sidecar_pair
    e = Engines(a, a, 1, 2, "direct")
    try:
        with SidecarClient(a.socket) as c:
            e.register(c, c)
            params = c.publish("direct-p", "s#g0", [SRC], BLOCK)
            result = c.pull(params, "direct-d", [DST], group=0)
            assert result.ok and result.path == "host-direct", result
            assert result.bytes == 2 * 2 * state_bytes(mamba2(2)), result
            e.assert_converted()
    finally:
        e.close()


def test_a_pairing_the_plan_cannot_convert_is_refused_naming_the_layer(
    sidecar_pair: tuple[SidecarProcess, SidecarProcess],
) -> None:
    """The decode engine does not describe its state's sharding: FAILED_PRECONDITION from the plan."""
    a, b = sidecar_pair
    plain = [{k: v for k, v in arr.items() if k not in ("tp_dim", "segments")} for arr in mamba2(2)]
    e = Engines(
        a, b, 1, 2, "plain", groups=[{"layers": ["m.0", "m.2"], "state": plain}, {"layers": ["a.1", "a.3"]}]
    )
    try:
        with SidecarClient(a.socket) as pc, SidecarClient(b.socket) as dc:
            e.register(pc, dc)
            params = pc.publish("plain-p", "s#g0", [SRC], BLOCK)
            result = dc.pull(params, "plain-d", [DST], group=0)
            assert not result.ok and result.error_code == "FAILED_PRECONDITION", result
            assert (
                "KV cache group 0 (layer m.0) holds Mamba state, which cannot be converted exactly between these "
                "engines: the decode engine (tp_size 2) does not describe how TP shards its conv state"
            ) in result.error, result
            e.assert_untouched()
            assert dc.abort("plain-d", params.request_id, params)
    finally:
        e.close()
