"""`dls train-model`: train the bundled model (``training/tiny.py``) on CPU, resumably.

Every plain field of ``TrainConfig`` is a flag of the same name (``--batch-size`` for ``batch_size``),
with the config's default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable

from shared.cli import CliError


def register(subparsers: argparse._SubParsersAction) -> None:
    from training.tiny import TrainConfig

    p = subparsers.add_parser("train-model", help="train the bundled model on CPU (resumable)")
    defaults = TrainConfig()
    parsers = {"int": int, "float": float, "str": str, "list[float]": _list_of(float, "numbers"),
               "list[int]": _list_of(int, "integers")}  # field type -> parser
    for f in dataclasses.fields(TrainConfig):
        if f.type in parsers:
            p.add_argument(f"--{f.name.replace('_', '-')}", type=parsers[f.type], default=getattr(defaults, f.name))
    p.set_defaults(func=_train)


def _list_of(parse: Callable[[str], object], what: str) -> Callable[[str], list]:
    """A flag parser for values separated by commas (``what``: how the error names them)."""

    def parse_list(text: str) -> list:
        try:
            return [parse(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} separated by commas, got {text!r}") from None

    return parse_list


def _train(args: argparse.Namespace) -> int:
    from training.tiny import TrainConfig, Trainer

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in names})
    if cfg.steps <= 0 or cfg.batch_size <= 0:
        raise CliError("--steps and --batch-size must be positive")
    print(f"training {cfg.output_dir}: {json.dumps(dataclasses.asdict(cfg))}", flush=True)
    Trainer(cfg).run(log=lambda line: print(line, flush=True))
    print(f"exported model to {cfg.output_dir}")
    return 0
