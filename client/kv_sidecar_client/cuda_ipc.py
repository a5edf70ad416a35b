"""Export engine KV tensors to the sidecar through legacy CUDA IPC handles.

The sidecar cannot use torch's own tensor sharing: torch opens an imported
handle in the context of the memory's own device, and a legacy IPC mapping is
visible only in the context that opened it, so a kernel on another GPU could
not read it. The engine therefore hands over the raw ingredients instead: the
64-byte `cudaIpcMemHandle_t` of the allocation *base* (IPC handles only exist
for whole allocations), the byte offset of the tensor inside that allocation,
and the owning device's UUID (device indices differ between processes with
different CUDA_VISIBLE_DEVICES; UUIDs do not).

Everything goes through the CUDA driver API with ctypes, so this module imports
without torch, NIXL or a GPU; torch is only touched by `export_tensor`.
Memory that cannot be exported with a legacy handle (the VMM API, e.g. torch's
`expandable_segments`, or stream-ordered memory pools) is refused with a
message that says what to change: the sidecar has no VMM import path.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any

IPC_HANDLE_SIZE = 64

# CUpointer_attribute values (cuda.h). Named here because the sidecar uses them too.
CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
CU_POINTER_ATTRIBUTE_IS_MANAGED = 8
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
CU_MEMORYTYPE_DEVICE = 2
CUDA_ERROR_NOT_SUPPORTED = 801

VMM_REFUSAL = (
    "is not exportable with a legacy CUDA IPC handle: it was allocated through the CUDA VMM API "
    "(cuMemCreate; PyTorch's PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or a "
    "cudaMallocAsync/memory-pool allocator). kv-sidecar imports only cudaMalloc memory: allocate "
    "the KV cache with expandable_segments off (e.g. torch.cuda.memory._set_allocator_settings("
    "'expandable_segments:False') around the KV-cache allocation) or with plain cudaMalloc"
)


class CudaIpcError(RuntimeError):
    """A CUDA driver call failed, or the memory cannot be shared over CUDA IPC."""


class CUipcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * IPC_HANDLE_SIZE)]


class CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


_lock = threading.Lock()
_driver: ctypes.CDLL | None = None


def cuda_driver() -> ctypes.CDLL:
    """libcuda, loaded and initialised once, with the signatures we call declared."""
    global _driver
    with _lock:
        if _driver is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                raise CudaIpcError(f"cannot load the CUDA driver (libcuda.so.1): {exc}") from exc
            _declare(lib)
            check(lib, lib.cuInit(0), "cuInit")
            _driver = lib
        return _driver


def _declare(lib: ctypes.CDLL) -> None:
    # Explicit argtypes: ctypes would otherwise truncate 64-bit pointers to int.
    u64, vp, cint, cuint = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint
    lib.cuInit.argtypes = [cuint]
    lib.cuGetErrorName.argtypes = [cint, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuDeviceGet.argtypes = [ctypes.POINTER(cint), cint]
    lib.cuDeviceGetCount.argtypes = [ctypes.POINTER(cint)]
    lib.cuDeviceGetUuid_v2.argtypes = [ctypes.POINTER(CUuuid), cint]
    lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(vp), cint]
    lib.cuDevicePrimaryCtxRelease_v2.argtypes = [cint]
    lib.cuCtxPushCurrent_v2.argtypes = [vp]
    lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(vp)]
    lib.cuPointerGetAttribute.argtypes = [vp, cint, u64]
    lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(u64), ctypes.POINTER(ctypes.c_size_t), u64]
    lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(CUipcMemHandle), u64]
    lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(u64), CUipcMemHandle, cuint]
    lib.cuIpcCloseMemHandle.argtypes = [u64]
    lib.cuDeviceCanAccessPeer.argtypes = [ctypes.POINTER(cint), cint, cint]
    lib.cuMemcpyDtoD_v2.argtypes = [u64, u64, ctypes.c_size_t]


def error_name(lib: ctypes.CDLL, code: int) -> str:
    name = ctypes.c_char_p()
    if lib.cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
        return name.value.decode()
    return f"CUDA error {code}"


def check(lib: ctypes.CDLL, code: int, what: str) -> None:
    if code != 0:
        raise CudaIpcError(f"{what} failed: {error_name(lib, code)} ({code})")


def device_uuid(ordinal: int) -> str:
    """'GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx' of a driver device ordinal (nvidia-smi's spelling)."""
    lib = cuda_driver()
    dev = ctypes.c_int()
    check(lib, lib.cuDeviceGet(ctypes.byref(dev), ordinal), f"cuDeviceGet({ordinal})")
    uuid = CUuuid()
    check(lib, lib.cuDeviceGetUuid_v2(ctypes.byref(uuid), dev.value), "cuDeviceGetUuid")
    h = bytes(uuid.bytes).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class PrimaryContext:
    """Makes a device's primary context current for a `with` block, then restores the caller's.

    The primary context is the one the CUDA runtime (and so torch and Triton) use
    for that device; IPC handles opened in it are visible to their kernels.
    """

    def __init__(self, ordinal: int) -> None:
        self.ordinal = ordinal
        self._lib = cuda_driver()
        self._ctx = ctypes.c_void_p()
        check(
            self._lib,
            self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(self._ctx), ordinal),
            f"cuDevicePrimaryCtxRetain({ordinal})",
        )

    def __enter__(self) -> PrimaryContext:
        check(self._lib, self._lib.cuCtxPushCurrent_v2(self._ctx), "cuCtxPushCurrent")
        return self

    def __exit__(self, *exc: object) -> None:
        popped = ctypes.c_void_p()
        self._lib.cuCtxPopCurrent_v2(ctypes.byref(popped))

    def release(self) -> None:
        self._lib.cuDevicePrimaryCtxRelease_v2(self.ordinal)


def pointer_attribute(ptr: int, attribute: int) -> int:
    lib = cuda_driver()
    value = ctypes.c_uint64(0)
    check(lib, lib.cuPointerGetAttribute(ctypes.byref(value), attribute, ptr), "cuPointerGetAttribute")
    return value.value


@dataclass(frozen=True)
class CudaIpcExport:
    """What the sidecar needs to map one tensor: matches the CudaIpcTensor proto message."""

    handle: bytes  # cudaIpcMemHandle_t of the allocation base, 64 bytes
    offset: int  # byte offset of the tensor's first element from the allocation base
    device_uuid: str  # "GPU-..." of the device that owns the memory
    nbytes: int  # bytes the tensor spans from `offset`
    allocation_size: int  # bytes of the whole allocation (the sidecar bounds-checks against it)

    def to_proto(self) -> Any:
        """A `kvsidecar.v1.CudaIpcTensor` (the generated protos are imported only here)."""
        from kv_sidecar_client._proto.kvsidecar.v1 import common_pb2

        return common_pb2.CudaIpcTensor(handle=self.handle, offset=self.offset, device_uuid=self.device_uuid)


def export_pointer(ptr: int, nbytes: int) -> CudaIpcExport:
    """Export `nbytes` of device memory starting at `ptr` (which must lie in one cudaMalloc allocation)."""
    if ptr == 0 or nbytes <= 0:
        raise CudaIpcError(f"cannot export {nbytes} bytes at address {ptr:#x}")
    lib = cuda_driver()
    try:
        mem_type = pointer_attribute(ptr, CU_POINTER_ATTRIBUTE_MEMORY_TYPE)
    except CudaIpcError as exc:
        raise CudaIpcError(f"address {ptr:#x} is not CUDA device memory ({exc})") from exc
    if mem_type != CU_MEMORYTYPE_DEVICE or pointer_attribute(ptr, CU_POINTER_ATTRIBUTE_IS_MANAGED):
        raise CudaIpcError(f"address {ptr:#x} is not plain device memory (managed or host memory)")
    ordinal = pointer_attribute(ptr, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)
    if not pointer_attribute(ptr, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE):
        raise CudaIpcError(f"memory at {ptr:#x} on cuda:{ordinal} {VMM_REFUSAL}")
    ctx = PrimaryContext(ordinal)
    try:
        with ctx:
            base, size = ctypes.c_uint64(), ctypes.c_size_t()
            check(
                lib,
                lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr),
                "cuMemGetAddressRange",
            )
            offset = ptr - base.value
            if offset + nbytes > size.value:
                raise CudaIpcError(
                    f"{nbytes} bytes at offset {offset} overrun their allocation of {size.value} bytes"
                )
            handle = CUipcMemHandle()
            code = lib.cuIpcGetMemHandle(ctypes.byref(handle), base.value)
            if code == CUDA_ERROR_NOT_SUPPORTED:
                raise CudaIpcError(f"memory at {ptr:#x} on cuda:{ordinal} {VMM_REFUSAL}")
            check(lib, code, "cuIpcGetMemHandle")
    finally:
        ctx.release()
    return CudaIpcExport(
        handle=bytes(handle.reserved),
        offset=offset,
        device_uuid=device_uuid(ordinal),
        nbytes=nbytes,
        allocation_size=size.value,
    )


def export_tensor(tensor: Any) -> CudaIpcExport:
    """Export a contiguous CUDA torch tensor (e.g. one layer's KV cache) for the sidecar.

    The engine must keep the tensor (and so its allocation) alive while it is
    registered: the handle does not hold a reference in the engine's allocator.
    """
    if not getattr(tensor, "is_cuda", False):
        raise CudaIpcError(f"expected a CUDA tensor, got one on {getattr(tensor, 'device', '?')}")
    if not tensor.is_contiguous():
        raise CudaIpcError(
            f"tensor of shape {tuple(tensor.shape)} and strides {tuple(tensor.stride())} is not contiguous"
        )
    return export_pointer(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def tensor_handles(tensors: Any) -> list[Any]:
    """`kvsidecar.v1.TensorHandle`s for RegisterRank from a rank's contiguous CUDA KV tensors."""
    from kv_sidecar_client._proto.kvsidecar.v1 import common_pb2

    return [
        common_pb2.TensorHandle(
            cuda_ipc=export_tensor(t).to_proto(),
            shape=list(t.shape),
            strides=list(t.stride()),
            dtype=str(t.dtype).removeprefix("torch."),
        )
        for t in tensors
    ]
