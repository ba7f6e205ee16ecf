"""The `dls` command: one entry point, subcommands registered by the modules that own them.

Each module in ``_SUBCOMMAND_MODULES`` has ``register(subparsers)``, which adds its subcommands
with ``set_defaults(func=...)``; ``func(args)`` returns the exit code. Modules are imported only
when the CLI starts. The dispatcher lives here, beside ``services/stack.py``, because it reaches
into every service; subcommands raise ``shared.cli.CliError`` for user errors.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from shared.cli import CliError

_SUBCOMMAND_MODULES = (
    "training.cli",  # train-model
    "services.worker.cli",  # profile, generate
    "services.reconfigurator.cli",  # reconfig solve
    "services.predictor.cli",  # collect-traces, train-predictor
    "sim.cli",  # sim, compare, capacity
    "services.stack",  # up
    "loadgen.cli",  # loadgen
    "calibrate.cli",  # calibrate
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dls", description="DiLaServe: serving diffusion language models")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CliError as exc:
        parser.exit(2, f"dls: error: {exc}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
