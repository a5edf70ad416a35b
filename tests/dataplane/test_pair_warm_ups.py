"""Which kernels a new GPU rank's registration compiles for its pairings with the other engines on the node
(dataplane/ranks._warm_pairs): every copy a gpu-direct pull between them would launch, either engine the
prefill, on the destination's device, and only the devices this process copies into.

The compile itself needs a GPU (tests/gpu/test_gpu_server.py checks that the first pull of such pairings
launches a compiled kernel); here `warm_copy` records what it is asked for instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from kv_sidecar.dataplane import ranks as ranks_mod
from kv_sidecar.dataplane.jobs import RankKey
from kv_sidecar.execute import gpu
from kv_sidecar.plan.spec import EngineSpec, Layout
from tests.gpu.kvcases import spec


@dataclass
class _View:
    spec: EngineSpec
    rank: int
    home: int  # the GPU whose context imported the rank at registration
    mapped_on: int


@dataclass
class _Rank:
    """What _warm_pairs reads of a GpuRank: its spec, rank, device, home, and its view on a device."""

    spec: EngineSpec
    rank: int
    device: int
    home: int

    def view(self, device: int) -> _View:
        return _View(self.spec, self.rank, self.home, device)


def _ranks(
    engine: str, spec: EngineSpec, devices: list[int], home: int | None = None
) -> list[tuple[RankKey, _Rank]]:
    """The engine's ranks on these devices, imported into their own (or, a worker's, into `home`)."""
    return [
        (RankKey(engine, r), _Rank(spec, r, devices[r], devices[r] if home is None else home))
        for r in range(spec.tp_size)
    ]


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, str, int, Any, int]]:
    calls: list[tuple[str, int, str, int, Any, int]] = []

    def record(src: _View, dst: _View, heads: Any, device: int) -> bool:
        # Each view as registration imported it (no mapping into another GPU's context here).
        assert src.mapped_on == src.home and dst.mapped_on == dst.home == device
        calls.append((src.spec.layout, src.rank, dst.spec.layout, dst.rank, heads, device))
        return True

    monkeypatch.setattr(gpu, "warm_copy", record)
    return calls


def test_a_tp2_engine_beside_a_tp1_engine_warms_every_read_both_ways(asked: list[Any]) -> None:
    one = spec()
    two = spec(tp_size=2, layout=Layout.FLASH_ATTN_HND)
    old = _ranks("p", one, [0])
    new = _ranks("d", two, [1, 0])
    for key, rank in new:
        others = [(k, r) for k, r in old + new if k.engine_id != key.engine_id]
        ranks_mod._warm_pairs(key, rank, others, None)  # type: ignore[arg-type]
    # tp1 -> tp2: each decode rank reads its two heads from the one prefill rank, on its own device.
    # tp2 -> tp1: the one decode rank reads two heads from each prefill rank, on device 0.
    assert sorted(asked, key=str) == sorted(
        [
            ("flash_attn_nhd", 0, "flash_attn_hnd", 0, (0, 2), 1),
            ("flash_attn_nhd", 0, "flash_attn_hnd", 1, (2, 4), 0),
            ("flash_attn_hnd", 0, "flash_attn_nhd", 0, (0, 2), 0),
            ("flash_attn_hnd", 1, "flash_attn_nhd", 0, (2, 4), 0),
        ],
        key=str,
    )


def test_a_device_worker_warms_only_the_copies_into_its_device(asked: list[Any]) -> None:
    one, two = spec(), spec(block_size=32)
    # In the worker of GPU 1 every rank was imported into GPU 1's context.
    (pk, p), (dk, d) = _ranks("p", one, [0], home=1)[0], _ranks("d", two, [1], home=1)[0]
    ranks_mod._warm_pairs(dk, d, [(pk, p)], 1)  # type: ignore[arg-type]
    assert asked == [("flash_attn_nhd", 0, "flash_attn_nhd", 0, (0, 4), 1)]  # p -> d only, on device 1
    assert asked[0][5] == d.device


def test_engines_that_cannot_pair_warm_nothing(asked: list[Any]) -> None:
    a, b = spec(), spec(head_dim=64)  # no pull between them: the pull says why
    (ak, ar), (bk, br) = _ranks("a", a, [0])[0], _ranks("b", b, [0])[0]
    ranks_mod._warm_pairs(bk, br, [(ak, ar)], None)  # type: ignore[arg-type]
    assert asked == []
