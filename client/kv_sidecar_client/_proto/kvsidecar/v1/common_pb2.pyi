from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineSpec(_message.Message):
    __slots__ = ("tp_size", "num_layers", "num_kv_heads", "head_dim", "dtype", "block_size", "num_blocks", "layout", "kernel_block_size", "cross_layer", "groups")
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KERNEL_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CROSS_LAYER_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    tp_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    num_blocks: int
    layout: str
    kernel_block_size: int
    cross_layer: bool
    groups: _containers.RepeatedCompositeFieldContainer[KVCacheGroup]
    def __init__(self, tp_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., layout: _Optional[str] = ..., kernel_block_size: _Optional[int] = ..., cross_layer: _Optional[bool] = ..., groups: _Optional[_Iterable[_Union[KVCacheGroup, _Mapping]]] = ...) -> None: ...

class KVCacheGroup(_message.Message):
    __slots__ = ("layers", "sliding_window", "state")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedScalarFieldContainer[str]
    sliding_window: int
    state: _containers.RepeatedCompositeFieldContainer[StateArray]
    def __init__(self, layers: _Optional[_Iterable[str]] = ..., sliding_window: _Optional[int] = ..., state: _Optional[_Iterable[_Union[StateArray, _Mapping]]] = ...) -> None: ...

class StateArray(_message.Message):
    __slots__ = ("name", "shape", "dtype", "offset", "tp_dim", "segments")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TP_DIM_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    offset: int
    tp_dim: int
    segments: _containers.RepeatedCompositeFieldContainer[StateSegment]
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., offset: _Optional[int] = ..., tp_dim: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[StateSegment, _Mapping]]] = ...) -> None: ...

class StateSegment(_message.Message):
    __slots__ = ("size", "replicated")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLICATED_FIELD_NUMBER: _ClassVar[int]
    size: int
    replicated: bool
    def __init__(self, size: _Optional[int] = ..., replicated: _Optional[bool] = ...) -> None: ...

class ShmTensor(_message.Message):
    __slots__ = ("name", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class CudaIpcTensor(_message.Message):
    __slots__ = ("handle", "offset", "device_uuid")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    offset: int
    device_uuid: str
    def __init__(self, handle: _Optional[bytes] = ..., offset: _Optional[int] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class TensorHandle(_message.Message):
    __slots__ = ("shm", "cuda_ipc", "shape", "strides", "dtype")
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    shm: ShmTensor
    cuda_ipc: CudaIpcTensor
    shape: _containers.RepeatedScalarFieldContainer[int]
    strides: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, shm: _Optional[_Union[ShmTensor, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcTensor, _Mapping]] = ..., shape: _Optional[_Iterable[int]] = ..., strides: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class TransferParams(_message.Message):
    __slots__ = ("engine_id", "sidecar_address", "sidecar_id", "request_id", "block_ids", "num_tokens", "lease_deadline_unix_ms", "first_token", "map_version")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MAP_VERSION_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    sidecar_address: str
    sidecar_id: str
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    lease_deadline_unix_ms: int
    first_token: int
    map_version: int
    def __init__(self, engine_id: _Optional[str] = ..., sidecar_address: _Optional[str] = ..., sidecar_id: _Optional[str] = ..., request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., lease_deadline_unix_ms: _Optional[int] = ..., first_token: _Optional[int] = ..., map_version: _Optional[int] = ...) -> None: ...
