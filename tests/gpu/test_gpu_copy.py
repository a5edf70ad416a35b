"""GPU executor end to end: engine tensors exported over CUDA IPC by real separate processes.

A source engine process owns the prefill caches, a destination engine process
the decode caches; this process is the sidecar: it imports both into the
copying GPU's primary context and runs the kernel there. The destination
engine then dumps its tensors, which must equal, bit for bit, what the CPU
executor produces from the same bytes: the requested tokens and heads
copied, every other byte (other blocks, other heads, the gaps between
tensors of one allocation) untouched.
"""

from __future__ import annotations

from collections.abc import Iterator

import kvcases as kc
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from ipc_engine import Engine, Job  # noqa: E402

from kv_sidecar.execute import gpu  # noqa: E402
from kv_sidecar.execute.gpu_geometry import tensor_nbytes  # noqa: E402
from kv_sidecar.memory.cuda_ipc import IpcRegistry  # noqa: E402
from kv_sidecar.plan.spec import PlanError  # noqa: E402

pytestmark = pytest.mark.gpu

PLACEMENTS = {"gpu0_to_gpu1": (0, 1, 2), "same_gpu": (0, 0, 1)}  # src device, dst device, GPUs needed
SEED = 1234


def _src_key(c: kc.Case, rank: int) -> str:
    return f"{c.name}/src{rank}"


def _dst_key(c: kc.Case) -> str:
    return f"{c.name}/dst"


class Setup:
    def __init__(self, src_dev: int, dst_dev: int) -> None:
        src_jobs = [
            Job(_src_key(c, r), c.src.to_dict(), r, SEED + 10 * r) for c in kc.CASES for r in c.src_ranks()
        ]
        # Destination ranks live in one allocation each, with gaps: the kernel
        # must not touch the gaps, and the tensors must share one IPC mapping.
        dst_jobs = [
            Job(_dst_key(c), c.dst.to_dict(), c.dst_rank, SEED + 1, one_allocation=True) for c in kc.CASES
        ]
        self.src_dev, self.dst_dev = src_dev, dst_dev
        self.src_engine = Engine(src_dev, src_jobs)
        self.dst_engine = Engine(dst_dev, dst_jobs)
        self.registry = IpcRegistry()

    def view(self, engine: Engine, key: str, spec: kc.EngineSpec, rank: int) -> gpu.GpuRankView:
        n = tensor_nbytes(spec)
        imported = [self.registry.open(e.handle, e.offset, n, self.dst_dev) for e in engine.exports[key]]
        return gpu.gpu_rank_view(spec, rank, imported, self.dst_dev)

    def close(self) -> None:
        self.src_engine.close()
        self.dst_engine.close()


@pytest.fixture(scope="module", params=list(PLACEMENTS))
def setup(request: pytest.FixtureRequest) -> Iterator[Setup]:
    src_dev, dst_dev, need = PLACEMENTS[request.param]
    if not torch.cuda.is_available() or torch.cuda.device_count() < need:
        pytest.skip(f"needs {need} CUDA GPU(s)")
    s = Setup(src_dev, dst_dev)
    yield s
    s.close()


@pytest.mark.parametrize("name", [c.name for c in kc.CASES])
def test_pull_matches_host_executor(setup: Setup, name: str) -> None:
    c = kc.case(name)
    src_ids, dst_ids = kc.block_ids(c, SEED)
    dview = setup.view(setup.dst_engine, _dst_key(c), c.dst, c.dst_rank)
    written = 0
    for r in c.reads:
        sview = setup.view(setup.src_engine, _src_key(c, r.src_rank), c.src, r.src_rank)
        written += gpu.copy_request(sview, dview, r.heads, src_ids, dst_ids, c.num_tokens, c.start_token)
        for t in sview.keepalive:
            t.release()
    for t in dview.keepalive:
        t.release()

    srcs = {r: kc.random_tensors(c.src, SEED + 10 * r) for r in c.src_ranks()}
    before = kc.random_tensors(c.dst, SEED + 1)
    want, want_bytes = kc.reference(c, srcs, before, src_ids, dst_ids)
    got = setup.dst_engine.dump([_dst_key(c)])[_dst_key(c)]
    assert written == want_bytes
    for i, (g, w, b) in enumerate(zip(got, want, before, strict=True)):
        assert not kc.bitwise_equal(w, b), "the case must change something"
        assert kc.bitwise_equal(g, w), f"{name}: tensor {i} differs from the host executor's result"
    gaps = setup.dst_engine.gaps(_dst_key(c))
    assert gaps.numel() > 0 and bool((gaps == 0x5A).all()), "bytes between the destination tensors changed"
    # The sources are read-only.
    src_now = setup.src_engine.dump([_src_key(c, r) for r in c.src_ranks()])
    for r in c.src_ranks():
        for g, w in zip(src_now[_src_key(c, r)], srcs[r], strict=True):
            assert kc.bitwise_equal(g, w)


def test_tensors_of_one_allocation_share_one_mapping(setup: Setup) -> None:
    """Every dst tensor of a rank came from one allocation: one handle, one mapping, refcounted."""
    c = kc.case("homogeneous")
    exports = setup.dst_engine.exports[_dst_key(c)]
    assert len({e.handle for e in exports}) == 1
    assert len({e.offset for e in exports}) == len(exports)
    before = setup.registry.open_count()
    view = setup.view(setup.dst_engine, _dst_key(c), c.dst, c.dst_rank)
    assert setup.registry.open_count() == before + 1
    for t in view.keepalive:
        t.release()
    assert setup.registry.open_count() == before


def test_bad_requests_rejected_before_launch(setup: Setup) -> None:
    c = kc.case("homogeneous")
    src_ids, dst_ids = kc.block_ids(c, SEED)
    sview = setup.view(setup.src_engine, _src_key(c, 0), c.src, 0)
    dview = setup.view(setup.dst_engine, _dst_key(c), c.dst, c.dst_rank)
    try:
        with pytest.raises(PlanError, match="out of range"):
            gpu.copy_request(sview, dview, (0, 4), [*src_ids[:-1], c.src.num_blocks], dst_ids, c.num_tokens)
        with pytest.raises(PlanError, match="appears twice"):
            gpu.copy_request(sview, dview, (0, 4), src_ids, [dst_ids[0], *dst_ids[:-1]], c.num_tokens)
        with pytest.raises(PlanError, match="not all held"):
            gpu.copy_request(sview, dview, (2, 6), src_ids, dst_ids, c.num_tokens)
    finally:
        for t in (*sview.keepalive, *dview.keepalive):
            t.release()


def test_launches_after_the_first_skip_triton_and_stay_exact() -> None:
    """Once Triton compiled a specialisation, gpu_kernels.launch calls its launcher directly; copies
    whose token counts, start tokens and ids differ (some crossing what Triton specialises on) land bit
    for bit either way, and the ones that match a compiled specialisation take the direct way."""
    import dataclasses

    from kv_sidecar.execute import gpu_kernels

    if not torch.cuda.is_available():
        pytest.skip("needs 1 CUDA GPU(s)")
    if not triton_direct():
        pytest.skip(f"Triton {triton_version()} is not one gpu_kernels.Launcher calls directly")
    c0 = kc.case("homogeneous")
    srcs = {r: kc.random_tensors(c0.src, 300 + r) for r in c0.src_ranks()}
    out = kc.random_tensors(c0.dst, 5)
    on_gpu = {r: [t.cuda(0) for t in ts] for r, ts in srcs.items()}
    out_gpu = [t.cuda(0) for t in out]
    dview = gpu.gpu_rank_view(c0.dst, c0.dst_rank, out_gpu, 0)
    sviews = {r: gpu.gpu_rank_view(c0.src, r, on_gpu[r], 0) for r in c0.src_ranks()}
    bd = c0.dst.block_size
    before = gpu_kernels.launch.direct_launches
    shapes = [(c0.num_tokens, 0), (c0.num_tokens - 1, 0), (c0.num_tokens, bd), (c0.num_tokens, 0), (1, 0)]
    for seed, (num_tokens, start_token) in enumerate(shapes * 2):
        c = dataclasses.replace(c0, num_tokens=num_tokens, start_token=start_token)
        src_ids, dst_ids = kc.block_ids(c, 80 + seed)
        want, want_bytes = kc.reference(c, srcs, out, src_ids, dst_ids)
        written = sum(
            gpu.copy_request(sviews[r.src_rank], dview, r.heads, src_ids, dst_ids, num_tokens, start_token)
            for r in c.reads
        )
        assert written == want_bytes
        for g, w in zip(out_gpu, want, strict=True):
            assert kc.bitwise_equal(g.cpu(), w), (num_tokens, start_token)
        out = want  # what the destination holds now
    assert gpu_kernels.launch.direct_launches - before >= len(shapes)  # every shape's second round


def test_a_triton_without_direct_launches_warns_once_and_stays_exact(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On a Triton release the launcher was not written for, every launch goes through Triton: the
    copies stay exact, the launches are counted as such, and the sidecar says so once in its log."""
    import logging

    from kv_sidecar.execute import gpu_kernels

    if not torch.cuda.is_available():
        pytest.skip("needs 1 CUDA GPU(s)")
    monkeypatch.setattr(gpu_kernels, "DIRECT_TRITON", ("0.0.",))  # no release is that
    launcher = gpu_kernels.Launcher()
    monkeypatch.setattr(gpu_kernels, "launch", launcher)
    c = kc.case("homogeneous")
    srcs = {r: kc.random_tensors(c.src, 400 + r) for r in c.src_ranks()}
    out = kc.random_tensors(c.dst, 6)
    out_gpu = [t.cuda(0) for t in out]
    dview = gpu.gpu_rank_view(c.dst, c.dst_rank, out_gpu, 0)
    sviews = {r: gpu.gpu_rank_view(c.src, r, [t.cuda(0) for t in ts], 0) for r, ts in srcs.items()}
    with caplog.at_level(logging.WARNING, logger=gpu_kernels.__name__):
        for seed in range(3):
            src_ids, dst_ids = kc.block_ids(c, 90 + seed)
            want, _ = kc.reference(c, srcs, out, src_ids, dst_ids)
            for r in c.reads:
                gpu.copy_request(sviews[r.src_rank], dview, r.heads, src_ids, dst_ids, c.num_tokens)
            for g, w in zip(out_gpu, want, strict=True):
                assert kc.bitwise_equal(g.cpu(), w), seed
            out = want
    assert launcher.counts() == {"direct": 0, "triton": 3 * len(c.reads)}
    warnings = [r for r in caplog.records if "Python launcher" in r.getMessage()]
    assert len(warnings) == 1 and triton_version() in warnings[0].getMessage()


def triton_direct() -> bool:
    from kv_sidecar.execute import gpu_kernels

    return triton_version().startswith(gpu_kernels.DIRECT_TRITON)


def triton_version() -> str:
    import triton

    return str(triton.__version__)
