"""What `dls calibrate` prints while it works: every stage says what it does, n of N and the time taken.

Progress lines go to stderr (at most one every ``every_s`` per task, and always the last); what a stage
wrote, skipped or redid goes to stdout. The clock is injected (tests pass their own).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


class Progress:
    def __init__(self, out: TextIO | None = None, err: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic, every_s: float = 2.0) -> None:
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.clock = clock
        self.every_s = every_s
        self.started = clock()
        self._last: dict[str, float] = {}  # task -> when it last printed

    def elapsed(self) -> float:
        return self.clock() - self.started

    def say(self, message: str) -> None:
        """A result line (stdout)."""
        print(message, file=self.out, flush=True)

    def note(self, message: str) -> None:
        """A progress line (stderr), stamped with the time since the start."""
        print(f"[{self.elapsed():7.1f}s] {message}", file=self.err, flush=True)

    def count(self, task: str, done: int, total: int, unit: str = "", since: float | None = None) -> None:
        """``task: done/total unit`` (and the time the task has taken), rate-limited per task."""
        now = self.clock()
        if done < total and now - self._last.get(task, -1e9) < self.every_s:
            return
        self._last[task] = now
        took = f", {now - since:.1f} s" if since is not None else ""
        self.note(f"{task}: {done}/{total}{' ' + unit if unit else ''}{took}")
