"""The vLLM backend -> EngineSpec mapping, against vLLM's own layout declarations and view code.

For every attention backend (GPU ones included: their classes import on a CPU
machine) and every KV cache layout it declares it can consume, build the layer
views exactly as vLLM does (`compute_layout_strides` + `create_kv_cache_views`,
kernel block size from `select_common_block_size`), fill the buffer with random
bytes, describe it with the connector (`kv_layout.describe`) and read it back
through the sidecar's own canonical view (`kv_sidecar.execute.host.rank_view`):
every logical (layer, K/V, block, token, head, element) must be the same
bytes. Layouts the sidecar cannot address must be refused with a message that
names the backend, the layout and the shape.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, _get_attn_isa
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.utils import _DEFAULT_LAYOUT_PREFERENCE, get_flashinfer_layout_string
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheLayout,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.worker.utils import select_common_block_size

from kv_sidecar.execute.host import rank_view
from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar_client.vllm.kv_layout import UnsupportedKVCache, VllmKVInfo, describe

from .views import layer_views

SUPPORTED = {"LBHNC", "LBNHC", "BLHNC", "BLNHC"}
BACKENDS = ["CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "TRITON_MLA", "FLASHMLA"]
MLA_BACKENDS = {"TRITON_MLA", "FLASHMLA"}


def declared_layouts(backend: str) -> list[KVCacheLayout]:
    cls = AttentionBackendEnum[backend].get_class()
    return list(cls.supported_kv_cache_layouts() or _DEFAULT_LAYOUT_PREFERENCE)


def cases() -> list[Any]:
    out = []
    for backend in BACKENDS:
        for layout in declared_layouts(backend):
            out.append(pytest.param(backend, layout, id=f"{backend}-{layout.name}"))
    # FlashInfer's module needs the flashinfer package; its layouts are the ones vLLM names for it.
    for name in ("LBNHC", "LBHNC", "BLHNC", "BLNHC", "BHLNC"):
        layout = KVCacheLayout[name]
        get_flashinfer_layout_string(layout)  # raises if vLLM would not give FlashInfer this layout
        out.append(pytest.param("FLASHINFER", layout, id=f"FLASHINFER-{name}"))
    return out


def vllm_views(
    backend: str,
    layout: KVCacheLayout,
    *,
    tp_size: int,
    block_size: int,
    num_blocks: int = 12,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[list[torch.Tensor], VllmKVInfo, Any]:
    mla = backend in MLA_BACKENDS
    total_heads = 1 if mla else 8
    heads = 1 if mla else max(1, total_heads // tp_size)
    if mla:
        spec: Any = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=64, dtype=dtype)
    else:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=32, dtype=dtype)
    kernel = None
    if backend != "FLASHINFER":
        cls = AttentionBackendEnum[backend].get_class()
        kernel = select_common_block_size(block_size, [cls], [spec])
    if layout.is_block_outermost:
        kernel = block_size  # vLLM does not split block-outermost pages
    layers = ["model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn"]
    # Strides as vLLM's get_kv_cache_config_from_groups computes them for one group.
    block_stride = len(layers) * spec.page_size_bytes if layout.is_block_outermost else None
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, num_blocks, len(layers), layout, fixed_strides=(None, block_stride, None, None, None)
    )
    size = len(layers) * num_blocks * spec.page_size_bytes
    tensor = KVCacheTensor(
        size=size, layers=layers, layer_stride=layer_stride, block_stride=block_stride, offset=0
    )
    raw = torch.randint(-128, 128, (size,), dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, num_blocks, layout, tensor, kernel_block_size=kernel)
    info = VllmKVInfo(
        backend=backend,
        layout=layout.name,
        block_size=block_size,
        num_kv_heads=total_heads,
        head_size=spec.head_size,
        head_size_v=0 if mla else spec.head_size,
        tp_size=tp_size,
        use_mla=mla,
    )
    return views, info, raw


def logical(view: torch.Tensor, mla: bool) -> torch.Tensor:
    """vLLM's [blocks, heads, tokens, K|V] as the sidecar's per-layer canonical [K, blocks, tokens, heads, D]."""
    v = view.view(torch.int16)
    if mla:
        return v.unsqueeze(0).permute(0, 1, 3, 2, 4)
    return v.unflatten(-1, (2, -1)).permute(3, 0, 2, 1, 4)


@pytest.mark.parametrize(("backend", "layout"), cases())
@pytest.mark.parametrize("tp_size", [1, 2])
def test_every_declared_layout_maps_to_the_same_bytes(
    backend: str, layout: KVCacheLayout, tp_size: int
) -> None:
    # Views only: CPU_ATTN's kernel stores its pages otherwise (test_cpu_attention_kernel_pages_are_vllm_cpu).
    views, info, _ = vllm_views(backend, layout, tp_size=tp_size, block_size=64)
    # One MLA head makes the head dim's position immaterial: heads-outer layouts are then plain ones.
    if layout.name not in SUPPORTED and not info.use_mla:
        with pytest.raises(
            UnsupportedKVCache, match=rf"{backend} \(vLLM KV cache layout {layout.name}\).*shape"
        ):
            describe(views, info)
        return
    desc = describe(views, info)
    spec = EngineSpec.from_dict(desc.spec)
    assert spec.rank_tensor_shapes() == [tuple(r.shape) for r in desc.regions]
    canon = rank_view(spec, 0, desc.regions).layers  # same-width ints: compared bit for bit
    ours = canon[0] if len(canon) == 1 else torch.cat(canon)
    # [L, K, N, B, H, D] on our side; vLLM's per layer, stacked.
    theirs = torch.stack([logical(v, info.use_mla) for v in views])
    assert ours.shape == theirs.shape
    assert torch.equal(ours, theirs)
    assert desc.spec["cross_layer"] == layout.is_block_outermost
    # The regions cover exactly vLLM's bytes: same first byte as layer 0.
    assert desc.regions[0].data_ptr() == views[0].data_ptr()


def test_kernel_block_split_is_described_as_kernel_block_size() -> None:
    # FlashMLA takes 64-token kernel blocks only: a 128-token block is two of them.
    views, info, _ = vllm_views("FLASHMLA", KVCacheLayout.LBNHC, tp_size=1, block_size=128)
    desc = describe(views, info)
    assert desc.spec["block_size"] == 128 and desc.spec["kernel_block_size"] == 64
    assert desc.spec["num_blocks"] == 12 and desc.spec["layout"] == "mla"


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda layout: layout.name)
@pytest.mark.parametrize("kernel", [None, 16])
def test_views_without_vllm_match_vllm(layout: KVCacheLayout, kernel: int | None) -> None:
    """tests/vllm/views.py (used on the GPU machine, where vLLM is absent) rebuilds vLLM's views exactly."""
    spec = FullAttentionSpec(block_size=32, num_kv_heads=4, head_size=32, dtype=torch.float16)
    layers = [f"model.layers.{i}.attn" for i in range(3)]
    block_stride = 3 * spec.page_size_bytes if layout.is_block_outermost else None
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, 10, 3, layout, fixed_strides=(None, block_stride, None, None, None)
    )
    size = 3 * 10 * spec.page_size_bytes
    tensor = KVCacheTensor(
        size=size, layers=layers, layer_stride=layer_stride, block_stride=block_stride, offset=0
    )
    raw = torch.zeros(size, dtype=torch.int8)
    kwargs: dict[str, Any] = dict(
        num_layers=3,
        num_blocks=10,
        heads=4,
        block_size=32,
        content_bytes=spec.state_content_size_bytes,
        dtype=torch.float16,
        kernel_block_size=kernel,
    )
    try:
        want = create_kv_cache_views(raw, spec, 10, layout, tensor, kernel_block_size=kernel)
    except ValueError:  # vLLM cannot split this layout's blocks: neither may we
        with pytest.raises(ValueError, match="cannot be split"):
            layer_views(raw, layout.name, **kwargs)
        return
    got = layer_views(raw, layout.name, **kwargs)
    for w, g in zip(want, got, strict=True):
        assert (g.shape, g.stride(), g.storage_offset(), g.dtype) == (
            w.shape,
            w.stride(),
            w.storage_offset(),
            w.dtype,
        )


# -- CPU_ATTN: what its kernel really writes (kv-sidecar issue 30) ---------------------------------
def cpu_attention(
    dtype: torch.dtype, block_size: int, heads: int, kv_cache_dtype: str = "auto"
) -> tuple[Any, Any]:
    """vLLM's CPU attention impl and a stand-in for its layer: what `do_kv_cache_update` reads of it."""
    # The impl's __init__ reads the current config (model dtype, parallel config) but needs no model.
    config = VllmConfig()
    config.model_config = SimpleNamespace(dtype=dtype)  # type: ignore[assignment]
    with set_current_vllm_config(config):
        impl = CPUAttentionBackendImpl(
            num_heads=2 * heads,
            head_size=32,
            scale=32**-0.5,
            num_kv_heads=heads,
            alibi_slopes=None,
            sliding_window=None,
            kv_cache_dtype=kv_cache_dtype,
        )
    # As CPUAttentionMetadataBuilder sets it (from the scheduler's block size), and Attention's scales.
    layer = SimpleNamespace(
        isa=_get_attn_isa(dtype, block_size, 32, kv_cache_dtype), _k_scale_float=1.0, _v_scale_float=1.0
    )
    return impl, layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [32, 64])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_cpu_attention_kernel_pages_are_vllm_cpu(dtype: torch.dtype, block_size: int, tp_size: int) -> None:
    """describe() asks CPU_ATTN's own cache write where K and V go: vllm_cpu, not the view's packed;
    then K and V the kernel writes into the real views read back through the sidecar bit for bit."""
    views, info, _ = vllm_views(
        "CPU_ATTN", KVCacheLayout.LBHNC, tp_size=tp_size, block_size=block_size, dtype=dtype
    )
    kblocks, heads, tokens, content = views[0].shape
    impl, layer = cpu_attention(dtype, block_size, heads)
    names = [f"model.layers.{i}.attn" for i in range(len(views))]

    def write(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        impl.do_kv_cache_update(layer, k, v, cache, slots)

    desc = describe(views, info, names, writers=[write] * len(views))
    assert desc.spec["layout"] == "vllm_cpu" and not desc.spec["cross_layer"]
    old = describe(views, info)  # without writers, as before issue 30: the view's claim
    assert old.spec["layout"] == "packed"

    # Real K/V through the kernel: 20 tokens scattered over blocks and offsets, other data per layer.
    g = torch.Generator().manual_seed(30)
    slots = torch.randperm(kblocks * tokens, generator=g)[:20]
    written = []
    for view in views:
        kv = torch.randn(2, len(slots), heads, content // 2, generator=g).to(dtype)
        impl.do_kv_cache_update(layer, kv[0], kv[1], view, slots)
        written.append(kv)
    blocks, offsets = slots // tokens, slots % tokens

    ours = rank_view(EngineSpec.from_dict(desc.spec), 0, desc.regions)
    as_read = rank_view(EngineSpec.from_dict(old.spec), 0, old.regions).layers  # [L, K, N, B, H, D] ints
    assert len(as_read) == 1
    for i, kv in enumerate(written):
        for plane in (0, 1):
            want = kv[plane].view(as_read[0].dtype)  # [tokens, H, D], bit for bit
            got = ours.part(i, plane)[0, 0, blocks, offsets]
            assert torch.equal(got, want), (i, plane)
            # Issue 30: registered as packed, the sidecar would have moved other bytes as these tokens.
            assert not torch.equal(as_read[0][i, plane, blocks, offsets], want), (i, plane)


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_an_fp8_cpu_cache_is_probed_through_its_quantising_kernel(scale: float) -> None:
    """An fp8 cache (uint8 in vLLM's views) holds quantised bytes, never the values written: the probe
    reads only which elements turn non-zero, so it still finds vllm_cpu, whatever the layer's scale."""
    views, info, _ = vllm_views("CPU_ATTN", KVCacheLayout.LBHNC, tp_size=1, block_size=32, dtype=torch.uint8)
    try:
        impl, layer = cpu_attention(torch.bfloat16, 32, views[0].shape[1], kv_cache_dtype="fp8")
    except NotImplementedError as e:  # vLLM's own refusal: an fp8 cache on CPU needs AVX-512 or AMX
        pytest.skip(f"vLLM runs no fp8 KV cache on this CPU: {e}")
    layer._k_scale_float = layer._v_scale_float = scale

    def write(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        impl.do_kv_cache_update(layer, k, v, cache, slots)

    desc = describe(views, replace(info, model_dtype=torch.bfloat16), writers=[write] * len(views))
    assert desc.spec["layout"] == "vllm_cpu" and desc.spec["dtype"] == "uint8"
