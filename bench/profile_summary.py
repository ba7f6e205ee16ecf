"""Summarise a py-spy ``--format raw`` profile (collapsed stacks): top functions per process.

    py-spy record --subprocesses --format raw -r 200 -o runs/cp.collapsed -- \\
        python -m bench.control_plane --duration 8
    python -m bench.profile_summary runs/cp.collapsed --top 25

For each process (the innermost ``process PID:"cmd"`` frame), prints the share of its busy samples
(py-spy leaves idle samples out) spent in each function including callees ("inclusive") and in the
function itself ("self"). Functions are named ``name (file)``: line numbers are dropped so that all
lines of one function add up.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter, defaultdict

_LINE = re.compile(r":\d+\)$")


def _function(frame: str) -> str:
    return _LINE.sub(")", frame.strip())


def summarise(path: str) -> dict[str, dict]:
    """process command -> {"samples": n, "inclusive": Counter, "self": Counter}."""
    out: dict[str, dict] = defaultdict(lambda: {"samples": 0, "inclusive": Counter(), "self": Counter()})
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            stack, _, count = line.rpartition(" ")
            try:
                n = int(count)
            except ValueError:
                continue
            frames = stack.split(";")
            proc_at = max((i for i, fr in enumerate(frames) if fr.startswith("process ")), default=-1)
            process = frames[proc_at].split(":", 1)[-1].strip('"') if proc_at >= 0 else "?"
            if "--workers-only" in process:
                process = "workers"
            elif "bench.control_plane" in process:
                process = "scheduler + driver"
            calls = [_function(fr) for fr in frames[proc_at + 1:]]
            entry = out[process]
            entry["samples"] += n
            for fn in set(calls):
                entry["inclusive"][fn] += n
            if calls:
                entry["self"][calls[-1]] += n
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--match", default="", help="only functions whose name contains this (e.g. services/)")
    args = p.parse_args(argv)
    for process, entry in sorted(summarise(args.path).items(), key=lambda kv: -kv[1]["samples"]):
        total = entry["samples"]
        print(f"== {process}: {total} busy samples")
        for kind in ("inclusive", "self"):
            print(f"  -- {kind}")
            rows = [(fn, n) for fn, n in entry[kind].most_common() if args.match in fn][: args.top]
            for fn, n in rows:
                print(f"  {100.0 * n / total:5.1f}%  {fn}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
