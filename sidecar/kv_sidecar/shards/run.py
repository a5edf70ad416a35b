"""`kv-sidecar serve` with control_shards > 1: the front door and its shards, until SIGTERM/SIGINT.

Shutdown as a sidecar's: the first signal turns health NOT_SERVING and passes SIGTERM to every shard,
which drains (up to drain_timeout_s) and exits; a second passes it again (the shards skip the rest of
their drains). Exit 0 when every shard exited 0.
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import socket
import threading
import time

from kv_sidecar.commands.signals import ShutdownSignals
from kv_sidecar.config import Settings
from kv_sidecar.security import PeerSecurity
from kv_sidecar.shards.children import SHARD_METRICS_HOST, ShardError, ShardSet, advertised_host
from kv_sidecar.shards.front_door import FrontDoorEngine, FrontDoorServers
from kv_sidecar.shards.metrics import ShardMetrics
from kv_sidecar.shards.placement import Placement, gpu_groups

log = logging.getLogger("kv_sidecar.shards")


def visible_gpus() -> tuple[str, ...]:
    """The UUIDs of the GPUs this process sees, by ordinal (the shards see the same); none without a
    driver. Through the driver alone: the front door loads neither torch nor a CUDA context."""
    from kv_sidecar_client.cuda_ipc import CudaIpcError, cuda_driver, device_uuid

    try:
        lib = cuda_driver()
        count = ctypes.c_int()
        if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return ()
        return tuple(device_uuid(i) for i in range(count.value))
    except CudaIpcError:
        return ()


def run_front_door(settings: Settings) -> int:
    try:
        groups = gpu_groups(settings.control_shard_gpus, settings.control_shards)
        placement = Placement(settings.control_shards, visible_gpus(), groups)
    except ValueError as e:  # a group naming a GPU this node does not see, or one left out
        log.error("could not start: %s", e)
        return 1
    security = PeerSecurity.from_settings(settings)
    servers = FrontDoorServers(settings, security)
    try:
        port = servers.bind()
    except OSError as e:
        log.error("could not start: %s", e)
        return 1
    sidecar_id = settings.sidecar_id or f"kvs-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
    host = advertised_host(settings.advertise_address) or (
        settings.peer_host if settings.peer_host not in ("0.0.0.0", "::", "") else socket.gethostname()
    )
    draining = threading.Event()
    # SERVING while every shard is up, and never again once draining (a shard started again late).
    shards = ShardSet(
        settings, on_change=lambda: servers.set_serving(shards.all_up and not draining.is_set())
    )
    try:
        shards.start()
    except ShardError as e:
        log.error("could not start: %s", e)
        servers.stop()
        return 1
    engine = FrontDoorEngine(
        placement,
        shards,
        settings.leader_wait_ms / 1000,
        (sidecar_id, f"{host}:{port}"),
        draining,
        security.describe(),
        spread=settings.control_shard_ranks == "spread",
    )
    servers.serve(engine, ShardMetrics(shards.shards, SHARD_METRICS_HOST))
    servers.set_serving(True)
    signals = ShutdownSignals(on_again=shards.cut_short)
    signals.install()
    log.info(
        "front door %s up: %d control shards (%s), %d GPUs seen, %s",
        sidecar_id,
        len(shards.shards),
        ", ".join(f"{s.index}: {s.info.peer_address}" for s in shards.shards if s.info),
        len(placement.devices),
        f"grouped {settings.control_shard_gpus}" if groups else "in contiguous groups",
    )
    print(
        f"kv-sidecar ready id={sidecar_id} engine_socket={settings.engine_socket} peer={host}:{port} "
        f"metrics_port={servers.metrics_port} shards={len(shards.shards)}",
        flush=True,
    )
    while not signals.count:  # the handler only counts (commands/signals.py)
        shards.tend()
        time.sleep(0.1)
    draining.set()
    servers.set_serving(False)
    codes = shards.stop()
    servers.stop()
    if any(c != 0 for c in codes):
        log.error("shards exited with %s", codes)
        return 1
    return 0
