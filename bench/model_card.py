"""Writes the bundled model's MODEL_CARD.md from its training record and a `bench.engine` JSON.

    python -m bench.model_card --bench runs/bench-engine.json [--model models/dls-tiny]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from shared.calibration import QUALITY, bundle_dir
from shared.tasks import CATEGORIES, CHAIN_NEXT_CATEGORY, SHORT_MIX_WEIGHTS


def _curve_table(bench: dict) -> str:
    rows = ["| threshold | accuracy (no cache) | mean steps (no cache) | accuracy (dual cache) | mean steps (dual cache) | add | words |",
            "|---|---|---|---|---|---|---|"]
    for tau in bench["thresholds"]:
        fam = bench["accuracy_by_family"][tau]
        rows.append(
            f"| {tau} | {bench['accuracy'][tau]:.3f} | {bench['mean_steps'][tau]:.2f} | "
            f"{bench['accuracy_dual_cache'][tau]:.3f} | {bench['mean_steps_dual_cache'][tau]:.2f} | "
            f"{fam['add']:.3f} | {fam['words']:.3f} |"
        )
    return "\n".join(rows)


def _family_table(bench: dict) -> str:
    """Accuracy / mean steps per family and threshold, as served (dual cache, default canvas)."""
    families = bench.get("families", {})
    names = list(families)
    rows = ["| threshold | " + " | ".join(f"{n} accuracy | {n} steps" for n in names) + " |",
            "|---|" + "---|---|" * len(names)]
    for tau in bench["thresholds"]:
        cells = " | ".join(f"{families[n]['accuracy'][tau]:.3f} | {families[n]['mean_steps'][tau]:.2f}" for n in names)
        rows.append(f"| {tau} | {cells} |")
    shapes = "; ".join(
        f"`{n}`: canvas {f['gen_length']} in blocks of {f['block_length']}, answers of {f['mean_answer_tokens']:.0f} "
        f"tokens on average (at most {f['max_answer_tokens']}, EOS included) over {f['mean_blocks']:.1f} blocks, "
        f"{f['forwards_saved_by_early_stop']:.1f} forwards saved per request by early stop at EOS "
        f"({f['forwards_with_ignore_eos']:.1f} with `ignore_eos`)"
        for n, f in families.items())
    return "\n".join(rows) + "\n\n" + shapes + "."


def _long_block_table(bench: dict) -> str:
    """The long family at each block length it was measured at: accuracy / mean steps / mean blocks."""
    by_block = bench.get("long_family_by_block", {})
    if not by_block:
        return "(not measured)"
    rows = ["| block | " + " | ".join(f"{t} accuracy / steps" for t in bench["thresholds"]) + " | blocks decoded |",
            "|---|" + "---|" * (len(bench["thresholds"]) + 1)]
    for block, f in by_block.items():
        cells = " | ".join(f"{f['accuracy'][t]:.3f} / {f['mean_steps'][t]:.1f}" for t in bench["thresholds"])
        rows.append(f"| {block} | {cells} | {f['mean_blocks']:.2f} |")
    return "\n".join(rows)


def _canvas_table(bench: dict) -> str:
    """Accuracy at each threshold per family and canvas length: the answer must not follow the canvas."""
    rows = ["| family | canvas | " + " | ".join(bench["thresholds"]) + " | steps at 0.9 |",
            "|---|---|" + "---|" * (len(bench["thresholds"]) + 1)]
    for family, canvases in bench.get("by_canvas", {}).items():
        for canvas, figures in canvases.items():
            cells = " | ".join(f"{figures['accuracy'][t]:.3f}" for t in bench["thresholds"])
            rows.append(f"| {family} | {canvas} | {cells} | {figures['mean_steps']['0.9']:.2f} |")
    return "\n".join(rows)


def _categories() -> str:
    rows = []
    for cat in CATEGORIES.values():
        words = ", ".join(f"{w} {p:.2f}" for w, p in sorted(cat.word_to_weight.items(), key=lambda kv: -kv[1])[:6])
        more = "" if len(cat.word_to_weight) <= 6 else f" (+{len(cat.word_to_weight) - 6} more)"
        rows.append(f"- `@{cat.name}=` ({cat.kind}): {words}{more}")
    return "\n".join(rows)


def _chain_links() -> str:
    return ", ".join(f"`{letter}` -> `@{category}`" for letter, category in CHAIN_NEXT_CATEGORY.items())


def _history_row(n: int, h: dict) -> str:
    settings = h.get("settings")
    detail = "; ".join(f"{k} {v['accuracy']:.2f}" for k, v in settings.items()) if settings else ""
    steps = f"{h['mean_steps']:.2f}" if "mean_steps" in h else ""
    return f"| {n} | {h['step']} | {h['loss']} | {h['accuracy']:.3f} | {steps} | {detail} |"


def render(model_dir: Path, bench: dict) -> str:
    info = json.loads((model_dir / "training_info.json").read_text())
    cfg = info["train_config"]
    stages = [*info.get("previous_stages", []), info]  # oldest first
    history = "\n".join(_history_row(n + 1, h) for n, stage in enumerate(stages) for h in stage["eval_history"])
    total_steps = sum(stage["steps_done"] for stage in stages)
    total_minutes = sum(stage["wall_time_s"] for stage in stages) / 60
    stage_lines = "\n".join(
        f"{n + 1}. {stage['steps_done']} steps, "
        f"{stage.get('note') or format(stage['train_config']['add_share'], '.0%') + ' arithmetic queries'}, "
        f"lr {stage['train_config']['lr']:g}, seed {stage['train_config']['seed']}, {stage['wall_time_s'] / 60:.0f} minutes"
        for n, stage in enumerate(stages)
    )
    long = bench.get("long_family", "chain")
    return f"""# {model_dir.name}: the bundled diffusion language model

A small LLaDA-architecture mask predictor (LLaMA blocks without the causal mask: RMSNorm, RoPE,
SwiGLU), trained by this project on CPU with the masked-diffusion objective. It stands in for
LLaDA-8B on GSM8K, which cannot be downloaded here, and it shows a real speed-quality trade-off:
lower confidence thresholds take fewer denoising steps and give wrong answers more often.

## Model

- Parameters: {info['parameters']:,} ({cfg['n_layers']} layers, d_model {cfg['d_model']}, {cfg['n_heads']} heads, SwiGLU {cfg['mlp_hidden_size']})
- Tokenizer: characters (`tokenizer.json`); ids 0 `<pad>`, 1 `<mask>`, 2 `<eos>`; a chat template
  that renders a conversation in the few-shot format (a single user message holding a task prompt
  is the plain prompt; earlier turns become worked examples)
- Canvas: any length from one block to {cfg.get('max_gen_length', cfg['gen_length'])} tokens (`max_gen_length`);
  default {cfg['gen_length']} (a request without `max_tokens`), blocks of {cfg['block_length']} by default
- Sums are written right-aligned in a 4-token field filled with `<pad>`, which the tokenizer renders as
  nothing (`347+589=` -> `<pad>936<eos>...` -> `936`): each digit has a fixed place whatever the carry
  out of the top digit
- Files: `config.json` + `model.safetensors` (`save_pretrained` format), `tokenizer.json`, `training_info.json`,
  `quality.json` (the measured curves), `predictor/` (its step predictor)

## What it promises

The same answer whatever canvas a request implies, from one block up to {cfg.get('max_gen_length', cfg['gen_length'])}
tokens, when the answer fits: decoded block by block, it stops at the first block that completes an
EOS. A server turns `max_tokens` into a canvas (rounded up to the block, at most
{cfg.get('max_gen_length', cfg['gen_length'])}; `shared/generation.py`) and cuts the answer at the cap (`finish_reason:
"length"`): with a canvas shorter than the answer the model writes the answer's first tokens. The
curves below are measured that way (`python -m bench.engine`).

## Data

Generated by `shared/tasks.py` (seeded; 10% of arithmetic queries are held out by a hash and never trained on):

- `add`: multi-digit addition with carries (`347+589=` -> `936`), operands of 1-3 digits, exact match.
- `words`: `@c=` -> three words of category `c`, drawn from a weighted list; scored by validity. In
  *coupled* categories every word differs from a non-word "favourite" in one letter, so committing
  each position's most likely letter at once spells the non-word (the cliff sits at the smallest
  per-position marginal); in *independent* ones every letter combination is a word.
- `chain` (the long family): `@d.q=` -> items labelled `a` up to `q` (`a:pat b:kan ... q:bog`),
  35 to 125 tokens; the first word is of category `d`, each later one of the category the last
  letter of the word before it names ({_chain_links()}): every word depends on the one before, across
  blocks, and the coupled categories along the chain break at low thresholds. Scored by validity.

{_categories()}

Prompts carry 0 to {cfg['max_shots']} worked examples of the short families (one per line) before the query.

## Training

`dls train-model` (see `training/tiny.py`): answers padded with EOS to a canvas drawn per
batch (from one block to {cfg.get('max_gen_length', cfg['gen_length'])}, a share shorter than the answer and cut there),
LLaDA's mask ratio t ~ U(0,1) over the canvas for half of the rows and semi-autoregressive masking
(a clean prefix, one block masked at ratio t, the rest masked) for the other half, loss on masked
positions weighted by 1/t, prompt never masked; AdamW with warm-up and cosine decay, batch
{cfg['batch_size']}; {total_steps} steps in all, {total_minutes:.0f} minutes of optimisation on the 2-core CPU (shared with
other jobs), in stages (each later one `--init-from` the one before, fresh optimizer):

{stage_lines}

Evaluation during training (held-out problems, threshold 0.9; the later stages per family and canvas):

| stage | step | loss | accuracy | mean steps | per setting |
|---|---|---|---|---|---|
{history}

## Speed-quality trade-off per family

Measured by `python -m bench.engine` (dual cache and early stop, as served; the long family `{long}`
at its bench block length):

{_family_table(bench)}

## The long family per block length

`{long}` on the 128-token canvas, dual cache, at each block length `bench.engine` measured
(`--long-block-lengths`; 32 is LLaDA's block and the long simulator presets'); `quality.json` has
the curves as `{long}` (the first) and `{long}@<block>`:

{_long_block_table(bench)}

## Per canvas length

The same problems at every canvas length (accuracy by threshold, dual cache):

{_canvas_table(bench)}

## The short families' mix

{bench['problems']} held-out problems with 0-{bench['max_shots']} shot prompts at the default canvas (accuracy = exact
match for `add`, validity for `words`; the last two columns split the no-cache accuracy by family):

{_curve_table(bench)}

Throughput (committed tokens per second, dual cache, threshold 0.9): {', '.join(f'batch {b}: {v}' for b, v in bench['tokens_per_s'].items())}.
Dual-cache step / recompute step at batch 8 with 128+ tokens: {bench['cache_step_over_recompute_step']}.

## Limits

A toy: it knows three task families and nothing else, and nothing beyond {cfg.get('max_gen_length', cfg['gen_length'])} tokens.
It exists so that every figure of the serving system (accuracy against threshold, steps per request,
blocks per answer, predictor features) comes from a real denoising model rather than a stand-in.
"""




def short_mix_by_canvas(bench: dict) -> dict[str, dict[str, float]]:
    """``accuracy@<canvas>``: the short families' mix (``SHORT_MIX_WEIGHTS``, as the task generator
    draws it) per canvas, from the bench's ``by_canvas`` (each family at that canvas, dual cache)."""
    by_canvas = bench.get("by_canvas", {})
    if not all(f.value in by_canvas for f in SHORT_MIX_WEIGHTS):
        return {}
    total = sum(SHORT_MIX_WEIGHTS.values())
    canvases = set.intersection(*(set(by_canvas[f.value]) for f in SHORT_MIX_WEIGHTS))
    mix = {}
    for canvas in sorted(canvases, key=int):
        curves = {f: by_canvas[f.value][canvas]["accuracy"] for f in SHORT_MIX_WEIGHTS}
        taus = next(iter(curves.values()))
        mix[f"accuracy@{canvas}"] = {
            tau: round(sum(w * curves[f][tau] for f, w in SHORT_MIX_WEIGHTS.items()) / total, 4) for tau in taus
        }
    return mix


def write_quality_curve(model_dir: Path, bench: dict) -> None:
    """The measured accuracy per threshold, next to the weights, for whatever picks candidate
    thresholds by an accuracy budget (the simulator's presets: ``quality_budget_pp``)."""
    curve = {
        "measured_by": "python -m bench.engine",
        "problems": bench["problems"],
        "max_shots": bench["max_shots"],
        "accuracy": bench["accuracy"],
        "accuracy_dual_cache": bench["accuracy_dual_cache"],
        # each family as served (dual cache, the default canvas; the long family at its bench block),
        # and the long family at its other block lengths as "<family>@<block length>"
        "families": {name: fam["accuracy"] for name, fam in bench.get("families", {}).items()},
    }
    long = bench.get("long_family")
    for block, figures in bench.get("long_family_by_block", {}).items():
        curve["families"][f"{long}@{block}"] = figures["accuracy"]
    # the short families' mix on each canvas the bench measured ("accuracy@<canvas>"): a tight canvas
    # can cost the model accuracy at low thresholds that its default canvas does not show
    curve.update(short_mix_by_canvas(bench))
    bundle_dir(model_dir).mkdir(parents=True, exist_ok=True)
    (bundle_dir(model_dir) / QUALITY).write_text(json.dumps(curve, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bench", required=True, help="JSON written by `python -m bench.engine --json`")
    parser.add_argument("--model", default="models/dls-tiny")
    args = parser.parse_args(argv)
    model_dir = Path(args.model)
    text = render(model_dir, json.loads(Path(args.bench).read_text()))
    (model_dir / "MODEL_CARD.md").write_text(text)
    write_quality_curve(model_dir, json.loads(Path(args.bench).read_text()))
    print(f"wrote {model_dir / 'MODEL_CARD.md'} and {bundle_dir(model_dir) / QUALITY}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
