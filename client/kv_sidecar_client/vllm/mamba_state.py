"""Mamba/SSM groups of a hybrid model (issue 33, item 5): what one request's state is, where it sits.

vLLM 0.32 gives each Mamba layer one page per block, in the same bytes an attention block of its layer
position occupies (the groups alias one allocation; vLLM raises the attention block size until an
attention page holds a Mamba page, and pads the Mamba page to it). The page starts with the layer's
state arrays back to back (`MambaBase.bind_kv_cache`): for Mamba-2 the conv state, then the SSM state;
the rest of the page is padding.

With `mamba_cache_mode` "none" (prefix caching off) a request's Mamba group holds one block, written
in place at every step: after n computed tokens it holds the state after token n - 1, h(n). The
prefill therefore computes all but the last prompt token and publishes h(n - 1) with the attention
groups' n - 1 tokens; the decode engine loads them and computes the last prompt token itself, from
that state, exactly as one engine continues a chunked prefill. Had the prefill computed the whole
prompt, the decode engine's recomputation of the last token (vLLM always computes at least one
token) would advance h(N) once more.

Not supported, refused at engine start naming the setting: mamba_cache_mode "align" (vLLM's default
with prefix caching on: a request's blocks are checkpoints at block boundaries, and which of them
holds the running state moves every step), and speculative blocks (scratch state slots).

Pure: plain values, no vLLM or torch import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from math import prod

from kv_sidecar_client.vllm.groups import StateArray

SUPPORTED_CACHE_MODE = "none"
DTYPE_SIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


class UnsupportedMambaState(ValueError):
    """A Mamba group the connector cannot move exactly; the message names the layer and the setting."""


def array_names(count: int) -> list[str]:
    """Mamba-1 and Mamba-2 keep (conv, ssm); other state layers get positional names."""
    return ["conv", "ssm"] if count == 2 else [f"state{i}" for i in range(count)]


def state_arrays(
    layer: str, shapes: Sequence[Sequence[int]], dtypes: Sequence[str]
) -> tuple[StateArray, ...]:
    """The arrays of one Mamba layer's page as vLLM lays them out: back to back from byte 0."""
    if len(shapes) != len(dtypes) or not shapes:
        raise UnsupportedMambaState(
            f"KVSidecarConnector: Mamba layer {layer} has shapes {shapes} and dtypes {dtypes}"
        )
    out = []
    offset = 0
    for name, shape, dtype in zip(array_names(len(shapes)), shapes, dtypes, strict=True):
        if dtype not in DTYPE_SIZES:
            raise UnsupportedMambaState(
                f"KVSidecarConnector: Mamba layer {layer} keeps its {name} state as {dtype}, which kv-sidecar "
                f"does not move (one of {sorted(DTYPE_SIZES)})"
            )
        out.append(StateArray(name, tuple(int(s) for s in shape), dtype, offset))
        offset += prod(shape) * DTYPE_SIZES[dtype]
    return tuple(out)


def mamba2_sharding(
    arrays: Sequence[StateArray],
    model_shapes: Sequence[Sequence[int]] | None,
    tp_size: int,
    conv_dim_first: bool,
) -> tuple[StateArray, ...]:
    """A Mamba-2 layer's (conv, ssm) arrays with how vLLM 0.32 shards them over `tp_size` ranks, from
    their shapes at TP 1 (`model_shapes`), so that the sidecar can convert them between TP sizes.

    vLLM (mamba_utils.mamba2_state_shape, MambaMixer2): the conv state's channels are x (intermediate
    size = heads x head_dim), then B and C (n_groups x state size each), each split over the ranks on
    its own (conv1d is a MergedColumnParallelLinear of those three); where n_groups does not divide TP
    (vLLM allows only n_groups 1 then), every rank holds the one group's B and C whole
    (`extra_groups_for_head_shards`, `mamba_v2_sharded_weight_loader` with duplicate_groups). The
    channels are the conv state's last dim (layout SD) or first (DS). The SSM state (heads, head_dim,
    state size) is split by heads. Arrays whose shapes do not fit that are returned undescribed (the
    sidecar then moves them only between engines of the same TP size)."""
    if model_shapes is None or len(arrays) != 2 or len(model_shapes) != 2:
        return tuple(arrays)
    conv, ssm = arrays
    conv1, ssm1 = (tuple(int(x) for x in s) for s in model_shapes)
    k = 0 if conv_dim_first else 1
    if len(conv.shape) != 2 or len(conv1) != 2 or len(ssm.shape) != 3 or len(ssm1) != 3:
        return tuple(arrays)
    heads, head_dim, state_size = ssm1
    x = heads * head_dim
    groups_size, odd = divmod(conv1[k] - x, 2)
    n_groups = groups_size // state_size if state_size else 0
    if odd or n_groups <= 0 or n_groups * state_size != groups_size or heads % tp_size or x % tp_size:
        return tuple(arrays)
    replicated = n_groups % tp_size != 0
    if replicated and n_groups != 1:
        return tuple(arrays)  # vLLM refuses such an engine; nothing to describe
    local_groups = groups_size if replicated else groups_size // tp_size
    want_conv = list(conv1)
    want_conv[k] = x // tp_size + 2 * local_groups
    if list(conv.shape) != want_conv or ssm.shape != (heads // tp_size, head_dim, state_size):
        return tuple(arrays)
    return (
        replace(conv, tp_dim=k, segments=((x, False), (groups_size, replicated), (groups_size, replicated))),
        replace(ssm, tp_dim=0, segments=((heads, False),)),
    )


def state_bytes(arrays: Sequence[StateArray]) -> int:
    return sum(prod(a.shape) * DTYPE_SIZES[a.dtype] for a in arrays)


def check_settings(
    layer: str, cache_mode: str, speculative_blocks: int, page_bytes: int, block_bytes: int
) -> None:
    """Refuse what would put a request's state elsewhere than its one block, or pages that are not one
    attention block of the layer position."""
    if cache_mode != SUPPORTED_CACHE_MODE:
        raise UnsupportedMambaState(
            f"KVSidecarConnector moves Mamba state only with mamba_cache_mode 'none'; the KV cache group of "
            f"{layer} has mamba_cache_mode {cache_mode!r} (vLLM's default with prefix caching on, where a "
            "request's state moves between checkpoint blocks): start both engines with "
            "--no-enable-prefix-caching"
        )
    if speculative_blocks:
        raise UnsupportedMambaState(
            f"KVSidecarConnector does not move Mamba state with speculative decoding: the KV cache group of "
            f"{layer} has {speculative_blocks} speculative state block(s)"
        )
    if page_bytes != block_bytes:
        raise UnsupportedMambaState(
            f"KVSidecarConnector: the Mamba page of {layer} is {page_bytes} bytes, the attention block of its "
            f"layer position {block_bytes}: the groups must share one page size"
        )


def prefill_tokens(num_prompt: int) -> int | None:
    """How many prompt tokens the prefill of a Mamba hybrid's request computes and publishes: all but the
    last, which the decode engine computes from their state. None: a one-token prompt, published whole,
    which the decode engine then computes itself (it cannot recompute a token whose state it loaded)."""
    return num_prompt - 1 if num_prompt > 1 else None


def state_block(request_id: str, layer: str, block_ids: Sequence[int], null_block: int) -> int:
    """The block that holds a request's state: with mamba_cache_mode 'none' its only block."""
    if len(block_ids) != 1 or block_ids[0] == null_block:
        raise UnsupportedMambaState(
            f"request {request_id}: its Mamba group (layer {layer}) holds blocks {list(block_ids)}, not one "
            "state block"
        )
    return int(block_ids[0])
