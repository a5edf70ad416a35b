"""One engine rank's KV tensors in GPU memory, mapped over CUDA IPC into whichever GPU copies.

A rank is imported once into its own GPU's context at registration (a bad
handle fails RegisterRank, not a later pull; a device worker imports it into
its own GPU's context instead), and lazily into the context of
any other GPU that runs a copy reading or writing it: a same-node kernel runs
on the destination GPU and reads the source over NVLink. Closing is deferred
while a copy still uses the mappings, because unmapping memory a kernel is
reading would fault the sidecar's whole CUDA context.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from kv_sidecar.dataplane.jobs import IpcTensorRef
from kv_sidecar.execute import gpu_geometry as geo
from kv_sidecar.execute.gpu import GpuRankView, gpu_rank_view
from kv_sidecar.memory.cuda_ipc import ImportedTensor, IpcRegistry, default_registry, device_for_uuid
from kv_sidecar.memory.held import HeldMemory
from kv_sidecar.plan.spec import EngineSpec, PlanError
from kv_sidecar_client.cuda_ipc import CudaIpcError


class GpuRank:
    def __init__(
        self,
        spec: EngineSpec,
        rank: int,
        refs: list[IpcTensorRef],
        registry: IpcRegistry | None = None,
        home: int | None = None,
    ) -> None:
        """home: the GPU whose context imports the rank at registration, its own unless given: a device
        worker copies on its GPU only, and importing every rank into its own GPU's context would give
        each worker a CUDA context on every GPU of the node."""
        uuids = {r.device_uuid for r in refs}
        if len(uuids) != 1:
            raise PlanError(f"rank {rank}: its KV tensors must all be on one GPU, got {sorted(uuids)}")
        self.spec = spec
        self.rank = rank
        self.device = device_for_uuid(refs[0].device_uuid)
        self._refs = refs
        self._nbytes = geo.tensor_nbytes(spec)
        self._registry = registry or default_registry()
        self._lock = threading.Lock()
        self._views: dict[int, tuple[GpuRankView, list[ImportedTensor]]] = {}
        self._held = HeldMemory(self._unregistered, self._lock)  # its lock guards `_views` too
        self.home = self.device if home is None else home
        try:
            self.view(self.home)
        except CudaIpcError:
            if self.home == self.device:
                raise
            # No peer access from `home` (GPUs without P2P): import it into its own GPU as before, so that
            # a copy into `home` fails with the driver's reason rather than as a rank not mapped.
            self.home = self.device
            self.view(self.home)

    def view(self, device: int) -> GpuRankView:
        """This rank's tensors as addresses valid in `device`'s primary context."""
        with self._lock:
            if self._held.closed:
                raise self._unregistered()
            known = self._views.get(device)
            if known is not None:
                return known[0]
            imported: list[ImportedTensor] = []
            try:
                for ref in self._refs:
                    imported.append(
                        self._registry.open(
                            ref.handle, ref.offset, self._nbytes, device, getattr(torch, self.spec.dtype)
                        )
                    )
                view = gpu_rank_view(self.spec, self.rank, imported, device)
            except BaseException:
                for t in imported:
                    t.release()
                raise
            self._views[device] = (view, imported)
            return view

    def in_use(self) -> contextlib.AbstractContextManager[None]:
        """Hold the mappings open for the duration of a copy, even if the rank is unregistered meanwhile."""
        return self._held.hold()

    def close(self) -> None:
        """No new copy; the mappings are released now, or once the last copy holding them ends."""
        self._held.close(self._release_all)

    def _unregistered(self) -> PlanError:
        return PlanError(f"rank {self.rank} was unregistered")

    def _release_all(self) -> None:
        with self._lock:
            views, self._views = list(self._views.values()), {}
        for _, imported in views:
            for t in imported:
                with contextlib.suppress(CudaIpcError):
                    t.release()

    @property
    def devices(self) -> list[int]:
        with self._lock:
            return sorted(self._views)
