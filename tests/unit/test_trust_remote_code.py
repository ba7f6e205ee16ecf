"""A checkpoint's tokenizer as Dream-org ships it (``tokenizer_config.json`` mapping ``AutoTokenizer`` to
code in the directory), loaded the same way by the gateway and every worker: the code runs only with
``DLS_TRUST_REMOTE_CODE``; without it, the checkpoint's ``tokenizer.json`` where it has one, else a
refusal naming the setting. Real transformers tokenizers, built at test time (``tests/dream_checkpoint.py``).
"""

import pytest
from transformers import PreTrainedTokenizerFast

from services.gateway.models import ModelLoadError, load_served_model
from services.node_agent.agent import NodeAgent, Worker
from services.worker.model.loading import CheckpointError, load_model
from shared.settings import NodeAgentSettings, WorkerSettings
from shared.tokenizer import CharTokenizer, TokenizerError, answer_text, load_hf_tokenizer
from tests.dream_checkpoint import EOS_ID, IM_END_ID, build_dream_directory, byte_vocab

SETTING = "DLS_TRUST_REMOTE_CODE"
CHAT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
VOCAB = byte_vocab()


def _dream_dir(path, fast_file: bool):
    return build_dream_directory(path, [VOCAB["o"], VOCAB["k"]], VOCAB["Ċ"], fast_file=fast_file)


def test_without_the_setting_code_is_refused_by_the_gateway_and_the_workers_naming_it(tmp_path):
    directory = _dream_dir(tmp_path / "dream", fast_file=False)
    with pytest.raises(TokenizerError, match=f"tokenization_dream.DreamTokenizer.*set {SETTING}=true"):
        load_hf_tokenizer(directory)
    with pytest.raises(CheckpointError, match=f"set {SETTING}=true"):
        load_model(directory)
    with pytest.raises(ModelLoadError, match=f"set {SETTING}=true"):
        load_served_model(directory)


def test_with_the_setting_the_shipped_code_is_the_tokenizer_everywhere(tmp_path):
    directory = _dream_dir(tmp_path / "dream", fast_file=False)
    worker = load_model(directory, trust_remote_code=True).tokenizer
    gateway = load_served_model(directory, trust_remote_code=True).codec.tokenizer
    for tokenizer in (load_hf_tokenizer(directory, trust_remote_code=True), worker, gateway):
        assert type(tokenizer).__name__ == "DreamTokenizer"
        ids = tokenizer.encode(CHAT)
        assert ids.count(IM_END_ID) == 1 and tokenizer.decode(ids) == CHAT
        assert tokenizer.eos_token_id == EOS_ID and tokenizer.chat_template


def test_without_the_setting_a_tokenizer_json_is_loaded_instead_with_the_same_tokens(tmp_path):
    directory = _dream_dir(tmp_path / "dream", fast_file=True)
    trusted = load_hf_tokenizer(directory, trust_remote_code=True)
    assert type(trusted).__name__ == "DreamTokenizer"  # the setting on: the checkpoint's own code
    worker = load_model(directory).tokenizer
    gateway = load_served_model(directory).codec.tokenizer
    for fast in (load_hf_tokenizer(directory), worker, gateway):
        assert isinstance(fast, PreTrainedTokenizerFast) and type(fast).__name__ != "DreamTokenizer"
        assert fast.encode(CHAT) == trusted.encode(CHAT)
        assert (fast.eos_token_id, fast.mask_token_id) == (trusted.eos_token_id, trusted.mask_token_id)
        assert fast.chat_template == trusted.chat_template


def test_answer_text_drops_special_tokens_and_is_the_join_of_its_tokens(tmp_path):
    directory = _dream_dir(tmp_path / "dream", fast_file=True)
    for tokenizer in (load_hf_tokenizer(directory), load_hf_tokenizer(directory, trust_remote_code=True)):
        ids = tokenizer.encode("ok<|im_end|>!") + [EOS_ID] + tokenizer.encode("?")
        assert IM_END_ID in ids
        assert answer_text(tokenizer, ids) == "ok!?" == "".join(answer_text(tokenizer, [i]) for i in ids)
    char = CharTokenizer()
    ids = char.encode("12") + [char.eos_token_id, char.pad_token_id] + char.encode("3")
    assert answer_text(char, ids) == "123" == "".join(answer_text(char, [i]) for i in ids)
    assert answer_text(char, [char.mask_token_id, *char.encode("4")], mask_token_id=char.mask_token_id) == "4"


@pytest.mark.parametrize("trusted", [True, False])
def test_the_node_agent_passes_its_setting_to_its_workers(monkeypatch, trusted):
    monkeypatch.setenv(SETTING, "false" if trusted else "true")  # the agent's settings win over what it inherits
    agent = NodeAgent(NodeAgentSettings(node="n1", gpu_ids=[0], trust_remote_code=trusted), nc=None)
    env = agent.worker_env(Worker("n1-tp1-g0-abcd", 1, (0,), restartable=True))
    monkeypatch.setenv(SETTING, env[SETTING])
    assert WorkerSettings().trust_remote_code is trusted  # what the worker will read


def test_the_worker_service_loads_its_engine_with_the_setting(tmp_path):
    from services.worker.service.startup import make_engine

    directory = _dream_dir(tmp_path / "dream", fast_file=False)
    with pytest.raises(CheckpointError, match=f"set {SETTING}=true"):
        make_engine(WorkerSettings(model_dir=str(directory)))
    engine = make_engine(WorkerSettings(model_dir=str(directory), trust_remote_code=True))
    assert type(engine.tokenizer).__name__ == "DreamTokenizer"
    assert engine.decode(engine.tokenizer.encode("ok<|im_end|>!")) == "ok!"
