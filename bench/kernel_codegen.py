"""What the copy kernel compiles to, without a GPU: the global loads and stores in its PTX, by width.

Triton compiles kv_copy_kernel for a CUDA target here (its bundled ptxas; no driver, no device), with the
launch the sidecar would plan for a rank pairing (execute/gpu.plan_launch over the model-shaped rank of
bench/node_scaling.py, 16-byte aligned), and counts `ld.global` and `st.global` instructions by vector
width: `.v4.b32` moves 16 bytes a thread, `.b32` four. The tile's loads and stores are the `evict_first`
ones and the stores; the others read block ids and layer tables.

    python bench/kernel_codegen.py                       # this tree's kernel, sm_90
    python bench/kernel_codegen.py --kernel-file F.py    # another gpu_kernels.py, e.g. a variant tried
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import node_scaling
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from kv_sidecar.execute import gpu, gpu_kernels
from kv_sidecar.plan.spec import EngineSpec

WORD = {4: "i32", 2: "i16", 1: "i8"}


def _kernel(path: str) -> Any:
    if not path:
        return gpu_kernels.kv_copy_kernel
    spec = importlib.util.spec_from_file_location("variant_gpu_kernels", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.kv_copy_kernel


def ptx_accesses(kernel: Any, spec: EngineSpec, arch: int) -> tuple[dict[str, int], dict[str, int]]:
    """(the launch's constexprs, the PTX's global load/store instructions by kind) for copies between two
    ranks of `spec` (all heads), planned as the sidecar plans them."""
    base = 1 << 30  # any 256-byte aligned address: the plan reads alignment from the addresses
    n = spec.rank_bytes() // len(spec.rank_tensor_shapes())
    view = gpu.gpu_rank_view(spec, 0, [base + i * n for i in range(len(spec.rank_tensor_shapes()))], 0)
    la = gpu.plan_launch(view, view, spec.num_kv_heads, 0, 0, 1, 0, 0, 0)
    names = list(kernel.arg_names)
    types = [f"*{WORD[la.width]}", "*i64", "*i64", "*i32", "*i32"]
    types += ["i32" if -(2**31) <= v < 2**31 else "i64" for v in la.args]
    signature = dict(zip(names, [*types, *["constexpr"] * len(la.constexprs)], strict=True))
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(3)}  # the anchor and the layer tables
    src = ASTSource(fn=kernel, signature=signature, constexprs=la.constexprs, attrs=aligned)
    compiled = compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": la.num_warps})
    found = re.findall(r"\b((?:ld|st)\.global[\w.:]*)", compiled.asm["ptx"])
    return la.constexprs, dict(collections.Counter(found))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel-file", default="", help="another gpu_kernels.py to compile instead")
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 (H100/H200)")
    args = ap.parse_args()
    spec = dataclasses.replace(node_scaling.GPU_SPEC, num_blocks=1024)
    constexprs, found = ptx_accesses(_kernel(args.kernel_file), spec, args.arch)
    print(f"sm_{args.arch}, {args.kernel_file or 'this tree'}; launch constexprs {constexprs}\n")
    print("| PTX instruction | count |")
    print("|---|---|")
    for kind, count in sorted(found.items()):
        print(f"| `{kind}` | {count} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
