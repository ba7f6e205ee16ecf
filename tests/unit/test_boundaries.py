"""Package boundaries, checked on the source (every import statement, lazy and ``TYPE_CHECKING`` ones
included, and ``importlib.import_module`` of a literal name):

- ``shared/`` imports no service (nor ``sim``, ``loadgen``, ``bench``, ``tests``): it holds the
  contracts and glue the others build on.
- No service imports another service's modules: services talk over NATS and Redis only. The
  composition at the top of ``services/`` (``services/cli.py``, the ``dls`` dispatcher, and
  ``services/stack.py``, ``dls up``) is no service and may name them all.
- Offline tools inside a service package (``OFFLINE_TOOLS``: ``dls collect-traces`` drives the worker's
  engine to record the predictor's training traces) are commands, not part of the running service:
  like the simulator, they compose other services' *cores* in process (``CORE_PREFIXES``: a
  ``services.<x>.core`` package, or the worker's engine, which is the worker's core), never their
  service adapters.
- ``sim/`` imports only cores and contracts: ``services.<x>.core``, the worker's engine, ``shared``,
  ``sim`` (and third-party packages).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIRST_PARTY = ("services", "shared", "sim", "loadgen", "bench", "tests", "calibrate", "training")
SERVICES = ("gateway", "scheduler", "predictor", "reconfigurator", "worker", "node_agent")
# the worker's engine and what it is built from: the worker's core (DESIGN section 2)
WORKER_CORE = tuple(f"services.worker.{m}" for m in ("engine", "runner", "decoding", "attention", "kv", "model",
                                                     "parallel", "reference"))
OFFLINE_TOOLS = ("services/predictor/cli.py", "services/predictor/traces.py")


def imported_modules(path: Path) -> set[str]:
    """Every first-party module ``path`` imports, however it imports it."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            names.add(node.args[0].value)
    return {n for n in names if n.split(".")[0] in FIRST_PARTY}


def is_core(module: str) -> bool:
    parts = module.split(".")
    in_core_package = len(parts) >= 3 and parts[0] == "services" and parts[2] == "core"
    return in_core_package or any(module == m or module.startswith(m + ".") for m in WORKER_CORE)


def service_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "services" and len(parts) > 1 and parts[1] in SERVICES else None


def violations(root: Path) -> list[str]:
    """Every import that crosses a boundary, as ``file: module`` lines."""
    found = []
    for path in sorted(p for top in ("services", "shared", "sim") for p in (root / top).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        top = rel.split("/")[0]
        for module in sorted(imported_modules(path)):
            if top == "shared" and module.split(".")[0] != "shared":
                found.append(f"{rel}: {module} (shared/ imports only shared)")
            elif top == "sim" and module.split(".")[0] not in ("sim", "shared") and not is_core(module):
                found.append(f"{rel}: {module} (sim/ imports only cores and contracts)")
            elif top == "services" and rel.count("/") >= 2:
                own, other = rel.split("/")[1], service_of(module)
                if other is None or other == own:
                    continue
                if rel in OFFLINE_TOOLS and is_core(module):
                    continue
                found.append(f"{rel}: {module} (services/{own} imports another service)")
    return found


def test_the_tree_keeps_its_boundaries():
    assert violations(ROOT) == []


@pytest.mark.parametrize(("path", "source", "expected"), [
    ("shared/a.py", "from services.worker.engine.engine import StepResult\n", "shared/a.py: services.worker.engine.engine"),
    ("shared/b.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import services.gateway.app\n",
     "shared/b.py: services.gateway.app"),
    ("shared/c.py", "import importlib\nimportlib.import_module('services.stack')\n", "shared/c.py: services.stack"),
    ("services/gateway/x.py", "def f():\n    from services.predictor.adapters import load\n",
     "services/gateway/x.py: services.predictor.adapters"),
    ("services/gateway/y.py", "from services.scheduler.core import Request\n",
     "services/gateway/y.py: services.scheduler.core"),
    ("services/predictor/cli.py", "from services.worker.service.service import WorkerService\n",
     "services/predictor/cli.py: services.worker.service.service"),
    ("sim/z.py", "from services.scheduler.service import SchedulerService\n",
     "sim/z.py: services.scheduler.service"),
    ("sim/w.py", "from loadgen.driver import Driver\n", "sim/w.py: loadgen.driver"),
])
def test_a_crossing_import_is_found(tmp_path, path, source, expected):
    (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / path).write_text(source)
    [line] = violations(tmp_path)
    assert line.startswith(expected + " (")


@pytest.mark.parametrize(("path", "source"), [
    ("services/predictor/cli.py", "from services.worker.engine.engine import DLMEngine\n"),  # an offline tool, a core
    ("sim/a.py", "from services.scheduler.core.loop import SchedulingLoop\nfrom services.worker.engine.engine import X\n"),
    ("services/gateway/a.py", "from services.gateway.slo import DefaultSlo\nfrom shared.state import RequestRecord\n"),
    ("services/cli.py", "import importlib\nimportlib.import_module('services.worker.cli')\n"),
])
def test_what_the_boundaries_allow(tmp_path, path, source):
    (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / path).write_text(source)
    assert violations(tmp_path) == []
