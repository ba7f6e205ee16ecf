"""Engine benchmark: the speed-quality trade-off of the bundled model, throughput, and the cache's gain.

    python -m bench.engine --json runs/bench-engine.json [--problems 500] [--quick]

Figures (all measured in this run):

* ``accuracy`` / ``mean_steps`` (no cache) and ``accuracy_dual_cache`` / ``mean_steps_dual_cache``
  by threshold, on held-out problems of the short families with few-shot prompts (0 to
  ``--max-shots`` examples), at the model's default canvas (a request without max_tokens; answers stop
  at their EOS block); accuracy is exact match for arithmetic and validity for the word task
  (``shared.tasks``); ``accuracy_by_family`` splits them.
* ``families``: per family (``add``, ``words`` and the long ``chain``, ``long_family``), dual cache
  as served: accuracy and mean steps by threshold, the mean number of blocks decoded and the longest
  answer (tokens, EOS included), and the forwards early stop at EOS saves per request (steps with
  ``ignore_eos`` minus steps without, at 0.9). Short families run at the default block length, the
  long one at the first of ``--long-block-lengths``.
* ``long_family_by_block``: the long family's figures at each of ``--long-block-lengths`` (16 and 32:
  LLaDA's block, which the long simulator presets decode in).
* ``by_canvas``: per family and canvas length, accuracy and mean steps by threshold: the answer must
  not change with the room the client allows.
* ``tokens_per_s`` by batch size: committed tokens per second, dual cache, threshold 0.9.
* ``cache_step_over_recompute_step``: median dual-cache step time over median recompute step time,
  at batch 8, prompt plus generation of at least 128 tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench.common import emit_json
from services.worker.engine.engine import DLMEngine
from shared.messages.base import CacheMode, StepKind
from shared.tasks import SHORT_FAMILIES, Family, Problem, Split, TaskGenerator, check_answer

THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
THROUGHPUT_BATCHES = (1, 4, 8)
LONG_FAMILY = Family.CHAIN
SHORT_CANVASES = (16, 32, 64, 128)  # by_canvas for the short families (each at most the model's longest)
SAVINGS_THRESHOLD = 0.9  # where early stop's forwards saved are measured


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def decode_problems(engine: DLMEngine, problems, threshold: float, mode: CacheMode, batch_size: int,
                    gen_length: int | None = None, block_length: int | None = None, ignore_eos: bool = False):
    """Answers and step counts for every problem, run in batches of ``batch_size``."""
    texts, steps = [], []
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        states = [engine.new_request(f"q{start + i}", engine.encode(p.prompt), gen_length, block_length, mode,
                                     ignore_eos) for i, p in enumerate(chunk)]
        engine.run_to_completion([(s, threshold) for s in states])
        texts += [engine.decode(engine.answer(s).token_ids) for s in states]
        steps += [s.num_steps for s in states]
    return texts, steps


def curve(engine: DLMEngine, problems, batch_size: int, gen_length: int | None, block_length: int | None,
          label: str) -> dict:
    """Accuracy and mean steps by threshold (dual cache, early stop: as served)."""
    accuracy, mean_steps = {}, {}
    for tau in THRESHOLDS:
        texts, steps = decode_problems(engine, problems, tau, CacheMode.DUAL, batch_size, gen_length, block_length)
        accuracy[str(tau)] = round(_mean([check_answer(p, t) for p, t in zip(problems, texts, strict=True)]), 4)
        mean_steps[str(tau)] = round(_mean(steps), 3)
    log(f"{label}: accuracy {accuracy}, mean steps {mean_steps}")
    return {"accuracy": accuracy, "mean_steps": mean_steps}


def family_problems(family: Family, count: int, max_shots: int, seed: int) -> list[Problem]:
    tasks = TaskGenerator(seed=seed)
    return [tasks.problem(i % (max_shots + 1), Split.HELD_OUT, family) for i in range(count)]


def answer_length(engine: DLMEngine, problem: Problem) -> int:
    """Tokens of the reference answer, EOS included (what the canvas must hold)."""
    return len(engine.encode(problem.answer)) + 1


def family_figures(engine: DLMEngine, family: Family, problems, batch_size: int, gen_length: int,
                   block_length: int) -> dict:
    """The family's curve as served, blocks decoded, longest answer, and early stop's savings."""
    figures = curve(engine, problems, batch_size, gen_length, block_length, f"{family.value} @{gen_length}/{block_length}")
    stopped = _states(engine, problems, gen_length, block_length, ignore_eos=False)
    whole = _states(engine, problems, gen_length, block_length, ignore_eos=True)
    blocks = [_blocks_decoded(engine, s) for s in stopped]
    saved = [w.num_steps - s.num_steps for s, w in zip(stopped, whole, strict=True)]
    return {
        **figures,
        "gen_length": gen_length,
        "block_length": block_length,
        "mean_blocks": round(_mean(blocks), 3),
        "max_answer_tokens": max(answer_length(engine, p) for p in problems),
        "mean_answer_tokens": round(_mean([answer_length(engine, p) for p in problems]), 2),
        "forwards_saved_by_early_stop": round(_mean(saved), 3),
        "forwards_with_ignore_eos": round(_mean([w.num_steps for w in whole]), 3),
    }


def _states(engine: DLMEngine, problems, gen_length: int, block_length: int, ignore_eos: bool):
    states = [engine.new_request(f"s{i}", engine.encode(p.prompt), gen_length, block_length, CacheMode.DUAL,
                                 ignore_eos) for i, p in enumerate(problems)]
    for start in range(0, len(states), 32):
        engine.run_to_completion([(s, SAVINGS_THRESHOLD) for s in states[start : start + 32]])
    return states


def _blocks_decoded(engine: DLMEngine, state) -> int:
    """Blocks up to the one holding the first EOS (all of them without one)."""
    answer = engine.answer(state)
    last = len(answer.token_ids) if answer.finish_reason == "stop" else state.gen_length - 1
    return last // state.block_length + 1


def quality_sweep(engine: DLMEngine, problems, mode: CacheMode, batch_size: int) -> dict:
    accuracy, mean_steps, by_family = {}, {}, {}
    for tau in THRESHOLDS:
        started = time.perf_counter()
        texts, steps = decode_problems(engine, problems, tau, mode, batch_size)
        correct = [check_answer(p, t) for p, t in zip(problems, texts, strict=True)]
        key = str(tau)
        accuracy[key] = round(sum(correct) / len(problems), 4)
        mean_steps[key] = round(sum(steps) / len(problems), 3)
        by_family[key] = {
            f.value: round(_mean([c for p, c in zip(problems, correct, strict=True) if p.family is f]), 4)
            for f in SHORT_FAMILIES
        }
        log(f"{mode.value:>5} tau={tau}: accuracy {accuracy[key]:.3f}, mean steps {mean_steps[key]:.2f} "
            f"({time.perf_counter() - started:.1f}s)")
    return {"accuracy": accuracy, "mean_steps": mean_steps, "by_family": by_family}


def _mean(values) -> float:
    return sum(values) / len(values) if values else float("nan")


def tokens_per_second(engine: DLMEngine, problems, batch_size: int) -> float:
    """Committed tokens per second, running ``problems`` in batches at threshold 0.9, dual cache."""
    committed, elapsed = 0, 0.0
    for start in range(0, len(problems), batch_size):
        states = [
            engine.new_request(f"t{start + i}", engine.encode(p.prompt), cache_mode=CacheMode.DUAL)
            for i, p in enumerate(problems[start : start + batch_size])
        ]
        active = [(s, 0.9) for s in states]
        began = time.perf_counter()
        while active:
            committed += sum(len(r.committed_positions) for r in engine.step(active))
            active = [(s, t) for s, t in active if not s.finished]
        elapsed += time.perf_counter() - began
    return committed / elapsed


def cache_ratio(engine: DLMEngine, problems, batch_size: int = 8, repeats: int = 10) -> dict:
    """Median dual-cache step time over median recompute step time at ``batch_size``."""
    recompute, cache = [], []
    for r in range(repeats + 1):
        chunk = problems[(r * batch_size) % len(problems) :][:batch_size]
        states = [engine.new_request(f"c{r}-{i}", engine.encode(p.prompt), cache_mode=CacheMode.DUAL) for i, p in enumerate(chunk)]
        for target in (recompute, cache):
            began = time.perf_counter()
            results = engine.step([(s, 1.0) for s in states])
            target.append(time.perf_counter() - began)
        assert results[0].kind is StepKind.CACHE
        for s in states:
            engine.drop(s.request_id)
    rec, cac = statistics.median(recompute[1:]), statistics.median(cache[1:])
    return {"ratio": round(cac / rec, 4), "recompute_ms": round(rec * 1000, 3), "cache_ms": round(cac * 1000, 3)}


def long_prompt_problems(count: int, min_tokens: int, gen_length: int, seed: int):
    gen = TaskGenerator(seed=seed)
    out = []
    while len(out) < count:
        p = gen.problem(8, Split.HELD_OUT)
        if len(p.prompt) + gen_length >= min_tokens:
            out.append(p)
    return out


def family_sweeps(engine: DLMEngine, args: argparse.Namespace) -> tuple[dict, dict, dict]:
    """``families`` (each at the canvas a request without max_tokens gets), ``by_canvas`` and the long
    family at each of its block lengths."""
    longest = engine.max_gen_length or engine.default_gen_length
    families, by_canvas, long_by_block = {}, {}, {}
    for n, family in enumerate((*SHORT_FAMILIES, LONG_FAMILY)):
        long = family is LONG_FAMILY
        problems = family_problems(family, args.long_problems if long else args.family_problems, args.max_shots,
                                   args.seed + 10 + n)
        block = args.long_block_lengths[0] if long else engine.default_block_length
        canvas = longest if long else engine.default_gen_length
        families[family.value] = family_figures(engine, family, problems, args.batch_size, canvas, block)
        if long:
            long_by_block[str(block)] = families[family.value]
            for other in args.long_block_lengths[1:]:
                long_by_block[str(other)] = family_figures(engine, family, problems, args.batch_size, canvas, other)
        canvases = (longest,) if long else [c for c in SHORT_CANVASES if c <= longest]
        by_canvas[family.value] = {
            str(c): curve(engine, problems[: args.canvas_problems], args.batch_size, c, block,
                          f"{family.value} @canvas {c}")
            for c in canvases
        }
    return families, by_canvas, long_by_block


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = DLMEngine.from_pretrained(args.model)
    problems = TaskGenerator(seed=args.seed).problems(args.problems, max_shots=args.max_shots, split=Split.HELD_OUT)
    log(f"{len(problems)} held-out problems, {args.max_shots} shots at most, model {args.model}")
    none = quality_sweep(engine, problems, CacheMode.NONE, args.batch_size)
    dual = quality_sweep(engine, problems, CacheMode.DUAL, args.batch_size)
    throughput_problems = problems[: args.throughput_problems]
    tps = {str(b): round(tokens_per_second(engine, throughput_problems, b), 2) for b in THROUGHPUT_BATCHES}
    log(f"tokens/s by batch: {tps}")
    long_problems = long_prompt_problems(8 * 11, 128, engine.default_gen_length, args.seed + 1)
    ratio = cache_ratio(engine, long_problems)
    log(f"cache step / recompute step at batch 8: {ratio}")
    families, by_canvas, long_by_block = family_sweeps(engine, args)
    return {
        "families": families,
        "long_family": LONG_FAMILY.value,
        "long_family_by_block": long_by_block,
        "by_canvas": by_canvas,
        "model": args.model,
        "problems": len(problems),
        "max_shots": args.max_shots,
        "gen_length": engine.default_gen_length,
        "block_length": engine.default_block_length,
        "thresholds": [str(t) for t in THRESHOLDS],
        "accuracy": none["accuracy"],
        "mean_steps": none["mean_steps"],
        "accuracy_dual_cache": dual["accuracy"],
        "mean_steps_dual_cache": dual["mean_steps"],
        "accuracy_by_family": none["by_family"],
        "accuracy_by_family_dual_cache": dual["by_family"],
        "tokens_per_s": tps,
        "tokens_per_s_batch8_over_batch1": round(tps["8"] / tps["1"], 3),
        "cache_step_over_recompute_step": ratio["ratio"],
        "cache_step_detail": {**ratio, "batch": 8, "min_context_tokens": 128},
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
    }


def _block_lengths(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected block lengths separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"block lengths must be positive, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--arch" or a.startswith("--arch=") for a in argv):  # speed on a random model: bench/engine_speed.py
        from bench import engine_speed

        return engine_speed.main(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the figures to this path too")
    parser.add_argument("--model", default="models/dls-tiny")
    parser.add_argument("--problems", type=int, default=500)
    parser.add_argument("--max-shots", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--throughput-problems", type=int, default=48)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--family-problems", type=int, default=300, help="problems per short family")
    parser.add_argument("--long-problems", type=int, default=400, help="problems of the long family")
    parser.add_argument("--canvas-problems", type=int, default=100, help="problems per family and canvas")
    parser.add_argument("--long-block-lengths", type=_block_lengths, default=(16, 32),
                        help="block lengths of the long family, comma-separated (the first is `families`')")
    parser.add_argument("--quick", action="store_true", help="60 problems: a smoke run, not the figures")
    args = parser.parse_args(argv)
    if args.quick:
        args.problems, args.throughput_problems = 60, 16
        args.family_problems = args.long_problems = args.canvas_problems = 24
    result = run(args)
    emit_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
