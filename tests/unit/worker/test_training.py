import json

import pytest
import torch

from services.cli import build_parser
from services.worker.model.loading import load_model
from shared.cli import CliError
from shared.tasks import Family, Split, TaskGenerator
from shared.tokenizer import CharTokenizer
from training.tiny import (
    SEMI_AR_BLOCK_LENGTHS,
    TrainConfig,
    Trainer,
    diffusion_loss,
    encode_batch,
    target_ids,
)


def _tiny(tmp_path, steps: int, **overrides) -> TrainConfig:
    shape = {"d_model": 32, "n_layers": 2, "n_heads": 4, "mlp_hidden_size": 64, **overrides}
    return TrainConfig(
        output_dir=str(tmp_path / "model"), checkpoint_dir=str(tmp_path / "ckpt"), steps=steps, batch_size=4,
        eval_every=2, eval_problems=2, save_every=2, warmup_steps=1, **shape,
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


def test_init_from_a_deeper_model_keeps_its_first_layers(tmp_path):
    Trainer(_tiny(tmp_path / "deep", steps=1, n_layers=3)).run(log=lambda _: None)
    deep = load_model(tmp_path / "deep" / "model").model.state_dict()
    shallow = Trainer(_tiny(tmp_path / "shallow", steps=1, n_layers=2, init_from=str(tmp_path / "deep" / "model")))
    assert shallow.model.config.n_layers == 2
    kept = shallow.model.state_dict()
    assert not any(".blocks.2." in k for k in kept)
    assert all(torch.equal(v, deep[k]) for k, v in kept.items())  # the embedding, blocks 0-1, norm and head
    wider = _tiny(tmp_path / "wide", steps=1, n_layers=2, d_model=64, init_from=str(tmp_path / "deep" / "model"))
    with pytest.raises(ValueError, match="d_model"):
        Trainer(wider)


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


def test_answers_are_padded_to_the_canvas_or_cut_to_it():
    tokenizer = CharTokenizer()
    problem = TaskGenerator(seed=3).problem(0, Split.TRAIN, Family.CHAIN)
    answer = target_ids(problem, tokenizer)
    ids, _, region = encode_batch([problem], tokenizer, 128)
    canvas = ids[0, region[0]].tolist()
    assert canvas[: len(answer)] == answer and set(canvas[len(answer):]) <= {tokenizer.eos_token_id}
    with pytest.raises(ValueError, match="does not fit"):
        encode_batch([problem], tokenizer, 16)
    ids, _, region = encode_batch([problem], tokenizer, 16, truncate=True)
    assert ids[0, region[0]].tolist() == answer[:16]  # the answer's first tokens, no EOS


def test_batches_draw_canvases_and_hold_the_long_family(tmp_path):
    trainer = Trainer(_tiny(tmp_path, steps=1, chain_share=0.5, truncate_share=0.2))
    widths, long_batches = set(), 0
    for _ in range(40):
        _, _, region, answer_lengths, long = trainer._batch()
        gen_length = int(region[0].sum())
        widths.add(gen_length)
        long_batches += max(answer_lengths) > 16
        assert long == (max(answer_lengths) > 16) or long  # a chain batch says so; a short one never holds >16
        assert 1 <= gen_length <= trainer.cfg.max_gen_length and max(answer_lengths) <= gen_length
    assert len(widths) > 10 and long_batches > 5



def test_tight_canvases_round_the_longest_short_answer_up_to_the_block(tmp_path):
    trainer = Trainer(_tiny(tmp_path, steps=1, chain_share=0.0, truncate_share=0.0, tight_canvas_share=1.0))
    block = trainer.cfg.block_length
    for _ in range(20):
        _, _, region, answer_lengths, _ = trainer._batch()
        gen_length = int(region[0].sum())
        assert gen_length % block == 0 and gen_length - block < max(answer_lengths) <= gen_length

def test_semi_autoregressive_rows_have_a_clean_prefix_and_a_masked_suffix():
    tokenizer = CharTokenizer()
    problems = TaskGenerator(seed=0).problems(8, max_shots=0, split=Split.TRAIN)
    ids, attention, region = encode_batch(problems, tokenizer, 64)
    model = Trainer(TrainConfig(d_model=32, n_layers=1, n_heads=4, mlp_hidden_size=64)).model
    seen = []
    model.forward = lambda noisy, attention_mask: seen.append(noisy) or type("Out", (), {"logits": torch.zeros(
        (*noisy.shape, tokenizer.vocab_size), requires_grad=True)})()
    diffusion_loss(model, ids, attention, region, tokenizer.mask_token_id, torch.Generator().manual_seed(1),
                   semi_ar_share=1.0, answer_lengths=[16] * 8)
    masked = (seen[0] == tokenizer.mask_token_id)[region].view(8, 64)

    def block_wise(row: list[bool]) -> bool:
        """Some block [b*L, (b+1)*L): nothing masked before it, everything after it."""
        return any(not any(row[: b * size]) and all(row[(b + 1) * size:])
                   for size in SEMI_AR_BLOCK_LENGTHS for b in range(64 // size))

    assert all(block_wise(row) for row in masked.tolist())
    assert not all(block_wise(row) for row in (torch.rand(8, 64) < 0.5).tolist())  # uniform masking is not


def test_confidence_ordered_rows_show_what_the_model_is_sure_of_and_mask_the_rest():
    tokenizer = CharTokenizer()
    problems = TaskGenerator(seed=0).problems(4, max_shots=0, split=Split.TRAIN)
    ids, attention, region = encode_batch(problems, tokenizer, 32)
    model = Trainer(TrainConfig(d_model=32, n_layers=1, n_heads=4, mlp_hidden_size=64)).model
    seen = []
    width = ids.shape[1]

    def forward(noisy, attention_mask):
        seen.append(noisy.clone())
        # sure of the even canvas positions only, at any threshold below 0.99
        logits = torch.zeros((*noisy.shape, tokenizer.vocab_size))
        logits[:, width - 32::2, 0] = 20.0
        return type("Out", (), {"logits": logits.requires_grad_()})()

    model.forward = forward
    diffusion_loss(model, ids, attention, region, tokenizer.mask_token_id, torch.Generator().manual_seed(3),
                   semi_ar_share=1.0, answer_lengths=[32] * 4, block_lengths=(32,), confidence_mask_share=1.0)
    probe, trained = seen  # the probe forward (no gradients), then the one the loss is taken on
    assert (probe[:, width - 32:] == tokenizer.mask_token_id).all()  # the whole block masked for the probe
    masked = trained[:, width - 32:] == tokenizer.mask_token_id
    assert not masked[:, 0::2].any()  # every position the model was sure of is shown
    assert masked[:, 1::2].any() and not masked[:, 1::2].all()  # the rest masked at ratio t


def test_the_probe_state_is_trained_with_its_over_confident_errors_weighted_up():
    tokenizer = CharTokenizer()
    problems = TaskGenerator(seed=0).problems(4, max_shots=0, split=Split.TRAIN)
    ids, attention, region = encode_batch(problems, tokenizer, 32)
    width = ids.shape[1]
    model = Trainer(TrainConfig(d_model=32, n_layers=1, n_heads=4, mlp_hidden_size=64)).model
    probes = []

    def forward(noisy, attention_mask):
        # sure of token 0 (never the answer) at the even canvas positions: over-confident errors
        logits = torch.zeros((*noisy.shape, tokenizer.vocab_size), requires_grad=True)
        confident = torch.zeros_like(logits.detach())
        confident[:, width - 32::2, 0] = 20.0
        out = logits + confident
        if (noisy[:, width - 32:] == tokenizer.mask_token_id).all():
            probes.append(logits)  # the probe forward: the block fully masked
        return type("Out", (), {"logits": out})()

    model.forward = forward

    def loss(weight, boost):
        return diffusion_loss(model, ids, attention, region, tokenizer.mask_token_id, torch.Generator().manual_seed(3),
                              semi_ar_share=1.0, answer_lengths=[32] * 4, block_lengths=(32,),
                              confidence_mask_share=1.0, probe_weight=weight, overconfident_boost=boost)

    plain, probed, boosted = loss(0.0, 0.0), loss(1.0, 0.0), loss(1.0, 4.0)
    assert plain < probed < boosted
    boosted.backward()
    gradient = probes[-1].grad[:, width - 32:].abs().sum(-1)  # per block position
    assert gradient[:, 0::2].mean() > 3 * gradient[:, 1::2].mean()  # the errors weigh 1 + 4 times as much
    assert probes[0].grad is None  # without probe_weight the probe takes no gradient


def test_chain_length_bias_draws_long_chains_more_often():
    def mean_items(bias: float) -> float:
        tasks = TaskGenerator(seed=5, family_weights={Family.CHAIN: 1.0}, chain_length_bias=bias)
        return sum(len(tasks.problem(0).answer.split(" ")) for _ in range(400)) / 400

    assert mean_items(2.0) > mean_items(0.0) + 1.5  # 15.9 against 13.5 items expected


def test_dls_train_model_takes_every_plain_config_field_as_a_flag():
    args = build_parser().parse_args(["train-model", "--steps", "0", "--shot-weights", "1,2.5", "--chain-block-lengths",
                                      "16,32", "--output-dir", "elsewhere"])
    assert args.shot_weights == [1.0, 2.5] and args.chain_block_lengths == [16, 32] and args.output_dir == "elsewhere"
    assert args.lr == TrainConfig().lr  # the config's default
    with pytest.raises(CliError, match="must be positive"):
        args.func(args)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train-model", "--chain-block-lengths", "16,x"])
