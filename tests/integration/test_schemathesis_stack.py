"""Schemathesis against the real stack (``dls up --workers 2``: gateway, scheduler, predictor,
reconfigurator, node agent, two workers of the bundled model, real nats-server and redis-server),
as a client would fuzz it: the ``st`` command, unmodified, on the gateway's own ``/openapi.json``, with
the examples, coverage and fuzzing phases and the checks ``not_a_server_error``,
``status_code_conformance``, ``content_type_conformance`` and ``response_schema_conformance``. No
operation is excluded. Afterwards the stack still answers a completion correctly (its workers were
never declared dead under the load).

Marked ``fuzz``: ``make test-fuzz`` runs it for ``DLS_FUZZ_SECONDS`` (150 by default), and ``.ci/run``
calls that target."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import dls_up

pytestmark = [pytest.mark.integration, pytest.mark.fuzz]

FUZZ_SECONDS = int(os.environ.get("DLS_FUZZ_SECONDS", "150"))
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


def _st() -> str:
    found = shutil.which("st", path=str(Path(sys.executable).parent)) or shutil.which("st")
    assert found, "the schemathesis CLI (st) is not installed: make setup installs it"
    return found


@pytest.mark.timeout(FUZZ_SECONDS + 600)  # the stack's start, the run, and st's own wind-down
def test_schemathesis_finds_no_failure_against_the_real_stack(tmp_path_factory):
    seconds = FUZZ_SECONDS
    run_dir = tmp_path_factory.mktemp("fuzz-stack")
    with dls_up(run_dir) as stack:
        argv = [_st(), "run", f"{stack.url}/openapi.json", "--checks", CHECKS,
                "--phases", "examples,coverage,fuzzing", "--max-time", str(seconds), "--workers", "2",
                "--seed", os.environ.get("DLS_FUZZ_SEED", "20261203"), "--no-color"]
        st = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 300, cwd=run_dir)
        report = st.stdout[-6000:] + st.stderr[-2000:]
        (run_dir / "schemathesis.log").write_text(st.stdout + st.stderr)
        assert st.returncode == 0, report
        answer = httpx.post(f"{stack.url}/v1/completions", timeout=60,
                            json={"model": "dls-tiny", "prompt": "347+589=", "max_tokens": 16})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == "936", answer.text
