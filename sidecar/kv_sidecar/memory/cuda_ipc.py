"""Map engines' CUDA IPC handles into the sidecar, in the context of the GPU that copies.

Why raw driver calls instead of torch's tensor sharing: a legacy IPC mapping is
visible only in the CUDA context that opened it. torch opens a handle in the
context of the memory's *own* device, so a kernel on the decode GPU cannot
read a prefill GPU's imported tensor (torch then falls back to slow staged
copies, ~38 GB/s measured). We open every handle with
`cuIpcOpenMemHandle(..., CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)` in the *primary*
context of the device that runs the copy (the destination GPU): that is the
context torch and Triton launch in, so one kernel there can read the source
over NVLink and write the destination (~372 of 394 GB/s measured).

Mappings are keyed by (allocation handle, context device) and reference
counted, so tensors that share an allocation share one mapping, and the same
allocation may be open in several devices' contexts at once (read by decode
GPUs 0 and 1, say). The last release closes the mapping.

Devices are named by UUID on the wire: an engine's `cuda:0` is not the
sidecar's `cuda:0` when their CUDA_VISIBLE_DEVICES differ.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field

from kv_sidecar_client.cuda_ipc import (
    IPC_HANDLE_SIZE,
    CudaIpcError,
    CUipcMemHandle,
    PrimaryContext,
    check,
    cuda_driver,
    device_uuid,
    error_name,
)

CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
CUDA_ERROR_PEER_ACCESS_UNSUPPORTED = 217
CUDA_ERROR_INVALID_CONTEXT = 201


def visible_devices() -> dict[str, int]:
    """UUID -> driver ordinal of every GPU this process sees (after CUDA_VISIBLE_DEVICES)."""
    lib = cuda_driver()
    count = ctypes.c_int()
    check(lib, lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
    return {device_uuid(i): i for i in range(count.value)}


# cuDeviceGetAttribute: whether contexts created on the device are shared through CUDA MPS (CUDA 12.x on).
CU_DEVICE_ATTRIBUTE_MPS_ENABLED = 133


def mps_enabled(ordinal: int) -> bool | None:
    """Whether this process's contexts on GPU `ordinal` are clients of a CUDA MPS server (their kernels
    then run beside other clients' instead of taking turns by time slices); None where the driver does
    not know the attribute."""
    lib = cuda_driver()
    lib.cuDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
    value = ctypes.c_int()
    if lib.cuDeviceGetAttribute(ctypes.byref(value), CU_DEVICE_ATTRIBUTE_MPS_ENABLED, ordinal) != 0:
        return None
    return bool(value.value)


def device_for_uuid(uuid: str) -> int:
    """Driver ordinal (== torch index in this process) of the GPU with this UUID."""
    devices = visible_devices()
    try:
        return devices[uuid]
    except KeyError:
        raise CudaIpcError(
            f"GPU {uuid} is not visible to the sidecar (it sees {sorted(devices) or 'no GPUs'}); "
            "give the sidecar container the same GPUs as the engine (CUDA_VISIBLE_DEVICES / device claim)"
        ) from None


@dataclass
class _Mapping:
    """One open IPC mapping: an allocation mapped into one device's primary context."""

    handle: bytes
    device: int
    base: int
    size: int
    context: PrimaryContext
    users: int = 0


@dataclass
class ImportedTensor:
    """A tensor-like view of imported memory that Triton launches accept (`data_ptr()`, `dtype`).

    Valid only for kernels running on `device` (the context it was opened in).
    Call `release()` (or use it as a context manager) when done.
    """

    device: int
    ptr: int
    nbytes: int
    dtype: object = None  # a torch dtype when the caller gives one; Triton reads it for typing
    _registry: IpcRegistry | None = field(default=None, repr=False)
    _key: tuple[bytes, int] | None = field(default=None, repr=False)

    def data_ptr(self) -> int:
        return self.ptr

    @property
    def __cuda_array_interface__(self) -> dict[str, object]:
        """Bytes, for `torch.as_tensor(imported)` (e.g. to read back in tests).

        Checked on H200s: torch asks the driver which device the pointer belongs
        to, and a peer mapping opened in GPU1's context answers GPU1, so the
        tensor lands on cuda:1 and reads through this very mapping; torch does
        not re-open the handle. The executor itself needs only `data_ptr()`.
        """
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3}

    def release(self) -> None:
        if self._registry is not None and self._key is not None:
            registry, key = self._registry, self._key
            self._registry = self._key = None
            registry._release(key)

    def __enter__(self) -> ImportedTensor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class IpcRegistry:
    """Reference-counted IPC mappings of one sidecar process (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: dict[tuple[bytes, int], _Mapping] = {}

    def open(
        self, handle: bytes, offset: int, nbytes: int, device: int, dtype: object = None
    ) -> ImportedTensor:
        """Map `nbytes` at `offset` of the exported allocation into `device`'s primary context."""
        if len(handle) != IPC_HANDLE_SIZE:
            raise CudaIpcError(f"a CUDA IPC handle has {IPC_HANDLE_SIZE} bytes, got {len(handle)}")
        if offset < 0 or nbytes <= 0:
            raise CudaIpcError(f"bad IPC tensor extent: offset {offset}, {nbytes} bytes")
        key = (bytes(handle), device)
        with self._lock:
            mapping = self._maps.get(key)
            if mapping is None:
                mapping = self._map(key)
                self._maps[key] = mapping
            if offset + nbytes > mapping.size:
                if mapping.users == 0:
                    self._close(key, mapping)
                raise CudaIpcError(
                    f"IPC tensor of {nbytes} bytes at offset {offset} overruns its allocation of "
                    f"{mapping.size} bytes"
                )
            mapping.users += 1
        return ImportedTensor(device, mapping.base + offset, nbytes, dtype, self, key)

    def open_count(self) -> int:
        """Open mappings (for tests and metrics)."""
        with self._lock:
            return len(self._maps)

    def _map(self, key: tuple[bytes, int]) -> _Mapping:
        handle, device = key
        lib = cuda_driver()
        context = PrimaryContext(device)
        ptr, size = ctypes.c_uint64(), ctypes.c_size_t()
        try:
            with context:
                code = lib.cuIpcOpenMemHandle_v2(
                    ctypes.byref(ptr),
                    CUipcMemHandle.from_buffer_copy(handle),
                    CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
                )
                if code == CUDA_ERROR_PEER_ACCESS_UNSUPPORTED:
                    raise CudaIpcError(
                        f"cuda:{device} cannot access the exporting GPU's memory (no peer access); "
                        "same-node copies need NVLink or PCIe P2P between the two GPUs"
                    )
                if code == CUDA_ERROR_INVALID_CONTEXT:
                    raise CudaIpcError(
                        "cuIpcOpenMemHandle: invalid context: a process cannot import its own IPC "
                        f"handle, or cuda:{device} is not usable ({error_name(lib, code)})"
                    )
                check(lib, code, "cuIpcOpenMemHandle")
                base = ctypes.c_uint64()
                code = lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr.value)
                if code != 0:
                    lib.cuIpcCloseMemHandle(ptr.value)
                    check(lib, code, "cuMemGetAddressRange (imported)")
        except BaseException:
            context.release()
            raise
        return _Mapping(handle, device, ptr.value, size.value, context)

    def _release(self, key: tuple[bytes, int]) -> None:
        with self._lock:
            mapping = self._maps[key]
            mapping.users -= 1
            if mapping.users == 0:
                self._close(key, mapping)

    def _close(self, key: tuple[bytes, int], mapping: _Mapping) -> None:
        del self._maps[key]
        lib = cuda_driver()
        with mapping.context:
            code = lib.cuIpcCloseMemHandle(mapping.base)
        mapping.context.release()
        check(lib, code, "cuIpcCloseMemHandle")


_default_registry: IpcRegistry | None = None
_default_lock = threading.Lock()


def default_registry() -> IpcRegistry:
    global _default_registry
    with _default_lock:
        if _default_registry is None:
            _default_registry = IpcRegistry()
        return _default_registry


def import_tensor(
    handle: bytes,
    offset: int,
    nbytes: int,
    device: int | str,
    dtype: object = None,
    registry: IpcRegistry | None = None,
) -> ImportedTensor:
    """Map an engine tensor for kernels on `device` (a driver ordinal, or a "GPU-..." UUID)."""
    ordinal = device_for_uuid(device) if isinstance(device, str) else device
    return (registry or default_registry()).open(handle, offset, nbytes, ordinal, dtype)
