from . import common_pb2 as _common_pb2
from . import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RouteRequest(_message.Message):
    __slots__ = ("engine_id", "rank", "device_uuid", "own_leader", "placement")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    OWN_LEADER_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    rank: int
    device_uuid: str
    own_leader: bool
    placement: str
    def __init__(self, engine_id: _Optional[str] = ..., rank: _Optional[int] = ..., device_uuid: _Optional[str] = ..., own_leader: _Optional[bool] = ..., placement: _Optional[str] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("engine_target", "shard", "leader_address")
    ENGINE_TARGET_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    LEADER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    engine_target: str
    shard: int
    leader_address: str
    def __init__(self, engine_target: _Optional[str] = ..., shard: _Optional[int] = ..., leader_address: _Optional[str] = ...) -> None: ...

class RegisterRankRequest(_message.Message):
    __slots__ = ("engine_id", "rank", "spec", "tensors", "leader_address")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    LEADER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    rank: int
    spec: _common_pb2.EngineSpec
    tensors: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorHandle]
    leader_address: str
    def __init__(self, engine_id: _Optional[str] = ..., rank: _Optional[int] = ..., spec: _Optional[_Union[_common_pb2.EngineSpec, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[_common_pb2.TensorHandle, _Mapping]]] = ..., leader_address: _Optional[str] = ...) -> None: ...

class RegisterRankResponse(_message.Message):
    __slots__ = ("sidecar_id", "peer_address", "leader_address")
    SIDECAR_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEADER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    sidecar_id: str
    peer_address: str
    leader_address: str
    def __init__(self, sidecar_id: _Optional[str] = ..., peer_address: _Optional[str] = ..., leader_address: _Optional[str] = ...) -> None: ...

class UnregisterRankRequest(_message.Message):
    __slots__ = ("engine_id", "rank")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    rank: int
    def __init__(self, engine_id: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class UnregisterRankResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EventsRequest(_message.Message):
    __slots__ = ("engine_id", "rank", "unregister_on_close", "batched")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    UNREGISTER_ON_CLOSE_FIELD_NUMBER: _ClassVar[int]
    BATCHED_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    rank: int
    unregister_on_close: bool
    batched: bool
    def __init__(self, engine_id: _Optional[str] = ..., rank: _Optional[int] = ..., unregister_on_close: _Optional[bool] = ..., batched: _Optional[bool] = ...) -> None: ...

class RequestConsumed(_message.Message):
    __slots__ = ("request_id", "block_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LeaseExpired(_message.Message):
    __slots__ = ("request_id", "block_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RequestReleased(_message.Message):
    __slots__ = ("request_id", "block_ids", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., reason: _Optional[str] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("consumed", "lease_expired", "ready", "released", "consumed_many")
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_MANY_FIELD_NUMBER: _ClassVar[int]
    consumed: RequestConsumed
    lease_expired: LeaseExpired
    ready: bool
    released: RequestReleased
    consumed_many: RequestsConsumed
    def __init__(self, consumed: _Optional[_Union[RequestConsumed, _Mapping]] = ..., lease_expired: _Optional[_Union[LeaseExpired, _Mapping]] = ..., ready: _Optional[bool] = ..., released: _Optional[_Union[RequestReleased, _Mapping]] = ..., consumed_many: _Optional[_Union[RequestsConsumed, _Mapping]] = ...) -> None: ...

class RequestsConsumed(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RequestConsumed]
    def __init__(self, requests: _Optional[_Iterable[_Union[RequestConsumed, _Mapping]]] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("engine_id", "request_id", "block_ids", "num_tokens", "lease_ms", "first_token")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    lease_ms: int
    first_token: int
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., lease_ms: _Optional[int] = ..., first_token: _Optional[int] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("params",)
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    params: _common_pb2.TransferParams
    def __init__(self, params: _Optional[_Union[_common_pb2.TransferParams, _Mapping]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("params", "engine_id", "ranks", "block_ids", "start_token", "timeout_ms", "group")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    START_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    params: _common_pb2.TransferParams
    engine_id: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    start_token: int
    timeout_ms: int
    group: int
    def __init__(self, params: _Optional[_Union[_common_pb2.TransferParams, _Mapping]] = ..., engine_id: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ..., start_token: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., group: _Optional[int] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("bytes", "duration_us", "path")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DURATION_US_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    duration_us: int
    path: str
    def __init__(self, bytes: _Optional[int] = ..., duration_us: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class PullBatchRequest(_message.Message):
    __slots__ = ("pulls", "stream_outcomes", "group_outcomes")
    PULLS_FIELD_NUMBER: _ClassVar[int]
    STREAM_OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    GROUP_OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    pulls: _containers.RepeatedCompositeFieldContainer[PullRequest]
    stream_outcomes: bool
    group_outcomes: bool
    def __init__(self, pulls: _Optional[_Iterable[_Union[PullRequest, _Mapping]]] = ..., stream_outcomes: _Optional[bool] = ..., group_outcomes: _Optional[bool] = ...) -> None: ...

class PullOutcomes(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[PullOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[PullOutcome, _Mapping]]] = ...) -> None: ...

class PullOutcome(_message.Message):
    __slots__ = ("response", "code", "message", "trailers", "index")
    class TrailersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRAILERS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    response: PullResponse
    code: str
    message: str
    trailers: _containers.ScalarMap[str, str]
    index: int
    def __init__(self, response: _Optional[_Union[PullResponse, _Mapping]] = ..., code: _Optional[str] = ..., message: _Optional[str] = ..., trailers: _Optional[_Mapping[str, str]] = ..., index: _Optional[int] = ...) -> None: ...

class PullBatchResponse(_message.Message):
    __slots__ = ("outcomes", "duration_us")
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    DURATION_US_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[PullOutcome]
    duration_us: int
    def __init__(self, outcomes: _Optional[_Iterable[_Union[PullOutcome, _Mapping]]] = ..., duration_us: _Optional[int] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("params",)
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    params: _containers.RepeatedCompositeFieldContainer[_common_pb2.TransferParams]
    def __init__(self, params: _Optional[_Iterable[_Union[_common_pb2.TransferParams, _Mapping]]] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("lease_deadline_unix_ms",)
    LEASE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    lease_deadline_unix_ms: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_deadline_unix_ms: _Optional[_Iterable[int]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("engine_id", "request_id", "params")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    params: _common_pb2.TransferParams
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., params: _Optional[_Union[_common_pb2.TransferParams, _Mapping]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class LaneHello(_message.Message):
    __slots__ = ("version", "sidecar_id", "max_call_bytes", "refused")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_CALL_BYTES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    version: int
    sidecar_id: str
    max_call_bytes: int
    refused: str
    def __init__(self, version: _Optional[int] = ..., sidecar_id: _Optional[str] = ..., max_call_bytes: _Optional[int] = ..., refused: _Optional[str] = ...) -> None: ...

class LaneCall(_message.Message):
    __slots__ = ("pull", "publish", "pull_batch")
    PULL_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_FIELD_NUMBER: _ClassVar[int]
    PULL_BATCH_FIELD_NUMBER: _ClassVar[int]
    pull: PullRequest
    publish: PublishRequest
    pull_batch: PullBatchRequest
    def __init__(self, pull: _Optional[_Union[PullRequest, _Mapping]] = ..., publish: _Optional[_Union[PublishRequest, _Mapping]] = ..., pull_batch: _Optional[_Union[PullBatchRequest, _Mapping]] = ...) -> None: ...

class LaneAnswer(_message.Message):
    __slots__ = ("pull", "publish", "pull_batch", "pull_outcome", "pull_outcomes", "code", "message", "trailers")
    class TrailersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PULL_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_FIELD_NUMBER: _ClassVar[int]
    PULL_BATCH_FIELD_NUMBER: _ClassVar[int]
    PULL_OUTCOME_FIELD_NUMBER: _ClassVar[int]
    PULL_OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRAILERS_FIELD_NUMBER: _ClassVar[int]
    pull: PullResponse
    publish: PublishResponse
    pull_batch: PullBatchResponse
    pull_outcome: PullOutcome
    pull_outcomes: PullOutcomes
    code: str
    message: str
    trailers: _containers.ScalarMap[str, str]
    def __init__(self, pull: _Optional[_Union[PullResponse, _Mapping]] = ..., publish: _Optional[_Union[PublishResponse, _Mapping]] = ..., pull_batch: _Optional[_Union[PullBatchResponse, _Mapping]] = ..., pull_outcome: _Optional[_Union[PullOutcome, _Mapping]] = ..., pull_outcomes: _Optional[_Union[PullOutcomes, _Mapping]] = ..., code: _Optional[str] = ..., message: _Optional[str] = ..., trailers: _Optional[_Mapping[str, str]] = ...) -> None: ...
