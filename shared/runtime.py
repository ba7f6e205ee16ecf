"""Process-level tuning for the services' hot loops.

``freeze_startup_heap()``: after a service has imported its libraries and built its start-up state,
``gc.freeze()`` moves every object alive at that point into the collector's permanent generation.
Those objects (modules, classes, numpy, pydantic, torch in a worker: hundreds of thousands) are
then never traversed again, so a full (generation-2) collection during the step loop costs what the
request state costs instead of tens of milliseconds (measured in the scheduler process of
``bench.control_plane``: 32-84 ms per full collection before; see docs/performance.md). Objects
created later are collected as usual.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect once, then freeze what survives (idempotent; call after a service's start-up)."""
    gc.collect()
    gc.freeze()
