"""Fuzz the engine and peer gRPC APIs of a live sidecar process (issue 5, item 6).

Hypothesis draws message fields (ids, huge block ids, block lists, transfer
params, tensor handles, engine specs) and sends them to a real sidecar. After
every example: the process is alive and SERVING, every call returned before its
deadline with a deliberate status (never INTERNAL/UNKNOWN), the canary memory
around the registered KV cache is unchanged, and inside the cache only blocks
that a pull of this example asked for changed.

KVS_FUZZ_EXAMPLES sets the number of examples (default 200); KVS_FUZZ_NOSHRINK=1 reports
failures without shrinking them (shrinking a hang takes long).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kv_sidecar import PROTOCOL_VERSION
from kv_sidecar.plan.spec import EngineSpec, Layout
from kv_sidecar.refengine.procs import SidecarProcess, together
from kv_sidecar_client._proto.kvsidecar.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    peer_pb2,
    peer_pb2_grpc,
)
from kv_sidecar_client.client import spec_message
from kv_sidecar_client.shm import ShmKVCache

from .conftest import spec_dict

SPEC = EngineSpec.from_dict(spec_dict(num_blocks=16))
EXAMPLES = int(os.environ.get("KVS_FUZZ_EXAMPLES", "200"))
CALL_TIMEOUT_S = 10.0
CANARY = [(2048,)]  # 4 KiB (fp16) before and after the registered tensors, in the same shm object
DST, SRC, REMOTE_SRC = "fz-dst", "fz-src", "fz-remote-src"
FIXTURE_ENGINES = (DST, SRC, REMOTE_SRC)
_ids = itertools.count()


@dataclass
class Target:
    local: SidecarProcess  # fuzzed
    remote: SidecarProcess  # holds REMOTE_SRC, for pulls over NIXL
    engine: engine_pb2_grpc.EngineServiceStub
    peer: peer_pb2_grpc.PeerServiceStub
    remote_engine: engine_pb2_grpc.EngineServiceStub
    canary: ShmKVCache  # [canary, layer 0, layer 1, canary]; DST registers the middle
    scratch: ShmKVCache  # registrations the fuzzer attempts point here
    channels: list[grpc.Channel] = field(default_factory=list)

    @property
    def registered(self) -> list[torch.Tensor]:
        return self.canary.tensors[1:-1]


def _cache(shapes: list[tuple[int, ...]], dtype: torch.dtype, seed: int) -> ShmKVCache:
    cache = ShmKVCache(shapes, dtype)
    g = torch.Generator().manual_seed(seed)
    for t in cache.tensors:
        flat = t.view(torch.uint8).view(-1)
        flat.copy_(torch.randint(0, 256, flat.shape, generator=g, dtype=torch.uint8))
    return cache


def _register(stub: engine_pb2_grpc.EngineServiceStub, engine_id: str, handles: list) -> Any:
    req = engine_pb2.RegisterRankRequest(
        engine_id=engine_id, rank=0, spec=spec_message(SPEC.to_dict()), tensors=handles
    )
    stub.RegisterRank(req, timeout=CALL_TIMEOUT_S)
    # Keep the rank registered whatever happens to this stream's client: no unregister on close.
    return stub.Events(engine_pb2.EventsRequest(engine_id=engine_id, rank=0, unregister_on_close=False))


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    local, remote = together(lambda: SidecarProcess("fuzz-local"), lambda: SidecarProcess("fuzz-remote"))
    shapes = SPEC.rank_tensor_shapes()
    canary = _cache([*CANARY, *shapes, *CANARY], torch.float16, 0)
    src, remote_src = _cache(shapes, torch.float16, 1), _cache(shapes, torch.float16, 2)
    scratch = _cache([(1 << 16,)], torch.uint8, 3)
    chans = [grpc.insecure_channel(t) for t in (f"unix:{local.socket}", local.peer_address)]
    chans.append(grpc.insecure_channel(f"unix:{remote.socket}"))
    tg = Target(
        local,
        remote,
        engine_pb2_grpc.EngineServiceStub(chans[0]),
        peer_pb2_grpc.PeerServiceStub(chans[1]),
        engine_pb2_grpc.EngineServiceStub(chans[2]),
        canary,
        scratch,
        chans,
    )
    streams = [
        _register(tg.engine, DST, canary.handles()[1:-1]),
        _register(tg.engine, SRC, src.handles()),
        _register(tg.remote_engine, REMOTE_SRC, remote_src.handles()),
    ]
    yield tg
    for s in streams:
        s.cancel()
    for c in chans:
        c.close()
    codes = local.stop(), remote.stop()
    for c in (canary, src, remote_src, scratch):
        c.close()
    assert codes == (0, 0), "\n".join(local.stderr_tail)


# -- strategies ---------------------------------------------------------------------
U32 = st.one_of(st.integers(0, 80), st.integers(0, 2**32 - 1), st.sampled_from([2**31, 2**32 - 1]))
U64 = st.one_of(st.integers(0, 1 << 20), st.integers(0, 2**64 - 1))
IDS = st.one_of(
    st.sampled_from([*FIXTURE_ENGINES, "", "x", "a" * 257]),
    st.text(max_size=40),
    st.text(alphabet="\x00\x01\x1f\n\t é😀", max_size=5),
)
BLOCK_LISTS = st.lists(st.one_of(st.integers(0, 20), U32), max_size=6)
DTYPES = st.sampled_from(["float16", "bfloat16", "float32", "uint8", "int64", "", "float8_e4m3fn", "x"])
LAYOUTS = st.sampled_from([*(layout.value for layout in Layout), "", "nhd"])  # every real one, two bad
SMALL = st.one_of(st.integers(0, 9), U32)


LAYER_NAMES = st.one_of(st.sampled_from(["0", "1", "3", "-1", "x"]), st.text(max_size=4))
STATE_ARRAYS = st.tuples(
    st.sampled_from(["conv", "ssm", ""]), st.lists(SMALL, max_size=9), DTYPES, U64
)  # a Mamba group's arrays (name, shape, dtype, offset)


@st.composite
def specs(draw: st.DrawFn) -> common_pb2.EngineSpec:
    if draw(st.booleans()):  # near the real spec: one field changed
        msg = spec_message(SPEC.to_dict())
        name = draw(st.sampled_from([f.name for f in msg.DESCRIPTOR.fields]))
        if (
            name == "groups"
        ):  # a hybrid model's KV cache groups: layer names, windows, Mamba state, sound or not
            for layers, window, state in draw(
                st.lists(
                    st.tuples(st.lists(LAYER_NAMES, max_size=3), SMALL, st.lists(STATE_ARRAYS, max_size=3)),
                    max_size=3,
                )
            ):
                group = msg.groups.add(layers=layers, sliding_window=window)
                for array_name, shape, dtype, offset in state:
                    group.state.add(name=array_name, shape=shape, dtype=dtype, offset=offset)
            return msg
        value = {
            "dtype": DTYPES,
            "layout": LAYOUTS,
            "cross_layer": st.booleans(),
        }.get(name, SMALL)
        setattr(msg, name, draw(value))
        return msg
    return common_pb2.EngineSpec(
        tp_size=draw(SMALL),
        num_layers=draw(SMALL),
        num_kv_heads=draw(SMALL),
        head_dim=draw(SMALL),
        dtype=draw(DTYPES),
        block_size=draw(SMALL),
        num_blocks=draw(SMALL),
        layout=draw(LAYOUTS),
        kernel_block_size=draw(SMALL),
        cross_layer=draw(st.booleans()),
    )


@st.composite
def handles(draw: st.DrawFn, scratch: str) -> common_pb2.TensorHandle:
    shape = draw(st.lists(st.one_of(st.integers(0, 64), U64), max_size=5))
    strides = draw(st.one_of(st.just(_contiguous(shape)), st.lists(U64, max_size=5)))
    h = common_pb2.TensorHandle(shape=shape, strides=strides, dtype=draw(DTYPES))
    kind = draw(st.sampled_from(["shm", "shm", "cuda_ipc", "none"]))
    if kind == "shm":
        name = draw(st.one_of(st.just(scratch), IDS, st.sampled_from(["../x", "/dev/shm/x", "."])))
        h.shm.name, h.shm.offset = name, draw(st.one_of(st.sampled_from([0, 4096, 1 << 16]), U64))
    elif kind == "cuda_ipc":
        h.cuda_ipc.handle = draw(st.binary(max_size=80))
        h.cuda_ipc.offset = draw(U64)
        h.cuda_ipc.device_uuid = draw(IDS)
    return h


def _contiguous(shape: list[int]) -> list[int]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc = (acc * s) % (1 << 64)
    return out[::-1]


def _no_writes(_: Any) -> list[int]:
    return []


# An operation is (description, call); a call returns the block ids of DST a pull may have written.
Op = tuple[str, Callable[[Target], list[int]]]


@st.composite
def engine_ops(draw: st.DrawFn) -> Op:
    kind = draw(
        st.sampled_from(["register", "publish", "pull", "pull", "pull", "keepalive", "abort", "unregister"])
    )
    if kind == "register":
        eid, rank, spec = draw(IDS), draw(SMALL), draw(specs())
        hs = draw(st.lists(handles("SCRATCH"), max_size=3))

        def register(tg: Target) -> list[int]:
            for h in hs:
                if h.shm.name == "SCRATCH":
                    h.shm.name = tg.scratch.name
            req = engine_pb2.RegisterRankRequest(engine_id=eid, rank=rank, spec=spec, tensors=hs)
            ok = _call(tg.engine.RegisterRank, req)
            if ok is not None and eid not in FIXTURE_ENGINES:  # it was valid: leave no trace
                _call(tg.engine.UnregisterRank, engine_pb2.UnregisterRankRequest(engine_id=eid, rank=rank))
            return []

        return f"register {eid!r} rank {rank} {spec} {hs}", register
    if kind == "publish":
        req = engine_pb2.PublishRequest(
            engine_id=draw(IDS),
            request_id=draw(IDS),
            block_ids=draw(BLOCK_LISTS),
            num_tokens=draw(SMALL),
            lease_ms=draw(SMALL),
        )
        return f"publish {req}", lambda tg: _no_writes(_call(tg.engine.Publish, req))
    if kind == "pull":
        return _pull_op(draw)
    if kind == "keepalive":
        params = draw(st.lists(transfer_params(), max_size=3))
        req = engine_pb2.KeepAliveRequest(params=params)
        return f"keepalive {req}", lambda tg: _no_writes(_call(tg.engine.KeepAlive, req))
    if kind == "abort":
        req = engine_pb2.AbortRequest(engine_id=draw(IDS), request_id=draw(IDS))
        if draw(st.booleans()):
            req.params.CopyFrom(draw(transfer_params()))
        return f"abort {req}", lambda tg: _no_writes(_call(tg.engine.Abort, req))
    eid = draw(IDS.filter(lambda e: e not in FIXTURE_ENGINES))
    req = engine_pb2.UnregisterRankRequest(engine_id=eid, rank=draw(SMALL))
    return f"unregister {req}", lambda tg: _no_writes(_call(tg.engine.UnregisterRank, req))


@st.composite
def transfer_params(draw: st.DrawFn) -> common_pb2.TransferParams:
    return common_pb2.TransferParams(
        engine_id=draw(IDS),
        sidecar_address=draw(st.sampled_from(["", "127.0.0.1:9", "not an address", "[::1", "LOCAL_PEER"])),
        sidecar_id=draw(IDS),
        request_id=draw(IDS),
        block_ids=draw(BLOCK_LISTS),
        num_tokens=draw(SMALL),
        lease_deadline_unix_ms=draw(U64),
    )


def _pull_op(draw: st.DrawFn) -> Op:
    """Mostly a real published request (direct or over NIXL) pulled with fuzzed fields."""
    source = draw(st.sampled_from(["direct", "remote", "random"]))
    n_src = draw(st.integers(1, 3))
    src_blocks = draw(st.lists(st.integers(0, 15), min_size=n_src, max_size=n_src, unique=True))
    tokens = draw(st.integers(16 * (n_src - 1) + 1, 16 * n_src))
    dst = draw(
        st.one_of(
            st.lists(st.integers(0, 15), min_size=n_src, max_size=n_src, unique=True),
            BLOCK_LISTS,
        )
    )
    mutate = draw(st.sampled_from(["none", "none", "params", "fields"]))
    fuzz_params = draw(transfer_params())
    ranks = draw(st.one_of(st.just([]), st.just([0]), st.lists(SMALL, max_size=3)))
    start_token = draw(st.one_of(st.just(0), st.just(0), st.sampled_from([16, 32]), SMALL))
    timeout_ms = draw(st.one_of(st.just(0), st.integers(1, 3000)))
    engine_id = draw(st.one_of(st.just(DST), st.just(DST), st.just(DST), IDS))
    field_name = draw(st.sampled_from(["engine_id", "sidecar_id", "request_id", "block_ids", "num_tokens"]))

    def pull(tg: Target) -> list[int]:
        rid = f"fz-{next(_ids)}"
        if source == "random":
            params = fuzz_params
        else:
            stub, eid = (tg.engine, SRC) if source == "direct" else (tg.remote_engine, REMOTE_SRC)
            pub = _call(
                stub.Publish,
                engine_pb2.PublishRequest(
                    engine_id=eid, request_id=rid, block_ids=src_blocks, num_tokens=tokens
                ),
            )
            params = pub.params
            if mutate == "params":
                params = fuzz_params
            elif mutate == "fields":
                params.ClearField(field_name)
                params.MergeFrom(_only(fuzz_params, field_name))
        if params.sidecar_address == "LOCAL_PEER":
            params.sidecar_address = tg.local.peer_address
        req = engine_pb2.PullRequest(
            params=params,
            engine_id=engine_id,
            ranks=ranks,
            block_ids=dst,
            start_token=start_token,
            timeout_ms=timeout_ms,
        )
        _call(tg.engine.Pull, req)
        return list(dst) if engine_id == DST else []

    return f"pull from {source} ({mutate}/{field_name}) into {engine_id!r} dst={dst} ranks={ranks}", pull


def _only(msg: common_pb2.TransferParams, name: str) -> common_pb2.TransferParams:
    out = common_pb2.TransferParams()
    value = getattr(msg, name)
    if name == "block_ids":
        out.block_ids.extend(value)
    else:
        setattr(out, name, value)
    return out


@st.composite
def peer_ops(draw: st.DrawFn) -> Op:
    kind = draw(st.sampled_from(["handshake", "openread", "keepalive", "closeread"]))
    version = draw(st.one_of(st.just(PROTOCOL_VERSION), SMALL))
    engine_id = draw(IDS)
    if kind == "handshake":
        req = peer_pb2.HandshakeRequest(
            protocol_version=version,
            sidecar_id=draw(IDS),
            agent_name=draw(IDS),
            agent_metadata=draw(st.binary(max_size=64)),
            engine_id=engine_id,
            reader_engine_id=draw(IDS),
            plan_hash=draw(IDS),
        )
        if draw(st.booleans()):
            req.reader_spec.CopyFrom(draw(specs()))
        return f"handshake {req}", lambda tg: _no_writes(_call(tg.peer.Handshake, req))
    if kind == "openread":
        use_real_hash = draw(st.booleans())
        req = peer_pb2.OpenReadRequest(
            sidecar_id=draw(IDS),
            engine_id=engine_id,
            request_id=draw(IDS),
            reader_engine_id=draw(IDS),
            reader_ranks=draw(st.lists(SMALL, max_size=3)),
            plan_hash=draw(IDS),
        )

        def openread(tg: Target) -> list[int]:
            if use_real_hash:
                hs = _call(
                    tg.peer.Handshake,
                    peer_pb2.HandshakeRequest(
                        protocol_version=PROTOCOL_VERSION,
                        engine_id=SRC,
                        reader_engine_id="fz-reader",
                        reader_spec=spec_message(SPEC.to_dict()),
                    ),
                )
                req.plan_hash = hs.plan_hash
            _call(tg.peer.OpenRead, req)
            return []

        return f"openread (real hash: {use_real_hash}) {req}", openread
    if kind == "keepalive":
        req = peer_pb2.PeerKeepAliveRequest(engine_id=engine_id, request_ids=draw(st.lists(IDS, max_size=3)))
        return f"peer keepalive {req}", lambda tg: _no_writes(_call(tg.peer.KeepAlive, req))
    req = peer_pb2.CloseReadRequest(
        engine_id=engine_id,
        request_id=draw(IDS),
        reader_engine_id=draw(IDS),
        reader_ranks=draw(st.lists(SMALL, max_size=3)),
        failed=draw(st.booleans()),
        release=draw(st.booleans()),
    )
    return f"closeread {req}", lambda tg: _no_writes(_call(tg.peer.CloseRead, req))


# -- the invariants ------------------------------------------------------------------
DELIBERATE = set(grpc.StatusCode) - {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


def _call(method: Callable[..., Any], request: Any) -> Any:
    """Call with a deadline; a failed call is fine if its status is deliberate and it did not hang."""
    t0 = time.monotonic()
    try:
        return method(request, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as e:
        code, details = e.code(), e.details() or ""  # type: ignore[attr-defined]
        elapsed = time.monotonic() - t0
        assert not (code is grpc.StatusCode.DEADLINE_EXCEEDED and details == "Deadline Exceeded"), (
            f"hung for {elapsed:.1f}s"
        )
        assert code in DELIBERATE, f"{code.name}: {details}"
        assert details, f"{code.name} without a message"
        return None


def _serving(tg: Target) -> None:
    assert tg.local.alive, "the fuzzed sidecar died:\n" + "\n".join(tg.local.stderr_tail)
    for ch in tg.channels[:2]:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


def _changed_blocks(before: list[torch.Tensor], after: list[torch.Tensor]) -> set[int]:
    # flash_attn_nhd per layer: [2, num_blocks, ...]; a block is dim 1.
    out: set[int] = set()
    for x, y in zip(before, after, strict=True):
        diff = (x.view(torch.uint8) != y.view(torch.uint8)).reshape(2, SPEC.num_blocks, -1).any(-1).any(0)
        out |= set(diff.nonzero().flatten().tolist())
    return out


@settings(
    max_examples=EXAMPLES,
    phases=[Phase.explicit, Phase.reuse, Phase.generate]
    if os.environ.get("KVS_FUZZ_NOSHRINK")
    else list(Phase),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(st.one_of(engine_ops(), peer_ops()), min_size=1, max_size=4))
def test_fuzzed_calls_never_crash_hang_or_write_outside_requested_blocks(
    target: Target, ops: list[Op]
) -> None:
    tg = target
    canaries = [tg.canary.tensors[0].clone(), tg.canary.tensors[-1].clone()]
    before = [t.clone() for t in tg.registered]
    allowed: set[int] = set()
    for _, op in ops:
        allowed |= set(op(tg))
    _serving(tg)
    for saved, now in zip(canaries, (tg.canary.tensors[0], tg.canary.tensors[-1]), strict=True):
        assert torch.equal(saved.view(torch.uint8), now.view(torch.uint8)), "bytes outside the cache changed"
    changed = _changed_blocks(before, [t.clone() for t in tg.registered])
    assert changed <= allowed, f"blocks {sorted(changed - allowed)} changed, no pull asked for them"
