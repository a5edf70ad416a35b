"""`make image-smoke`: two kv-sidecar containers from the CPU image, proven end to end.

Each "pod" is one container run from the image exactly as deploy/k8s/base/deployment.yaml runs the
`kv-sidecar` container: its command and args, its environment (the pod IP is 127.0.0.1), its user and
group, and every one of its volume mounts (the config file, the optional peer-auth Secret, the engine
socket directory, /dev/shm and /tmp), all read from the manifest by `pod_plan()` below; the startup
probe is polled as the kubelet would (gRPC health on the peer port, its period and failure threshold).
Because both pods share the host's loopback, three settings differ, as environment variables:
the peer and metrics ports (free ports) and the peer bind address (127.0.0.1). tests/deploy checks
that the plan matches the manifest, the Dockerfile and config.yaml.

Containers run with `buildah run --isolation chroot` (the image's root file system in its own mount
namespace, on the host's network and PID namespaces): the OCI runtime behind `podman run` cannot set
rlimits in some sandboxes. The reference engines run from the same image beside each sidecar, as the
pod's engine container would: same user (their shared-memory caches are mode 0600), the pod's
socket directory and /dev/shm. Checked, each failing loudly:

  1. each sidecar's startup probe passes; the process runs as uid/gid 65532 without capabilities,
     chrooted into the image;
  2. gRPC health is SERVING on the peer port and the engine socket;
  3. verified P/D transfers between the two containers over NIXL: same layout (host-nixl) and
     TP 1 -> 2 with another layout and block size (host-nixl-staged), every byte compared, and the
     prefill engine gets its "consumed" events;
  4. /metrics scraped from both, counting those pulls and handshakes;
  5. `kv-sidecar status` run inside the decode container (its engine socket, and the prefill
     sidecar through --peer) answers with the engines and pulls;
  6. SIGTERM drains: with a pull held in flight (the prefill sidecar frozen by SIGSTOP), the decode
     sidecar reports NOT_SERVING, refuses new work as draining, lets the pull finish once the prefill
     side runs again, removes its sockets and exits 0; the prefill sidecar then stops with 0 too;
  7. neither sidecar wrote into the image's root file system outside its volumes (the manifest runs
     it read-only);
  8. a third container runs the node sidecar as control shards (SHARD_OVERRIDES: `control_shards: 2`,
     docs/operations.md, "Control shards"): its startup probe passes once both shards serve, each
     shard runs as the container's user, engines that know only the front door's socket pull from
     each other within a shard (host-direct) and across the shards (host-nixl), every byte
     compared; the front door's /metrics carries both shards' series; SIGTERM drains the shards,
     the front door exits 0 and no process of the container is left.

Run as root with the project's venv: `.venv/bin/python scripts/image_smoke.py [IMAGE]`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "deploy" / "k8s" / "base" / "deployment.yaml"
CONFIG = REPO / "deploy" / "k8s" / "base" / "config.yaml"
CONTAINER = "kv-sidecar"
POD_IP = "127.0.0.1"
# The settings the smoke test changes, because its two pods share one network namespace.
PORT_OVERRIDES = ("KV_SIDECAR_PEER_HOST", "KV_SIDECAR_PEER_PORT", "KV_SIDECAR_METRICS_PORT")
# What the third pod (check 8) sets on top: the manifest's sidecar run as control shards.
SHARDS = 2
SHARD_OVERRIDES = {"KV_SIDECAR_CONTROL_SHARDS": str(SHARDS)}


@dataclass(frozen=True)
class Mount:
    path: str  # in the container
    volume: str
    kind: str  # configMap, secret, emptyDir
    read_only: bool
    sub_path: str = ""
    medium: str = ""


@dataclass(frozen=True)
class Probe:
    port: int
    period_s: float
    failure_threshold: int


@dataclass(frozen=True)
class PodPlan:
    """The kv-sidecar container of the base manifest: what the smoke test runs."""

    image: str
    argv: list[str]  # command + args
    env: dict[str, str]  # fieldRef status.podIP -> POD_IP
    uid: int
    gid: int
    ports: dict[str, int]
    probes: dict[str, Probe]  # startup, readiness, liveness
    mounts: list[Mount]
    read_only_root: bool
    fs_group: int | None = None  # the pod's: a supplementary group of its containers
    drop_caps: list[str] = field(default_factory=list)


def pod_plan(manifest: Path = MANIFEST) -> PodPlan:
    doc = yaml.safe_load(manifest.read_text())
    spec = doc["spec"]["template"]["spec"]
    (c,) = [c for c in spec["initContainers"] + spec["containers"] if c["name"] == CONTAINER]
    volumes = {v["name"]: v for v in spec["volumes"]}
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[e["name"]] = POD_IP
        else:
            raise ValueError(f"the smoke test does not know how to fill env {e['name']}: {e}")
    mounts = []
    for m in c["volumeMounts"]:
        vol = volumes[m["name"]]
        (kind,) = [k for k in ("configMap", "secret", "emptyDir") if k in vol]
        mounts.append(
            Mount(
                path=m["mountPath"],
                volume=m["name"],
                kind=kind,
                read_only=bool(m.get("readOnly", False)),
                sub_path=m.get("subPath", ""),
                medium=(vol[kind] or {}).get("medium", "") if kind == "emptyDir" else "",
            )
        )
    sc = c["securityContext"]
    probes = {
        name: Probe(p["grpc"]["port"], float(p.get("periodSeconds", 10)), int(p.get("failureThreshold", 3)))
        for name in ("startup", "readiness", "liveness")
        if (p := c.get(f"{name}Probe"))
    }
    return PodPlan(
        image=c["image"],
        argv=[*c["command"], *c["args"]],
        env=env,
        uid=int(sc["runAsUser"]),
        gid=int(sc["runAsGroup"]),
        ports={p["name"]: int(p["containerPort"]) for p in c["ports"]},
        probes=probes,
        mounts=mounts,
        read_only_root=bool(sc.get("readOnlyRootFilesystem", False)),
        fs_group=spec.get("securityContext", {}).get("fsGroup"),
        drop_caps=list(sc.get("capabilities", {}).get("drop", [])),
    )


def smoke_env(plan: PodPlan, peer_port: int, metrics_port: int) -> dict[str, str]:
    """The container's environment in the smoke test: the manifest's, plus PORT_OVERRIDES."""
    return plan.env | dict(zip(PORT_OVERRIDES, (POD_IP, str(peer_port), str(metrics_port)), strict=True))


def host_volumes(plan: PodPlan, pod_dir: Path, config: Path = CONFIG) -> list[tuple[str, str, bool]]:
    """(host path, container path, read-only) for each of the manifest's mounts: the ConfigMap's
    config.yaml is deploy/k8s/base/config.yaml, the optional Secret an empty directory, /dev/shm the
    host's (engine and sidecar share it, as the pod's Memory emptyDir), other emptyDirs fresh
    directories owned by the container's user (the pod's fsGroup).

    /dev/shm cannot be anything but the host's here: buildah's chroot isolation (1.28) binds the
    host's /dev/shm into every container and ignores a volume there. Both pods share it, and a
    manifest without its /dev/shm mount would pass; tests/deploy/test_manifests.py checks that."""
    out = []
    for m in plan.mounts:
        if m.kind == "configMap":
            if m.sub_path != config.name:
                raise ValueError(f"mount {m.path}: expected subPath {config.name}, not {m.sub_path!r}")
            host = str(config)
        elif m.path == "/dev/shm":
            host = "/dev/shm"
        else:
            d = pod_dir / m.volume
            d.mkdir(mode=0o750 if m.kind == "secret" else 0o770)
            if m.kind == "emptyDir":
                os.chown(d, plan.uid, plan.gid)
            host = str(d)
        out.append((host, m.path, m.read_only))
    return out


# --------------------------------------------------------------------------- running


class Failed(Exception):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind((POD_IP, 0))
        return int(s.getsockname()[1])


def sh(argv: list[str], timeout: float = 120) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        raise Failed(f"{' '.join(argv)} exited with {r.returncode}:\n{r.stdout}{r.stderr}")
    return r.stdout


def children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
    return out


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL a process and everything under it (a `buildah run` and the contained process)."""
    for p in [*descendants(pid), pid]:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)


def status_fields(pid: int) -> dict[str, str]:
    text = Path(f"/proc/{pid}/status").read_text()
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


class Pod:
    """One kv-sidecar container (a buildah working container of the image)."""

    def __init__(
        self, name: str, image: str, plan: PodPlan, work: Path, more_env: dict[str, str] | None = None
    ) -> None:
        self.name, self.plan = name, plan
        self.dir = work / name
        self.dir.mkdir()
        self.peer_port, self.metrics_port = free_port(), free_port()
        self.env = smoke_env(plan, self.peer_port, self.metrics_port) | (more_env or {})
        self.volumes = host_volumes(plan, self.dir)
        (sock_dir,) = [h for h, c, _ in self.volumes if c == os.path.dirname(self.setting("engine_socket"))]
        self.socket = os.path.join(sock_dir, os.path.basename(self.setting("engine_socket")))
        self.peer = f"{POD_IP}:{self.peer_port}"
        self.ctr = sh(
            ["buildah", "from", "--pull-never", "--name", f"kvs-smoke-{name}-{os.getpid()}", image]
        ).strip()
        self.log_path = self.dir / "container.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid = 0

    def setting(self, key: str) -> str:
        return str(yaml.safe_load(CONFIG.read_text())[key])

    def run_argv(self, argv: list[str]) -> list[str]:
        cmd = ["buildah", "run", "--isolation", "chroot", "--user", f"{self.plan.uid}:{self.plan.gid}"]
        cmd += [f"--cap-drop={c.lower()}" for c in self.plan.drop_caps]
        for host, path, ro in self.volumes:
            cmd += ["-v", f"{host}:{path}{':ro' if ro else ''}"]
        for k, v in self.env.items():
            cmd += ["-e", f"{k}={v}"]
        return [*cmd, self.ctr, "--", *argv]

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.run_argv(self.plan.argv), stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )

    def wait_started(self) -> float:
        """The startup probe, as the kubelet runs it; the seconds it took."""
        p = self.plan.probes["startup"]
        t0 = time.monotonic()
        for _ in range(p.failure_threshold):
            if self.proc is not None and self.proc.poll() is not None:
                raise Failed(f"{self.name}: the container exited with {self.proc.returncode}:\n{self.tail()}")
            if health(self.peer) == "SERVING":
                self.pid = self.find_pid()
                return time.monotonic() - t0
            time.sleep(p.period_s)
        raise Failed(f"{self.name}: startup probe failed {p.failure_threshold} times:\n{self.tail()}")

    def find_pid(self) -> int:
        """The kv-sidecar process: the descendant of `buildah run` that runs the manifest's argv (with
        control shards, the front door: the shards it starts run `serve` too, below it)."""
        assert self.proc is not None
        todo, found = [self.proc.pid], []
        while todo:
            pid = todo.pop()
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
                if "serve" in argv and not any("buildah" in a for a in argv[:1]):
                    found.append(pid)
                    continue
            todo += children(pid)
        if len(found) != 1:
            raise Failed(f"{self.name}: expected one kv-sidecar process under buildah run, found {found}")
        return found[0]

    def exec(self, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """A command in the container, as `kubectl exec` would run it (same user, env and volumes)."""
        return subprocess.run(self.run_argv(argv), capture_output=True, text=True, timeout=timeout)

    def engine(self, engine_id: str, spec: Any) -> Any:
        """A reference engine in a second container of this pod: the image's Python as the same user,
        with the pod's volumes (engine socket directory, /dev/shm), as the manifest's engine container
        shares them. Its shared-memory KV caches (mode 0600) are the sidecar's user's, as the docs ask
        of a non-root engine (docs/operations.md, 5.5)."""
        from kv_sidecar.refengine.procs import EngineProcess

        python = self.run_argv(["python"])
        return EngineProcess(
            self.setting("engine_socket"), engine_id, spec, start_timeout_s=120, python=python
        )

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def wait_exit(self, timeout: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired as e:
            raise Failed(f"{self.name}: still running {timeout} s after SIGTERM:\n{self.tail()}") from e

    def tail(self, n: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""

    def logged(self, fragment: str) -> bool:
        return fragment in self.log_path.read_text(errors="replace")

    def rootfs_writes(self) -> list[str]:
        """Files the container's processes created or changed in the image's root file system (the
        overlay's upper directory), less what `buildah run` itself puts there: mount points of the
        volumes and the files it writes for every run (/etc/hosts, /etc/resolv.conf, /etc/hostname)."""
        mnt = Path(sh(["buildah", "mount", self.ctr]).strip())
        try:
            upper = mnt.parent / "diff"
            if not upper.is_dir():
                raise Failed(f"{self.name}: no overlay upper directory beside {mnt}")
            allowed = {"/etc/hosts", "/etc/resolv.conf", "/etc/hostname", "/run/.containerenv"}
            for _, path, _ in self.volumes:
                parts = Path(path).parts
                allowed |= {str(Path(*parts[: i + 1])) for i in range(1, len(parts))}
            written = []
            for p in upper.rglob("*"):
                rel = "/" + str(p.relative_to(upper))
                if rel not in allowed and not any(rel.startswith(v + "/") for _, v, _ in self.volumes):
                    written.append(rel)
            return sorted(written)
        finally:
            sh(["buildah", "umount", self.ctr])

    def remove(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if self.pid:
                with contextlib.suppress(OSError):
                    os.kill(self.pid, signal.SIGCONT)
            kill_tree(self.proc.pid)
            self.proc.wait()
        subprocess.run(["buildah", "rm", self.ctr], capture_output=True)


def health(target: str, service: str = "") -> str:
    """grpc.health.v1 Check, as the kubelet's gRPC probe sends it; the status name or the error."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(target) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2
            )
            return str(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))
    except grpc.RpcError as e:
        return f"error {e.code().name}"


def scrape(port: int) -> dict[str, float]:
    """/metrics: each metric name summed over its labels."""
    text = urllib.request.urlopen(f"http://{POD_IP}:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{[^}]*\})? (\S+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def wait_for(what: str, cond: Callable[[], object], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise Failed(f"timed out waiting for {what}")
        time.sleep(0.05)


class Checks:
    def __init__(self) -> None:
        self.failed: list[str] = []

    @contextlib.contextmanager
    def check(self, what: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        except Exception as e:
            self.failed.append(what)
            print(f"FAIL  {what}: {type(e).__name__}: {e}", flush=True)
            raise
        print(f"ok    {what} ({time.monotonic() - t0:.1f} s)", flush=True)


# --------------------------------------------------------------------------- the smoke test


SPEC: dict[str, Any] = {
    "tp_size": 1,
    "num_layers": 4,
    "num_kv_heads": 4,
    "head_dim": 64,
    "dtype": "bfloat16",
    "block_size": 16,
    "num_blocks": 64,
    "layout": "flash_attn_nhd",
}


def smoke(image: str) -> None:
    from kv_sidecar.plan.spec import EngineSpec
    from kv_sidecar.refengine.procs import EngineProcess, together
    from kv_sidecar_client import SidecarClient

    plan = pod_plan()
    checks = Checks()
    check = checks.check
    work = Path(tempfile.mkdtemp(prefix="kv-sidecar-smoke-"))
    os.chmod(work, 0o755)
    pods: list[Pod] = []
    engines: list[EngineProcess] = []
    try:
        with check(f"two containers from {image} pass their startup probes"):
            pods = [Pod("prefill", image, plan, work), Pod("decode", image, plan, work)]
            for pod in pods:
                pod.start()
            took = [pod.wait_started() for pod in pods]
            print(
                f"      started in {took[0]:.1f} s and {took[1]:.1f} s; peers {pods[0].peer}, {pods[1].peer}"
            )
        a, b = pods

        with check(f"each sidecar runs as uid/gid {plan.uid}, no capabilities, chrooted in the image"):
            for pod in pods:
                st = status_fields(pod.pid)
                uids, gids = st["Uid"].split(), st["Gid"].split()
                assert set(uids) == {str(plan.uid)}, f"{pod.name}: Uid {uids}"
                assert set(gids) == {str(plan.gid)}, f"{pod.name}: Gid {gids}"
                groups = set(st["Groups"].split())
                assert groups <= {str(plan.gid), str(plan.fs_group)}, f"{pod.name}: groups {groups}"
                assert int(st["CapEff"], 16) == 0 and int(st["CapPrm"], 16) == 0, (
                    f"{pod.name}: {st['CapEff']}"
                )
                root = os.readlink(f"/proc/{pod.pid}/root")
                # The root is buildah's mount of the image, in the container's own mount namespace.
                assert root != "/" and os.path.exists(f"/proc/{pod.pid}/root/opt/venv/bin/kv-sidecar"), root

        with check("gRPC health SERVING on the peer ports and the engine sockets"):
            for pod in pods:
                for target in (pod.peer, f"unix:{pod.socket}"):
                    for service in (
                        "",
                        "kvsidecar.v1.PeerService" if target == pod.peer else "kvsidecar.v1.EngineService",
                    ):
                        got = health(target, service)
                        assert got == "SERVING", f"{pod.name} {target} {service!r}: {got}"

        pspec = EngineSpec.from_dict(SPEC)
        staged = EngineSpec.from_dict(SPEC | {"tp_size": 2, "layout": "flash_attn_hnd", "block_size": 32})
        with check("reference engines (in the image, beside each sidecar) register through the sockets"):
            made = together(
                lambda: a.engine("prefill-0", pspec),
                lambda: b.engine("decode-0", pspec),
                lambda: b.engine("decode-1", staged),
            )
            engines.extend(made)
            prefill, decode, decode2 = made

        def transfer(
            rid: str, dst: EngineProcess, tokens: int, src_blocks: list[int], dst_blocks: list[int]
        ) -> dict[str, Any]:
            pub = prefill.send(
                {
                    "cmd": "prefill",
                    "request_id": rid,
                    "block_ids": src_blocks,
                    "num_tokens": tokens,
                    "seed": len(rid),
                }
            )
            assert pub["ok"], pub
            res = dst.send(
                {"cmd": "pull", "params": pub["params"], "block_ids": dst_blocks, "seed": len(rid)}
            )
            assert res["ok"], f"{rid}: {res.get('error_code')}: {res.get('error')}"
            assert res["verified"], f"{rid}: bytes differ: {res['errors']}"
            for _ in range(pspec.tp_size):
                ev = prefill.send({"cmd": "next_event", "timeout_s": 10})
                assert ev.get("kind") == "consumed" and ev.get("request_id") == rid, ev
            return res

        with check("verified P/D transfers between the containers (every byte, 'consumed' events)"):
            r1 = transfer("smoke-same", decode, 100, [9, 3, 40, 17, 22, 5, 61], [50, 2, 33, 7, 12, 60, 1])
            assert r1["path"] == "host-nixl", r1["path"]
            r2 = transfer("smoke-staged", decode2, 100, [11, 30, 4, 25, 8, 44, 2], [20, 6, 13, 31])
            assert r2["path"] == "host-nixl-staged", r2["path"]
            for rid, done in (("smoke-same", r1), ("smoke-staged", r2)):
                print(
                    f"      {rid}: {done['path']}, {done['bytes']} bytes in {done['duration_s'] * 1e3:.2f} ms, verified"
                )

        with check("/metrics scraped from both containers"):
            ma, mb = scrape(a.metrics_port), scrape(b.metrics_port)
            assert mb.get("kvsidecar_pulls_total", 0) >= 2, {k: v for k, v in mb.items() if "pull" in k}
            assert mb.get("kvsidecar_pull_bytes_total", 0) >= r1["bytes"] + r2["bytes"], mb.get(
                "kvsidecar_pull_bytes_total"
            )
            assert mb.get("kvsidecar_handshakes_total", 0) >= 1, mb.get("kvsidecar_handshakes_total")
            assert ma.get("kvsidecar_registered_ranks") == 1 and mb.get("kvsidecar_registered_ranks") == 3, (
                ma.get("kvsidecar_registered_ranks"),
                mb.get("kvsidecar_registered_ranks"),
            )
            print(
                f"      decode: {mb['kvsidecar_pulls_total']:.0f} pulls, {mb['kvsidecar_pull_bytes_total']:.0f} bytes"
            )

        with check("`kv-sidecar status` answers inside the decode container (engine socket and --peer)"):
            r = b.exec(["kv-sidecar", "status", "--json"])
            assert r.returncode == 0, r.stdout + r.stderr
            st = json.loads(r.stdout[r.stdout.index("{") :])
            ranks = sorted((rk["engine_id"], rk["rank"]) for rk in st["ranks"])
            assert ranks == [("decode-0", 0), ("decode-1", 0), ("decode-1", 1)], ranks
            assert int(st["recent"]["pulls"]) >= 2 and not st.get("draining"), st["recent"]
            assert any(p["direction"] == "outgoing" and p["address"] == a.peer for p in st["peers"]), st[
                "peers"
            ]
            text = b.exec(["kv-sidecar", "status"])
            assert text.returncode == 0 and "serving" in text.stdout and "decode-1" in text.stdout, (
                text.stdout + text.stderr
            )
            peer = b.exec(["kv-sidecar", "status", "--peer", a.peer])
            assert peer.returncode == 0 and "prefill-0" in peer.stdout, peer.stdout + peer.stderr
            print("      " + text.stdout.splitlines()[0])

        with check(
            "SIGTERM drains the decode sidecar: NOT_SERVING, new work refused, the pull in flight finishes, exit 0"
        ):
            pub = prefill.send(
                {
                    "cmd": "prefill",
                    "request_id": "smoke-drain",
                    "block_ids": [13, 14],
                    "num_tokens": 20,
                    "seed": 3,
                }
            )
            assert pub["ok"], pub
            box: list[dict[str, Any]] = []
            a.signal(signal.SIGSTOP)  # the prefill sidecar answers nothing: the pull stays in flight
            try:
                t = threading.Thread(
                    target=lambda: box.append(
                        decode.send(
                            {"cmd": "pull", "params": pub["params"], "block_ids": [40, 41], "seed": 3}
                        )
                    ),
                    daemon=True,
                )
                t.start()

                def in_flight() -> bool:
                    with SidecarClient(b.socket, lane=False) as c:
                        return any(x.request_id == "smoke-drain" for x in c.status().inflight)

                wait_for("the pull to be in flight", in_flight)
                b.signal(signal.SIGTERM)
                wait_for("NOT_SERVING on the decode peer port", lambda: health(b.peer) == "NOT_SERVING", 10)
                assert health(f"unix:{b.socket}") == "NOT_SERVING"
                refused = decode2.send({"cmd": "pull", "params": pub["params"], "block_ids": [1], "seed": 3})
                assert not refused["ok"] and refused["error_code"] == "UNAVAILABLE", refused
                assert "draining" in refused["error"], refused
                assert b.proc is not None and b.proc.poll() is None, "exited before the pull in flight ended"
            finally:
                a.signal(signal.SIGCONT)
            t.join(60)
            assert box and box[0]["ok"] and box[0]["verified"], box
            code = b.wait_exit(float(b.setting("drain_timeout_s")) + 10)
            assert code == 0, f"exit code {code}:\n{b.tail()}"
            assert b.logged("draining: 1 transfers in flight") and b.logged('"msg":"drained"'), b.tail()
            left = [p for p in (b.socket, b.socket + ".lane") if os.path.exists(p)]
            assert not left, f"sockets left behind: {left}"

        with check("the prefill sidecar stops cleanly after its engine (native sidecar order)"):
            t0 = time.monotonic()
            for e in engines:
                e.stop()
            engines.clear()
            print(f"      engines stopped in {time.monotonic() - t0:.1f} s")
            a.signal(signal.SIGTERM)
            code = a.wait_exit(float(a.setting("drain_timeout_s")) + 10)
            assert code == 0, f"exit code {code}:\n{a.tail()}"
            assert a.logged('"msg":"drained"'), a.tail()
            for pod in pods:
                for line in pod.log_path.read_text().splitlines():
                    if "drain" in line:
                        print(f"      {pod.name}: {line}")
            assert not os.path.exists(a.socket), a.socket

        with check(
            "nothing written to the image's root file system outside the volumes (readOnlyRootFilesystem)"
        ):
            assert plan.read_only_root
            for pod in pods:
                written = pod.rootfs_writes()
                assert not written, f"{pod.name} wrote {written[:20]}"

        node = Pod("node", image, plan, work, SHARD_OVERRIDES)
        pods.append(node)
        shards_check(node, plan, pspec, engines, check)
    except Exception:
        if not checks.failed:
            raise
        for pod in pods:
            print(f"--- {pod.name} container log (last lines):\n{pod.tail()}", file=sys.stderr)
    finally:
        for e in engines:
            with contextlib.suppress(Exception):
                e.stop(10)
            if e.alive:
                kill_tree(e.proc.pid)
                e.proc.wait()
        for pod in pods:
            pod.remove()
        shutil.rmtree(work, ignore_errors=True)
    if checks.failed:
        print(f"image smoke test FAILED: {', '.join(checks.failed)}", flush=True)
        sys.exit(1)
    print(f"image smoke test passed: {image}", flush=True)


def shards_check(node: Pod, plan: PodPlan, spec: Any, engines: list[Any], check: Any) -> None:
    """Check 8: the node sidecar as control shards, in a container of its own."""
    from kv_sidecar.shards.children import shard_socket
    from kv_sidecar.shards.placement import Placement

    with check(f"a container running {SHARDS} control shards passes its startup probe"):
        node.start()
        took = node.wait_started()
        shard_pids = descendants(node.pid)
        shard_pids = [p for p in shard_pids if "serve" in Path(f"/proc/{p}/cmdline").read_bytes().decode()]
        assert len(shard_pids) == SHARDS, f"shard processes under the front door: {shard_pids}"
        for pid in shard_pids:
            st = status_fields(pid)
            assert set(st["Uid"].split()) == {str(plan.uid)} and int(st["CapEff"], 16) == 0, st["Uid"]
        socks = [shard_socket(node.socket, k) for k in range(SHARDS)]
        assert all(os.path.exists(s) for s in socks), socks
        print(f"      started in {took:.1f} s: front door {node.pid}, shards {shard_pids}")

    # Host engines go to a shard by their engine id: two on shard 0, one on shard 1.
    place = Placement(SHARDS)
    names = (f"node-e{i}" for i in range(1000))
    on0 = [n for n in names if place.shard_of(n) == 0][:2]
    on1 = next(n for n in (f"node-f{i}" for i in range(1000)) if place.shard_of(n) == 1)
    with check("engines that know only the front door pull within a shard and across shards, verified"):
        from kv_sidecar.refengine.procs import together

        prefill, near, far = together(*(lambda n=n: node.engine(n, spec) for n in (*on0, on1)))
        engines.extend((prefill, near, far))
        for rid, dst, path in (("shards-near", near, "host-direct"), ("shards-far", far, "host-nixl")):
            pub = prefill.send(
                {"cmd": "prefill", "request_id": rid, "block_ids": [3, 9, 27], "num_tokens": 40, "seed": 5}
            )
            assert pub["ok"], pub
            res = dst.send({"cmd": "pull", "params": pub["params"], "block_ids": [8, 1, 30], "seed": 5})
            assert res["ok"] and res["verified"], f"{rid}: {res}"
            assert res["path"] == path, f"{rid}: {res['path']}"
            print(f"      {rid}: {res['path']}, {res['bytes']} bytes, verified")

    with check("the front door's /metrics carries both shards"):
        text = (
            urllib.request.urlopen(f"http://{POD_IP}:{node.metrics_port}/metrics", timeout=5).read().decode()
        )
        for k in range(SHARDS):
            assert f'kvsidecar_shard_up{{shard="{k}"}} 1.0' in text, f"shard {k} not up"
        pulls = re.findall(r'^kvsidecar_pulls_total\{[^}]*shard="(\d+)"[^}]*\} (\S+)$', text, re.MULTILINE)
        assert sum(float(v) for _, v in pulls) >= 2, pulls

    with check("SIGTERM: the shards drain, the front door exits 0, no process of the container is left"):
        for e in engines:
            e.stop()
        engines.clear()
        below = descendants(node.pid)
        node.signal(signal.SIGTERM)
        code = node.wait_exit(float(node.setting("drain_timeout_s")) + 10)
        assert code == 0, f"exit code {code}:\n{node.tail()}"
        left = [p for p in below if Path(f"/proc/{p}").exists()]
        assert not left, f"still running: {left}"
        socks = [node.socket, *(shard_socket(node.socket, k) for k in range(SHARDS))]
        assert not any(os.path.exists(s) for s in socks), socks
        written = node.rootfs_writes()
        assert not written, f"wrote {written[:20]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("image", nargs="?", help="the CPU image (default: scripts/image.sh name cpu)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("image_smoke.py: run as root (buildah, and engines run as the container's user)")
    if not shutil.which("buildah"):
        sys.exit("image_smoke.py: needs buildah (Debian/Ubuntu: apt-get install buildah)")
    image = args.image or sh([str(REPO / "scripts" / "image.sh"), "name", "cpu"]).strip()
    smoke(image)


if __name__ == "__main__":
    main()
