"""A reference engine: real processes with paged KV caches in shared memory.

Used by `kv-sidecar demo`, the end-to-end tests and the benchmarks. It fills
prefill blocks from a seeded logical KV tensor and checks decode blocks against
the same logical KV, byte for byte, plus that no other block changed.
"""
