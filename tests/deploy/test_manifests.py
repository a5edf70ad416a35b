"""Offline checks of the Kubernetes manifests and the Grafana dashboard.

Each overlay under deploy/k8s/overlays is rendered with `kubectl kustomize`
(skipped when kubectl is not on PATH), every document is validated against the
Kubernetes JSON schemas that ship with the `kubernetes-validate` package
(strict mode: unknown fields are errors), and the invariants the sidecar relies
on are asserted. The optional components (DRA, PodMonitor, peer TLS) are
rendered by composing them onto overlays/prefill in a temporary kustomization.

Custom resources: kubernetes-validate only knows the core API. The Prometheus
Operator PodMonitor is therefore *not* schema-validated; it is listed in
CRD_KINDS, skipped explicitly, and checked structurally instead. Any other kind
without a schema fails the test.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")
from kubernetes_validate.utils import all_versions  # noqa: E402

from kv_sidecar.config import Settings, load_settings  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS_DIR = K8S / "overlays"
COMPONENTS_DIR = K8S / "components"
DASHBOARD = REPO / "deploy" / "grafana" / "kv-sidecar-dashboard.json"

# Oldest Kubernetes the manifests target: native sidecars need >= 1.29; 1.31 is
# the oldest minor still commonly supported by managed offerings. DRA's
# resource.k8s.io/v1 needs 1.34.
K8S_VERSION = "1.31"
DRA_K8S_VERSION = "1.34"

EXPECTED_OVERLAYS = {"prefill", "decode", "rdma", "prefill-rdma", "decode-rdma"}
OVERLAYS = sorted(p.name for p in OVERLAYS_DIR.iterdir() if (p / "kustomization.yaml").is_file())

# Components rendered on top of overlays/prefill: name -> Kubernetes version to validate against.
COMPONENTS = {
    "dra-gpu": DRA_K8S_VERSION,
    "podmonitor": K8S_VERSION,
    "peer-tls": K8S_VERSION,
    "sidecar-per-gpu": K8S_VERSION,
}

# (apiVersion, kind) of custom resources that kubernetes-validate has no schema for.
CRD_KINDS = {("monitoring.coreos.com/v1", "PodMonitor")}

SIDECAR = "kv-sidecar"
ENGINE = "engine"
SIDECAR_IMAGE = "ghcr.io/kv-sidecar/kv-sidecar:0.1.0"
PEER_PORT = 50061
METRICS_PORT = 9464
SOCKET_DIR = "/run/kv-sidecar"
SOCKET_PATH = "/run/kv-sidecar/engine.sock"
CONFIG_PATH = "/etc/kv-sidecar/config.yaml"
# Every key the sidecar accepts (kv_sidecar.config.Settings): config.yaml and KV_SIDECAR_* env may use no other.
CONFIG_KEYS = {f.name for f in dataclasses.fields(Settings)}

# Metric names the sidecar exports (kv_sidecar's metrics module); the dashboard may query nothing else.
# tests/e2e/test_transfer.py checks this against what a running sidecar exports.
COUNTERS = {
    "kvsidecar_pulls_total",
    "kvsidecar_pull_bytes_total",
    "kvsidecar_handshakes_total",
    "kvsidecar_lease_expiries_total",
    "kvsidecar_failures_total",
    "kvsidecar_ucx_emulation_detected_total",
    "kvsidecar_push_starts_total",
    "kvsidecar_done_notifications_received_total",
    "kvsidecar_push_calls_total",
    "kvsidecar_peer_opens_total",
    "kvsidecar_gpu_launches_total",
    "kvsidecar_worker_restarts_total",
    "kvsidecar_worker_failures_total",
    "kvsidecar_worker_ucx_emulation_detected_total",
    "kvsidecar_worker_gpu_launches_total",
    "kvsidecar_publishes_refused_total",
    "kvsidecar_nixl_lone_polls_total",
    "kvsidecar_worker_nixl_lone_polls_total",
}
HISTOGRAMS = {
    "kvsidecar_pull_duration_seconds",
    "kvsidecar_pull_throughput_bytes_per_second",
    "kvsidecar_nixl_descriptors_per_transfer",
    "kvsidecar_handshake_duration_seconds",
    "kvsidecar_pull_batch_pulls",
    "kvsidecar_staged_transfer_reads",
    "kvsidecar_worker_nixl_descriptors_per_transfer",
}
GAUGES = {
    "kvsidecar_registered_engines",
    "kvsidecar_registered_ranks",
    "kvsidecar_host_ranks_leaving",
    "kvsidecar_staging_bytes_in_use",
    "kvsidecar_staging_bytes_capacity",
    "kvsidecar_worker_staging_bytes_in_use",
    "kvsidecar_worker_staging_bytes_capacity",
    "kvsidecar_inflight_transfers",
    "kvsidecar_published_requests",
    "kvsidecar_gpu_memory_bytes",
    "kvsidecar_gpu_mps",
    "kvsidecar_nixl_held",
    "kvsidecar_nixl_release_failures",
    "kvsidecar_worker_nixl_held",
    "kvsidecar_worker_nixl_release_failures",
    "kvsidecar_engine_lane_connections",
}
METRICS = COUNTERS | HISTOGRAMS | GAUGES
PATH_VALUES = {"host-direct", "host-nixl", "host-nixl-staged", "gpu-direct", "gpu-staged"}


# --------------------------------------------------------------------------- rendering


def _kubectl() -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not on PATH: cannot render the kustomize overlays")
    return kubectl


@functools.cache
def _render_dir(path: str) -> tuple[str, ...]:
    out = subprocess.run(
        [_kubectl(), "kustomize", path], check=True, capture_output=True, text=True, timeout=60
    ).stdout
    return tuple(json.dumps(d) for d in yaml.safe_load_all(out) if d)


def render(path: Path) -> list[dict]:
    try:
        return [json.loads(d) for d in _render_dir(str(path))]
    except subprocess.CalledProcessError as e:  # show kustomize's message, not just the exit code
        pytest.fail(f"kubectl kustomize {path} failed:\n{e.stderr}")


def render_overlay(name: str) -> list[dict]:
    return render(OVERLAYS_DIR / name)


_component_roots: dict[str, Path] = {}


def render_component(name: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    if name in _component_roots:
        return render(_component_roots[name])
    root = _component_roots[name] = tmp_path_factory.mktemp(f"component-{name}")
    (root / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                # kustomize refuses absolute paths.
                "resources": [os.path.relpath(OVERLAYS_DIR / "prefill", root)],
                "components": [os.path.relpath(COMPONENTS_DIR / name, root)],
            }
        )
    )
    return render(root)


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def pod_spec(deploy: dict) -> dict:
    return deploy["spec"]["template"]["spec"]


def sidecar_of(spec: dict) -> dict:
    found = [c for c in spec.get("initContainers", []) if c["name"] == SIDECAR]
    assert len(found) == 1, "kv-sidecar must be exactly one (native sidecar) init container"
    return found[0]


def engine_of(spec: dict) -> dict:
    found = [c for c in spec["containers"] if c["name"] == ENGINE]
    assert len(found) == 1, "engine container missing"
    return found[0]


def mounts(container: dict) -> dict[str, str]:
    """mountPath -> volume name."""
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


def all_containers(spec: dict) -> list[dict]:
    return list(spec.get("initContainers", [])) + list(spec["containers"])


# --------------------------------------------------------------------------- schema validation


def validate_docs(docs: list[dict], version: str) -> None:
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if key in CRD_KINDS:
            continue  # no offline schema for CRDs; checked structurally in test_podmonitor
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            pytest.fail(
                f"{doc['kind']}/{doc['metadata']['name']} invalid for k8s {version}: {path}: {e.message}"
            )
        except kubernetes_validate.SchemaNotFoundError as e:
            pytest.fail(
                f"no schema for {key} in k8s {version} ({e.message}); add it to CRD_KINDS if it is a CRD"
            )


def test_expected_overlays_exist():
    assert set(OVERLAYS) >= EXPECTED_OVERLAYS


def test_schema_version_is_shipped():
    versions = all_versions()
    for v in (K8S_VERSION, DRA_K8S_VERSION):
        assert any(x.startswith(v + ".") for x in versions), f"kubernetes-validate ships no {v} schemas"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates(overlay):
    validate_docs(render_overlay(overlay), K8S_VERSION)


@pytest.mark.parametrize("component", sorted(COMPONENTS))
def test_component_validates(component, tmp_path_factory):
    validate_docs(render_component(component, tmp_path_factory), COMPONENTS[component])


def test_every_component_is_covered():
    present = {p.name for p in COMPONENTS_DIR.iterdir() if (p / "kustomization.yaml").is_file()}
    # rdma is covered through the *-rdma overlays.
    assert present - {"rdma"} == set(COMPONENTS)


# --------------------------------------------------------------------------- invariants


def check_pod(docs: list[dict], deploy: dict, *, rdma: bool, grpc_probes: bool = True) -> None:
    spec = pod_spec(deploy)
    side, eng = sidecar_of(spec), engine_of(spec)

    assert side["restartPolicy"] == "Always", "kv-sidecar must be a native sidecar"
    assert side["image"] == SIDECAR_IMAGE
    assert side.get("command", ["kv-sidecar"]) == ["kv-sidecar"]
    assert side["args"] == ["serve", "--config", CONFIG_PATH]
    assert spec["shareProcessNamespace"] is True

    volumes = {v["name"]: v for v in spec["volumes"]}

    # /dev/shm: one memory-backed emptyDir with a size limit, in both containers.
    shm = mounts(side).get("/dev/shm")
    assert shm is not None and mounts(eng).get("/dev/shm") == shm
    assert volumes[shm]["emptyDir"]["medium"] == "Memory"
    assert volumes[shm]["emptyDir"].get("sizeLimit")

    # Engine socket directory shared by both containers.
    sock = mounts(side).get(SOCKET_DIR)
    assert sock is not None and mounts(eng).get(SOCKET_DIR) == sock
    assert "emptyDir" in volumes[sock]

    # Config: ConfigMap from this render, mounted at the path given to --config.
    cfg_vol = volumes[mounts(side)[CONFIG_PATH]]
    cm_name = cfg_vol["configMap"]["name"]
    cms = {c["metadata"]["name"]: c for c in of_kind(docs, "ConfigMap")}
    assert cm_name in cms, f"{cm_name} not rendered"
    config = yaml.safe_load(cms[cm_name]["data"]["config.yaml"])
    assert set(config) <= CONFIG_KEYS, f"unknown config keys: {set(config) - CONFIG_KEYS}"
    assert config["engine_socket"] == SOCKET_PATH
    assert config["peer_port"] == PEER_PORT
    assert config["metrics_port"] == METRICS_PORT

    # Peer token/TLS Secret: a secret volume mounted read-only in the sidecar only.
    secret_vols = [n for n, v in volumes.items() if "secret" in v]
    assert secret_vols and all(n in mounts(side).values() for n in secret_vols)
    assert not any(n in mounts(eng).values() for n in secret_vols)

    # Env: advertise address from the downward API; KV_SIDECAR_* names map to config keys.
    env = {e["name"]: e for e in side.get("env", [])}
    assert env["KV_SIDECAR_ADVERTISE_ADDRESS"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    for name in env:
        if name.startswith("KV_SIDECAR_"):
            assert name.removeprefix("KV_SIDECAR_").lower() in CONFIG_KEYS, name

    # Ports and probes.
    ports = {p["name"]: p["containerPort"] for p in side["ports"]}
    assert ports["peer"] == PEER_PORT
    assert ports["metrics"] == METRICS_PORT
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if grpc_probes:
            assert side[probe]["grpc"] == {"port": PEER_PORT}, probe
        else:
            assert side[probe]["tcpSocket"] == {"port": PEER_PORT}, probe
    annotations = deploy["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(METRICS_PORT)

    # Resources on the sidecar.
    res = side["resources"]
    for k in ("cpu", "memory"):
        assert k in res["requests"] and k in res["limits"], k

    # Security context.
    sc = side["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert "/tmp" in mounts(side), "read-only root needs a writable /tmp"

    rdma_containers = [
        c["name"]
        for c in all_containers(spec)
        if "rdma/ib" in c.get("resources", {}).get("requests", {})
        or "rdma/ib" in c.get("resources", {}).get("limits", {})
    ]
    added_caps = {
        c["name"]: c.get("securityContext", {}).get("capabilities", {}).get("add", [])
        for c in all_containers(spec)
    }
    if rdma:
        assert rdma_containers == [SIDECAR]
        assert res["requests"]["rdma/ib"] == res["limits"]["rdma/ib"]
        assert added_caps[SIDECAR] == ["IPC_LOCK"]
        assert not added_caps[ENGINE]
    else:
        assert rdma_containers == []
        assert not any(added_caps.values()), added_caps
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0


def check_service(docs: list[dict], deploy: dict) -> None:
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    services = [s for s in of_kind(docs, "Service") if s["spec"]["selector"].items() <= pod_labels.items()]
    assert len(services) == 1, f"expected one Service selecting {deploy['metadata']['name']}"
    svc = services[0]
    assert svc["spec"]["clusterIP"] == "None"
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert ports["peer"]["port"] == PEER_PORT and ports["peer"]["appProtocol"] == "grpc"
    assert ports["metrics"]["port"] == METRICS_PORT


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_invariants(overlay):
    docs = render_overlay(overlay)
    deploys = of_kind(docs, "Deployment")
    roles = sorted(
        d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] for d in deploys
    )
    assert roles == (["decode", "prefill"] if overlay == "rdma" else [overlay.removesuffix("-rdma")])
    for deploy in deploys:
        check_pod(docs, deploy, rdma="rdma" in overlay)
        check_service(docs, deploy)


def test_dra_component_shares_one_claim(tmp_path_factory):
    docs = render_component("dra-gpu", tmp_path_factory)
    (template,) = of_kind(docs, "ResourceClaimTemplate")
    (deploy,) = of_kind(docs, "Deployment")
    spec = pod_spec(deploy)
    check_pod(docs, deploy, rdma=False)
    (claim,) = spec["resourceClaims"]
    assert claim["resourceClaimTemplateName"] == template["metadata"]["name"]
    side, eng = sidecar_of(spec), engine_of(spec)
    assert side["resources"]["claims"] == [{"name": claim["name"]}]
    assert eng["resources"]["claims"] == [{"name": claim["name"]}]
    assert "nvidia.com/gpu" not in eng["resources"].get("limits", {})
    assert "NVIDIA_VISIBLE_DEVICES" not in {e["name"] for e in side["env"]}


def test_default_gpu_is_device_plugin_on_engine():
    (deploy,) = of_kind(render_overlay("prefill"), "Deployment")
    spec = pod_spec(deploy)
    assert engine_of(spec)["resources"]["limits"]["nvidia.com/gpu"] >= 1
    side = sidecar_of(spec)
    assert "nvidia.com/gpu" not in side["resources"].get("limits", {})
    assert {e["name"]: e.get("value") for e in side["env"]}["NVIDIA_VISIBLE_DEVICES"] == "all"


def test_base_config_is_accepted_by_the_sidecar():
    settings = load_settings({}, str(K8S / "base" / "config.yaml"), env={})
    (deploy,) = of_kind(render_overlay("prefill"), "Deployment")
    # The drain must end before the kubelet's SIGKILL, with time left for the engine's own shutdown.
    assert settings.drain_timeout_s < pod_spec(deploy)["terminationGracePeriodSeconds"] / 2


def test_peer_tls_component(tmp_path_factory):
    docs = render_component("peer-tls", tmp_path_factory)
    (deploy,) = of_kind(docs, "Deployment")
    check_pod(docs, deploy, rdma=False, grpc_probes=False)
    env = {e["name"]: e.get("value") for e in sidecar_of(pod_spec(deploy))["env"]}
    for key in ("tls_cert", "tls_key", "tls_ca", "token_file"):
        assert env[f"KV_SIDECAR_{key.upper()}"].startswith("/etc/kv-sidecar/secrets/")
    # One certificate for every pod, dialed by pod IP: peers verify a fixed name instead.
    assert env["KV_SIDECAR_TLS_SERVER_NAME"] == "kv-sidecar-peer"
    assert "KV_SIDECAR_TLS_CLIENT_AUTH" not in env  # the default, require: mutual TLS


def test_sidecar_per_gpu_component(tmp_path_factory):
    """Rank 0's sidecar and rank 1's, each its own socket and ports, as the engine's connector finds them."""
    from kv_sidecar_client.vllm.config import ConnectorConfig

    docs = render_component("sidecar-per-gpu", tmp_path_factory)
    (deploy,) = of_kind(docs, "Deployment")
    spec = pod_spec(deploy)
    check_pod(docs, deploy, rdma=False)  # rank 0's sidecar is the base's, as it was
    sidecars = [c for c in spec["initContainers"] if c["name"] in (SIDECAR, f"{SIDECAR}-1")]
    assert [c["name"] for c in sidecars] == [SIDECAR, f"{SIDECAR}-1"]
    config = yaml.safe_load(of_kind(docs, "ConfigMap")[0]["data"]["config.yaml"])
    settings = []
    for c in sidecars:
        assert c["restartPolicy"] == "Always" and c["image"] == SIDECAR_IMAGE
        assert c["args"] == ["serve", "--config", CONFIG_PATH]
        assert mounts(c) == mounts(sidecars[0]), "the same config, socket directory, /dev/shm, secrets"
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert {
            n.removeprefix("KV_SIDECAR_").lower() for n in env if n.startswith("KV_SIDECAR_")
        } <= CONFIG_KEYS
        # What the sidecar runs with: the config file, then its KV_SIDECAR_* env.
        given = {k: v for k, v in env.items() if k.startswith("KV_SIDECAR_") and v is not None}
        settings.append(load_settings({}, str(K8S / "base" / "config.yaml"), env=given))
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": settings[-1].peer_port}, (c["name"], probe)
        assert sorted(p["containerPort"] for p in c["ports"]) == sorted(
            [settings[-1].peer_port, settings[-1].metrics_port]
        )
    assert config["engine_socket"] == SOCKET_PATH  # the file's, which env overrides per sidecar
    assert [s.engine_socket for s in settings] == [f"{SOCKET_DIR}/gpu0.sock", f"{SOCKET_DIR}/gpu1.sock"]
    assert len({s.peer_port for s in settings}) == len({s.metrics_port for s in settings}) == 2
    (flag,) = [a for a in engine_of(spec)["args"] if a.startswith("--kv-transfer-config=")]
    extra = json.loads(flag.split("=", 1)[1])["kv_connector_extra_config"]
    connector = ConnectorConfig.from_extra_config(extra)
    assert [connector.socket_for(r) for r in (0, 1)] == [s.engine_socket for s in settings]
    # The leader: rank 0's sidecar, by a loopback address on its peer port (server/identity.py is_me).
    assert connector.leader_address == f"127.0.0.1:{settings[0].peer_port}"


def test_podmonitor(tmp_path_factory):
    docs = render_component("podmonitor", tmp_path_factory)
    (pm,) = of_kind(docs, "PodMonitor")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    (deploy,) = of_kind(docs, "Deployment")
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    port_names = {p["name"] for p in sidecar_of(pod_spec(deploy))["ports"]}
    for ep in pm["spec"]["podMetricsEndpoints"]:
        assert ep["port"] in port_names and ep["port"] == "metrics"


# --------------------------------------------------------------------------- dashboard


def _walk_exprs(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("expr", "query") and isinstance(v, str):
                yield v
            elif k == "query" and isinstance(v, dict) and isinstance(v.get("query"), str):
                yield v["query"]
            else:
                yield from _walk_exprs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk_exprs(v)


def _metric_names(expr: str) -> set[str]:
    names = set()
    for raw in re.findall(r"\bkvsidecar_[a-z0-9_]+", expr):
        base = re.sub(r"_(bucket|sum|count)$", "", raw)
        names.add(base if base in HISTOGRAMS else raw)
    return names


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_queries_only_known_metrics(dashboard):
    exprs = list(_walk_exprs(dashboard))
    assert exprs, "dashboard has no queries"
    used = set().union(*(_metric_names(e) for e in exprs))
    assert used <= METRICS, f"unknown metrics: {sorted(used - METRICS)}"
    # Every exported metric has a place on the dashboard.
    assert used == METRICS, f"not on the dashboard: {sorted(METRICS - used)}"
    for expr in exprs:
        for raw in re.findall(r"\bkvsidecar_[a-z0-9_]+_(?:bucket|sum|count)\b", expr):
            assert re.sub(r"_(bucket|sum|count)$", "", raw) in HISTOGRAMS, raw
        for name in _metric_names(expr):
            if name in HISTOGRAMS:
                assert re.search(rf"{name}_(bucket|sum|count)", expr), f"histogram {name} queried bare"


def test_dashboard_path_values(dashboard):
    for expr in _walk_exprs(dashboard):
        for value in re.findall(r'path\s*=~?\s*"([^"$]+)"', expr):
            assert set(value.split("|")) <= PATH_VALUES, value


def test_dashboard_panels(dashboard):
    panels = []
    for p in dashboard["panels"]:
        panels.append(p)
        panels.extend(p.get("panels", []))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    titles = " | ".join(p.get("title", "") for p in panels).lower()
    for word in (
        "pull rate",
        "bytes/s",
        "latency",
        "throughput",
        "failures",
        "lease",
        "staging",
        "in-flight",
        "handshake",
    ):
        assert word in titles, f"no panel about {word!r}"


def test_engine_loads_the_vllm_connector_on_the_sidecar_socket():
    from kv_sidecar_client.vllm.config import ConnectorConfig

    for overlay in ("prefill", "decode"):
        (deploy,) = of_kind(render_overlay(overlay), "Deployment")
        eng = engine_of(pod_spec(deploy))
        (flag,) = [a for a in eng["args"] if a.startswith("--kv-transfer-config=")]
        kv = json.loads(flag.split("=", 1)[1])
        assert kv["kv_connector"] == "KVSidecarConnector"
        assert kv["kv_connector_module_path"] == "kv_sidecar_client.vllm"
        config = ConnectorConfig.from_extra_config(kv["kv_connector_extra_config"])  # keys and types accepted
        assert config.sidecar_socket == SOCKET_PATH
        assert config.engine_id == "$(POD_NAME)"
        env = {e["name"]: e for e in eng["env"]}
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        # The connector supports vLLM's hybrid KV cache manager: turning it off would cost hybrid models
        # (sliding-window next to full attention) most of their KV capacity.
        assert "--disable-hybrid-kv-cache-manager" not in eng["args"]
