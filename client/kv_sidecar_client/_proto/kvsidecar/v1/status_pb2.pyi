from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankStatus(_message.Message):
    __slots__ = ("engine_id", "rank", "tp_size", "layout", "num_blocks", "bytes", "sessions")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    rank: int
    tp_size: int
    layout: str
    num_blocks: int
    bytes: int
    sessions: int
    def __init__(self, engine_id: _Optional[str] = ..., rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., layout: _Optional[str] = ..., num_blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., sessions: _Optional[int] = ...) -> None: ...

class PeerStatus(_message.Message):
    __slots__ = ("address", "sidecar_id", "direction", "engine_id", "reader_engine_id", "plan_hash")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_ID_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    READER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_HASH_FIELD_NUMBER: _ClassVar[int]
    address: str
    sidecar_id: str
    direction: str
    engine_id: str
    reader_engine_id: str
    plan_hash: str
    def __init__(self, address: _Optional[str] = ..., sidecar_id: _Optional[str] = ..., direction: _Optional[str] = ..., engine_id: _Optional[str] = ..., reader_engine_id: _Optional[str] = ..., plan_hash: _Optional[str] = ...) -> None: ...

class TransferStatus(_message.Message):
    __slots__ = ("kind", "request_id", "engine_id", "remote_engine_id", "peer", "elapsed_s", "bytes", "path")
    KIND_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    kind: str
    request_id: str
    engine_id: str
    remote_engine_id: str
    peer: str
    elapsed_s: float
    bytes: int
    path: str
    def __init__(self, kind: _Optional[str] = ..., request_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., remote_engine_id: _Optional[str] = ..., peer: _Optional[str] = ..., elapsed_s: _Optional[float] = ..., bytes: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class RecentThroughput(_message.Message):
    __slots__ = ("window_s", "pulls", "failed_pulls", "bytes", "busy_s", "served_reads")
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    FAILED_PULLS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    SERVED_READS_FIELD_NUMBER: _ClassVar[int]
    window_s: float
    pulls: int
    failed_pulls: int
    bytes: int
    busy_s: float
    served_reads: int
    def __init__(self, window_s: _Optional[float] = ..., pulls: _Optional[int] = ..., failed_pulls: _Optional[int] = ..., bytes: _Optional[int] = ..., busy_s: _Optional[float] = ..., served_reads: _Optional[int] = ...) -> None: ...

class PublishRefusal(_message.Message):
    __slots__ = ("engine_id", "reason", "count", "last_message", "last_unix_s")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    LAST_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LAST_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    reason: str
    count: int
    last_message: str
    last_unix_s: float
    def __init__(self, engine_id: _Optional[str] = ..., reason: _Optional[str] = ..., count: _Optional[int] = ..., last_message: _Optional[str] = ..., last_unix_s: _Optional[float] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("device", "pid", "restarts", "local_copies", "staged", "starting")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_COPIES_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    STARTING_FIELD_NUMBER: _ClassVar[int]
    device: int
    pid: int
    restarts: int
    local_copies: bool
    staged: bool
    starting: bool
    def __init__(self, device: _Optional[int] = ..., pid: _Optional[int] = ..., restarts: _Optional[int] = ..., local_copies: _Optional[bool] = ..., staged: _Optional[bool] = ..., starting: _Optional[bool] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("sidecar_id", "version", "peer_address", "peer_security", "draining", "uptime_s", "ranks", "published_requests", "peers", "inflight", "recent", "engine_lane", "engine_lane_connections", "publish_refusals", "device_workers", "workers", "shards", "shard_gpus")
    SIDECAR_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PEER_SECURITY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    RECENT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_LANE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_LANE_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_REFUSALS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    SHARD_GPUS_FIELD_NUMBER: _ClassVar[int]
    sidecar_id: str
    version: str
    peer_address: str
    peer_security: str
    draining: bool
    uptime_s: float
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    published_requests: int
    peers: _containers.RepeatedCompositeFieldContainer[PeerStatus]
    inflight: _containers.RepeatedCompositeFieldContainer[TransferStatus]
    recent: RecentThroughput
    engine_lane: str
    engine_lane_connections: int
    publish_refusals: _containers.RepeatedCompositeFieldContainer[PublishRefusal]
    device_workers: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    shards: _containers.RepeatedCompositeFieldContainer[StatusResponse]
    shard_gpus: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sidecar_id: _Optional[str] = ..., version: _Optional[str] = ..., peer_address: _Optional[str] = ..., peer_security: _Optional[str] = ..., draining: _Optional[bool] = ..., uptime_s: _Optional[float] = ..., ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ..., published_requests: _Optional[int] = ..., peers: _Optional[_Iterable[_Union[PeerStatus, _Mapping]]] = ..., inflight: _Optional[_Iterable[_Union[TransferStatus, _Mapping]]] = ..., recent: _Optional[_Union[RecentThroughput, _Mapping]] = ..., engine_lane: _Optional[str] = ..., engine_lane_connections: _Optional[int] = ..., publish_refusals: _Optional[_Iterable[_Union[PublishRefusal, _Mapping]]] = ..., device_workers: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., shards: _Optional[_Iterable[_Union[StatusResponse, _Mapping]]] = ..., shard_gpus: _Optional[_Iterable[int]] = ...) -> None: ...
