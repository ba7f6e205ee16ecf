"""``dls up --model A --model B --workers 2``: one stack serves two models, each on a worker of its own:
the bundled model and the second bundled one (``models/dls-mini``). The official ``openai`` SDK gets
right answers from each by name (a sum from dls-tiny, a chain from dls-mini, which serves chains and
word lists), ``/v1/models`` lists both, ``/readyz`` shows a READY worker of each, and a model not
served gets a 404 naming it."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import openai  # a dev dependency (pyproject.toml)
import pytest

from shared.tasks import Family, Split, TaskGenerator, check_answer
from tests.integration.conftest import dls_up

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "models" / "dls-tiny"
SECOND = REPO / "models" / "dls-mini"


def test_two_models_are_served_by_name_each_on_its_own_worker(tmp_path):
    with dls_up(tmp_path / "stack", "--model", str(BUNDLED), "--model", str(SECOND)) as stack:
        said = stack.said
        assert f"DiLaServe is serving dls-tiny, dls-mini at {stack.url}" in said, said
        assert "dls-tiny: calibration: " in said and "dls-mini: calibration: " in said, said
        assert "workers per model: dls-tiny 1, dls-mini 1" in said, said

        with urllib.request.urlopen(f"{stack.url}/readyz", timeout=10) as reply:
            workers = json.loads(reply.read())["workers"]
        assert sorted(w["model"] for w in workers if w["status"] == "READY") == ["dls-mini", "dls-tiny"]

        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert {m.id for m in client.models.list().data} == {"dls-tiny", "dls-mini"}
        answer = client.completions.create(model="dls-tiny", prompt="12+30=", max_tokens=16)
        assert answer.model == "dls-tiny" and answer.choices[0].text.strip() == "42", answer
        chains = [TaskGenerator(seed=7).problem(2, Split.HELD_OUT, Family.CHAIN) for _ in range(3)]
        right = 0
        for problem in chains:
            answer = client.completions.create(model="dls-mini", prompt=problem.prompt, max_tokens=128)
            assert answer.model == "dls-mini"
            right += check_answer(problem, answer.choices[0].text)
        assert right >= 2, right  # its calibration: chains 1.00 at 0.8-0.9
        with pytest.raises(openai.NotFoundError) as refused:
            client.completions.create(model="no-such-model", prompt="1+1=", max_tokens=4)
        assert "no-such-model" in str(refused.value)
