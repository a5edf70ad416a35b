"""Executors: apply a plan to real memory (host tensors, NIXL, GPU kernels)."""
