"""kv-sidecar: a per-node sidecar that moves LLM KV-cache blocks between engines."""

__version__ = "0.1.0"
PROTOCOL_VERSION = 2  # 2: the staged GPU path's Gather stream became Push (docs/gpu.md)
