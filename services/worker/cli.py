"""`dls profile`, `dls generate`: the worker's commands (`dls train-model` is ``training/cli.py``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from shared.cli import CliError

DEFAULT_MODEL_DIR = "models/dls-tiny"


def register(subparsers: argparse._SubParsersAction) -> None:
    _register_profile(subparsers)
    _register_generate(subparsers)


def _register_profile(subparsers) -> None:
    p = subparsers.add_parser("profile", help="measure step latency per step kind and batch size")
    p.add_argument("--model", default=DEFAULT_MODEL_DIR, help="model directory")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    p.add_argument("--context-tokens", type=int, default=128, help="prompt plus generation tokens per request")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--output", default=None, help="default: profiles/<model>-<device>.json")
    p.set_defaults(func=_profile)


def _profile(args: argparse.Namespace) -> int:
    from services.worker.profiling import profile_model

    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        raise CliError(f"--batch-sizes: expected integers separated by commas, got {args.batch_sizes!r}") from None
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    profile = profile_model(args.model, args.device, batch_sizes, args.context_tokens, args.repeats)
    output = Path(args.output or f"profiles/{profile['model']}-{profile['device_slug']}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(profile, indent=2) + "\n")
    print(f"wrote {output}")
    return 0


def _register_generate(subparsers) -> None:
    p = subparsers.add_parser("generate", help="denoise one prompt with the engine and print the answer")
    p.add_argument("prompt")
    p.add_argument("--model", default=DEFAULT_MODEL_DIR)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--gen-length", type=int, default=None, help="default: the model's training length")
    p.add_argument("--block-length", type=int, default=None)
    p.add_argument("--cache", choices=["none", "prefix", "dual"], default="dual")
    p.add_argument("--show-steps", action="store_true", help="print the canvas after every step")
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from services.worker.engine.engine import CacheMode, DLMEngine
    from services.worker.engine.request import EngineError

    if not 0.0 <= args.threshold <= 1.0:
        raise CliError(f"--threshold must be between 0 and 1, got {args.threshold}")
    try:
        engine = DLMEngine.from_pretrained(args.model)
        result = engine.generate(
            args.prompt, threshold=args.threshold, gen_length=args.gen_length,
            block_length=args.block_length, cache=CacheMode(args.cache),
            on_step=(lambda canvas: print(f"  {canvas}", file=sys.stderr)) if args.show_steps else None,
        )
    except EngineError as exc:
        raise CliError(str(exc)) from None
    print(result.text)
    print(f"[steps: {result.num_steps}, threshold: {args.threshold}, cache: {args.cache}]", file=sys.stderr)
    return 0
