"""Event streams hold an engine-API thread each; they must never starve register/publish/pull."""

from __future__ import annotations

import time

import pytest
import torch

from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import SidecarProcess
from kv_sidecar_client import KVSidecarError, SidecarClient
from kv_sidecar_client.shm import ShmKVCache
from tests.e2e.conftest import spec_dict


def test_streams_beyond_the_limit_are_refused_and_unary_calls_still_run() -> None:
    spec = EngineSpec.from_dict(spec_dict(num_blocks=4))
    sc = SidecarProcess("streams", extra=["--engine-workers", "8"])  # 4 for streams, 4 for the rest
    client = SidecarClient(sc.socket, timeout_s=20)
    caches, streams = [], []
    try:
        for n in range(5):
            cache = ShmKVCache(spec.rank_tensor_shapes(), torch.float16)
            caches.append(cache)
            client.register_rank(f"e{n}", 0, spec.to_dict(), cache.handles())
            stream = client.events(f"e{n}", 0)
            streams.append(stream)
            if n < 4:
                assert next(iter(stream)).kind == "ready"
            else:
                with pytest.raises(KVSidecarError) as err:
                    next(iter(stream))
                assert err.value.code == "RESOURCE_EXHAUSTED"
                assert "engine_workers" in err.value.message
        # With 4 streams open, unary calls still find a thread.
        params = client.publish("e0", "r0", [0], 16)
        assert client.abort("e0", params.request_id)
        streams[0].close()  # a closed stream frees its slot
        for _ in range(50):
            again = client.events("e4", 0)
            try:
                if next(iter(again)).kind == "ready":
                    break
            except KVSidecarError:
                again.close()
                time.sleep(0.1)  # the server sees the cancellation within its 0.2 s poll
        else:
            pytest.fail("a stream slot was not freed after a stream closed")
        again.close()
    finally:
        for s in streams:
            s.close()
        client.close()
        for c in caches:
            c.close()
        assert sc.stop() == 0
