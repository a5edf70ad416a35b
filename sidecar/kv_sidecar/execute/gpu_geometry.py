"""Where each (layer, K/V, kernel block, token, head) row of a rank's KV cache lives, as plain integers.

The GPU kernel works on raw addresses, so it needs, per side, the address of
every layer's first element and the element strides of the K/V plane, the
kernel block, the token in block and the local head. head_dim is innermost
and contiguous in every layout, so a (token, head) row of head_dim elements is
always one contiguous run; the strides below come from the same dim table
(`LAYOUT_DIMS`) the host executor builds its views from, so both executors
agree by construction. No torch here: this is testable anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kv_sidecar.plan.spec import K_TRANSPOSED, EngineSpec, PlanError, tensor_dims


@dataclass(frozen=True)
class Strides:
    """Element strides of one side; 0 for a dim the layout lacks (MLA: K/V and head)."""

    kv: int
    block: int
    token: int
    head: int
    layer: int  # cross-layer tensors only (0 for per-layer tensors)


def strides(spec: EngineSpec) -> Strides:
    """Contiguous element strides of the registered tensors, by dim letter."""
    if spec.layout in K_TRANSPOSED:
        raise PlanError(
            f"layout {spec.layout.value} keeps its K plane transposed (vLLM's CPU backend): "
            "a host-memory layout, not one the GPU data plane moves"
        )
    sizes = spec.dim_sizes()
    found: dict[str, int] = {}
    step = 1
    for letter in reversed(tensor_dims(spec)):
        found[letter] = step
        step *= sizes[letter]
    if found.get("D") != 1:
        raise PlanError(f"layout {spec.layout.value}: head_dim must be the innermost dim")
    return Strides(
        kv=found.get("K", 0),
        block=found["N"],
        token=found["B"],
        head=found.get("H", 0),
        layer=found.get("L", 0),
    )


def layer_addresses(spec: EngineSpec, tensor_ptrs: Sequence[int]) -> tuple[int, ...]:
    """Byte address of element 0 of every layer, from the registered tensors' addresses."""
    want = 1 if spec.cross_layer else spec.num_layers
    if len(tensor_ptrs) != want:
        raise PlanError(f"expected {want} KV tensor address(es) for this spec, got {len(tensor_ptrs)}")
    if spec.cross_layer:
        step = strides(spec).layer * spec.element_size
        return tuple(tensor_ptrs[0] + layer * step for layer in range(spec.num_layers))
    return tuple(tensor_ptrs)


def row_bytes(spec: EngineSpec) -> int:
    """Bytes of one contiguous (token, head) row: head_dim elements (the MLA latent)."""
    return spec.head_dim * spec.element_size


def tensor_nbytes(spec: EngineSpec) -> int:
    """Bytes of each registered tensor."""
    shape = spec.rank_tensor_shapes()[0]
    n = spec.element_size
    for size in shape:
        n *= size
    return n


def word_bytes(specs: Sequence[EngineSpec], addresses: Sequence[int]) -> int:
    """Widest integer (4, 2 or 1 bytes) that divides every row and address: the kernel copies words.

    Copying as integers makes the copy bitwise (NaN payloads, float8) and lets
    the compiler issue 16-byte vector accesses over rows of 4-byte words.
    """
    for width in (4, 2, 1):
        if all(row_bytes(s) % width == 0 for s in specs) and all(a % width == 0 for a in addresses):
            return width
    return 1


def vector_words(specs: Sequence[EngineSpec], addresses: Sequence[int], width: int) -> int:
    """Words every row start is a multiple of (so 16-byte accesses are legal), at most 16 bytes."""
    best = 1
    for vec_bytes in (16, 8, 4, 2):
        if vec_bytes < width:
            break
        aligned = all(row_bytes(s) % vec_bytes == 0 for s in specs) and all(
            a % vec_bytes == 0 for a in addresses
        )
        if aligned:
            best = vec_bytes // width
            break
    return best


def chunk_words(row_words: int, cap: int = 64) -> int:
    """Largest power of two <= cap dividing the row length: rows are split into equal chunks of it.

    A 576-element bf16 MLA row (288 words) becomes 9 chunks of 32 words instead
    of one 512-wide tile with 224 masked-off lanes.
    """
    chunk = 1
    while chunk < cap and row_words % (chunk * 2) == 0:
        chunk *= 2
    return chunk
