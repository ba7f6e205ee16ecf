"""Open-loop load for the soak: Poisson arrivals at a fixed rate, whatever the cluster is going through
(arrivals do not wait for answers, as real clients do not), each a streamed completion followed to its
end by ``tests.chaos.client.run_request`` (a broken stream is read back by id; a refused connection
goes to the next gateway). A 429 or 503 is not sent again: it counts as refused, with its Retry-After.
``measure_capacity`` finds the rate to load at: requests completed per second by a closed loop that
keeps the cluster busy."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

from tests.chaos.client import Tracked, run_request

REQUEST_DEADLINE_S = 600.0  # an accepted request not answered within this is lost


class OpenLoopLoad:
    """Sends requests to ``urls`` at ``rate_per_s`` (Poisson) for a while; keeps every ``Tracked``."""

    def __init__(self, urls: list[str], rate_per_s: float, rng: random.Random) -> None:
        if rate_per_s <= 0:
            raise ValueError(f"the load's rate must be positive, got {rate_per_s}")
        self.urls = urls
        self.rate_per_s = rate_per_s
        self.rng = rng
        self.tracked: list[Tracked] = []
        self.tasks: list[asyncio.Task] = []
        self.last_completion_at = 0.0  # time.monotonic() of the latest completion
        self.sending = False  # between run's start and its end

    async def run(self, duration_s: float, keep_going: Callable[[], bool] | None = None,
                  max_extra_s: float = 0.0, start: float | None = None) -> None:
        """Send for ``duration_s`` seconds from ``start`` (``time.monotonic()``; default: now), and after that
        while ``keep_going()`` (a fault still to be seen recovering: only a request completing shows it), at
        most ``max_extra_s`` more; then return (the requests go on: ``finish``)."""
        start = time.monotonic() if start is None else start
        next_at = start
        self.sending = True
        try:
            while True:
                next_at += self.rng.expovariate(self.rate_per_s)
                elapsed = next_at - start
                if elapsed >= duration_s and (keep_going is None or not keep_going()
                                              or elapsed >= duration_s + max_extra_s):
                    return
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                self._send()
        finally:
            self.sending = False

    @property
    def in_flight(self) -> bool:
        """A request sent is not answered yet (its completion may still show a recovery)."""
        return any(not t.done() for t in self.tasks)

    @property
    def idle(self) -> bool:
        """Done sending and every request answered: no completion is left to show a recovery."""
        return not self.sending and not self.in_flight

    def _send(self) -> None:
        # a request the gateway refuses is not sent again; the urls rotate from a random one, as a load
        # balancer would spread clients
        tracked = Tracked(index=len(self.tracked), retry_429=False, retry_503=False)
        self.tracked.append(tracked)
        start = self.rng.randrange(len(self.urls))
        urls = self.urls[start:] + self.urls[:start]
        self.tasks.append(asyncio.create_task(self._follow(urls, tracked)))

    async def _follow(self, urls: list[str], tracked: Tracked) -> None:
        await run_request(urls, tracked, time.monotonic() + REQUEST_DEADLINE_S)
        if tracked.outcome == "completed":
            self.last_completion_at = time.monotonic()

    async def finish(self) -> None:
        """Until every request sent is terminal (or past its deadline)."""
        await asyncio.gather(*self.tasks)


async def measure_capacity(urls: list[str], seconds: float, concurrency: int, warmup_s: float = 10.0) -> float:
    """Completed requests per second with ``concurrency`` requests always in flight (a 429 is sent again),
    counted after ``warmup_s``."""
    stop_at = time.monotonic() + warmup_s + seconds
    counted_from = time.monotonic() + warmup_s
    completed: list[float] = []

    async def client(i: int) -> None:
        n = 0
        while time.monotonic() < stop_at:
            tracked = Tracked(index=i * 1000 + n)
            n += 1
            await run_request(urls, tracked, stop_at + 120.0)
            if tracked.outcome == "completed" and counted_from <= time.monotonic() <= stop_at:
                completed.append(time.monotonic())

    await asyncio.gather(*(client(i) for i in range(concurrency)))
    return len(completed) / seconds
