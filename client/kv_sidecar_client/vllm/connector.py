"""KVSidecarConnector: vLLM's KV connector API on top of the kv-sidecar client.

The glue only: it translates vLLM's objects into the plain values that
scheduler.py (one per engine) and worker.py (one per TP rank) work with.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

from kv_sidecar_client.vllm.config import ConnectorConfig
from kv_sidecar_client.vllm.groups import KVGroup, StateArray, region_layers
from kv_sidecar_client.vllm.kv_layout import (
    KVWriter,
    UnsupportedKVCache,
    VllmKVInfo,
    check_covers_allocation,
    describe,
    transferred_layers,
)
from kv_sidecar_client.vllm.mamba_state import check_settings, mamba2_sharding, state_arrays, state_bytes
from kv_sidecar_client.vllm.metadata import StepOrders
from kv_sidecar_client.vllm.scheduler import SidecarScheduler
from kv_sidecar_client.vllm.worker import SidecarWorker

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def _log_like_vllm() -> None:
    """Our modules log under kv_sidecar_client.*; show those lines where and as vLLM shows its own."""
    ours, vllm_logger = logging.getLogger("kv_sidecar_client"), logging.getLogger("vllm")
    if not ours.handlers and vllm_logger.handlers:
        for handler in vllm_logger.handlers:
            ours.addHandler(handler)
        ours.setLevel(vllm_logger.level)
        ours.propagate = False


@dataclass
class KVSidecarMetadata(KVConnectorMetadata):
    orders: StepOrders = field(default_factory=StepOrders)


class KVSidecarConnector(KVConnectorBase_V1, SupportsHMA):
    """Load with `--kv-transfer-config '{"kv_connector": "KVSidecarConnector",
    "kv_connector_module_path": "kv_sidecar_client.vllm", "kv_role": "kv_both", ...}'` (docs/vllm.md)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_like_vllm()
        ktc = vllm_config.kv_transfer_config
        self.config = ConnectorConfig.from_extra_config(ktc.kv_connector_extra_config)
        self.engine_id = self.config.engine_id or str(ktc.engine_id)
        _check_parallelism(vllm_config)
        self._scheduler: SidecarScheduler | None = None
        self._worker: SidecarWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            groups = self._groups()
            self._scheduler = SidecarScheduler(
                self.config,
                self.engine_id,
                vllm_config.cache_config.block_size,
                groups[0].window if len(groups) == 1 else None,
                groups=groups,
            )
        else:
            on_cpu = vllm_config.device_config.device.type == "cpu"
            self._worker = SidecarWorker(
                self.config, self.engine_id, get_tensor_model_parallel_rank(), on_cpu
            )

    # -- worker side -------------------------------------------------------------------------
    def get_mem_pool_context(self) -> AbstractContextManager | None:
        # CPU engines: the KV cache goes into /dev/shm so the sidecar maps the very same pages.
        # GPU engines keep the default caching allocator (cudaMalloc memory is IPC-exportable).
        if self._worker is not None and self._worker.pool is not None:
            return self._worker.pool.allocation()
        return None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        info = self._kv_info()
        attention = _attention_layers(self._vllm_config)
        sharing = {
            name: getattr(layer, "kv_sharing_target_layer_name", None) for name, layer in attention.items()
        }
        groups = self._kv_cache_config.kv_cache_groups if self._kv_cache_config is not None else []
        if len(groups) > 1:
            self._worker.register(self._describe_hybrid(kv_caches, info, attention, sharing))
            return
        names = transferred_layers(
            kv_caches, sharing, [n for g in groups for n in g.layer_names], _layer_index
        )
        # Every layer's page order is checked against its own kernel (MLA pages have one order).
        writers = None if info.use_mla else [_kernel_writer(name, attention.get(name)) for name in names]
        desc = describe([kv_caches[n] for n in names], info, names, writers)
        if self._kv_cache_config is not None:
            check_covers_allocation(desc, [t.size for t in self._kv_cache_config.kv_cache_tensors])
        self._worker.register(desc)

    def _describe_hybrid(
        self,
        kv_caches: dict[str, torch.Tensor],
        info: VllmKVInfo,
        attention: dict[str, Any],
        sharing: dict[str, str | None],
    ) -> Any:
        """A hybrid model's rank (groups.py): one region per layer position, shared by that position's
        layer of every group. Each group's layers are checked against their own kernels, and every
        layer must be exactly its position's view: otherwise a group's blocks would be moved as
        another layer's bytes. The regions are the attention layers' views; a Mamba layer's pages and
        state views must lie in its position's region as its group's state arrays say."""
        assert self._kv_cache_config is not None
        kinds = self._groups()
        state_groups = [list(k.layers) for k in kinds if k.state]
        groups = [list(k.layers) for k in kinds if not k.state]
        shared = sorted(n for n, t in sharing.items() if t is not None)
        if shared:
            raise UnsupportedKVCache(
                f"KVSidecarConnector: hybrid models with cross-layer KV sharing are not supported ({shared[0]} "
                f"reads {sharing[shared[0]]}'s cache)"
            )
        missing = sorted({n for g in (*groups, *state_groups) for n in g} - set(kv_caches))
        if missing:
            raise UnsupportedKVCache(f"KVSidecarConnector: vLLM gave no KV cache for layers {missing}")
        positions = region_layers(groups)
        width = max(len(g) for g in (*groups, *state_groups))
        if len(positions) != width:
            raise UnsupportedKVCache(
                f"KVSidecarConnector: the attention groups cover {len(positions)} of the {width} layer "
                "positions; a position of Mamba layers only has no attention page to describe its region by"
            )
        for layers in positions:
            first = kv_caches[layers[0]]
            for name in layers[1:]:
                t = kv_caches[name]
                if (t.data_ptr(), t.shape, t.stride()) != (first.data_ptr(), first.shape, first.stride()):
                    raise UnsupportedKVCache(
                        f"KVSidecarConnector: {name} (a layer of another KV cache group) is not the view of "
                        f"{layers[0]}'s bytes that vLLM's hybrid allocation makes it (shape {tuple(t.shape)}, "
                        f"strides {tuple(t.stride())}, at {t.data_ptr():#x}); the connector cannot tell "
                        "which group's blocks it holds"
                    )
        names = [layers[0] for layers in positions]
        desc = describe(
            [kv_caches[n] for n in names],
            info,
            names,
            None if info.use_mla else [_kernel_writer(n, attention.get(n)) for n in names],
        )
        for layers in groups[1:]:  # the other groups' kernels must write the same page order
            other = describe(
                [kv_caches[n] for n in layers],
                info,
                layers,
                None if info.use_mla else [_kernel_writer(n, attention.get(n)) for n in layers],
            )
            if other.spec["layout"] != desc.spec["layout"]:
                raise UnsupportedKVCache(
                    f"KVSidecarConnector: {layers[0]} writes its KV cache as {other.spec['layout']}, the "
                    f"layer sharing its bytes ({names[0]}) as {desc.spec['layout']}"
                )
        # Each Mamba layer's page is its position's region, block for block, and its state views sit
        # where the spec says: otherwise a state block would be moved as other bytes.
        for kind in kinds:
            for j, name in enumerate(kind.layers if kind.state else ()):
                _check_state_views(
                    name,
                    kv_caches[name],
                    _state_views(self._vllm_config, name),
                    desc.regions[j],
                    desc.spec["block_size"]
                    // (desc.spec.get("kernel_block_size") or desc.spec["block_size"]),
                    kind,
                )
        # The groups alias one allocation (every KVCacheTensor names the same one): count it once.
        check_covers_allocation(desc, sorted({t.size for t in self._kv_cache_config.kv_cache_tensors}))
        # The sidecar's plan pairs engines only if their groups correspond (it names the layer if not).
        desc.spec["groups"] = [
            {
                "layers": list(g.layers),
                "sliding_window": g.window or 0,
                **({"state": [a.to_json() for a in g.state]} if g.state else {}),
            }
            for g in kinds
        ]
        return desc

    def _groups(self) -> list[KVGroup]:
        """vLLM's KV cache groups: their layers and windows (the tokens vLLM keeps behind a request's
        next token: the window and any extra tokens it retains; None: full attention). One group of
        any kind is as before; a hybrid model's groups must be full or sliding-window attention, or
        Mamba state (with its arrays: mamba_state.py) next to at least one attention group."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

        groups = self._kv_cache_config.kv_cache_groups if self._kv_cache_config is not None else []
        out = []
        for g in groups:
            spec = g.kv_cache_spec
            first = g.layer_names[0] if g.layer_names else "?"
            window = None
            if isinstance(spec, SlidingWindowSpec):
                window = int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0) or 0)
            if len(groups) > 1 and type(spec) is MambaSpec:
                out.append(KVGroup(tuple(g.layer_names), None, _mamba_arrays(first, spec, self._vllm_config)))
                continue
            # Exactly these kinds in a hybrid: subclasses (MLA, sinks, ...) are not tested with groups.
            if len(groups) > 1 and type(spec) not in (FullAttentionSpec, SlidingWindowSpec):
                raise ValueError(
                    f"KVSidecarConnector supports hybrid models of full and sliding-window attention and Mamba "
                    f"state; KV cache group of {first} is a {type(spec).__name__}"
                )
            out.append(KVGroup(tuple(g.layer_names), window))
        if out and all(g.state for g in out):
            raise ValueError(
                "KVSidecarConnector: a model of Mamba layers only (no attention group) is not supported"
            )
        return out or [KVGroup((), None)]

    def _kv_info(self) -> VllmKVInfo:
        cfg = self._vllm_config
        groups = self._kv_cache_config.kv_cache_groups if self._kv_cache_config is not None else []
        if not groups:
            raise ValueError("KVSidecarConnector: this model has no KV cache group (attention-free?)")
        kinds = self._groups()  # a hybrid model's groups are of kinds we move
        # Mamba groups page their state into the attention blocks' bytes (mamba_state.py): the attention
        # groups give the regions' geometry, and the Mamba pages must be exactly one such block.
        attention = [g for g, kind in zip(groups, kinds, strict=True) if not kind.state]
        spec = attention[0].kv_cache_spec
        for g, kind in zip(groups, kinds, strict=True):
            if kind.state:
                check_settings(
                    g.layer_names[0],
                    str(g.kv_cache_spec.mamba_cache_mode),
                    int(g.kv_cache_spec.num_speculative_blocks),
                    int(g.kv_cache_spec.page_size_bytes),
                    int(spec.page_size_bytes),
                )
        # The groups of a hybrid model share one allocation and one page geometry (regions per layer
        # position): the same block size, heads, head size and dtype in every group.
        geometry = _geometry(spec)
        for g in attention[1:]:
            if _geometry(g.kv_cache_spec) != geometry:
                raise ValueError(
                    f"KVSidecarConnector: KV cache group of {g.layer_names[0]} has block size, KV heads, head "
                    f"size, dtype {_geometry(g.kv_cache_spec)}, the first group {geometry}: hybrid models "
                    "need one page geometry"
                )
        for needed in ("num_kv_heads", "head_size", "dtype"):
            if not hasattr(spec, needed):
                raise ValueError(f"KVSidecarConnector cannot move a {type(spec).__name__} KV cache")
        return VllmKVInfo(
            backend=_backend_name(cfg),
            layout=str(
                cfg.cache_config.kv_cache_layout or getattr(self._kv_cache_config, "kv_cache_layout", "?")
            ),
            block_size=spec.block_size,
            num_kv_heads=cfg.model_config.get_total_num_kv_heads(),
            head_size=spec.head_size,
            head_size_v=getattr(spec, "head_size_v", spec.head_size) or 0,
            tp_size=cfg.parallel_config.tensor_parallel_size,
            use_mla=bool(cfg.model_config.use_mla),
            model_dtype=cfg.model_config.dtype,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVSidecarMetadata)
        self._worker.take_orders(meta.orders)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-request and asynchronous: vLLM waits for them between steps

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # prefill blocks are read in place by the sidecar; nothing to save

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._transfer_results().as_finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # A failed receive makes vLLM compute the request from its start (its sliding window's blocks
        # before the first unfilled one no longer hold what that token attends): failed_recving.
        return self._transfer_results().as_vllm()

    def _transfer_results(self) -> _Results:
        assert self._worker is not None
        sending, recving = self._worker.finished()
        return _Results(sending, recving, self._worker.failed_receives())

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # -- scheduler side -------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)
        keep = self._scheduler.prefill_length(request)
        if keep is not None:
            _shorten_prompt(request, keep)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        tables = [_table(group) for group in blocks.blocks]
        if len(tables) > 1:
            self._scheduler.after_alloc_groups(request, tables, num_external_tokens)
            return
        ((ids, cached, nulls),) = tables
        self._scheduler.after_alloc(request, ids, cached, num_external_tokens, num_null_blocks=nulls)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return KVSidecarMetadata(self._scheduler.take_orders())

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.finished_loading(
            list(connector_output.finished_recving or ()),
            connector_output.failed_recving or (),
            connector_output.invalid_block_ids or (),
        )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM calls this instead of request_finished when the hybrid manager is on (SupportsHMA)."""
        assert self._scheduler is not None
        if len(block_ids) == 1:
            return self._scheduler.request_finished(request, block_ids[0])
        return self._scheduler.request_finished_groups(request, [list(b) for b in block_ids])

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        groups = self._kv_cache_config.kv_cache_groups if self._kv_cache_config is not None else [None]
        return tuple(range(len(groups)))  # every group's blocks of the request are loaded


@dataclass
class _Results:
    sending: set[str]
    recving: set[str]
    failed: set[str]  # also in recving, as vLLM wants failed receives

    def as_finished(self) -> tuple[set[str] | None, set[str] | None]:
        return self.sending or None, self.recving or None

    def as_vllm(self) -> KVConnectorTransferResults:
        return KVConnectorTransferResults(self.sending, self.recving, self.failed)


def _table(group: Sequence[Any]) -> tuple[list[int], int, int]:
    """One group's blocks of a request: (ids, local prefix-cache hit, leading null blocks). A
    sliding-window table starts with null blocks (vLLM's padding for the blocks before its window);
    then the local prefix-cache hit: blocks that already carry a hash."""
    nulls = 0
    while nulls < len(group) and group[nulls].is_null:
        nulls += 1
    cached = 0
    for block in group[nulls:]:
        if block.block_hash is None or block.is_null:
            break
        cached += 1
    return [b.block_id for b in group], cached, nulls


def _geometry(spec: Any) -> tuple[Any, ...]:
    return (
        spec.block_size,
        getattr(spec, "num_kv_heads", None),
        getattr(spec, "head_size", None),
        spec.dtype,
    )


def _shorten_prompt(request: Any, keep: int) -> None:
    """Prefill of a sliding-window request: compute only its first `keep` prompt tokens and one output
    token (window.prefill_tokens says why; the decode engine computes the rest). vLLM's NixlConnector
    shortens a prefill the same way for Mamba state (`_truncate_request_for_prefill`)."""
    drop = int(request.num_prompt_tokens) - keep
    if drop <= 0 or request.prompt_token_ids is None or getattr(request, "prompt_embeds", None) is not None:
        return
    skip_reading = getattr(request, "get_skip_reading_prefix_cache", None)
    if skip_reading is not None and skip_reading():
        return  # prompt logprobs: the decode engine reads no KV and computes the whole prompt itself
    del request.prompt_token_ids[-drop:]
    del request._all_token_ids[-drop:]
    request.num_prompt_tokens -= drop
    request.max_tokens = 1  # a longer prefill would free more of the window than the decode engine needs


def _mamba_arrays(layer: str, spec: Any, vllm_config: VllmConfig) -> tuple[StateArray, ...]:
    """The layer's state arrays, with their TP sharding where the sidecar can convert them (Mamba-2)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    arrays = state_arrays(layer, spec.shapes, [str(d).removeprefix("torch.") for d in spec.dtypes])
    if getattr(getattr(spec, "mamba_type", None), "name", None) != "MAMBA2":
        return arrays
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    return mamba2_sharding(arrays, _model_state_shapes(vllm_config), tp, is_conv_state_dim_first())


def _model_state_shapes(vllm_config: VllmConfig) -> tuple[tuple[int, ...], ...] | None:
    """The Mamba state shapes of the model at TP 1, as vLLM computes them for any TP
    (`get_mamba_state_shape_from_config`, the model class's own, given a copy of the config at TP 1);
    None where that cannot be had."""
    import copy

    from vllm.model_executor.models.registry import ModelRegistry

    try:
        model_cls, _ = ModelRegistry.resolve_model_cls(
            vllm_config.model_config.architecture, model_config=vllm_config.model_config
        )
        at_one = copy.copy(vllm_config)
        parallel = copy.copy(vllm_config.parallel_config)
        object.__setattr__(parallel, "tensor_parallel_size", 1)
        object.__setattr__(at_one, "parallel_config", parallel)
        shapes = model_cls.get_mamba_state_shape_from_config(at_one)
        return tuple(tuple(int(x) for x in shape) for shape in shapes)
    except Exception as e:  # undescribed: such state moves only between engines of one TP size
        log.info("KVSidecarConnector: no Mamba state shapes at TP 1 (%s); state converts only at equal TP", e)
        return None


def _state_views(vllm_config: VllmConfig, name: str) -> tuple[torch.Tensor, ...]:
    """A Mamba layer's state views as its kernels use them (bound by vLLM before registration)."""
    layer = vllm_config.compilation_config.static_forward_context.get(name)
    views = getattr(layer, "kv_cache", None)
    if not isinstance(views, (tuple, list)) or not all(isinstance(v, torch.Tensor) for v in views):
        raise UnsupportedKVCache(
            f"KVSidecarConnector: Mamba layer {name} has no state views bound ({views!r})"
        )
    return tuple(views)


def _check_state_views(
    name: str,
    page: torch.Tensor,
    views: Sequence[torch.Tensor],
    region: torch.Tensor,
    kernel_blocks: int,
    group: KVGroup,
) -> None:
    """The Mamba layer's page view and state views lie in its position's region as the spec says: block b
    of the state is block b of the region (`kernel_blocks` of the region's first dim), each array at its
    offset, contiguous within the block."""
    base, block = region.data_ptr(), region.stride(0) * region.element_size() * kernel_blocks
    page_block = page.stride(0) * page.element_size()
    if page.data_ptr() != base or page_block != block or page.shape[0] * kernel_blocks != region.shape[0]:
        raise UnsupportedKVCache(
            f"KVSidecarConnector: Mamba layer {name}'s pages (shape {tuple(page.shape)}, strides {tuple(page.stride())}, "
            f"at {page.data_ptr():#x}) are not the blocks of its layer position's region ({region.shape[0]} blocks "
            f"of {block} bytes at {base:#x})"
        )
    if len(views) != len(group.state):
        raise UnsupportedKVCache(
            f"KVSidecarConnector: Mamba layer {name} binds {len(views)} state arrays, its KV cache spec {len(group.state)}"
        )
    for view, want in zip(views, group.state, strict=True):
        got_dtype = str(view.dtype).removeprefix("torch.")
        contiguous = view[0].is_contiguous() if view.shape[0] else True
        if (
            view.data_ptr() - base != want.offset
            or tuple(view.shape[1:]) != want.shape
            or got_dtype != want.dtype
            or view.stride(0) * view.element_size() != block
            or not contiguous
        ):
            raise UnsupportedKVCache(
                f"KVSidecarConnector: Mamba layer {name}'s {want.name} state (shape {tuple(view.shape)}, strides "
                f"{tuple(view.stride())}, {got_dtype}, at byte {view.data_ptr() - base} of its region) is not "
                f"{want.describe()} in blocks of {block} bytes"
            )
    if state_bytes(group.state) > block:
        raise UnsupportedKVCache(
            f"KVSidecarConnector: Mamba layer {name}'s state does not fit in a block of {block} bytes"
        )


def _layer_index(name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(name)


def _attention_layers(vllm_config: VllmConfig) -> dict[str, Any]:
    from vllm.config.vllm import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    return dict(get_layers_from_vllm_config(vllm_config, AttentionLayerBase))


def _kernel_writer(name: str, layer: Any) -> KVWriter:
    """The layer's own cache write (vLLM's `do_kv_cache_update`), for describe() to check the layout by."""
    update = getattr(getattr(layer, "impl", None), "do_kv_cache_update", None)
    if update is None:
        raise UnsupportedKVCache(
            f"KVSidecarConnector cannot check the KV cache layout of {name}: its attention backend "
            f"({type(getattr(layer, 'impl', None)).__name__}) has no do_kv_cache_update to write a probe with"
        )
    return lambda key, value, cache, slots: update(layer, key, value, cache, slots)


def _backend_name(vllm_config: VllmConfig) -> str:
    try:
        from vllm.config.vllm import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)
        names = {layer.get_attn_backend().get_name() for layer in layers.values()}
        return "/".join(sorted(names)) or "?"
    except Exception:  # only for messages
        return "?"


def _check_parallelism(vllm_config: VllmConfig) -> None:
    pc = vllm_config.parallel_config
    for name in ("pipeline_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(pc, name, 1) or 1
        if size > 1:
            raise ValueError(f"KVSidecarConnector supports tensor parallelism only; {name} is {size}")
