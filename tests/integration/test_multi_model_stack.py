"""``dls up --model A --model B --workers 2``: one stack serves two models, each on a worker of its own.
The official ``openai`` SDK gets an answer from each by name, ``/v1/models`` lists both, ``/readyz``
shows a READY worker of each, and a model not served gets a 404 naming it."""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path

import openai  # a dev dependency (pyproject.toml)
import pytest

from tests.integration.conftest import dls_up

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "models" / "dls-tiny"


def test_two_models_are_served_by_name_each_on_its_own_worker(tmp_path):
    other = tmp_path / "tiny-twin"  # the bundled weights under another name: a second model
    shutil.copytree(BUNDLED, other, ignore=shutil.ignore_patterns("replay", "MODEL_CARD.md"))
    with dls_up(tmp_path / "stack", "--model", str(BUNDLED), "--model", str(other)) as stack:
        said = stack.said
        assert f"DiLaServe is serving dls-tiny, tiny-twin at {stack.url}" in said, said
        assert "dls-tiny: calibration: " in said and "tiny-twin: calibration: " in said, said
        assert "workers per model: dls-tiny 1, tiny-twin 1" in said, said

        with urllib.request.urlopen(f"{stack.url}/readyz", timeout=10) as reply:
            workers = json.loads(reply.read())["workers"]
        assert sorted(w["model"] for w in workers if w["status"] == "READY") == ["dls-tiny", "tiny-twin"]

        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert {m.id for m in client.models.list().data} == {"dls-tiny", "tiny-twin"}
        for name in ("dls-tiny", "tiny-twin"):
            answer = client.completions.create(model=name, prompt="12+30=", max_tokens=16)
            assert answer.model == name and answer.choices[0].text.strip() == "42", answer
        with pytest.raises(openai.NotFoundError) as refused:
            client.completions.create(model="no-such-model", prompt="1+1=", max_tokens=4)
        assert "no-such-model" in str(refused.value)
