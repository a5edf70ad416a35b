"""The GPU kernel's index arithmetic, checked on the CPU through Triton's interpreter.

No GPU needed (skipped where triton is not installed): the very kernel the
GPU runs is executed by `triton.runtime.interpreter` over host tensors and
compared, bit for bit, with the CPU executor. Also: the GPU geometry's
strides agree with the host executor's strided views.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import kvcases as kc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_sidecar.execute import gpu_geometry as geo
from kv_sidecar.plan.blocks import dst_block_count
from kv_sidecar.plan.spec import K_TRANSPOSED, Layout, PlanError

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("layout", [layout for layout in Layout if layout not in K_TRANSPOSED])
@pytest.mark.parametrize("cross_layer", [False, True])
def test_strides_match_host_views(layout: Layout, cross_layer: bool) -> None:
    from kv_sidecar.execute import host

    extra = kc.MLA if layout is Layout.MLA else {"layout": layout}
    s = kc.spec(**{**extra, "kernel_block_size": 8, "cross_layer": cross_layer, "num_blocks": 5})
    tensors = [torch.empty(shape, dtype=torch.bfloat16) for shape in s.rank_tensor_shapes()]
    view = host.rank_view(s, 0, tensors)
    st = geo.strides(s)
    lay = geo.layer_addresses(s, [t.data_ptr() for t in tensors])
    es = s.element_size
    for layer in (0, s.num_layers - 1):
        canon = view.layers[0][layer] if view.is_single_view else view.layers[layer][0]
        k, n, b, h, d = canon.stride()
        assert d == 1
        assert (canon.data_ptr() - lay[layer]) == 0
        assert (n, b) == (st.block, st.token)
        if not s.is_mla:
            assert (k, h) == (st.kv, st.head)
    assert lay[1] - lay[0] == (
        st.layer * es if cross_layer else tensors[1].data_ptr() - tensors[0].data_ptr()
    )


def test_a_transposed_k_plane_is_refused_by_the_gpu_data_plane() -> None:
    s = kc.spec(layout=Layout.VLLM_CPU)
    with pytest.raises(PlanError, match="vllm_cpu keeps its K plane transposed"):
        geo.strides(s)


@pytest.mark.parametrize("name", [c.name for c in kc.CASES])
def test_vector_hint_holds_for_every_row_start(name: str) -> None:
    """The kernel promises the compiler every row chunk starts on ALIGN words; the interpreter cannot check it.

    A row starts at layer + kv*s_kv + block*s_n + slot*s_b + head*s_h + chunk*CHUNK words, so
    each term must be a multiple (packed layouts put V rows head_dim elements into a row).
    """
    from kv_sidecar.execute import gpu

    c = kc.case(name)
    views = [gpu.gpu_rank_view(c.src, r.src_rank, kc.random_tensors(c.src, 1), 0) for r in c.reads]
    dview = gpu.gpu_rank_view(c.dst, c.dst_rank, kc.random_tensors(c.dst, 2), 0)
    for sview in views:
        la = gpu.plan_launch(sview, dview, 1, 0, 0, c.num_tokens, c.start_token, 0, 0)
        align = la.constexprs["ALIGN"]
        assert la.constexprs["CHUNK"] % align == 0
        assert all(stride % align == 0 for stride in la.args[6:14]), la.args[6:14]
        assert all(p % (align * la.width) == 0 for p in (*sview.layer_ptrs, *dview.layer_ptrs))


def test_row_chunks() -> None:
    assert geo.chunk_words(64) == 64
    assert geo.chunk_words(288) == 32  # 576-element bf16 MLA latent: 9 chunks of 32 words
    assert geo.chunk_words(24) == 8
    assert geo.chunk_words(7) == 1


@pytest.mark.parametrize("name", [c.name for c in kc.CASES])
@pytest.mark.parametrize("ids", ["lists", "int64-arrays", "src-run", "dst-run", "both-runs"])
def test_kernel_in_interpreter_matches_host_executor(name: str, ids: str) -> None:
    """The server hands the executors int64 arrays (pull.py `_job`); engines and tests, lists. A side
    whose ids are one ascending run (here ending at the last block) reads them from the device's 0..n-1
    table instead of an upload (`_device_ids`)."""
    pytest.importorskip("triton")
    from kv_sidecar.execute import gpu

    c = kc.case(name)
    srcs = {r: kc.random_tensors(c.src, 100 + r) for r in c.src_ranks()}
    before = kc.random_tensors(c.dst, 7)
    runs = {"src-run": "src", "dst-run": "dst", "both-runs": "both"}.get(ids)
    src_ids, dst_ids = kc.run_ids(c, 0, runs) if runs else kc.block_ids(c, 3)
    want, want_bytes = kc.reference(c, srcs, before, src_ids, dst_ids)
    if ids == "int64-arrays":
        src_ids, dst_ids = np.asarray(src_ids, dtype=np.int64), np.asarray(dst_ids, dtype=np.int64)
    out = [t.clone() for t in before]
    dview = gpu.gpu_rank_view(c.dst, c.dst_rank, out, 0)
    written = 0
    for r in c.reads:
        sview = gpu.gpu_rank_view(c.src, r.src_rank, srcs[r.src_rank], 0)
        written += gpu.copy_request(
            sview, dview, r.heads, src_ids, dst_ids, c.num_tokens, c.start_token, interpret=True
        )
    assert written == want_bytes
    for g, w in zip(out, want, strict=True):
        assert kc.bitwise_equal(g, w)


@pytest.mark.parametrize(
    ("src", "dst", "from_table"),
    [
        ([7], [3], (True, True)),
        ([4, 5, 6, 7], np.array([9, 10], dtype=np.int64), (True, True)),
        ([4, 6, 5, 7], [2, 3], (False, True)),  # first and last a run apart, not a run
        ([1, 2], [3, 1], (True, False)),
        ([2, 1], [5, 5], (False, False)),
        ([], [0, 1, 2], (False, True)),
    ],
)
def test_only_ids_out_of_a_row_are_uploaded(
    src: Any, dst: Any, from_table: tuple[bool, bool], fresh_gpu: Any
) -> None:
    gpu = fresh_gpu
    dev = torch.device("cpu")
    got = gpu._device_ids(src, dst, dev, None)
    table = gpu._state.arange(dev, 1)
    for ids, want, from_t in zip(got, (src, dst), from_table, strict=True):
        assert ids.dtype == torch.int32 and ids.tolist() == list(want)
        shares = ids.numel() > 0 and ids.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()
        assert shares == from_t


@given(st.lists(st.integers(0, 40), max_size=8), st.booleans())
def test_a_run_is_found_exactly(ids: list[int], as_run: bool) -> None:
    from kv_sidecar.execute import gpu

    if as_run and ids:
        ids = list(range(ids[0], ids[0] + len(ids)))
    if not ids:  # nothing to upload: a run of none
        assert gpu._run_start(np.asarray(ids, dtype=np.int64)) == 0
        return
    is_run = ids == list(range(ids[0], ids[0] + len(ids)))
    assert gpu._run_start(np.asarray(ids, dtype=np.int64)) == (ids[0] if is_run else None)


@pytest.fixture
def fresh_gpu(monkeypatch: pytest.MonkeyPatch) -> Any:
    """kv_sidecar.execute.gpu with empty template caches: earlier tests' geometries could reach a
    bound, and clear the caches, in the middle of a test that counts templates."""
    pytest.importorskip("triton")
    from kv_sidecar.execute import gpu

    monkeypatch.setattr(gpu, "_state", gpu._DeviceState())
    return gpu


@pytest.mark.parametrize("name", ["homogeneous", "gather_2to1", "block_16_to_32"])
def test_direct_copies_share_templates_and_stay_exact(name: str, fresh_gpu: Any) -> None:
    """Copies between the same two views reuse one launch template per read (heads), whatever their
    ids, token counts and start tokens: each copy fills in its own, and every copy lands bit for bit
    (a count or position leaking from one copy into the next would write the wrong tokens)."""
    import dataclasses

    gpu = fresh_gpu
    c0 = kc.case(name)
    srcs = {r: kc.random_tensors(c0.src, 200 + r) for r in c0.src_ranks()}
    out = kc.random_tensors(c0.dst, 4)
    dview = gpu.gpu_rank_view(c0.dst, c0.dst_rank, out, 0)
    sviews = {r: gpu.gpu_rank_view(c0.src, r, srcs[r], 0) for r in c0.src_ranks()}
    bd = c0.dst.block_size
    # The case as given, a shorter last block, a prefix hit (start past the first block), the case again.
    shapes = [(c0.num_tokens, 0), (c0.num_tokens - 1, 0), (c0.num_tokens, bd), (c0.num_tokens, 0)]
    for seed, (num_tokens, start_token) in enumerate(shapes):
        c = dataclasses.replace(c0, num_tokens=num_tokens, start_token=start_token)
        src_ids, dst_ids = kc.block_ids(c, 60 + seed)
        want, want_bytes = kc.reference(c, srcs, out, src_ids, dst_ids)
        written = 0
        for r in c.reads:
            written += gpu.copy_request(
                sviews[r.src_rank], dview, r.heads, src_ids, dst_ids, num_tokens, start_token, interpret=True
            )
        assert written == want_bytes
        for g, w in zip(out, want, strict=True):
            assert kc.bitwise_equal(g, w)
    assert len(gpu._state._direct) == len(c0.reads)  # one template per (source view, heads), reused


def test_staging_round_trip_in_interpreter() -> None:
    """Gather into a contiguous staging mini-cache (dst layout), scatter out: same as the direct copy."""
    pytest.importorskip("triton")
    from kv_sidecar.execute import gpu

    c = kc.case("nhd_to_hnd")
    src = kc.random_tensors(c.src, 11)
    before = kc.random_tensors(c.dst, 12)
    src_ids, dst_ids = kc.block_ids(c, 5)
    want, _ = kc.reference(c, {0: src}, before, src_ids, dst_ids)
    n = len(dst_ids)
    buf = torch.zeros(gpu.staging_bytes(c.dst, n), dtype=torch.uint8)
    stage = gpu.staging_view(c.dst, c.dst_rank, buf, n, 0)
    sview = gpu.gpu_rank_view(c.src, 0, src, 0)
    out = [t.clone() for t in before]
    dview = gpu.gpu_rank_view(c.dst, c.dst_rank, out, 0)
    ring = list(range(n))
    gpu.copy_request(sview, stage, (0, 4), src_ids, ring, c.num_tokens, interpret=True)
    gpu.copy_request(stage, dview, (0, 4), ring, dst_ids, c.num_tokens, interpret=True)
    for g, w in zip(out, want, strict=True):
        assert kc.bitwise_equal(g, w)


def test_empty_and_prefix_only_requests_launch_nothing() -> None:
    pytest.importorskip("triton")
    from kv_sidecar.execute import gpu

    c = kc.case("homogeneous")
    src = kc.random_tensors(c.src, 1)
    dst = kc.random_tensors(c.dst, 2)
    before = [t.clone() for t in dst]
    sview = gpu.gpu_rank_view(c.src, 0, src, 0)
    dview = gpu.gpu_rank_view(c.dst, 0, dst, 0)
    # Every token already held (start_token == num_tokens): nothing to write.
    assert gpu.copy_request(sview, dview, (0, 4), [0, 1], [], 32, 32, interpret=True) == 0
    for a, b in zip(dst, before, strict=True):
        assert kc.bitwise_equal(a, b)


@pytest.mark.parametrize("name", [c.name for c in kc.CASES])
@pytest.mark.parametrize("blocks_per_chunk", [1, 3])
@pytest.mark.parametrize(
    "ahead",
    ["", "whole"],
    ids=["ids-uploaded-here", "ids-uploaded-ahead"],
)
@pytest.mark.parametrize("runs", [False, True], ids=["random-ids", "ids-in-a-row"])
def test_staged_chunks_in_interpreter_match_host_executor(
    name: str, blocks_per_chunk: int, ahead: str, runs: bool
) -> None:
    """The staged path's copies (validated once, one launch per chunk) through a 2-slot ring:
    gather each chunk in the reader's layout into a slot, scatter it out, reuse the slots. `ahead`:
    the gather's ids come uploaded, as a source's published request's do; `runs`: both sides' ids
    are runs, read from the device's 0..n-1 table."""
    pytest.importorskip("triton")
    from kv_sidecar.dataplane.staged_protocol import plan_chunks
    from kv_sidecar.execute import gpu

    c = kc.case(name)
    srcs = {r: kc.random_tensors(c.src, 100 + r) for r in c.src_ranks()}
    before = kc.random_tensors(c.dst, 7)
    src_ids, dst_ids = kc.run_ids(c, 3, "both") if runs else kc.block_ids(c, 3)
    want, want_bytes = kc.reference(c, srcs, before, src_ids, dst_ids)
    out = [t.clone() for t in before]
    dview = gpu.gpu_rank_view(c.dst, c.dst_rank, out, 0)
    slot_bytes = gpu.staging_bytes(c.dst, blocks_per_chunk)
    ring = torch.zeros(2 * slot_bytes + 64, dtype=torch.uint8)
    base = (ring.data_ptr() + 63) // 64 * 64
    slots = [base, base + slot_bytes]
    chunks = plan_chunks(c.start_token, c.num_tokens, c.dst.block_size, blocks_per_chunk)
    written = 0
    whole = torch.tensor(src_ids, dtype=torch.int32)
    up = whole if ahead else None
    for r in c.reads:
        sview = gpu.gpu_rank_view(c.src, r.src_rank, srcs[r.src_rank], 0)
        gather = gpu.StagedCopies(
            sview,
            c.dst,
            c.dst_rank,
            r.heads,
            src_ids,
            c.num_tokens,
            c.start_token,
            into_staging=True,
            interpret=True,
            uploaded_ids=up,
        )
        if ahead == "whole":
            assert gather._ids is up  # taken as it came, not uploaded again
        assert torch.equal(gather._ids, whole)
        scatter = gpu.StagedCopies(
            dview,
            c.dst,
            c.dst_rank,
            r.heads,
            dst_ids,
            c.num_tokens,
            c.start_token,
            into_staging=False,
            interpret=True,
        )
        for i, (t0, t1) in enumerate(chunks):
            assert gather.chunk_bytes(t0, t1) <= slot_bytes
            moved = gather.launch(t0, t1, slots[i % 2])
            assert scatter.launch(t0, t1, slots[i % 2]) == moved
            written += moved
    assert written == want_bytes
    for g, w in zip(out, want, strict=True):
        assert kc.bitwise_equal(g, w)


def test_staged_copies_refuse_bad_ids_before_any_launch() -> None:
    pytest.importorskip("triton")
    from kv_sidecar.execute import gpu
    from kv_sidecar.plan.spec import PlanError

    c = kc.case("homogeneous")
    view = gpu.gpu_rank_view(c.dst, 0, kc.random_tensors(c.dst, 1), 0)
    n = -(-c.num_tokens // c.dst.block_size)
    with pytest.raises(PlanError, match="out of range"):
        gpu.StagedCopies(
            view, c.dst, 0, (0, 4), [*range(n - 1), 999], c.num_tokens, into_staging=False, interpret=True
        )
    with pytest.raises(PlanError, match="appears twice"):
        gpu.StagedCopies(view, c.dst, 0, (0, 4), [0] * n, c.num_tokens, into_staging=False, interpret=True)
    ahead = torch.arange(n, dtype=torch.int32)
    with pytest.raises(PlanError, match="out of range"):  # ids uploaded ahead skip no check
        gpu.StagedCopies(
            view,
            c.dst,
            0,
            (0, 4),
            [*range(n - 1), 999],
            c.num_tokens,
            into_staging=True,
            interpret=True,
            uploaded_ids=ahead,
        )
    short = ahead[:-1]  # not the request's ids: uploaded anew
    assert (
        gpu.StagedCopies(
            view,
            c.dst,
            0,
            (0, 4),
            list(range(n)),
            c.num_tokens,
            into_staging=True,
            interpret=True,
            uploaded_ids=short,
        )._ids
        is not short
    )
    ok = gpu.StagedCopies(
        view, c.dst, 0, (0, 4), list(range(n)), c.num_tokens, into_staging=False, interpret=True
    )
    with pytest.raises(PlanError, match="block-aligned"):
        ok.launch(8, 32, 0)


@pytest.mark.parametrize("name", ["homogeneous", "block_16_to_32", "split_1to2"])
def test_staged_transfers_share_templates_and_stay_exact(name: str, fresh_gpu: Any) -> None:
    """Consecutive transfers through the same slot reuse one launch template per (slot, blocks),
    also when a later request has other ids and fewer tokens in its last block: each launch fills
    in its own ids, positions and token counts, and every transfer lands bit for bit."""
    import dataclasses

    gpu = fresh_gpu
    c0 = kc.case(name)
    srcs = {r: kc.random_tensors(c0.src, 300 + r) for r in c0.src_ranks()}
    out = kc.random_tensors(c0.dst, 8)
    dview = gpu.gpu_rank_view(c0.dst, c0.dst_rank, out, 0)
    bd = c0.dst.block_size
    n_dst = -(-c0.num_tokens // bd)
    slot = torch.zeros(gpu.staging_bytes(c0.dst, n_dst) + 64, dtype=torch.uint8)
    address = (slot.data_ptr() + 63) // 64 * 64
    # Same block count, fewer tokens in the last block, then a fresh set of ids for the first length.
    lengths = [c0.num_tokens, (n_dst - 1) * bd + 1, c0.num_tokens]
    templates: set[int] = set()
    for seed, num_tokens in enumerate(lengths):
        c = dataclasses.replace(c0, num_tokens=num_tokens)
        src_ids, dst_ids = kc.block_ids(c, 40 + seed)
        want, want_bytes = kc.reference(c, srcs, out, src_ids, dst_ids)
        written = 0
        for r in c.reads:
            sview = gpu.gpu_rank_view(c.src, r.src_rank, srcs[r.src_rank], 0)
            args = (c.dst, c.dst_rank, r.heads)
            gather = gpu.StagedCopies(sview, *args, src_ids, num_tokens, into_staging=True, interpret=True)
            scatter = gpu.StagedCopies(dview, *args, dst_ids, num_tokens, into_staging=False, interpret=True)
            moved = gather.launch(0, num_tokens, address)
            assert scatter.launch(0, num_tokens, address) == moved
            written += moved
            templates |= {id(copies._templates[(address, n_dst)]) for copies in (gather, scatter)}
        assert written == want_bytes
        for g, w in zip(out, want, strict=True):
            assert kc.bitwise_equal(g, w)
    assert len(templates) == 2 * len(c0.reads)  # one gather and one scatter template per read, reused


def test_staged_templates_stay_bounded(fresh_gpu: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the bound a geometry's templates are dropped and computed again; copies stay exact."""
    gpu = fresh_gpu
    monkeypatch.setattr(gpu, "_MAX_TEMPLATES", 2)
    c = kc.case("homogeneous")
    (read,) = c.reads
    src = kc.random_tensors(c.src, 5)
    out = kc.random_tensors(c.dst, 6)
    sview = gpu.gpu_rank_view(c.src, 0, src, 0)
    dview = gpu.gpu_rank_view(c.dst, 0, out, 0)
    src_ids, dst_ids = kc.block_ids(c, 9)
    want, _ = kc.reference(c, {0: src}, out, src_ids, dst_ids)
    n_dst = -(-c.num_tokens // c.dst.block_size)
    slot_bytes = gpu.staging_bytes(c.dst, n_dst)
    ring = torch.zeros(4 * slot_bytes + 64, dtype=torch.uint8)
    base = (ring.data_ptr() + 63) // 64 * 64
    for i in range(4):  # four slots: four templates per side, two kept at most
        address = base + i * slot_bytes
        args = (c.dst, 0, read.heads)
        gather = gpu.StagedCopies(sview, *args, src_ids, c.num_tokens, into_staging=True, interpret=True)
        scatter = gpu.StagedCopies(dview, *args, dst_ids, c.num_tokens, into_staging=False, interpret=True)
        gather.launch(0, c.num_tokens, address)
        scatter.launch(0, c.num_tokens, address)
        assert len(gather._templates) <= 2 and len(scatter._templates) <= 2
    for g, w in zip(out, want, strict=True):
        assert kc.bitwise_equal(g, w)


def test_specialization_key_changes_where_triton_specialises() -> None:
    """gpu_kernels.launch keeps one compiled kernel per key: the key must differ wherever Triton would
    compile another kernel (an int leaving 32 bits; a pointer's dtype, or a table's 16-byte alignment;
    a constexpr; num_warps) and only there: not for an int's value (being 1, divisible by 16), which
    the kernel tells Triton not to specialise on, nor for the id lists' alignment where Triton can be
    told."""
    pytest.importorskip("triton")
    from kv_sidecar.execute import gpu_kernels
    from kv_sidecar.execute.gpu_kernels import _CONSTEXPRS, specialization_key

    words = torch.zeros(64, dtype=torch.int64)
    ids = torch.zeros(64, dtype=torch.int32)
    ptrs = (words, words, words, ids, ids)
    consts = dict.fromkeys(_CONSTEXPRS, 2)

    def key(ints: tuple[int, ...], pointers: tuple[Any, ...] = ptrs, num_warps: int = 4, **c: int) -> Any:
        return specialization_key(pointers, ints, {**consts, **c}, num_warps)

    base = key((32, 5, 2**20))
    for same in ((48, 7, 2**21), (1, 5, 2**20), (33, 5, 2**20), (32, 16, 2**20), (0, 1, 1)):
        assert key(same) == base, same
    for other in ((2**40, 5, 2**20), (32, 5, 2**40), (32, 5, 2**63), (32, -(2**40), 2**20)):
        assert key(other) != base, other
    assert key((32, 5, 2**20), pointers=(words, words[1:], words, ids, ids)) != base  # 8-byte aligned
    ids_at_4 = key((32, 5, 2**20), pointers=(words, words, words, ids, ids[1:]))
    assert (ids_at_4 == base) == gpu_kernels._IDS_ANY_ALIGNMENT
    assert key((32, 5, 2**20), pointers=(words.view(torch.int32), words, words, ids, ids)) != base
    assert key((32, 5, 2**20), ROWS=4) != base
    assert key((32, 5, 2**20), num_warps=8) != base
    # What the kernel was told, so that the key above is what Triton does.
    assert set(gpu_kernels.kv_copy_kernel.do_not_specialize) == set(gpu_kernels._INTS)
    names = list(gpu_kernels.kv_copy_kernel.arg_names)
    ints = names[gpu_kernels._N_POINTERS : -len(_CONSTEXPRS)]
    assert ints == list(gpu_kernels._INTS), "every int parameter is in _INTS, in order"


@pytest.mark.parametrize("name", ["homogeneous", "block_16_to_32", "gather_2to1"])
def test_a_batchs_direct_copies_between_two_views_go_as_one_launch(
    name: str, fresh_gpu: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """local_copies' join of a PullBatch's gpu-direct copies, through the interpreter: the members
    between the same two views go as one launch and each lands as its own copy would; a member the
    executor refuses fails alone, with the words it gets alone; two members into one destination block
    launch one after the other, as they did before joins."""
    import functools

    from kv_sidecar.dataplane import local_copies
    from kv_sidecar.dataplane.jobs import Tokens
    from kv_sidecar.plan.blocks import check_copy

    gpu = fresh_gpu
    launches: list[int] = []
    real = gpu.copy_request

    def counted(*args: Any, **kw: Any) -> int:
        launches.append(1)
        return real(*args, **{**kw, "interpret": True})

    monkeypatch.setattr(local_copies.gpu, "copy_request", functools.partial(counted))
    c = kc.case(name)
    bd = c.dst.block_size
    r = c.reads[0]
    src = kc.random_tensors(c.src, 31 + r.src_rank)
    sview = gpu.gpu_rank_view(c.src, r.src_rank, src, 0)
    # Whole decode blocks but the last member's, so that the join pads nothing and whole tensors compare.
    shapes = [(2 * bd, 0), (3 * bd, bd), (bd + 5, 0)]
    rng = np.random.default_rng(3)
    src_order = rng.permutation(c.src.num_blocks).tolist()
    dst_order = rng.permutation(c.dst.num_blocks).tolist()
    tokens, s_at, d_at = [], 0, 0
    for n, start in shapes:
        n_src, n_dst = -(-n // c.src.block_size), dst_block_count(bd, n, start)
        tokens.append(
            Tokens(
                np.array(src_order[s_at : s_at + n_src]), np.array(dst_order[d_at : d_at + n_dst]), n, start
            )
        )
        s_at, d_at = s_at + n_src, d_at + n_dst
    bad = Tokens(tokens[0].src_blocks, np.array(dst_order[d_at : d_at + 1]), 2 * bd, 0)  # one block short

    def run(members: list[Tokens]) -> tuple[list[torch.Tensor], list[int | BaseException]]:
        out_t = kc.random_tensors(c.dst, 8)
        dview = gpu.gpu_rank_view(c.dst, c.dst_rank, out_t, 0)
        out: list[int | BaseException] = [0] * len(members)
        launches.clear()
        pair = local_copies._Pair(sview, dview, r.heads, list(range(len(members))))
        local_copies._launch_pair(pair, members, out, local_copies._launch_gpu, gpu.staging_bytes(c.dst, 1))
        return out_t, out

    got, out = run([*tokens, bad])
    assert len(launches) == 1, "the three good members as one launch"
    want = kc.random_tensors(c.dst, 8)
    dview = gpu.gpu_rank_view(c.dst, c.dst_rank, want, 0)
    for k, t in enumerate(tokens):
        assert out[k] == real(
            sview, dview, r.heads, t.src_blocks, t.dst_blocks, t.num_tokens, t.start_token, interpret=True
        )
    for g, w in zip(got, want, strict=True):
        assert kc.bitwise_equal(g, w)
    assert isinstance(out[3], PlanError)
    with pytest.raises(PlanError) as alone:
        check_copy(
            c.src, r.src_rank, c.dst, c.dst_rank, r.heads, bad.src_blocks, bad.dst_blocks, bad.num_tokens, 0
        )
    assert str(out[3]) == str(alone.value)
    # Joins stop at JOIN_BYTES: two members of two blocks joined, the third launched alone.
    monkeypatch.setattr(local_copies, "JOIN_BYTES", 4 * gpu.staging_bytes(c.dst, 1))
    got, out = run(tokens)
    assert len(launches) == 2 and all(isinstance(o, int) and o > 0 for o in out), out
    for g, w in zip(got, want, strict=True):
        assert kc.bitwise_equal(g, w)
    # Two members into one destination block: no join (a block written twice in one launch races).
    twice = [
        tokens[0],
        dataclasses.replace(
            tokens[1], dst_blocks=np.array([tokens[0].dst_blocks[0], *tokens[1].dst_blocks[1:]])
        ),
    ]
    got, out = run(twice)
    assert len(launches) == 2 and all(isinstance(o, int) and o > 0 for o in out), out
