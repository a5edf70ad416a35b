"""Mapping engine memory into the sidecar (shared memory, CUDA IPC)."""
