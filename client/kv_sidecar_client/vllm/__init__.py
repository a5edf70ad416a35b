"""vLLM KV connector for kv-sidecar (`pip install kv-sidecar-client[vllm]`).

    --kv-transfer-config '{"kv_connector": "KVSidecarConnector",
                           "kv_connector_module_path": "kv_sidecar_client.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"sidecar_socket": "/run/kv-sidecar/engine.sock"}}'

The connector is imported lazily: the pure parts (config, kv_layout) import
without vLLM, and loading `KVSidecarConnector` checks the vLLM version first.
See docs/vllm.md.
"""

from __future__ import annotations

import os
import re
from typing import Any

SUPPORTED_VLLM = ">=0.32,<0.33"
_SUPPORTED_RANGE = ((0, 32), (0, 33))  # [lowest, first unsupported) as (major, minor)
SKIP_CHECK_ENV = "KV_SIDECAR_VLLM_SKIP_VERSION_CHECK"


class UnsupportedVllmVersion(ImportError):
    pass


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM whose connector API this connector was not built and tested against."""
    m = re.match(r"(\d+)\.(\d+)", version)
    lo, hi = _SUPPORTED_RANGE
    if m is None or not lo <= (int(m.group(1)), int(m.group(2))) < hi:
        raise UnsupportedVllmVersion(
            f"KVSidecarConnector supports vLLM {SUPPORTED_VLLM}; this is vLLM {version}. Install a supported "
            f"vLLM (pip install 'kv-sidecar-client[vllm]'), or set {SKIP_CHECK_ENV}=1 to try it anyway."
        )


def __getattr__(name: str) -> Any:
    if name in ("KVSidecarConnector", "KVSidecarMetadata"):
        import vllm

        if os.environ.get(SKIP_CHECK_ENV) != "1":
            check_vllm_version(vllm.__version__)
        from kv_sidecar_client.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
