"""The worker process from its start to its end (``python -m services.worker``, settings from
``DLS_WORKER_*``): the device checked, the served model's calibration read, the engine built (its KV
budget set, warmed up), the profile it announces chosen, then the ``WorkerService`` wired to NATS and
Redis until it stops.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable

from services.worker.engine.protocol import Engine
from services.worker.service.online_profile import OnlineProfile
from services.worker.service.service import WorkerService
from shared.calibration import Calibration, of_service, uncalibrated_message
from shared.devices import VISIBLE_DEVICES, DeviceError, cuda_problem, is_cuda
from shared.runtime import connect_nats, on_stop_signals
from shared.settings import WorkerSettings
from shared.telemetry import setup_tracing, shutdown_tracing

logger = logging.getLogger("dls.worker")


def make_engine(settings: WorkerSettings) -> Engine:
    """The instance's engine: a plain ``DLMEngine`` at TP 1, a ``TensorParallelEngine`` above; the model's
    tokenizer code runs only with ``DLS_TRUST_REMOTE_CODE`` (as in the gateway)."""
    from services.worker.parallel.build import make_engine as make_any_engine

    return make_any_engine(settings.model_dir, settings.tp, settings.device,
                           trust_remote_code=settings.trust_remote_code)


def kv_budget_bytes(settings: WorkerSettings) -> int:
    """The KV pool's byte budget per GPU: ``kv_budget_bytes``, else on CUDA ``kv_memory_fraction`` of the
    memory free now (the model loaded), else 0 (no cap)."""
    if settings.kv_budget_bytes:
        return settings.kv_budget_bytes
    import torch

    device = torch.device(settings.device)
    if device.type != "cuda":
        return 0
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * settings.kv_memory_fraction)


def check_device(settings: WorkerSettings) -> None:
    """``DeviceError`` naming the setting when the instance's GPUs are not there (before loading anything)."""
    problem = cuda_problem(settings.device, settings.tp)
    if problem:
        raise DeviceError(f"DLS_WORKER_DEVICE={settings.device} (TP {settings.tp}): {problem}")


def served_calibration(settings: WorkerSettings) -> Calibration | None:
    """The calibration of the served model (``CalibrationMismatch`` naming what differs when it was made
    for other weights), or None: uncalibrated (said)."""
    calibration = of_service(settings)
    if calibration is None:
        logger.warning(uncalibrated_message(settings.model_dir))
    else:
        logger.info("calibration %s", calibration.label)
    return calibration


def served_profile(settings: WorkerSettings, calibration: Calibration | None,
                   engine: Engine) -> tuple[str, OnlineProfile | None]:
    """(the calibration's profile, None) or, for a worker that names no profile of its own and serves an
    uncalibrated model (or one whose profile was measured on another kind of device or GPU: refused,
    said), ("", the step times measured now, kept current as it serves)."""
    if settings.pace_profile or settings.profile:
        return "", None
    if calibration is not None:
        from services.worker.profiling import device_name

        refusal = calibration.profile_refusal(settings.device, device_name(settings.device))
        if refusal is None:
            return str(calibration.profile_path), None
        logger.warning("%s; this worker measures its step times instead", refusal)
    return "", OnlineProfile.measured(engine, settings.max_batch)


async def warm_up(engine: Engine) -> None:
    """The engine's first forwards (and whatever it prepares then), in a thread, before the worker
    heartbeats READY: the first request served must not pay for them."""
    started = time.perf_counter()
    await asyncio.to_thread(engine.warm_up)
    logger.info("engine warmed up in %.2f s", time.perf_counter() - started)


def worker_clock(offset_s: float) -> Callable[[], float]:
    """``time.time``, or (tests only: ``DLS_TEST_CLOCK_OFFSET_S``) a clock ``offset_s`` off it, as on a host
    whose clock is wrong; leases never depend on it (``shared.leases``)."""
    if not offset_s:
        return time.time
    logger.warning("worker clock offset by %+.1f s (DLS_TEST_CLOCK_OFFSET_S)", offset_s)
    return functools.partial(_offset_time, offset_s)


def _offset_time(offset_s: float) -> float:
    return time.time() + offset_s


async def serve(settings: WorkerSettings) -> None:
    """One model instance, until it has drained (SIGTERM) or stopped."""
    from services.worker.parallel.placement import rank_gpus
    from shared.state import RedisStateStore

    check_device(settings)
    calibration = served_calibration(settings)  # refused before the model loads when made for another
    setup_tracing("dls-worker", settings)
    engine = await asyncio.to_thread(make_engine, settings)
    logger.info("engine on %s: GPUs %s of the machine (%s=%s)", settings.device,
                rank_gpus(settings.device, settings.tp) if is_cuda(settings.device) else "none", VISIBLE_DEVICES,
                os.environ.get(VISIBLE_DEVICES, "unset"))
    budget = kv_budget_bytes(settings)
    if budget:
        engine.set_kv_budget(budget)
        logger.info("KV cache budget: %d bytes per GPU", budget)
    await warm_up(engine)
    profile, online = await asyncio.to_thread(served_profile, settings, calibration, engine)
    nc = await connect_nats(settings, "dls-worker")
    store = RedisStateStore.from_url(settings.redis_url, settings.redis_key_prefix)
    service = WorkerService(settings, engine, nc, store, clock=worker_clock(settings.clock_offset_s),
                            beat_connect=functools.partial(connect_nats, settings, "dls-worker-heartbeat"),
                            profile=profile, online=online)
    on_stop_signals(service.drain)
    await service.start()
    try:
        await service.wait_stopped()
    finally:
        await nc.drain()
        await store.close()
        engine.close()
        overruns = (f", {service.pace_overruns} over their paced time (by {service.pace_overrun_s:.1f} s in all, "
                    f"{service.paced_s:.1f} s paced)") if service.pace is not None else ""
        logger.info("worker %s stopped after %d steps%s", service.instance_id, service.num_steps, overruns)
        shutdown_tracing()
