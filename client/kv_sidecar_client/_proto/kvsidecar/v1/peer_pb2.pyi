from . import common_pb2 as _common_pb2
from . import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemoryRegion(_message.Message):
    __slots__ = ("address", "length", "device_id")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    address: int
    length: int
    device_id: int
    def __init__(self, address: _Optional[int] = ..., length: _Optional[int] = ..., device_id: _Optional[int] = ...) -> None: ...

class RankMemory(_message.Message):
    __slots__ = ("rank", "regions", "memory_kind", "worker_agent", "worker_agent_metadata", "generation")
    RANK_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_KIND_FIELD_NUMBER: _ClassVar[int]
    WORKER_AGENT_FIELD_NUMBER: _ClassVar[int]
    WORKER_AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    regions: _containers.RepeatedCompositeFieldContainer[MemoryRegion]
    memory_kind: str
    worker_agent: str
    worker_agent_metadata: bytes
    generation: int
    def __init__(self, rank: _Optional[int] = ..., regions: _Optional[_Iterable[_Union[MemoryRegion, _Mapping]]] = ..., memory_kind: _Optional[str] = ..., worker_agent: _Optional[str] = ..., worker_agent_metadata: _Optional[bytes] = ..., generation: _Optional[int] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("protocol_version", "sidecar_id", "agent_name", "agent_metadata", "engine_id", "reader_engine_id", "reader_spec", "plan_hash")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    READER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    READER_SPEC_FIELD_NUMBER: _ClassVar[int]
    PLAN_HASH_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    sidecar_id: str
    agent_name: str
    agent_metadata: bytes
    engine_id: str
    reader_engine_id: str
    reader_spec: _common_pb2.EngineSpec
    plan_hash: str
    def __init__(self, protocol_version: _Optional[int] = ..., sidecar_id: _Optional[str] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., engine_id: _Optional[str] = ..., reader_engine_id: _Optional[str] = ..., reader_spec: _Optional[_Union[_common_pb2.EngineSpec, _Mapping]] = ..., plan_hash: _Optional[str] = ...) -> None: ...

class SidecarRanks(_message.Message):
    __slots__ = ("sidecar_id", "peer_address", "agent_name", "agent_metadata", "ranks", "staged_workers")
    SIDECAR_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    STAGED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    sidecar_id: str
    peer_address: str
    agent_name: str
    agent_metadata: bytes
    ranks: _containers.RepeatedCompositeFieldContainer[RankMemory]
    staged_workers: bool
    def __init__(self, sidecar_id: _Optional[str] = ..., peer_address: _Optional[str] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., ranks: _Optional[_Iterable[_Union[RankMemory, _Mapping]]] = ..., staged_workers: _Optional[bool] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("protocol_version", "sidecar_id", "agent_name", "agent_metadata", "spec", "ranks", "plan_hash", "members", "push_key", "push_members", "push_members_v2", "staged_workers", "done_batches", "map_version")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    PLAN_HASH_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    PUSH_KEY_FIELD_NUMBER: _ClassVar[int]
    PUSH_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    PUSH_MEMBERS_V2_FIELD_NUMBER: _ClassVar[int]
    STAGED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    DONE_BATCHES_FIELD_NUMBER: _ClassVar[int]
    MAP_VERSION_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    sidecar_id: str
    agent_name: str
    agent_metadata: bytes
    spec: _common_pb2.EngineSpec
    ranks: _containers.RepeatedCompositeFieldContainer[RankMemory]
    plan_hash: str
    members: _containers.RepeatedCompositeFieldContainer[SidecarRanks]
    push_key: bytes
    push_members: bool
    push_members_v2: bool
    staged_workers: bool
    done_batches: bool
    map_version: int
    def __init__(self, protocol_version: _Optional[int] = ..., sidecar_id: _Optional[str] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., spec: _Optional[_Union[_common_pb2.EngineSpec, _Mapping]] = ..., ranks: _Optional[_Iterable[_Union[RankMemory, _Mapping]]] = ..., plan_hash: _Optional[str] = ..., members: _Optional[_Iterable[_Union[SidecarRanks, _Mapping]]] = ..., push_key: _Optional[bytes] = ..., push_members: _Optional[bool] = ..., push_members_v2: _Optional[bool] = ..., staged_workers: _Optional[bool] = ..., done_batches: _Optional[bool] = ..., map_version: _Optional[int] = ...) -> None: ...

class OpenReadRequest(_message.Message):
    __slots__ = ("sidecar_id", "engine_id", "request_id", "reader_engine_id", "reader_ranks", "plan_hash", "reader_spec", "reply_id", "reader_address")
    SIDECAR_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    READER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    READER_RANKS_FIELD_NUMBER: _ClassVar[int]
    PLAN_HASH_FIELD_NUMBER: _ClassVar[int]
    READER_SPEC_FIELD_NUMBER: _ClassVar[int]
    REPLY_ID_FIELD_NUMBER: _ClassVar[int]
    READER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    sidecar_id: str
    engine_id: str
    request_id: str
    reader_engine_id: str
    reader_ranks: _containers.RepeatedScalarFieldContainer[int]
    plan_hash: str
    reader_spec: _common_pb2.EngineSpec
    reply_id: str
    reader_address: str
    def __init__(self, sidecar_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., reader_engine_id: _Optional[str] = ..., reader_ranks: _Optional[_Iterable[int]] = ..., plan_hash: _Optional[str] = ..., reader_spec: _Optional[_Union[_common_pb2.EngineSpec, _Mapping]] = ..., reply_id: _Optional[str] = ..., reader_address: _Optional[str] = ...) -> None: ...

class OpenReadResponse(_message.Message):
    __slots__ = ("block_ids", "num_tokens", "lease_deadline_unix_ms", "first_token", "generations")
    class GenerationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    lease_deadline_unix_ms: int
    first_token: int
    generations: _containers.ScalarMap[int, int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., lease_deadline_unix_ms: _Optional[int] = ..., first_token: _Optional[int] = ..., generations: _Optional[_Mapping[int, int]] = ...) -> None: ...

class OpenReadReply(_message.Message):
    __slots__ = ("response", "code", "message")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    response: OpenReadResponse
    code: int
    message: str
    def __init__(self, response: _Optional[_Union[OpenReadResponse, _Mapping]] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class PeerKeepAliveRequest(_message.Message):
    __slots__ = ("engine_id", "request_ids")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, engine_id: _Optional[str] = ..., request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class PeerKeepAliveResponse(_message.Message):
    __slots__ = ("lease_deadline_unix_ms",)
    LEASE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    lease_deadline_unix_ms: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_deadline_unix_ms: _Optional[_Iterable[int]] = ...) -> None: ...

class CloseReadRequest(_message.Message):
    __slots__ = ("engine_id", "request_id", "reader_engine_id", "reader_ranks", "failed", "release")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    READER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    READER_RANKS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    reader_engine_id: str
    reader_ranks: _containers.RepeatedScalarFieldContainer[int]
    failed: bool
    release: bool
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., reader_engine_id: _Optional[str] = ..., reader_ranks: _Optional[_Iterable[int]] = ..., failed: _Optional[bool] = ..., release: _Optional[bool] = ...) -> None: ...

class CloseReadResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PushSlot(_message.Message):
    __slots__ = ("address", "length")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    address: int
    length: int
    def __init__(self, address: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("engine_id", "request_id", "reader_engine_id", "reader_spec", "reader_rank", "source_rank", "plan_hash", "start_token", "transfer_id", "reader_agent", "reader_agent_metadata", "memory_kind", "device_id", "slots", "timeout_ms", "open", "open_num_tokens", "notified", "stopping", "members", "reader_worker_agent", "source_in_worker", "failure_notice", "refusal_notice", "source_agent")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    READER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    READER_SPEC_FIELD_NUMBER: _ClassVar[int]
    READER_RANK_FIELD_NUMBER: _ClassVar[int]
    SOURCE_RANK_FIELD_NUMBER: _ClassVar[int]
    PLAN_HASH_FIELD_NUMBER: _ClassVar[int]
    START_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    READER_AGENT_FIELD_NUMBER: _ClassVar[int]
    READER_AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    MEMORY_KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    OPEN_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NOTIFIED_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    READER_WORKER_AGENT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_IN_WORKER_FIELD_NUMBER: _ClassVar[int]
    FAILURE_NOTICE_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_NOTICE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_AGENT_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    reader_engine_id: str
    reader_spec: _common_pb2.EngineSpec
    reader_rank: int
    source_rank: int
    plan_hash: str
    start_token: int
    transfer_id: str
    reader_agent: str
    reader_agent_metadata: bytes
    memory_kind: str
    device_id: int
    slots: _containers.RepeatedCompositeFieldContainer[PushSlot]
    timeout_ms: int
    open: OpenReadRequest
    open_num_tokens: int
    notified: bool
    stopping: bool
    members: _containers.RepeatedCompositeFieldContainer[PushMember]
    reader_worker_agent: str
    source_in_worker: bool
    failure_notice: bool
    refusal_notice: bool
    source_agent: str
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., reader_engine_id: _Optional[str] = ..., reader_spec: _Optional[_Union[_common_pb2.EngineSpec, _Mapping]] = ..., reader_rank: _Optional[int] = ..., source_rank: _Optional[int] = ..., plan_hash: _Optional[str] = ..., start_token: _Optional[int] = ..., transfer_id: _Optional[str] = ..., reader_agent: _Optional[str] = ..., reader_agent_metadata: _Optional[bytes] = ..., memory_kind: _Optional[str] = ..., device_id: _Optional[int] = ..., slots: _Optional[_Iterable[_Union[PushSlot, _Mapping]]] = ..., timeout_ms: _Optional[int] = ..., open: _Optional[_Union[OpenReadRequest, _Mapping]] = ..., open_num_tokens: _Optional[int] = ..., notified: _Optional[bool] = ..., stopping: _Optional[bool] = ..., members: _Optional[_Iterable[_Union[PushMember, _Mapping]]] = ..., reader_worker_agent: _Optional[str] = ..., source_in_worker: _Optional[bool] = ..., failure_notice: _Optional[bool] = ..., refusal_notice: _Optional[bool] = ..., source_agent: _Optional[str] = ...) -> None: ...

class PushMember(_message.Message):
    __slots__ = ("request_id", "open", "num_tokens", "start_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    START_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    open: OpenReadRequest
    num_tokens: int
    start_token: int
    def __init__(self, request_id: _Optional[str] = ..., open: _Optional[_Union[OpenReadRequest, _Mapping]] = ..., num_tokens: _Optional[int] = ..., start_token: _Optional[int] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("chunks", "bytes", "push_key")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PUSH_KEY_FIELD_NUMBER: _ClassVar[int]
    chunks: int
    bytes: int
    push_key: bytes
    def __init__(self, chunks: _Optional[int] = ..., bytes: _Optional[int] = ..., push_key: _Optional[bytes] = ...) -> None: ...

class ReportRanksRequest(_message.Message):
    __slots__ = ("protocol_version", "engine_id", "spec", "member")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    engine_id: str
    spec: _common_pb2.EngineSpec
    member: SidecarRanks
    def __init__(self, protocol_version: _Optional[int] = ..., engine_id: _Optional[str] = ..., spec: _Optional[_Union[_common_pb2.EngineSpec, _Mapping]] = ..., member: _Optional[_Union[SidecarRanks, _Mapping]] = ...) -> None: ...

class ReportRanksResponse(_message.Message):
    __slots__ = ("leader_id",)
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    leader_id: str
    def __init__(self, leader_id: _Optional[str] = ...) -> None: ...

class PeerPublishRequest(_message.Message):
    __slots__ = ("engine_id", "request_id", "block_ids", "num_tokens", "lease_ms", "leader_id", "first_token")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    lease_ms: int
    leader_id: str
    first_token: int
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., lease_ms: _Optional[int] = ..., leader_id: _Optional[str] = ..., first_token: _Optional[int] = ...) -> None: ...

class PeerPublishResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PeerAbortRequest(_message.Message):
    __slots__ = ("engine_id", "request_id")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class PeerAbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...
