"""The benchmark guard: measure the headline figures and fail when one falls below its floor.

    python -m bench.guard [--json PATH] [--only NAME,...] [--figures FILE] [--out-dir DIR]

Runs the project's own benchmark commands at reduced sizes (``bench/floors.toml`` says which, and
holds every floor beside the figure it guards), reduces their JSON to the guarded figures, and
prints one JSON report: each figure, its floor (or ceiling) and target, and whether it holds. Exits
1 when any figure fails, 2 when a command fails. ``make bench-guard`` runs it; so does `.ci/run`.

``--figures FILE`` checks figures measured earlier (this command's ``--json`` output, or a plain
``{name: value}`` object) without running anything: how a weakened figure is shown to fail.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bench.common import emit_json
from sim.results_doc import gaps

REPO_ROOT = Path(__file__).resolve().parents[1]
FLOORS_FILE = REPO_ROOT / "bench" / "floors.toml"
TOP_POINT = "2.0x"  # the paper-bench presets' high-load point
CODE_TRACE = "tests/data/AzureLLMInferenceTrace_code_first10min.csv"
CONV_TRACE = "tests/data/AzureLLMInferenceTrace_conv_first10min.csv"
MEASURED_PROFILE = "profiles/llada-8b-h200-measured.json"  # the headline again on hardware that was measured


class GuardError(RuntimeError):
    """A command that failed, or a floors file or figures file that cannot be used."""


@dataclass(frozen=True)
class Run:
    """One benchmark command and the figures its JSON gives."""

    name: str
    args: tuple[str, ...]  # after the Python interpreter
    figures: Callable[[dict], dict[str, float]]
    lane: int  # runs of one lane go one after another; the two lanes at once (two cores)

    @property
    def command(self) -> str:
        """As a user types it."""
        if self.args[0] == "-c":
            return "dls " + " ".join(self.args[2:])
        return "python " + " ".join(self.args)


def _compare(preset: str, *extra: str) -> tuple[str, ...]:
    return ("-c", "from services.cli import main; raise SystemExit(main())", "compare", "--preset", preset,
            "--quick", "--no-fidelity", *extra)


def _bench_figures(prefix: str) -> Callable[[dict], dict[str, float]]:
    def figures(result: dict) -> dict[str, float]:
        by_point = gaps(result)
        lead, loss = by_point[TOP_POINT]
        return {f"{prefix}_lead_pp": lead, f"{prefix}_accuracy_loss_pp": loss,
                f"_{prefix}_max_loss_pp": max(v[1] for v in by_point.values())}
    return figures


def _cache_figures(result: dict) -> dict[str, float]:
    """ablation-cache at 2x: the lead, and its accuracy loss apart from the cross-run figure (a known
    gap: bench/floors.toml says why)."""
    lead, loss = gaps(result)[TOP_POINT]
    return {"ablation_cache_lead_pp": lead, "ablation_cache_accuracy_loss_pp": loss}


def _trace_figures(prefix: str, top: bool) -> Callable[[dict], dict[str, float]]:
    def figures(result: dict) -> dict[str, float]:
        by_point = gaps(result)
        out = {f"{prefix}_worst_gap_pp": min(v[0] for v in by_point.values()),
               f"_{prefix}_max_loss_pp": max(v[1] for v in by_point.values())}
        if top:
            out[f"{prefix}_top_lead_pp"] = by_point[list(by_point)[-1]][0]
        return out
    return figures


def _predictor_figures(result: dict) -> dict[str, float]:
    overall, chain = result["relative_error"], result["by_family"]["chain"]
    return {
        "predictor_error_ratio": overall["progress_confidence"] / overall["one_shot"],
        "predictor_long_error_ratio": chain["progress_confidence"] / chain["one_shot"],
        "predictor_confidence_ratio": overall["progress_confidence"] / overall["progress"],
        "predictor_total_ratio": result["total_ratio"]["progress_confidence"],
    }


def runs(out_dir: Path) -> list[Run]:
    """The runs in two lanes of about equal length (the replay traces ship with the model, so none
    is recorded; both Azure runs use one trace, and share a lane)."""
    return [
        Run("paper-bench-long", _compare("paper-bench-long", "--policies", "dilaserve,infaas,llumnix"),
            _bench_figures("paper_bench_long"), lane=0),
        Run("paper-bench-long-h200", _compare("paper-bench-long", "--policies", "dilaserve,infaas,llumnix",
                                              "--profile", MEASURED_PROFILE),
            _bench_figures("paper_bench_long_h200"), lane=0),
        Run("azure-code", _compare("paper-trace", "--trace", CODE_TRACE), _trace_figures("azure_code", top=False),
            lane=1),
        Run("azure-conv", _compare("paper-trace", "--trace", CONV_TRACE), _trace_figures("azure_conv", top=True),
            lane=1),
        Run("ablation-cache", _compare("ablation-cache", "--policies", "dilaserve,infaas,llumnix"), _cache_figures,
            lane=1),
        Run("predictor", ("-m", "bench.predictor", "--quick", "--repeats", "5",
                          "--traces-dir", str(out_dir / "predictor-traces")), _predictor_figures, lane=1),
        Run("paper-bench", _compare("paper-bench", "--policies", "dilaserve,infaas,llumnix"),
            _bench_figures("paper_bench"), lane=0),
    ]


def measure_all(todo: list[Run], out_dir: Path) -> dict[str, float]:
    """Every run, lane by lane in parallel; the first failure is raised once all have ended."""
    def lane(runs_: list[Run]) -> dict[str, float]:
        figures: dict[str, float] = {}
        for run in runs_:
            figures.update(measure(run, out_dir))
        return figures

    lanes = sorted({r.lane for r in todo})
    with ThreadPoolExecutor(max_workers=len(lanes) or 1) as pool:
        futures = [pool.submit(lane, [r for r in todo if r.lane == n]) for n in lanes]
    measured: dict[str, float] = {}
    for future in futures:
        measured.update(future.result())
    return measured


def read_floors(path: Path = FLOORS_FILE) -> dict[str, dict]:
    try:
        floors = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise GuardError(f"{path}: {exc}") from None
    for name, entry in floors.items():
        if ("floor" in entry) == ("ceiling" in entry):
            raise GuardError(f"{path}: [{name}] needs exactly one of floor and ceiling")
    return floors


def measure(run: Run, out_dir: Path) -> dict[str, float]:
    """Run one command (its stdout, JSON, to ``out_dir/<name>.json``; progress on stderr) and reduce it."""
    path = out_dir / f"{run.name}.json"
    started = time.perf_counter()
    print(f"bench-guard: {run.name}: {run.command}", file=sys.stderr, flush=True)
    args = [sys.executable, *run.args, "--json", str(path)]
    done = subprocess.run(args, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=sys.stderr, check=False)
    if done.returncode != 0:
        raise GuardError(f"{run.name}: exit status {done.returncode} from {run.command} --json {path}")
    figures = run.figures(json.loads(path.read_text()))
    print(f"bench-guard: {run.name}: {time.perf_counter() - started:.0f} s: "
          + ", ".join(f"{k} {v:.3f}" for k, v in figures.items() if not k.startswith("_")), file=sys.stderr, flush=True)
    return figures


def combine(figures: dict[str, float]) -> dict[str, float]:
    """Add the cross-run figure (the largest accuracy loss) and drop the helpers it is made from."""
    losses = [v for k, v in figures.items() if k.endswith("_max_loss_pp")]
    out = {k: v for k, v in figures.items() if not k.startswith("_")}
    if losses and "accuracy_loss_pp" not in out:
        out["accuracy_loss_pp"] = max(losses)
    return out


def check(figures: dict[str, float], floors: dict[str, dict]) -> dict[str, dict]:
    """One verdict per guarded figure that was measured: value, bound, target, whether it holds."""
    verdicts = {}
    for name, entry in floors.items():
        if name not in figures:
            continue
        value = float(figures[name])
        if "floor" in entry:
            ok, bound = value >= entry["floor"], {"floor": entry["floor"]}
        else:
            ok, bound = value <= entry["ceiling"], {"ceiling": entry["ceiling"]}
        verdicts[name] = {"value": round(value, 4), **bound, "target": entry.get("target"), "ok": ok,
                          "size": entry.get("size")}
    return verdicts


def _load_figures(path: str) -> dict[str, float]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise GuardError(f"--figures: {path}: {exc}") from None
    figures = data.get("figures", data) if isinstance(data, dict) else None
    if not isinstance(figures, dict) or not all(isinstance(v, int | float) for v in figures.values()):
        raise GuardError(f"--figures: {path}: expected {{name: number}} or this command's JSON report")
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.guard", description=__doc__.split("\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the report here too")
    parser.add_argument("--only", default=None, help="comma-separated runs: predictor, paper-bench, "
                        "paper-bench-long, paper-bench-long-h200, azure-code, azure-conv, ablation-cache (default: all)")
    parser.add_argument("--figures", metavar="FILE", help="check these figures instead of measuring")
    parser.add_argument("--floors", default=str(FLOORS_FILE), help="the floors file")
    parser.add_argument("--out-dir", default="runs/guard", help="where each command's JSON goes")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        floors = read_floors(Path(args.floors))
        if args.figures:
            figures = combine(_load_figures(args.figures))
        else:
            out_dir = Path(args.out_dir)
            out_dir.mkdir(parents=True, exist_ok=True)
            todo = runs(out_dir)
            if args.only:
                wanted = set(args.only.split(","))
                unknown = wanted - {r.name for r in todo}
                if unknown:
                    raise GuardError(f"--only: unknown run(s) {', '.join(sorted(unknown))}")
                todo = [r for r in todo if r.name in wanted]
            figures = combine(measure_all(todo, out_dir))
    except GuardError as exc:
        print(f"bench-guard: {exc}", file=sys.stderr)
        return 2
    verdicts = check(figures, floors)
    failed = [name for name, v in verdicts.items() if not v["ok"]]
    report = {"figures": {k: round(v, 4) for k, v in figures.items()}, "verdicts": verdicts, "failed": failed,
              "unguarded": sorted(set(figures) - set(floors)), "wall_s": round(time.perf_counter() - started, 1)}
    emit_json(report, args.json)
    for name in failed:
        v = verdicts[name]
        bound = f"floor {v['floor']}" if "floor" in v else f"ceiling {v['ceiling']}"
        print(f"bench-guard: FAILED {name}: {v['value']} against its {bound} (bench/floors.toml)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
