"""Put a CPU vLLM engine's KV cache into POSIX shared memory, where the sidecar can map it.

vLLM allocates the whole KV cache as one `torch.zeros(n, dtype=int8)` buffer
inside the context a connector returns from `get_mem_pool_context()`, then
views every layer into it. That context here redirects CPU `torch.zeros` and
`torch.empty` calls to a fresh /dev/shm object (zero-filled by the kernel), so
the engine's own tensors *are* the shared pages: nothing is copied, before or
during a transfer.

What it costs: the cache is tmpfs memory instead of anonymous memory. It is
the same RAM, faulted in on first touch as before, but it counts as shared
memory (the container's /dev/shm must be at least the KV cache size:
VLLM_CPU_KVCACHE_SPACE), it cannot use transparent huge pages, and an engine
killed with SIGKILL leaves its object in /dev/shm until someone removes it
(a clean shutdown unlinks it).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from kv_sidecar_client.shm import ShmKVCache

log = logging.getLogger(__name__)


class ShmKVPool:
    """The shared-memory objects holding one engine rank's KV cache."""

    def __init__(self, label: str) -> None:
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", label)[:80]
        self._prefix = f"kvsidecar-vllm-{safe}-{os.getpid()}"
        self._caches: list[ShmKVCache] = []
        self._lock = threading.Lock()
        remove_orphans(safe)
        atexit.register(self.close)

    @contextlib.contextmanager
    def allocation(self) -> Iterator[None]:
        """CPU tensor allocations inside this block land in shared memory."""
        with _AllocateInShm(self._allocate):
            yield

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            cache = ShmKVCache([shape], dtype, name=f"{self._prefix}-{len(self._caches)}")
            self._caches.append(cache)
        log.info("KV cache buffer of %d bytes in /dev/shm/%s", cache.size, cache.name)
        return cache.tensors[0]

    def locate(self, tensor: torch.Tensor) -> tuple[str, int]:
        """(shm object name, byte offset) of a tensor that lies inside one of our objects."""
        start = tensor.data_ptr()
        end = start + _span_bytes(tensor)
        with self._lock:
            for cache in self._caches:
                base = cache.tensors[0].data_ptr() if cache.tensors else 0
                if base and base <= start and end <= base + cache.size:
                    return cache.name, start - base
        raise ValueError(
            f"KV cache tensor at {start:#x} ({end - start} bytes) is not in the shared memory this connector "
            "allocated: vLLM did not allocate the CPU KV cache inside KVSidecarConnector.get_mem_pool_context() "
            "(another connector's memory pool, or a vLLM version that ignores it)"
        )

    def close(self) -> None:
        with self._lock:
            caches, self._caches = self._caches, []
        for cache in caches:
            cache.close(unlink=True)


def remove_orphans(label: str, shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink the objects an earlier, killed process of the same engine rank left behind.

    Our names end in the owner's pid; an object of this engine rank whose owner is gone
    (SIGKILL, OOM) would otherwise hold its RAM until the node reboots.
    """
    pattern = re.compile(rf"^kvsidecar-vllm-{re.escape(label)}-(\d+)-\d+$")
    removed = []
    for name in os.listdir(shm_dir):
        m = pattern.match(name)
        if m is None or int(m.group(1)) == os.getpid() or _alive(int(m.group(1))):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
            log.info("removed /dev/shm/%s, left by a process that no longer runs", name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _span_bytes(tensor: torch.Tensor) -> int:
    if tensor.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return (last + 1) * tensor.element_size()


class _AllocateInShm(TorchFunctionMode):
    """Redirects CPU torch.zeros / torch.empty to shared memory; everything else passes through."""

    def __init__(self, allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> None:
        super().__init__()
        self._allocate = allocate

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in (torch.zeros, torch.empty) and _is_cpu(kwargs.get("device")) and "out" not in kwargs:
            shape = _shape(args)
            if shape is not None:
                dtype = kwargs.get("dtype") or torch.get_default_dtype()
                return self._allocate(shape, dtype)
        return func(*args, **kwargs)


def _is_cpu(device: Any) -> bool:
    return device is None or torch.device(device).type == "cpu"


def _shape(args: tuple[Any, ...]) -> tuple[int, ...] | None:
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        args = tuple(args[0])
    if args and all(isinstance(a, int) for a in args):
        return tuple(args)
    return None
