"""A host pull long enough to break midway (tests/e2e/test_failures.py, test_gone_readers.py).

Converting NHD -> HND through a staging area of 2 blocks takes one NIXL read per block, so 1920 blocks
give 1920 rounds (~3 s here), long enough to break it midway. 480 blocks were not, once the per-pull
work got faster; nor, once in CI, 960 rounds of 2 blocks (~1.3 s): the prefill engine got "consumed".
A test that breaks the pull ends it at once, so length costs little.
"""

from __future__ import annotations

import json
import time
from typing import Any

from kv_sidecar.plan.spec import EngineSpec
from kv_sidecar.refengine.procs import EngineProcess, SidecarProcess

from .conftest import metric, spec_dict

BLOCKS = 1920
SRC = EngineSpec.from_dict(spec_dict(num_blocks=2048))
DST = EngineSpec.from_dict(spec_dict(num_blocks=2048, layout="flash_attn_hnd"))
# The decode sidecar's --staging-bytes: 2 blocks.
STAGING_BYTES = 2 * SRC.num_layers * 2 * SRC.block_size * SRC.num_kv_heads * SRC.head_dim * 2
READS = "kvsidecar_nixl_descriptors_per_transfer_count"  # one sample per conversion round's READ


def start_long_pull(
    prefill: EngineProcess, decode: EngineProcess, timeout_s: float, request_id: str = "long", seed: int = 5
) -> tuple[list[int], dict[str, Any]]:
    """Publish BLOCKS blocks and send the decode engine its pull without waiting for the answer: the
    blocks it pulls into, and the request's params."""
    pub = prefill.send(
        {
            "cmd": "prefill",
            "request_id": request_id,
            "block_ids": list(range(BLOCKS)),
            "num_tokens": BLOCKS * SRC.block_size,
            "seed": seed,
        }
    )
    assert pub["ok"], pub
    dst = list(range(DST.num_blocks - 1, DST.num_blocks - 1 - BLOCKS, -1))
    cmd = {"cmd": "pull", "params": pub["params"], "block_ids": dst, "seed": seed, "timeout_s": timeout_s}
    assert decode.proc.stdin is not None
    decode.proc.stdin.write(json.dumps(cmd) + "\n")
    decode.proc.stdin.flush()
    return dst, pub["params"]


def wait_transfer_started(decode_sidecar: SidecarProcess, reads_before: float, timeout_s: float = 30) -> None:
    """Until a conversion round has written into the engine's blocks. Rounds run one after another
    (READ into staging, then convert), so a second round's READ means the first round's blocks are
    written. (Staging memory in use only says the first READ went out: on a loaded 32-core machine
    a kill 50 ms after that still found nothing written.)"""
    deadline = time.monotonic() + timeout_s
    while metric(decode_sidecar.metrics_port, READS) < reads_before + 2:
        assert time.monotonic() < deadline, "the long pull never wrote a block"
        time.sleep(0.01)
