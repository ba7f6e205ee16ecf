"""The wire and state schemas mirror the cores' types; these tests fail when either side drifts.

Only structs that differ on purpose are mirrored (a core's dataclass and its wire struct); the enums
every side uses (``StepKind``, ``CacheMode``, ``RequestStatus``) are defined once, in
``shared.messages.base`` (``test_one_definition.py``). The cores are read with ``ast`` rather than
imported, so the contract tests stay free of torch.
"""

from __future__ import annotations

import ast
from pathlib import Path

import msgspec
import pytest

from shared.messages.base import ConfidenceStats
from shared.messages.control import Arrival, InstanceSlot, NodePlan
from shared.messages.predictor import PredictionQuery, RemainingSteps, StepPrediction
from shared.messages.steps import RequestStepResult

ROOT = Path(__file__).resolve().parents[3]
ENGINE = ROOT / "services/worker/engine/request.py"
PREDICTOR = ROOT / "services/predictor/core/predictor.py"
PLAN = ROOT / "services/reconfigurator/core/plan.py"
SPEC = ROOT / "services/reconfigurator/core/spec.py"
MONITOR = ROOT / "services/reconfigurator/core/monitor.py"


def _class(path: Path, name: str) -> ast.ClassDef:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"{path.relative_to(ROOT)} has no class {name}")


def core_fields(path: Path, name: str) -> set[str]:
    """Annotated fields of a dataclass / NamedTuple."""
    return {i.target.id for i in _class(path, name).body if isinstance(i, ast.AnnAssign)}


def fields(struct: type[msgspec.Struct]) -> set[str]:
    return set(struct.__struct_fields__)


@pytest.mark.parametrize(("struct", "path", "core"), [
    (PredictionQuery, PREDICTOR, "PredictionQuery"),
    (RemainingSteps, PREDICTOR, "RemainingSteps"),
    (StepPrediction, PREDICTOR, "StepPrediction"),
    (ConfidenceStats, ENGINE, "ConfidenceStats"),
    (NodePlan, PLAN, "NodePlan"),
], ids=lambda v: getattr(v, "__name__", None) or str(v)[-20:])
def test_same_fields_as_the_core(struct, path, core):
    assert fields(struct) == core_fields(path, core)


def test_arrival_is_the_monitors_event_plus_its_model():
    # A workload monitor is one model's: the core takes the model beside the event
    # (ModelsReconfigurator.observe(event, model)) to pick the monitor, so the event itself has none.
    assert fields(Arrival) == core_fields(MONITOR, "ArrivalEvent") | {"model"}


def test_step_result_has_the_engine_fields_plus_block_done_the_state_version_and_the_answer_length():
    # masked_confidences (every masked position's probability) stays in the process: the simulator's
    # replay calibration reads it; on the wire the confidence statistics stand for it. The answer's
    # length at finish (the scheduler's generation-token metrics) needs the request's cap and stop
    # strings, which the worker has and the engine's result does not
    engine_fields = core_fields(ENGINE, "StepResult") - {"masked_confidences"}
    assert fields(RequestStepResult) == engine_fields | {"block_done", "state_version", "num_answer_tokens"}


def test_instance_slot_is_the_planner_instance_without_its_node():
    # plus the model it serves, which the planner keeps beside its instances (running_models, ModelPlacement)
    assert fields(InstanceSlot) == core_fields(SPEC, "Instance") - {"node"} | {"model"}
