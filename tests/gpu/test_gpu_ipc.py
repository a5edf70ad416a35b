"""CUDA IPC export (engine side) and import (sidecar side) on real GPUs and real processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from ipc_engine import Engine, Job  # noqa: E402

from kv_sidecar.memory import cuda_ipc as mem  # noqa: E402
from kv_sidecar.plan.spec import EngineSpec, Layout  # noqa: E402
from kv_sidecar_client import cuda_ipc as client  # noqa: E402

pytestmark = pytest.mark.gpu

SPEC = EngineSpec(
    tp_size=1,
    num_layers=2,
    num_kv_heads=2,
    head_dim=64,
    dtype="float16",
    block_size=16,
    num_blocks=8,
    layout=Layout.FLASH_ATTN_NHD,
)


def _need(n: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA GPU(s)")


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    _need(1)
    e = Engine(0, [Job("one", SPEC.to_dict(), 0, 5, one_allocation=True), Job("sep", SPEC.to_dict(), 0, 6)])
    yield e
    e.close()


def test_uuid_names_the_same_device_as_torch() -> None:
    _need(1)
    for i in range(torch.cuda.device_count()):
        uuid = client.device_uuid(i)
        assert uuid.startswith("GPU-")
        assert uuid[4:] == str(torch.cuda.get_device_properties(i).uuid)
        assert mem.device_for_uuid(uuid) == i
    with pytest.raises(client.CudaIpcError, match="not visible"):
        mem.device_for_uuid("GPU-00000000-0000-0000-0000-000000000000")


def test_export_describes_allocation_base_and_offset(engine: Engine) -> None:
    one = engine.exports["one"]
    assert len({e.handle for e in one}) == 1, "tensors of one allocation export its one base handle"
    assert all(len(e.handle) == client.IPC_HANDLE_SIZE for e in one)
    assert one[0].offset > 0 and one[1].offset > one[0].offset
    assert all(e.device_uuid == client.device_uuid(0) for e in one)
    # "sep" tensors are separate torch allocations, but the caching allocator carves small
    # ones from one 2 MiB cudaMalloc segment: then they share the handle too (and one mapping).
    sep = engine.exports["sep"]
    assert all(e.offset + e.nbytes <= e.allocation_size for e in sep)


def test_refcounted_mappings_per_handle_and_device(engine: Engine) -> None:
    reg = mem.IpcRegistry()
    one = engine.exports["one"]
    n = one[0].nbytes
    a = reg.open(one[0].handle, one[0].offset, n, 0)
    b = reg.open(one[1].handle, one[1].offset, n, 0)
    assert reg.open_count() == 1
    assert b.data_ptr() - a.data_ptr() == one[1].offset - one[0].offset
    a.release()
    a.release()  # idempotent
    assert reg.open_count() == 1
    b.release()
    assert reg.open_count() == 0
    with reg.open(one[0].handle, one[0].offset, n, 0):
        assert reg.open_count() == 1
    assert reg.open_count() == 0


def test_one_allocation_open_in_two_contexts(engine: Engine) -> None:
    _need(2)
    reg = mem.IpcRegistry()
    e = engine.exports["sep"][0]
    on0 = mem.import_tensor(e.handle, e.offset, e.nbytes, 0, registry=reg)
    on1 = mem.import_tensor(e.handle, e.offset, e.nbytes, client.device_uuid(1), registry=reg)
    assert reg.open_count() == 2 and on1.device == 1
    on0.release()
    on1.release()
    assert reg.open_count() == 0


def test_imported_bytes_are_the_engines(engine: Engine) -> None:
    """Read an imported tensor back through a driver copy in the importing context."""
    import ctypes

    reg = mem.IpcRegistry()
    e = engine.exports["sep"][1]
    dev = torch.cuda.device_count() - 1
    out = torch.empty(e.nbytes, dtype=torch.uint8, device=f"cuda:{dev}")
    with reg.open(e.handle, e.offset, e.nbytes, dev) as t, client.PrimaryContext(dev):
        lib = client.cuda_driver()
        client.check(lib, lib.cuMemcpyDtoD_v2(out.data_ptr(), t.data_ptr(), e.nbytes), "cuMemcpyDtoD")
    want = engine.dump(["sep"])["sep"][1]
    assert torch.equal(out.cpu(), want.view(torch.uint8).view(-1))
    del ctypes


def test_torch_wraps_a_peer_mapping_on_the_importing_device(engine: Engine) -> None:
    """A GPU0 allocation opened in the last GPU's context: torch sees it there and reads the right bytes."""
    reg = mem.IpcRegistry()
    e = engine.exports["one"][1]
    dev = torch.cuda.device_count() - 1
    with reg.open(e.handle, e.offset, e.nbytes, dev) as imported:
        t = torch.as_tensor(imported)
        assert t.device == torch.device("cuda", dev)
        got = t.cpu()
    want = engine.dump(["one"])["one"][1]
    assert torch.equal(got, want.view(torch.uint8).view(-1))


def test_out_of_bounds_import_refused(engine: Engine) -> None:
    reg = mem.IpcRegistry()
    e = engine.exports["sep"][0]
    with pytest.raises(client.CudaIpcError, match="overruns"):
        reg.open(e.handle, e.offset, e.allocation_size + 1, 0)
    assert reg.open_count() == 0
    with pytest.raises(client.CudaIpcError, match="64 bytes"):
        reg.open(e.handle[:10], 0, 1, 0)


def test_export_refuses_vmm_memory() -> None:
    """expandable_segments memory is VMM memory: refused with a message that names the fix."""
    _need(1)
    e = Engine(0, [Job("vmm", SPEC.to_dict(), 0, 1, fill="device")], env={"EXPANDABLE": "1"})
    try:
        err = e.exports["vmm"]
        assert isinstance(err, client.CudaIpcError), err
        assert "expandable_segments" in str(err) and "VMM" in str(err)
    finally:
        e.close()


def test_export_refuses_cpu_and_strided_tensors() -> None:
    _need(1)
    with pytest.raises(client.CudaIpcError, match="CUDA tensor"):
        client.export_tensor(torch.zeros(4))
    t = torch.zeros(8, 8, device="cuda:0")
    with pytest.raises(client.CudaIpcError, match="not contiguous"):
        client.export_tensor(t.t())


def test_own_handle_cannot_be_imported_in_the_same_process() -> None:
    _need(1)
    t = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
    ex = client.export_tensor(t)
    with pytest.raises(client.CudaIpcError):
        mem.IpcRegistry().open(ex.handle, ex.offset, ex.nbytes, 0)
