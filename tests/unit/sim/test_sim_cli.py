import pytest

from shared.cli import build_parser
from sim import cli


def _run(argv):
    args = build_parser().parse_args(argv)
    return args.func(args)


def test_unknown_preset_names_the_field():
    with pytest.raises(cli.CliError, match="--preset: unknown preset 'nope'"):
        _run(["sim", "--preset", "nope"])


def test_unknown_policy_names_the_field():
    with pytest.raises(cli.CliError, match="--policies: unknown policy 'fifo'"):
        _run(["compare", "--preset", "tiny", "--policies", "dilaserve,fifo"])


def test_bad_target_and_missing_trace():
    with pytest.raises(cli.CliError, match="--target"):
        _run(["capacity", "--preset", "tiny", "--target", "1.5"])
    with pytest.raises(cli.CliError, match="--trace: file not found"):
        _run(["sim", "--preset", "tiny", "--trace", "/nonexistent.csv"])
