"""The image smoke test (scripts/image_smoke.py, `make image-smoke`) runs what the manifest runs.

No image is needed: the smoke test reads its container's image, command, environment, user, ports,
probes and volumes from deploy/k8s/base/deployment.yaml (`pod_plan`); these tests check that plan
against the manifest's raw YAML, the Dockerfile, config.yaml and the image names `scripts/image.sh`
builds, and that the smoke test changes nothing but the ports it must (two pods on one loopback).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOYMENT = REPO / "deploy" / "k8s" / "base" / "deployment.yaml"
CONFIG = REPO / "deploy" / "k8s" / "base" / "config.yaml"
DOCKERFILE = REPO / "Dockerfile"


def _load_smoke() -> ModuleType:
    spec = importlib.util.spec_from_file_location("image_smoke", REPO / "scripts" / "image_smoke.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["image_smoke"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


smoke = _load_smoke()


@pytest.fixture(scope="module")
def container() -> dict[str, Any]:
    spec = yaml.safe_load(DEPLOYMENT.read_text())["spec"]["template"]["spec"]
    (c,) = [c for c in spec["initContainers"] if c["name"] == "kv-sidecar"]
    return c


@pytest.fixture(scope="module")
def pod_spec() -> dict[str, Any]:
    return yaml.safe_load(DEPLOYMENT.read_text())["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    return yaml.safe_load(CONFIG.read_text())


def _final_stage() -> list[str]:
    """The Dockerfile's last stage, instructions joined across continuation lines."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    last_from = max(i for i, ln in enumerate(lines) if ln.upper().startswith("FROM "))
    return lines[last_from:]


def _instruction(name: str) -> str:
    (value,) = [ln.split(None, 1)[1] for ln in _final_stage() if ln.upper().startswith(name + " ")]
    return value


def test_the_smoke_runs_the_manifests_command_which_is_the_images_entrypoint(
    container: dict[str, Any],
) -> None:
    plan = smoke.pod_plan()
    assert plan.argv == [*container["command"], *container["args"]]
    assert plan.argv == json.loads(_instruction("ENTRYPOINT")) + json.loads(_instruction("CMD"))


def test_the_smoke_runs_the_manifests_image_in_its_cpu_variant(container: dict[str, Any]) -> None:
    plan = smoke.pod_plan()
    assert plan.image == container["image"]
    names = {
        v: subprocess.run(
            [str(REPO / "scripts" / "image.sh"), "name", v], capture_output=True, text=True, check=True
        ).stdout.strip()
        for v in ("cuda", "cpu")
    }
    # `make image` builds what the manifest pulls; `make image-smoke` runs the same build's CPU variant.
    assert names == {"cuda": plan.image, "cpu": plan.image + "-cpu"}


def test_user_and_security_context(container: dict[str, Any]) -> None:
    plan = smoke.pod_plan()
    sc = container["securityContext"]
    assert (plan.uid, plan.gid) == (sc["runAsUser"], sc["runAsGroup"]) == (65532, 65532)
    assert _instruction("USER") == f"{plan.uid}:{plan.gid}"
    assert plan.read_only_root is True and plan.drop_caps == ["ALL"]


def test_ports_and_probes_match_the_config_and_the_image(
    container: dict[str, Any], config: dict[str, Any]
) -> None:
    plan = smoke.pod_plan()
    assert plan.ports == {p["name"]: p["containerPort"] for p in container["ports"]}
    assert plan.ports == {"peer": config["peer_port"], "metrics": config["metrics_port"]}
    assert sorted(int(p) for p in _instruction("EXPOSE").split()) == sorted(plan.ports.values())
    for name in ("startup", "readiness", "liveness"):
        raw = container[f"{name}Probe"]
        assert plan.probes[name] == smoke.Probe(
            raw["grpc"]["port"], float(raw.get("periodSeconds", 10)), int(raw.get("failureThreshold", 3))
        )
        # Every probe asks the peer port, which the smoke test polls (remapped to its own free port).
        assert plan.probes[name].port == plan.ports["peer"]


def test_the_smoke_overrides_only_the_ports_it_must(
    container: dict[str, Any], config: dict[str, Any]
) -> None:
    plan = smoke.pod_plan()
    literal = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    from_pod_ip = {e["name"] for e in container["env"] if "valueFrom" in e}
    assert from_pod_ip == {"KV_SIDECAR_ADVERTISE_ADDRESS"}
    env = smoke.smoke_env(plan, 40001, 40002)
    assert env == literal | {
        "KV_SIDECAR_ADVERTISE_ADDRESS": smoke.POD_IP,
        "KV_SIDECAR_PEER_HOST": smoke.POD_IP,
        "KV_SIDECAR_PEER_PORT": "40001",
        "KV_SIDECAR_METRICS_PORT": "40002",
    }
    # Each override names a key of config.yaml: the rest of the file is used as it is.
    for name in smoke.PORT_OVERRIDES:
        assert name.removeprefix("KV_SIDECAR_").lower() in config
    # The third pod (check 8) only runs the same sidecar as control shards, a key the file leaves at 1.
    assert list(smoke.SHARD_OVERRIDES) == ["KV_SIDECAR_CONTROL_SHARDS"]
    assert config["control_shards"] == 1 and int(smoke.SHARD_OVERRIDES["KV_SIDECAR_CONTROL_SHARDS"]) > 1


def test_the_smoke_mounts_every_volume_of_the_manifest(
    container: dict[str, Any], pod_spec: dict[str, Any], tmp_path: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("host_volumes gives the emptyDirs to the container's user: needs root")
    plan = smoke.pod_plan()
    vols = smoke.host_volumes(plan, tmp_path)
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert {path: ro for _, path, ro in vols} == {
        p: bool(m.get("readOnly", False)) for p, m in mounts.items()
    }
    by_path = {path: host for host, path, _ in vols}
    # The ConfigMap's file is the repository's config.yaml; /dev/shm is shared with the engines.
    (cfg,) = [p for p, m in mounts.items() if m.get("subPath") == "config.yaml"]
    assert by_path[cfg] == str(CONFIG)
    assert by_path["/dev/shm"] == "/dev/shm"
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
    # Other emptyDirs are fresh directories owned by the container's user (the pod's fsGroup).
    empty = {p for p, m in mounts.items() if "emptyDir" in volumes[m["name"]] and p != "/dev/shm"}
    owned = {str(d) for d in tmp_path.iterdir() if (d.stat().st_uid, d.stat().st_gid) == (plan.uid, plan.gid)}
    assert owned == {by_path[p] for p in empty}
    assert pod_spec["securityContext"]["fsGroup"] == plan.gid
    # The engine socket the config names lies in one of them, where the smoke test's engines find it.
    sock_dir = str(Path(yaml.safe_load(CONFIG.read_text())["engine_socket"]).parent)
    assert sock_dir in empty
