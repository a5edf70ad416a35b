"""The vLLM connector's parts that need no vLLM: config, version gate, layout mapping, shm pool, and the
sliding-window arithmetic.

(Real vLLM engines through the connector: tests/vllm, `make test-vllm`.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_sidecar.execute.host import rank_view
from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar_client.vllm import UnsupportedVllmVersion, check_vllm_version
from kv_sidecar_client.vllm.config import ConnectorConfig, ConnectorConfigError
from kv_sidecar_client.vllm.kv_layout import (
    UnsupportedKVCache,
    VllmKVInfo,
    check_covers_allocation,
    describe,
    transferred_layers,
)
from kv_sidecar_client.vllm.scheduler import BadParams, SidecarScheduler, remote_params
from kv_sidecar_client.vllm.shm_pool import ShmKVPool
from kv_sidecar_client.vllm.window import first_kept_token, leading_nulls, prefill_tokens, skipped_tokens


# -- configuration ------------------------------------------------------------------------
def test_config_defaults_and_int_for_float() -> None:
    cfg = ConnectorConfig.from_extra_config({"pull_timeout_s": 5, "lease_ms": 9000, "engine_id": "p"})
    assert cfg.pull_timeout_s == 5.0 and isinstance(cfg.pull_timeout_s, float)
    assert cfg.sidecar_socket == "/run/kv-sidecar/engine.sock" and cfg.engine_id == "p"
    assert ConnectorConfig.from_extra_config(None) == ConnectorConfig()
    assert ConnectorConfig().shard_placement == ""  # control shards: by engine id
    assert ConnectorConfig.from_extra_config({"shard_placement": "pair-1"}).shard_placement == "pair-1"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"pull_timeout": 5}, r"unknown key\(s\) \['pull_timeout'\]"),
        ({"pull_timeout_s": "5"}, r"pull_timeout_s must be a float, got str '5'"),
        ({"lease_ms": True}, r"lease_ms must be a int, got bool"),
        ({"pull_timeout_s": 0}, r"pull_timeout_s must be positive"),
        ({"publish_timeout_s": -1.0}, r"publish_timeout_s must be positive"),
        ({"sidecar_socket": ""}, r"sidecar_socket must not be empty"),
        (
            {"lease_ms": 2000, "keepalive_interval_s": 3.0},
            r"keepalive_interval_s \(3.0\) must be shorter than lease_ms",
        ),
        ({"leader_address": "nohost"}, r"leader_address must be host:port"),
        (
            {"sidecar_socket": "/run/kv-sidecar/gpu{rank}.sock"},
            r"needs kv_connector_extra_config.leader_address",
        ),
    ],
)
def test_config_errors_name_the_key(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConnectorConfigError, match=message):
        ConnectorConfig.from_extra_config(extra)


def test_a_socket_per_rank_fills_in_the_rank_and_the_scheduler_takes_rank_0s() -> None:
    cfg = ConnectorConfig.from_extra_config(
        {"sidecar_socket": "/run/kv-sidecar/gpu{rank}.sock", "leader_address": "127.0.0.1:50061"}
    )
    assert [cfg.socket_for(r) for r in (0, 3)] == ["/run/kv-sidecar/gpu0.sock", "/run/kv-sidecar/gpu3.sock"]
    one = ConnectorConfig.from_extra_config({"sidecar_socket": "/run/kv-sidecar/engine.sock"})
    assert one.socket_for(5) == "/run/kv-sidecar/engine.sock"  # one sidecar for every rank


# -- vLLM version gate -----------------------------------------------------------------------
@pytest.mark.parametrize("version", ["0.32.0", "0.32.7", "0.32.1rc1.dev3+gabc"])
def test_supported_vllm_versions(version: str) -> None:
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0", "dev"])
def test_unsupported_vllm_versions_name_the_range(version: str) -> None:
    with pytest.raises(UnsupportedVllmVersion, match=rf"supports vLLM >=0.32,<0.33; this is vLLM {version}"):
        check_vllm_version(version)


def test_connector_package_imports_without_vllm() -> None:
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import kv_sidecar_client.vllm as v\n"
        "from kv_sidecar_client.vllm import config, kv_layout, scheduler, worker\n"
        "try:\n    v.KVSidecarConnector\nexcept ImportError:\n    pass\nelse:\n    raise SystemExit('imported')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


# -- transfer params on a decode request -------------------------------------------------------
def test_remote_params_roundtrip_and_refusals() -> None:
    good = {
        "engine_id": "p",
        "sidecar_address": "h:1",
        "request_id": "r",
        "block_ids": [3, 4],
        "num_tokens": 40,
    }
    assert remote_params({"do_remote_decode": True}) is None
    assert remote_params(None) is None
    p = remote_params({"do_remote_prefill": True, "kv_sidecar": good})
    assert p is not None and list(p.block_ids) == [3, 4] and p.num_tokens == 40
    # A field a newer prefill sidecar adds is left out, not refused: a decode side upgraded later pulls.
    newer = remote_params({"do_remote_prefill": True, "kv_sidecar": good | {"a_field_from_later": 7}})
    assert newer == p
    for bad in (
        {},
        {"kv_sidecar": "{not json"},
        {"kv_sidecar": {"engine_id": "p"}},
        {"kv_sidecar": {"x": 1}},
    ):
        with pytest.raises(BadParams):
            remote_params({"do_remote_prefill": True, **bad})


# -- layout mapping on hand-made vLLM-style views ----------------------------------------------
def _info(**over: Any) -> VllmKVInfo:
    base: dict[str, Any] = dict(
        backend="TEST",
        layout="LBHNC",
        block_size=16,
        num_kv_heads=4,
        head_size=8,
        head_size_v=8,
        tp_size=2,
        use_mla=False,
    )
    return VllmKVInfo(**(base | over))


def _layer_compact_hnc(num_layers: int = 3, blocks: int = 5) -> tuple[torch.Tensor, list[torch.Tensor]]:
    # vLLM LBHNC: [L, B, H, N, C] contiguous; per layer [B, H, N, C]; 2 heads per rank of 4 over TP 2.
    raw = torch.arange(num_layers * blocks * 2 * 16 * 16, dtype=torch.int16).view(torch.bfloat16)
    full = raw.view(num_layers, blocks, 2, 16, 16)
    return raw, [full[i] for i in range(num_layers)]


def test_head_major_layer_compact_is_packed() -> None:
    _, layers = _layer_compact_hnc()
    desc = describe(layers, _info())
    assert desc.spec == {
        "tp_size": 2,
        "num_layers": 3,
        "num_kv_heads": 4,
        "head_dim": 8,
        "dtype": "bfloat16",
        "block_size": 16,
        "num_blocks": 5,
        "layout": "packed",
        "kernel_block_size": None,
        "cross_layer": False,
    }
    assert [r.data_ptr() for r in desc.regions] == [t.data_ptr() for t in layers]
    # The sidecar's own view reads the same values as vLLM's: layer 1, block 2, head 1, token 7, V element 3.
    canon = rank_view(EngineSpec.from_dict(desc.spec), 0, desc.regions).layers[0]  # [L, K, N, B, H, D]
    assert canon[1, 1, 2, 7, 1, 3] == layers[1][2, 1, 7, 8 + 3].view(torch.int16)


def test_block_outermost_layers_are_one_cross_layer_region() -> None:
    raw = torch.zeros(5 * 3 * 2 * 16 * 16, dtype=torch.bfloat16)
    full = raw.view(5, 3, 2, 16, 16)  # vLLM BLHNC: [B, L, H, N, C]
    desc = describe([full[:, i] for i in range(3)], _info(layout="BLHNC"))
    assert desc.spec["cross_layer"] and desc.spec["layout"] == "packed"
    assert len(desc.regions) == 1 and tuple(desc.regions[0].shape) == (5, 3, 2, 16, 16)


def test_kernel_blocks_are_reported_as_kernel_block_size() -> None:
    raw = torch.zeros(3 * 10 * 2 * 8 * 16, dtype=torch.bfloat16)
    full = raw.view(3, 10, 2, 8, 16)  # 5 blocks of 16 tokens as 10 kernel blocks of 8
    desc = describe([full[i] for i in range(3)], _info())
    assert desc.spec["num_blocks"] == 5 and desc.spec["kernel_block_size"] == 8


@pytest.mark.parametrize(
    ("make", "info", "message"),
    [
        (
            lambda raw: [raw.view(2, 2, 5, 16, 16)[i].transpose(0, 1) for i in range(2)],
            {},
            "not one dense",
        ),
        (lambda raw: [raw.view(2, 5, 2, 16, 16)[i][..., :12] for i in range(2)], {}, "content"),
        (
            lambda raw: [raw.view(2, 5, 2, 16, 16)[i] for i in range(2)],
            {"head_size_v": 4},
            "K and V heads differ",
        ),
        (
            lambda raw: [raw.view(2, 5, 2, 16, 16)[i] for i in range(2)],
            {"tp_size": 1},
            "2 head slots per rank",
        ),
        (lambda raw: [raw.view(2, 5, 2, 16, 16)], {}, "4-D"),
    ],
    ids=["heads-outermost", "scales-in-page", "diff-kv", "wrong-heads", "not-4d"],
)
def test_unsupported_caches_are_refused_with_backend_layout_and_shape(
    make: Any, info: dict[str, Any], message: str
) -> None:
    raw = torch.zeros(2 * 5 * 2 * 16 * 16, dtype=torch.bfloat16)
    with pytest.raises(
        UnsupportedKVCache,
        match=rf"backend TEST \(vLLM KV cache layout LBHNC\): layer 0: tensor shape .*{message}",
    ):
        describe(make(raw), _info(**info))


# -- the page order the kernels really write (describe with writers) ------------------------------
# Writers stand in for vLLM's `do_kv_cache_update`: key/value [tokens, heads, D], the cache a layer's
# logical [kernel blocks, heads, tokens, K|V] view, slot = kernel block * tokens per kernel block + offset.
_NAMES = ["model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn"]


def _cpu_kernel_writer(
    key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor
) -> None:
    # What vLLM's CPU backend does: each head's page is [2B, D], K rows then V rows, and its
    # kernel keeps the K half transposed ([D, B]) while V stays [B, D].
    n, h, b, c = cache.shape
    k_half, v_half = cache.view(n, h, 2 * b, c // 2).chunk(2, dim=2)
    for t, slot in enumerate(slots.tolist()):
        block, off = divmod(slot, b)
        k_half[block].view(h, c // 2, b)[:, :, off] = key[t]
        v_half[block, :, off] = value[t]


def _view_writer(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    # A kernel that means what the view says: K|V in the last dim of each (block, head, token).
    b = cache.shape[2]
    for t, slot in enumerate(slots.tolist()):
        cache[slot // b, :, slot % b] = torch.cat([key[t], value[t]], dim=-1)


def _token_major_bytes_writer(
    key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor
) -> None:
    # Whatever the (contiguous) view claims, each page is stored [tokens, heads, K|V].
    n, h, b, c = cache.shape
    pages = cache.view(n, b, h, c)
    for t, slot in enumerate(slots.tolist()):
        pages[slot // b, slot % b] = torch.cat([key[t], value[t]], dim=-1)


def _layer_compact_nhc(num_layers: int = 3, blocks: int = 5) -> list[torch.Tensor]:
    # vLLM LBNHC: [L, B, N, H, C] contiguous, each layer's view permuted to [B, H, N, C].
    full = torch.zeros(num_layers, blocks, 16, 2, 16, dtype=torch.bfloat16)
    return [full[i].transpose(1, 2) for i in range(num_layers)]


def _hnc_views(kind: str) -> tuple[list[torch.Tensor], VllmKVInfo]:
    """Head-major views (3 layers, 2 heads/rank, D 8) with kernel blocks as vLLM splits or groups them."""
    if kind == "whole-blocks":
        return _layer_compact_hnc()[1], _info()
    if kind == "kernel-blocks":  # 5 blocks of 16 tokens as 10 kernel blocks of 8
        full = torch.zeros(3, 10, 2, 8, 16, dtype=torch.bfloat16)
        return [full[i] for i in range(3)], _info()
    full = torch.zeros(5, 3, 2, 16, 16, dtype=torch.bfloat16)  # cross-layer BLHNC: [B, L, H, N, C]
    return [full[:, i] for i in range(3)], _info(layout="BLHNC")


@pytest.mark.parametrize("kind", ["whole-blocks", "kernel-blocks", "cross-layer"])
def test_cpu_kernel_pages_are_vllm_cpu_and_the_sidecar_reads_what_it_wrote(kind: str) -> None:
    """The layout comes from the writer, not the view, and the sidecar's view of the registered
    regions then reads back bit for bit what that writer put in the real layer tensors."""
    layers, info = _hnc_views(kind)
    desc = describe(layers, info, _NAMES, [_cpu_kernel_writer] * 3)
    assert desc.spec["layout"] == "vllm_cpu"
    assert desc.spec["cross_layer"] == (kind == "cross-layer")
    kblocks, heads, tokens, content = layers[0].shape
    g = torch.Generator().manual_seed(1)
    slots = torch.randperm(kblocks * tokens, generator=g)[:12]  # scattered over blocks and offsets
    written = []
    for layer in layers:  # different data per layer: a layer mix-up must show
        kv = torch.randn(2, len(slots), heads, content // 2, generator=g).to(torch.bfloat16)
        _cpu_kernel_writer(kv[0], kv[1], layer, slots)
        written.append(kv)
    view = rank_view(EngineSpec.from_dict(desc.spec), 0, desc.regions)
    assert view.split_planes
    for i, kv in enumerate(written):
        for plane in (0, 1):
            part = view.part(i, plane)  # [1, 1, N, B, H, D] as int16
            assert part.dtype == torch.int16
            got = part[0, 0, slots // tokens, slots % tokens]  # [tokens, H, D]
            assert torch.equal(got, kv[plane].view(torch.int16)), (i, plane)


def test_kv_per_token_writers_give_the_packed_layouts() -> None:
    """A kernel that stores K|V per token, as the view says, keeps the view's own order."""
    _, hnc = _layer_compact_hnc()
    assert describe(hnc, _info(), _NAMES, [_view_writer] * 3).spec["layout"] == "packed"
    nhc = _layer_compact_nhc()
    assert describe(nhc, _info(layout="LBNHC"), _NAMES, [_view_writer] * 3).spec["layout"] == "packed_nhd"
    # What counts is the bytes: a kernel that puts a head-major view's pages token-major is packed_nhd.
    assert describe(hnc, _info(), _NAMES, [_token_major_bytes_writer] * 3).spec["layout"] == "packed_nhd"


def _swaps_k_and_v(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    _cpu_kernel_writer(value, key, cache, slots)


def _drops_v(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    _cpu_kernel_writer(key, torch.zeros_like(value), cache, slots)


def _raises(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    raise RuntimeError("no ISA for this block size")


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (_swaps_k_and_v, "none of the sidecar's page orders"),
        (_drops_v, "leaves part of a page unwritten"),
        (_raises, "failed: RuntimeError: no ISA for this block size"),
        (_view_writer, "its kernel writes packed pages, model.layers.0.attn's kernel vllm_cpu"),
    ],
    ids=["k-v-swapped", "v-dropped", "raises", "disagrees"],
)
def test_a_kernel_no_layout_explains_is_refused_naming_its_layer(bad: Any, message: str) -> None:
    """Only layer 1's kernel misbehaves: the refusal must name it, not layer 0."""
    _, layers = _layer_compact_hnc()
    with pytest.raises(
        UnsupportedKVCache,
        match=rf"backend TEST \(vLLM KV cache layout LBHNC\): model\.layers\.1\.attn: .*{message}",
    ):
        describe(layers, _info(), _NAMES, [_cpu_kernel_writer, bad, _cpu_kernel_writer])


# -- which tensors are registered: overlap, KV sharing, coverage ------------------------------------
def test_layers_over_the_same_bytes_are_refused() -> None:
    """Two layers registered over one layer's bytes would move one layer's data as the other's."""
    raw, layers = _layer_compact_hnc()
    with pytest.raises(
        UnsupportedKVCache, match=r"model\.layers\.0\.attn: .*overlap model\.layers\.1\.attn's"
    ):
        describe([layers[0], layers[0].view(layers[0].shape)], _info(), _NAMES[:2])
    # Partly overlapping: layer 1 starts two blocks into layer 0.
    page = 2 * 16 * 16
    shifted = torch.as_strided(raw, layers[0].shape, layers[0].stride(), 2 * page)
    with pytest.raises(UnsupportedKVCache, match="overlap"):
        describe([layers[0], shifted, layers[2]], _info(), _NAMES)


def _index(name: str) -> int:
    return int(name.split(".")[2])


def test_transferred_layers_drops_declared_sharers_in_model_order() -> None:
    _, (t0, t1, t2) = _layer_compact_hnc()
    names = [f"model.layers.{i}.attn" for i in (0, 2, 10, 11)]
    # Layer 11 reads layer 2's cache: the same bytes, as another tensor object (vLLM re-views it).
    caches = {names[3]: t2.view(t2.shape), names[2]: t1, names[0]: t0, names[1]: t2}
    got = transferred_layers(caches, {names[3]: names[1]}, names, _index)
    assert got == names[:3]  # by layer index (10 after 2), without the sharer


@pytest.mark.parametrize(
    ("caches", "sharing", "message"),
    [
        (
            lambda t: {"model.layers.0.attn": t[0], "model.layers.1.attn": t[1]},
            {"model.layers.1.attn": "model.layers.0.attn"},
            r"model\.layers\.1\.attn is declared to share model\.layers\.0\.attn's KV cache, but its tensor is not",
        ),
        (
            lambda t: {"model.layers.0.attn": t[0], "model.layers.1.attn": t[0][1:]},
            {"model.layers.1.attn": "model.layers.0.attn"},
            r"model\.layers\.1\.attn is declared to share .* its tensor is not",
        ),
        (
            lambda t: {"model.layers.0.attn": t[0], "model.layers.1.attn": t[0]},
            {"model.layers.1.attn": "model.layers.7.attn"},
            r"model\.layers\.1\.attn is declared to share model\.layers\.7\.attn's",
        ),
    ],
    ids=["other-tensor", "offset-view", "absent-target"],
)
def test_transferred_layers_refuses_a_sharer_that_is_not_its_target(
    caches: Any, sharing: dict[str, str], message: str
) -> None:
    _, layers = _layer_compact_hnc()
    kv = caches(layers)
    with pytest.raises(UnsupportedKVCache, match=message):
        transferred_layers(kv, sharing, list(kv), _index)


def test_transferred_layers_refuses_a_group_layer_without_a_cache() -> None:
    _, layers = _layer_compact_hnc()
    caches = {"model.layers.0.attn": layers[0]}
    with pytest.raises(UnsupportedKVCache, match=r"name layers \['model\.layers\.1\.attn'\] but gave"):
        transferred_layers(caches, {}, ["model.layers.0.attn", "model.layers.1.attn"], _index)


def test_check_covers_allocation_wants_exactly_the_allocated_bytes() -> None:
    raw, layers = _layer_compact_hnc()
    desc = describe(layers, _info())
    allocated = raw.numel() * raw.element_size()
    check_covers_allocation(desc, [allocated])
    check_covers_allocation(desc, [allocated // 3] * 3)  # one tensor per layer: the sum counts
    for wrong in ([allocated + 2], [allocated - 2], [allocated, 4096]):
        with pytest.raises(
            UnsupportedKVCache, match=rf"vLLM allocated {sum(wrong)} bytes .* accounts for {allocated}"
        ):
            check_covers_allocation(desc, wrong)


# -- shared memory for CPU engines -----------------------------------------------------------------
def test_shm_pool_puts_cpu_allocations_in_shared_memory_and_locates_views() -> None:
    pool = ShmKVPool("engine/with:odd chars")
    try:
        with pool.allocation():
            raw = torch.zeros(1 << 16, dtype=torch.int8)
            other = torch.ones(4)  # not a zeros/empty call: stays private
        view = raw.view(torch.bfloat16)[1024:2048]
        name, offset = pool.locate(view)
        assert offset == 2048 and os.path.exists(f"/dev/shm/{name}")
        assert "/" not in name and ":" not in name and " " not in name
        with open(f"/dev/shm/{name}", "r+b") as f:  # the same pages: a write through the file shows up
            f.seek(2048)
            f.write(b"\x07")
        assert int(raw[2048]) == 7
        with pytest.raises(ValueError, match="not in the shared memory this connector allocated"):
            pool.locate(other)
    finally:
        pool.close()
    assert not os.path.exists(f"/dev/shm/{name}")


def test_shm_pool_removes_objects_left_by_dead_processes_of_the_same_rank() -> None:
    import subprocess as sp

    dead = sp.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    orphan = f"/dev/shm/kvsidecar-vllm-orphan_test-r0-{pid}-0"
    live = f"/dev/shm/kvsidecar-vllm-orphan_test-r0-{os.getppid()}-0"  # a process that runs
    other = f"/dev/shm/kvsidecar-vllm-other_rank-r0-{pid}-0"
    for path in (orphan, live, other):
        open(path, "wb").close()
    pool = ShmKVPool("orphan_test-r0")
    try:
        assert not os.path.exists(orphan)
        assert os.path.exists(live) and os.path.exists(other)
    finally:
        pool.close()
        for path in (live, other):
            os.unlink(path)


# -- sliding-window requests (window.py) -------------------------------------------------------------
@settings(max_examples=500, deadline=None)
@given(
    num_prompt=st.integers(1, 5000),
    window=st.integers(2, 600),
    grid=st.sampled_from([(16, 16, 16), (16, 32, 32), (32, 16, 32), (32, 64, 64), (64, 32, 128), (5, 3, 15)]),
)
def test_a_windowed_prefill_stops_where_both_grids_keep_the_same_window(
    num_prompt: int, window: int, grid: tuple[int, int, int]
) -> None:
    """What vLLM keeps after the prefill's tokens, on the prefill's grid and the decode's, starts at the
    same token, which lies inside the window of the first token the decode engine computes; the decode
    engine computes between 1 and `alignment` tokens, and the pull moves a window's tokens at most."""
    bp, bd, alignment = grid
    n = prefill_tokens(num_prompt, window, alignment)
    if num_prompt == 1:
        assert n == 1
        return
    assert 1 <= num_prompt - n <= max(1, alignment)
    kept = first_kept_token(n, window, bp)
    assert kept == first_kept_token(n, window, bd) == skipped_tokens(n, window)
    assert kept % alignment == 0
    # Token n (the decode's first) attends tokens [n - window + 1, n]: all held, from `kept` on.
    assert kept <= max(0, n - window + 1)
    assert n - kept <= window - 1 or kept == 0


def test_prefill_tokens_examples() -> None:
    assert prefill_tokens(20, 64, 32) == 19  # no token left the window: only the last is the decode's
    assert prefill_tokens(65, 64, 32) == 63
    assert prefill_tokens(1000, 64, 64) == 959  # kept from token 896 = 14 x 64
    assert first_kept_token(959, 64, 32) == 896
    # A prefill of a whole prompt of 95 would keep tokens from 32 on, but the decode engine recomputes
    # token 94, which attends from token 31: the prefill stops at 63 tokens and keeps them all.
    assert first_kept_token(95, 64, 32) == 32
    assert prefill_tokens(95, 64, 32) == 63 and first_kept_token(63, 64, 32) == 0


def test_leading_nulls() -> None:
    assert leading_nulls([0, 0, 0, 7, 8]) == 3
    assert leading_nulls([7, 0]) == 0
    assert leading_nulls([]) == 0


def test_window_alignment_is_a_known_key() -> None:
    assert ConnectorConfig.from_extra_config({"window_alignment": 128}).window_alignment == 128
    with pytest.raises(ConnectorConfigError, match="window_alignment must be >= 0"):
        ConnectorConfig.from_extra_config({"window_alignment": -1})
    # Not a multiple of the engine's block size: the engine does not start (before any sidecar call).
    with pytest.raises(
        ConnectorConfigError, match=r"window_alignment \(48\) must be a multiple of .* \(32\)"
    ):
        SidecarScheduler(ConnectorConfig(window_alignment=48), "e", 32, window=64)


# -- hybrid models (groups.py) ---------------------------------------------------------------
def test_region_layers_are_each_positions_layers_of_every_group() -> None:
    from kv_sidecar_client.vllm.groups import region_layers

    assert region_layers([["a0", "a3"], ["a1", "a4"], ["a2", "a5"]]) == [
        ["a0", "a1", "a2"],
        ["a3", "a4", "a5"],
    ]
    # vLLM pads the last group of a kind: its missing layer leaves the position to the others.
    assert region_layers([["f0", "f1"], ["s0"]]) == [["f0", "s0"], ["f1"]]


def test_hybrid_groups_share_one_window_or_are_refused() -> None:
    from kv_sidecar_client.vllm.groups import KVGroup, common_window

    assert common_window([KVGroup(("a",), 64), KVGroup(("b",), None), KVGroup(("c",), 64)]) == 64
    assert common_window([KVGroup(("a",), None)]) is None
    with pytest.raises(ValueError, match=r"share one window; this one has windows \[64, 128\]"):
        common_window([KVGroup(("a",), 64), KVGroup(("b",), 128)])


def test_groups_mismatch_names_the_layer() -> None:
    from kv_sidecar_client.vllm.groups import KVGroup, mismatch

    mine = [KVGroup(("l0", "l3"), 64), KVGroup(("l2", "l5"), None)]
    assert mismatch(mine, mine) is None
    assert "position 1: the prefill engine has layer l4 there, this engine l3" in (
        mismatch([KVGroup(("l0", "l4"), 64), mine[1]], mine) or ""
    )
    assert "layer l2 (KV cache group 1) is sliding window 64 on the prefill engine and full attention" in (
        mismatch([mine[0], KVGroup(("l2", "l5"), 64)], mine) or ""
    )
    assert "has 1 KV cache group(s) (?) and this engine 2 (l0 l3 | l2 l5)" in (
        mismatch([KVGroup((), None)], mine) or ""
    )
    roundtrip = [KVGroup.from_json(g.to_json()) for g in mine]
    assert roundtrip == mine


# -- Mamba/SSM groups (mamba_state.py) -----------------------------------------------------------
GRANITE_STATE = (((3, 544), (8, 64, 16)), ("float32", "float32"))  # the test model's MambaSpec, one rank


def test_mamba_state_arrays_are_vllms_page_order() -> None:
    from kv_sidecar_client.vllm.groups import StateArray
    from kv_sidecar_client.vllm.mamba_state import UnsupportedMambaState, state_arrays, state_bytes

    arrays = state_arrays("model.layers.0.mixer", *GRANITE_STATE)
    assert arrays == (
        StateArray("conv", (3, 544), "float32", 0),
        StateArray("ssm", (8, 64, 16), "float32", 3 * 544 * 4),
    )
    assert state_bytes(arrays) == 39296  # what vLLM's int8 page view of the layer spans
    assert [a.name for a in state_arrays("m", [(1,), (2,), (3,)], ["float16"] * 3)] == [
        "state0",
        "state1",
        "state2",
    ]
    with pytest.raises(UnsupportedMambaState, match=r"Mamba layer m keeps its ssm state as complex64"):
        state_arrays("m", [(1,), (2,)], ["float32", "complex64"])


def test_mamba_settings_that_move_the_state_are_refused_naming_the_setting() -> None:
    from kv_sidecar_client.vllm.mamba_state import UnsupportedMambaState, check_settings

    check_settings("m0", "none", 0, 131072, 131072)
    with pytest.raises(
        UnsupportedMambaState, match=r"m0 has mamba_cache_mode 'align'.*--no-enable-prefix-caching"
    ):
        check_settings("m0", "align", 0, 131072, 131072)
    with pytest.raises(UnsupportedMambaState, match=r"m0 has 2 speculative state block"):
        check_settings("m0", "none", 2, 131072, 131072)
    with pytest.raises(
        UnsupportedMambaState, match=r"Mamba page of m0 is 65536 bytes, the attention block .* 131072"
    ):
        check_settings("m0", "none", 0, 65536, 131072)


def test_a_request_has_one_state_block_and_the_prefill_stops_one_token_short() -> None:
    from kv_sidecar_client.vllm.mamba_state import UnsupportedMambaState, prefill_tokens, state_block

    assert state_block("r", "m0", [7], 0) == 7
    for blocks in ([], [0], [3, 4]):
        with pytest.raises(
            UnsupportedMambaState, match=r"request r: its Mamba group \(layer m0\) holds blocks"
        ):
            state_block("r", "m0", blocks, 0)
    assert [prefill_tokens(n) for n in (1, 2, 128, 129)] == [None, 1, 127, 128]


def test_mamba2_sharding_is_vllms_and_described_state_corresponds_across_tp_sizes() -> None:
    """The test model (8 heads of 64, state 16, one group, conv kernel 4) at TP 1, 2 and 4: x split, the
    one group's B and C split at TP 1 and whole on every rank above (vLLM's extra groups); SSM by heads.
    Arrays that do not fit Mamba-2's formula stay undescribed; described arrays of one model correspond
    at any TP size, other head splits do not."""
    from kv_sidecar_client.vllm.groups import KVGroup, mismatch
    from kv_sidecar_client.vllm.mamba_state import mamba2_sharding, state_arrays

    model = ((3, 544), (8, 64, 16))

    def at(tp: int, conv_dim_first: bool = False) -> tuple[Any, ...]:
        channels = 512 // tp + 32  # x's share, then B and C (one group: whole at any TP size)
        shape = (channels, 3) if conv_dim_first else (3, channels)
        arrays = state_arrays("m0", (shape, (8 // tp, 64, 16)), ("float32", "float32"))
        m = ((544, 3), model[1]) if conv_dim_first else model
        return mamba2_sharding(arrays, m, tp, conv_dim_first)

    one, two, four = at(1), at(2), at(4)
    assert (one[0].tp_dim, one[0].segments) == (1, ((512, False), (16, False), (16, False)))
    assert (two[0].tp_dim, two[0].segments) == (1, ((512, False), (16, True), (16, True)))
    assert four[0].shape == (3, 160) and four[0].segments[1] == (16, True)
    assert (two[1].tp_dim, two[1].segments) == (0, ((8, False),))
    assert (at(2, True)[0].tp_dim, at(2, True)[0].shape) == (0, (288, 3))  # VLLM_SSM_CONV_STATE_LAYOUT=DS
    # Two groups at TP 2: one per rank, split (vLLM's MergedColumnParallelLinear, no extra groups).
    g2 = mamba2_sharding(
        state_arrays("m0", ((3, 256 + 32), (4, 64, 16)), ("float32", "float32")),
        ((3, 512 + 64), (8, 64, 16)),
        2,
        False,
    )
    assert g2[0].segments == ((512, False), (32, False), (32, False))
    # Shapes that are not Mamba-2's at that TP size, or no TP 1 shapes: undescribed.
    plain = state_arrays("m0", ((3, 300), (4, 64, 16)), ("float32", "float32"))
    assert mamba2_sharding(plain, model, 2, False) == plain
    bare = state_arrays("m0", ((3, 288), (4, 64, 16)), ("float32", "float32"))
    assert mamba2_sharding(bare, None, 2, False) == bare
    # In transfer params, and compared by the decode side.
    attention = KVGroup(("a1", "a3"), None)
    groups = {
        tp: [KVGroup(("m0", "m2"), None, arrays), attention] for tp, arrays in ((1, one), (2, two), (4, four))
    }
    assert KVGroup.from_json(groups[2][0].to_json()) == groups[2][0]
    assert all(mismatch(groups[a], groups[b]) is None for a in groups for b in groups)
    heads = mamba2_sharding(
        state_arrays("m0", ((3, 288), (8, 32, 16)), ("float32", "float32")),
        ((3, 544), (16, 32, 16)),
        2,
        False,
    )
    assert heads[1].segments == ((16, False),)
    assert "ssm (8, 32, 16) float32 at byte 3456) on this engine" in (
        mismatch(groups[2], [KVGroup(("m0", "m2"), None, heads), attention]) or ""
    )
    undescribed = state_arrays("m0", ((3, 288), (4, 64, 16)), ("float32", "float32"))
    assert mismatch(groups[1], [KVGroup(("m0", "m2"), None, undescribed), attention])


def test_state_groups_in_transfer_params_and_their_mismatches() -> None:
    from kv_sidecar_client import params_to_json
    from kv_sidecar_client.client import TransferParams
    from kv_sidecar_client.vllm.groups import KVGroup, mismatch, token_group
    from kv_sidecar_client.vllm.mamba_state import state_arrays
    from kv_sidecar_client.vllm.scheduler import group_params

    mamba = KVGroup(("m0", "m2"), None, state_arrays("m0", *GRANITE_STATE))
    attention = KVGroup(("a1", "a3"), None)
    mine = [mamba, attention]
    assert [KVGroup.from_json(g.to_json()) for g in mine] == mine and "state" not in attention.to_json()
    assert token_group(mine) == 1 and token_group([attention]) == 0
    assert mismatch(mine, mine) is None
    tp2 = KVGroup(("m0", "m2"), None, state_arrays("m0", ((3, 288), (4, 64, 16)), ("float32", "float32")))
    assert (
        "layer m0 (KV cache group 0) is Mamba state (conv (3, 544) float32 at byte 0, ssm (8, 64, 16) float32 at "
        "byte 6528) on the prefill engine and Mamba state (conv (3, 288)"
    ) in (mismatch(mine, [tp2, attention]) or "")
    assert "is full attention on the prefill engine and Mamba state" in (
        mismatch([KVGroup(("m0", "m2"), None), attention], mine) or ""
    )

    def entry(group: KVGroup, tokens: int, blocks: list[int]) -> dict[str, Any]:
        p = TransferParams(
            engine_id="e",
            sidecar_address="h:1",
            sidecar_id="s",
            request_id=f"r#{len(blocks)}",
            block_ids=blocks,
            num_tokens=tokens,
        )
        return {"params": json.loads(params_to_json(p)), **group.to_json()}

    # The state group's record counts one block's tokens; only the attention groups must agree.
    ok = {"kv_sidecar_groups": [entry(mamba, 128, [5]), entry(attention, 299, [1, 2, 3])]}
    assert [(g.state != (), p.num_tokens) for g, p in group_params(ok) or []] == [(True, 128), (False, 299)]
    two = {"kv_sidecar_groups": [entry(mamba, 128, [5, 6]), entry(attention, 299, [1, 2, 3])]}
    with pytest.raises(BadParams, match="a Mamba group of other than one state block"):
        group_params(two)


@settings(max_examples=100, deadline=None)
@given(
    arrays=st.lists(
        st.tuples(
            st.lists(st.integers(1, 40), min_size=1, max_size=4), st.sampled_from(["float32", "bfloat16"])
        ),
        min_size=1,
        max_size=4,
    ),
    block_size=st.sampled_from([16, 64, 128]),
)
def test_the_connectors_state_description_is_accepted_by_the_sidecar_iff_it_fits_a_block(
    arrays: list[tuple[list[int], str]], block_size: int
) -> None:
    """What the connector registers for a Mamba group (mamba_state.state_arrays) is a valid sidecar spec
    exactly when the state fits one block of its layer position; otherwise the sidecar refuses it."""
    from kv_sidecar.plan.spec import PlanError
    from kv_sidecar_client.vllm.mamba_state import state_arrays, state_bytes

    state = state_arrays("m0", [s for s, _ in arrays], [d for _, d in arrays])
    block = block_size * 2 * 2 * 64 * 4  # 2 KV heads of 64, float32, K and V
    spec = {
        "tp_size": 1,
        "num_layers": 1,
        "num_kv_heads": 2,
        "head_dim": 64,
        "dtype": "float32",
        "block_size": block_size,
        "num_blocks": 8,
        "layout": "vllm_cpu",
        "groups": [{"layers": ["m0"], "state": [a.to_json() for a in state]}, {"layers": ["a1"]}],
    }
    if state_bytes(state) <= block:
        assert EngineSpec.from_dict(spec).groups[0].state[-1].offset == state[-1].offset
    else:
        with pytest.raises(PlanError, match=r"KV cache group 0 \(layer m0\): state array .* does not fit"):
            EngineSpec.from_dict(spec)
