"""A PullBatch's host copies between the same two ranks go joined (dataplane/local_copies.copy_host_all):
whole blocks of identity plans as one run of memmoves, converted ones as one executor call over their
joined tokens. Real host tensors, no sidecar: the calls are counted, the bytes compared with each
copy made alone."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kv_sidecar.dataplane import local_copies
from kv_sidecar.dataplane.jobs import LocalCopy, RankKey, RankRead, Tokens
from kv_sidecar.dataplane.ranks import HostRank
from kv_sidecar.execute.host import rank_view
from kv_sidecar.plan.chunks import chunk_geometry
from kv_sidecar.plan.spec import EngineSpec, PlanError

BASE = {"tp_size": 1, "num_layers": 2, "num_kv_heads": 4, "head_dim": 8, "dtype": "float16", "num_blocks": 32}


class _Ranks:
    """The two host ranks of a batch, as MappedRanks hands them out."""

    def __init__(self, *ranks: HostRank) -> None:
        self._ranks = {r.key: r for r in ranks}

    def host(self, key: RankKey) -> HostRank:
        return self._ranks[key]

    def is_gpu(self, key: RankKey) -> bool:
        return False


class _Go:
    def remaining(self) -> float:
        return 60.0


def _rank(name: str, spec: EngineSpec, seed: int) -> HostRank:
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(s, generator=g).to(torch.float16) for s in spec.rank_tensor_shapes()]
    key = RankKey(name, 0)
    return HostRank(key, spec, tensors, [], rank_view(spec, 0, tensors), chunk_geometry(spec))


@pytest.mark.parametrize("layout", ["flash_attn_nhd", "flash_attn_hnd"])
def test_host_copies_of_a_batch_go_joined_and_land_as_each_alone(
    layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill NHD or HND into decode NHD, blocks of 16: whole blocks (identity) or the executor over
    joined tokens (converted). A member past a prefix, the last one's last block partial; one that
    the executor refuses fails alone with the words it gets alone, whichever check refuses it: the
    counts, a source id the join would not read, or a destination id only the joined copy's check sees
    (then the join is refused once, and the good members go joined again)."""
    src_spec = EngineSpec.from_dict(BASE | {"block_size": 16, "layout": layout})
    dst_spec = EngineSpec.from_dict(BASE | {"block_size": 16, "layout": "flash_attn_nhd"})
    identity = layout == "flash_attn_nhd"
    calls: list[str] = []
    for name in ("copy_blocks", "copy_request"):
        real = getattr(local_copies, name)

        def counted(*args: Any, _real: Any = real, _name: str = name) -> int:
            calls.append(_name)
            return _real(*args)

        monkeypatch.setattr(local_copies, name, counted)
    src = _rank("p", src_spec, 1)
    # Whole blocks but the last member's, so that the join pads nothing (test_join_tokens checks the
    # padding) and whole tensors compare.
    members = [
        ([1, 2, 3], 48, [10, 11, 12], 0),
        ([4], 16, [14], 0),
        ([5, 6, 7], 48, [17, 18], 16),
        ([8], 9, [20], 0),
    ]
    tokens = [Tokens(np.array(s), np.array(d), n, start) for s, n, d, start in members]
    read = RankRead(RankKey("d", 0), src.key, (0, 4))
    jobs = [(LocalCopy((read,), t, whole_blocks=identity), _Go()) for t in tokens]
    bad = [  # members the executor refuses alone (32 blocks a side)
        ([9, 10], [25]),  # a destination list one block short
        ([9, 10], [21, 22, 23]),  # one block too many: a join would take the first two
        ([9, 10, 99], [26, 27]),  # a source id out of range past those the tokens need
        ([9], [28, 29]),  # a source list one block short
        ([9, 10], [30, 40]),  # a destination id out of range: only the joined copy's check sees it
    ]

    def run(jobs: list[Any], joined: bool) -> tuple[list[torch.Tensor], list[int | BaseException]]:
        dst = _rank("d", dst_spec, 2)
        ranks = _Ranks(src, dst)
        calls.clear()
        if joined:
            return dst.tensors, local_copies.copy_host_all(ranks, jobs)  # type: ignore[arg-type]
        return dst.tensors, [_alone(ranks, j) for j in jobs]

    # Converted: the four good members with each bad one (every one once as the batch's first).
    batches = (
        [jobs]
        if identity
        else [
            [(LocalCopy((read,), Tokens(np.array(s), np.array(d), 32, 0), False), _Go()), *jobs]
            for s, d in bad
        ]
    )
    for n, batch in enumerate(batches):
        got, out = run(batch, joined=True)
        # The four as one call; the join with the bad destination id is refused once first.
        refused_join = not identity and bad[n][1] == [30, 40]
        assert calls == ["copy_blocks" if identity else "copy_request"] * (1 + refused_join), (n, calls)
        want, each = run(batch, joined=False)
        good = slice(len(batch) - 4, None)
        assert out[good] == each[good] and all(isinstance(o, int) and o > 0 for o in out[good]), (out, each)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g.view(torch.int16), w.view(torch.int16))
        if not identity:
            assert isinstance(out[0], PlanError) and str(out[0]) == str(each[0]), (n, out[0], each[0])


def _alone(ranks: _Ranks, job: tuple[LocalCopy, _Go]) -> int | BaseException:
    try:
        return local_copies.copy_host(ranks, *job)  # type: ignore[arg-type]
    except Exception as e:
        return e
