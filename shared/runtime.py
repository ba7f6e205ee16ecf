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
import weakref


def freeze_startup_heap() -> None:
    """Collect once, then freeze what survives (idempotent; call after a service's start-up)."""
    gc.collect()
    gc.freeze()


# the NATS connections connect_nats made in this process, for readiness probes (shared.metrics)
_NATS_CONNECTIONS: weakref.WeakSet = weakref.WeakSet()


async def connect_nats(settings, name: str):
    """A NATS connection for a service: every URL of ``settings.nats_url``, reconnecting forever."""
    import nats

    nc = await nats.connect(settings.nats_url.split(","), max_reconnect_attempts=-1, name=name)
    _NATS_CONNECTIONS.add(nc)
    return nc


def nats_connected() -> bool:
    """Is every NATS connection ``connect_nats`` made in this process connected, and is there one?"""
    connections = list(_NATS_CONNECTIONS)
    return bool(connections) and all(nc.is_connected for nc in connections if not nc.is_closed)


def on_stop_signals(callback=None):
    """Call ``callback`` on SIGTERM and SIGINT (default: set the returned event); returns the event
    a service's ``serve`` waits on."""
    import asyncio
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, callback or stop.set)
    return stop


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for local servers and tests)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ports_free(base: int, size: int) -> bool:
    """Are the ``size`` ports from ``base`` free on 127.0.0.1 right now?"""
    import socket

    for port in range(base, base + size):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def free_port_range(size: int, avoid=frozenset()) -> int:
    """A base port with ``size`` ports from it free on 127.0.0.1 right now, none of them in ``avoid``
    (for a stack whose services listen on consecutive ports)."""
    for _ in range(200):
        base = free_port()
        if base + size > 65000 or set(avoid) & set(range(base, base + size)):
            continue
        if ports_free(base, size):
            return base
    raise RuntimeError(f"no {size} free ports in a row")


EVENT_LOOP_ENV = "DLS_EVENT_LOOP"


def event_loop_name() -> str:
    """The event loop the services run on: ``uvloop`` when it is installed (the default), else
    ``asyncio``; ``DLS_EVENT_LOOP=asyncio`` forces the standard loop, ``=uvloop`` requires uvloop."""
    import os

    wanted = os.environ.get(EVENT_LOOP_ENV, "").strip().lower()
    if wanted not in ("", "uvloop", "asyncio"):
        raise ValueError(f"{EVENT_LOOP_ENV} must be 'uvloop' or 'asyncio', not {wanted!r}")
    if wanted == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if wanted == "uvloop":
            raise ValueError(f"{EVENT_LOOP_ENV}=uvloop but uvloop is not installed (pip install uvloop)") from None
        return "asyncio"
    return "uvloop"


def run(main):
    """Run a service's top-level coroutine to completion on the loop ``event_loop_name()`` picks.

    uvloop (libuv) runs the NATS and Redis clients' socket work and task switches in C: in
    ``bench.control_plane`` it cut both the bare NATS round trip and the step loop's overhead
    (docs/performance.md)."""
    import asyncio

    if event_loop_name() == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
