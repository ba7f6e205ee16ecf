"""Each concept that crosses a boundary is defined once (the wire contract is its single source).

``StepKind`` (what a step computed), ``CacheMode``, ``RequestStatus`` live in ``shared.messages.base``;
``StepResult`` is the engine's per-request result (the scheduler core's per-instance one is
``BatchOutcome``, the reconfigurator's planning round ``PlanningRound``); ``RequestRecord`` is the
Redis record (the simulator's is ``SimRequestRecord``). The scan is textual, as
``grep -rE "^class (StepKind|...)\\b" services shared sim`` would do it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("services", "shared", "sim")
# concept -> the one file that defines it
HOMES = {
    "StepKind": "shared/messages/base.py",
    "CacheMode": "shared/messages/base.py",
    "RequestStatus": "shared/messages/base.py",
    "StepResult": "services/worker/engine/request.py",
    "RequestRecord": "shared/state.py",
}


def definitions(name: str) -> list[str]:
    pattern = re.compile(rf"^class {name}\b", re.MULTILINE)
    return sorted(str(path.relative_to(ROOT)) for package in PACKAGES for path in (ROOT / package).rglob("*.py")
                  if pattern.search(path.read_text()))


@pytest.mark.parametrize("name", sorted(HOMES))
def test_defined_once(name):
    assert definitions(name) == [HOMES[name]]


def test_the_scan_sees_a_second_definition(tmp_path, monkeypatch):
    """The scan itself: a copy of a concept in another package is found."""
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "a.py").write_text("class StepKind:\n    pass\n")
    (tmp_path / "sim").mkdir()
    (tmp_path / "sim" / "b.py").write_text("x = 1\nclass StepKind(IntEnum):\n    A = 0\n")
    (tmp_path / "services").mkdir()
    monkeypatch.setattr(__name__ + ".ROOT", tmp_path)
    assert definitions("StepKind") == ["shared/a.py", "sim/b.py"]
