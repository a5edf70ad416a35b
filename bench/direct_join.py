"""A PullBatch's gpu-direct copies as one joined launch against one launch each, on the GPU alone.

No sidecar: the executor's own calls (execute/gpu.copy_request), timed by the host (launch to the
end of a stream synchronize) over model-shaped ranks (32 layers, 8 KV heads, head_dim 128, bf16,
16-token blocks: 2 MiB a block). `--source 1`: the source rank on GPU1 read by the kernel on GPU0
over NVLink, by address, with peer access enabled between the two primary contexts (as gpu-direct
reads an engine's memory through its IPC mapping); default both on GPU0. Each row: `--members`
requests of `--blocks` blocks, copied as `--members` launches or as one over their joined tokens
(dataplane/jobs.join_tokens), alternating, `--iters` times each; the median and the GB/s it makes,
and each way's first call (where Triton compiles or loads a specialization it has not launched
before in this process).

    python bench/direct_join.py                     # 16 members of 1 and of 32 blocks, one GPU
    python bench/direct_join.py --blocks 1,8,32 --members 4,16 --source 1
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import numpy as np
import torch
from gpu_latency import MODEL  # the model-shaped rank of the GPU benches

from kv_sidecar.dataplane.jobs import Tokens, join_tokens
from kv_sidecar.execute import gpu
from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar_client.cuda_ipc import PrimaryContext, check, cuda_driver

CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704


def peer_access(reader: int, owner: int) -> None:
    """Let kernels in `reader`'s primary context read `owner`'s memory by address."""
    lib = cuda_driver()
    owner_ctx = ctypes.c_void_p()
    check(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(owner_ctx), owner), "cuDevicePrimaryCtxRetain")
    with PrimaryContext(reader):
        code = lib.cuCtxEnablePeerAccess(owner_ctx, 0)
        if code != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
            check(lib, code, "cuCtxEnablePeerAccess")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", default="1,32", help="blocks per member (comma-separated)")
    ap.add_argument("--members", default="16", help="members per batch (comma-separated)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument(
        "--source", type=int, default=0, help="the GPU holding the source rank (the copy runs on GPU0)"
    )
    args = ap.parse_args()
    blocks = [int(b) for b in args.blocks.split(",")]
    members = [int(m) for m in args.members.split(",")]
    need = max(blocks) * max(members)
    spec = EngineSpec.from_dict(MODEL | {"num_blocks": need + 1})
    src_t = [
        torch.randn(s, dtype=torch.bfloat16, device=f"cuda:{args.source}") for s in spec.rank_tensor_shapes()
    ]
    dst_t = [torch.zeros(s, dtype=torch.bfloat16, device="cuda:0") for s in spec.rank_tensor_shapes()]
    if args.source != 0:
        torch.cuda.synchronize(args.source)
        peer_access(reader=0, owner=args.source)
    # The source by address in GPU0's context, as the sidecar's mapping of an engine's memory is.
    sview = gpu.gpu_rank_view(spec, 0, [t.data_ptr() for t in src_t], 0)
    dview = gpu.gpu_rank_view(spec, 0, dst_t, 0)
    heads = (0, spec.num_kv_heads)
    stream = torch.cuda.current_stream(0)
    rng = np.random.default_rng(0)
    print(f"GPU: {torch.cuda.get_device_name(0)}; source rank on cuda:{args.source}, the copy on cuda:0")
    print(
        "| members | blocks each | launch each, ms | joined, ms | joined / each | GB/s each | GB/s joined "
        "| first call each / joined, ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for m in members:
        for b in blocks:
            src_ids = rng.permutation(need)[: m * b]
            dst_ids = rng.permutation(need)[: m * b]
            toks = [
                Tokens(src_ids[i * b : (i + 1) * b], dst_ids[i * b : (i + 1) * b], b * spec.block_size, 0)
                for i in range(m)
            ]

            def each(toks: list[Tokens] = toks) -> int:
                return sum(
                    gpu.copy_request(
                        sview, dview, heads, t.src_blocks, t.dst_blocks, t.num_tokens, synchronize=False
                    )
                    for t in toks
                )

            def joined(toks: list[Tokens] = toks) -> int:
                whole, _ = join_tokens(toks, spec.block_size, spec.block_size)
                return gpu.copy_request(
                    sview,
                    dview,
                    heads,
                    whole.src_blocks,
                    whole.dst_blocks,
                    whole.num_tokens,
                    synchronize=False,
                )

            times: dict[str, list[float]] = {"each": [], "joined": []}
            first: dict[str, float] = {}
            nbytes = 0
            for it in range(args.iters + 3):
                for name, fn in (
                    (("each", each), ("joined", joined)) if it % 2 else (("joined", joined), ("each", each))
                ):
                    stream.synchronize()
                    t0 = time.perf_counter()
                    nbytes = fn()
                    stream.synchronize()
                    took = time.perf_counter() - t0
                    first.setdefault(name, took)
                    if it >= 3:  # the first ones compile and fill the caches
                        times[name].append(took)
            e, j = statistics.median(times["each"]), statistics.median(times["joined"])
            print(
                f"| {m} | {b} | {e * 1e3:.3f} | {j * 1e3:.3f} | {j / e:.2f}x | {nbytes / e / 1e9:.1f} "
                f"| {nbytes / j / 1e9:.1f} | {first['each'] * 1e3:.1f} / {first['joined'] * 1e3:.1f} |"
            )


if __name__ == "__main__":
    main()
