import json

import torch

from services.worker.loading import load_model
from shared.tokenizer import CharTokenizer
from services.worker.training import TrainConfig, Trainer, diffusion_loss, encode_batch, target_ids
from shared.tasks import Split, TaskGenerator


def _tiny(tmp_path, steps: int, **overrides) -> TrainConfig:
    return TrainConfig(
        output_dir=str(tmp_path / "model"), checkpoint_dir=str(tmp_path / "ckpt"), steps=steps, batch_size=4,
        d_model=32, n_layers=2, n_heads=4, mlp_hidden_size=64, eval_every=2, eval_problems=2, save_every=2,
        warmup_steps=1, **overrides,
    )


def test_training_exports_a_loadable_model_and_resumes(tmp_path):
    Trainer(_tiny(tmp_path, steps=2)).run(log=lambda _: None)
    info = json.loads((tmp_path / "model" / "training_info.json").read_text())
    assert info["steps_done"] == 2 and len(info["eval_history"]) == 1
    assert load_model(tmp_path / "model").tokenizer is not None

    lines = []
    Trainer(_tiny(tmp_path, steps=4)).run(log=lines.append)
    assert any("resumed" in line and "step 2" in line for line in lines)
    assert json.loads((tmp_path / "model" / "training_info.json").read_text())["steps_done"] == 4


def test_init_from_starts_with_the_given_weights(tmp_path):
    Trainer(_tiny(tmp_path, steps=2)).run(log=lambda _: None)
    other = tmp_path / "second"
    trainer = Trainer(_tiny(other, steps=2, init_from=str(tmp_path / "model")))
    shipped = load_model(tmp_path / "model").model
    assert torch.equal(trainer.model.model.transformer.wte.weight, shipped.model.transformer.wte.weight)


def test_loss_only_counts_masked_answer_positions():
    tokenizer = CharTokenizer()
    problems = TaskGenerator(seed=0).problems(3, max_shots=2, split=Split.TRAIN)
    ids, attention, region = encode_batch(problems, tokenizer, 16)
    assert region.sum() == 3 * 16 and not (region & ~attention).any()
    model = Trainer(TrainConfig(d_model=32, n_layers=1, n_heads=4, mlp_hidden_size=64)).model
    loss = diffusion_loss(model, ids, attention, region, tokenizer.mask_token_id, torch.Generator().manual_seed(0))
    assert loss.item() > 0 and loss.requires_grad


def test_sums_are_right_aligned_with_fill_that_decodes_to_nothing():
    tokenizer = CharTokenizer()
    gen = TaskGenerator(seed=0)
    for _ in range(50):
        problem = gen.problem(0, Split.TRAIN)
        ids = target_ids(problem, tokenizer)
        assert tokenizer.decode(ids) == problem.answer
        if problem.family.value == "add":
            assert len(ids) == 5 and ids[-1] == tokenizer.eos_token_id  # units digit always at index 3
