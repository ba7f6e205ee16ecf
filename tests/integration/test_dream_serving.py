"""A Dream checkpoint as Dream-org ships it, served by a real ``dls up`` and queried with the official
``openai`` package (acceptance of issue 41).

The directory is built at test time (``tests/dream_checkpoint.py``): Dream weights (shifted logits, GQA,
q/k/v biases) that answer ``ok<|im_end|>!`` then EOS after a prompt ending in a newline, and a
tokenizer whose ``tokenizer_config.json`` maps ``AutoTokenizer`` to ``tokenization_dream.DreamTokenizer``
in the directory, with no ``tokenizer.json``.

* With ``DLS_TRUST_REMOTE_CODE=true`` the gateway and both workers load it and serve; the answer's
  ``<|im_end|>`` stays out of the text in completions, chat and streams, the text is the join of its
  ``logprobs`` tokens, and ``stop`` matches the text as returned.
* Without it, the gateway (``dls up``) and a worker refuse the directory with an error naming the setting.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai  # a dev dependency (pyproject.toml)
import pytest

from shared.runtime import free_port
from tests.dream_checkpoint import IM_END_ID, build_dream_directory, byte_vocab
from tests.integration.conftest import dls_up

pytestmark = pytest.mark.integration

SETTING = "DLS_TRUST_REMOTE_CODE"
VOCAB = byte_vocab()
ANSWER_TEXT = "ok!"  # what the model answers once <|im_end|> is dropped
PROMPT = "say ok\n"


@pytest.fixture(scope="module")
def dream_dir(tmp_path_factory) -> Path:
    answer = [VOCAB["o"], VOCAB["k"], IM_END_ID, VOCAB["!"]]  # ok<|im_end|>!, then EOS
    return build_dream_directory(tmp_path_factory.mktemp("ckpt") / "dream-tiny", answer, after_prompt=VOCAB["Ċ"])


@pytest.fixture(scope="module")
def stack(dream_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("stack")
    env = {SETTING: "true", "HF_MODULES_CACHE": str(run_dir / "hf-modules")}  # the shipped code is copied there
    with dls_up(run_dir / "run", "--model", str(dream_dir), env=env) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_served_with_the_setting_by_the_gateway_and_every_worker(stack, dream_dir):
    deadline, instances = time.monotonic() + 60, []
    while time.monotonic() < deadline:  # dls up says it serves once one worker is READY: wait for both
        instances = httpx.get(f"{stack.url}/v1/cluster", timeout=10).json()["instances"]
        if sum(i["status"] == "READY" and i["serves_this_model"] for i in instances) == 2:
            break
        time.sleep(0.5)
    assert [(i["model"], i["status"]) for i in instances] == [(dream_dir.name, "READY")] * 2
    models = httpx.get(f"{stack.url}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [dream_dir.name]


def test_completion_text_has_no_special_tokens_and_joins_its_logprobs_tokens(client, dream_dir):
    answer = client.completions.create(model=dream_dir.name, prompt=PROMPT, max_tokens=16, logprobs=1)
    choice = answer.choices[0]
    assert choice.text == ANSWER_TEXT and choice.finish_reason == "stop"
    tokens = choice.logprobs.tokens
    assert answer.usage.completion_tokens == len(tokens) == 4 and "" in tokens  # <|im_end|> is one of them
    assert "".join(tokens) == choice.text
    assert choice.logprobs.text_offset == [0, 1, 2, 2]


def test_chat_text_has_no_special_tokens_and_joins_its_logprobs_tokens(client, dream_dir):
    answer = client.chat.completions.create(model=dream_dir.name, messages=[{"role": "user", "content": "say ok"}],
                                            max_tokens=16, logprobs=True, top_logprobs=2)
    choice = answer.choices[0]
    assert choice.message.content == ANSWER_TEXT and choice.finish_reason == "stop"
    tokens = [t.token for t in choice.logprobs.content]
    assert len(tokens) == 4 and "".join(tokens) == choice.message.content
    assert all(bytes(t.bytes).decode() == t.token for t in choice.logprobs.content)


def test_streams_carry_no_special_tokens(client, dream_dir):
    chunks = client.completions.create(model=dream_dir.name, prompt=PROMPT, max_tokens=16, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ANSWER_TEXT
    chat = client.chat.completions.create(model=dream_dir.name, messages=[{"role": "user", "content": "say ok"}],
                                          max_tokens=16, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == ANSWER_TEXT


def test_stop_strings_match_the_text_as_returned(client, dream_dir):
    # "k!" is in the text only once <|im_end|> is dropped ("ok<|im_end|>!" holds no "k!")
    answer = client.completions.create(model=dream_dir.name, prompt=PROMPT, max_tokens=16, stop=["k!"])
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == ("o", "stop")
    chunks = client.completions.create(model=dream_dir.name, prompt=PROMPT, max_tokens=16, stop=["k!"], stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "o"


def test_without_the_setting_dls_up_refuses_naming_it(dream_dir, tmp_path):
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != SETTING}
    env.update(DLS_NATS_URL=f"nats://127.0.0.1:{free_port()}", DLS_REDIS_URL=f"redis://127.0.0.1:{free_port()}/0",
               HF_MODULES_CACHE=str(tmp_path / "hf-modules"))
    argv = [sys.executable, "-m", "services.cli", "up", "--port", str(free_port()), "--workers", "1",
            "--model", str(dream_dir), "--run-dir", str(run_dir)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode != 0, done.stdout
    assert "gateway exited" in done.stdout + done.stderr
    gateway_log = (run_dir / "logs" / "gateway.log").read_text()
    assert f"set {SETTING}=true" in gateway_log and "tokenization_dream.DreamTokenizer" in gateway_log


def test_without_the_setting_a_worker_refuses_naming_it(dream_dir, nats_server, redis_server, unique_prefix,
                                                         tmp_path):
    env = {k: v for k, v in os.environ.items() if k != SETTING}
    env.update(DLS_NATS_URL=nats_server.url, DLS_REDIS_URL=redis_server.url, DLS_SUBJECT_PREFIX=unique_prefix,
               DLS_REDIS_KEY_PREFIX=unique_prefix, DLS_WORKER_MODEL_DIR=str(dream_dir),
               HF_MODULES_CACHE=str(tmp_path / "hf-modules"))
    done = subprocess.run([sys.executable, "-m", "services.worker"], env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode != 0
    assert f"set {SETTING}=true" in done.stderr, done.stderr[-2000:]
