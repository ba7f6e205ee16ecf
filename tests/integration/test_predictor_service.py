"""The predictor service against a real nats-server, with the trained predictor in models/dls-tiny/calibration/predictor:
batched predictions in query order, malformed payloads answered with an error, and the process entry point."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import nats
import pytest

from services.predictor.service import PredictorService
from shared.messages import decode, encode
from shared.messages.control import WorkloadStats
from shared.messages.predictor import PredictionQuery, PredictReply, PredictRequest
from shared.settings import PredictorSettings
from shared.subjects import Subjects

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / "models" / "dls-tiny"


def queries() -> list[PredictionQuery]:
    arriving = PredictionQuery(request_id="r-new", num_steps_done=0, gen_length=16, prompt_length=24, block_length=8)
    running = PredictionQuery(request_id="r-mid", num_steps_done=2, gen_length=16, prompt_length=30, block_length=8,
                              num_committed=5, block_committed=5, block_size=8,
                              confidence=(0.2, 0.35, 0.5, 0.5, 0.7), threshold=0.9)
    return [arriving, running]


async def ask(nc, subjects: Subjects, payload: bytes) -> PredictReply:
    return decode(PredictReply, (await nc.request(subjects.predict, payload, timeout=10.0)).data)


def test_predictions_per_query_and_errors_keep_the_service_answering(nats_server, unique_prefix):
    async def main():
        settings = PredictorSettings(nats_url=nats_server.url, subject_prefix=unique_prefix, model_dir=str(MODEL_DIR))
        nc = await nats.connect(nats_server.url)
        service = PredictorService(settings, nc)
        service.load_models()
        await service.start()
        subjects = Subjects(unique_prefix)

        reply = await ask(nc, subjects, encode(PredictRequest(queries=queries(), thresholds=[0.5, 0.9])))
        assert reply.error is None and reply.model_version
        assert [p.request_id for p in reply.predictions] == ["r-new", "r-mid"]
        assert [p.made_at_step for p in reply.predictions] == [0, 2]
        for prediction in reply.predictions:
            steps = prediction.threshold_to_steps
            assert set(steps) == {0.5, 0.9}
            assert steps[0.9].total >= steps[0.5].total >= 1.0
            assert all(s.recompute_steps >= 0 and s.cache_steps >= 0 for s in steps.values())

        garbage = await ask(nc, subjects, b"\xc1 not msgpack")
        assert garbage.error and "PredictRequest" in garbage.error and not garbage.predictions
        wrong_type = await ask(nc, subjects, encode(WorkloadStats(window_start=0.0, window_end=1.0)))
        assert wrong_type.error and not wrong_type.predictions
        no_thresholds = await ask(nc, subjects, encode(PredictRequest(queries=queries(), thresholds=[])))
        assert no_thresholds.error and "threshold" in no_thresholds.error

        one_shot = await ask(nc, subjects, encode(PredictRequest(queries=queries(), thresholds=[0.5, 0.9],
                                                                 one_shot=True)))
        assert one_shot.error is None and len(one_shot.predictions) == 2
        assert one_shot.model_version != reply.model_version  # the arrival-time model answered

        again = await ask(nc, subjects, encode(PredictRequest(queries=queries()[:1], thresholds=[0.7])))
        assert again.error is None and len(again.predictions) == 1
        assert (service.num_requests, service.num_malformed, service.num_errors) == (3, 2, 3)
        await service.drain()
        await nc.close()

    asyncio.run(main())


def test_process_answers_and_exits_cleanly_on_sigterm(nats_server, unique_prefix, tmp_path):
    env = {**os.environ, "DLS_NATS_URL": nats_server.url, "DLS_SUBJECT_PREFIX": unique_prefix,
           "DLS_PREDICTOR_MODEL_DIR": str(MODEL_DIR), "DLS_PREDICTOR_MODE": "one-shot", "OMP_NUM_THREADS": "1"}
    log = (tmp_path / "predictor.log").open("wb")
    process = subprocess.Popen([sys.executable, "-m", "services.predictor"], cwd=REPO, env=env, stdout=log,
                               stderr=subprocess.STDOUT)

    async def main():
        nc = await nats.connect(nats_server.url)
        subjects = Subjects(unique_prefix)
        request = encode(PredictRequest(queries=queries(), thresholds=[0.5, 0.9]))
        try:
            for _ in range(300):  # until the process subscribed (no responders before that)
                try:
                    return await ask(nc, subjects, request)
                except nats.errors.NoRespondersError:
                    assert process.poll() is None, (tmp_path / "predictor.log").read_text()
                    await asyncio.sleep(0.1)
            pytest.fail("the predictor process never answered")
        finally:
            await nc.close()

    try:
        reply = asyncio.run(main())
        assert reply.error is None and len(reply.predictions) == 2
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0, (tmp_path / "predictor.log").read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_service_retrains_on_served_requests_and_answers_with_the_new_version(nats_server, redis_server,
                                                                                   unique_prefix, tmp_path):
    """A live scheduler and worker serve requests; the predictor of an uncalibrated model (the bound)
    reads each finished request back from Redis, measures its error, retrains on its schedule, swaps the
    trained model in (it beats the bound) and answers with its version, which the scheduler sees."""
    from shared.state import RedisStateStore
    from shared.tasks import Split, TaskGenerator
    from tests.integration.live import LiveCluster, engine

    async def main():
        settings = PredictorSettings(
            nats_url=nats_server.url, redis_url=redis_server.url, subject_prefix=unique_prefix,
            redis_key_prefix=unique_prefix, model_dir=str(tmp_path),  # no calibration: BoundPredictor
            retrain_interval_s=0.5, retrain_min_rows=40, retrain_holdout_share=0.25, live_error_rows=500)
        nc = await nats.connect(nats_server.url)
        store = RedisStateStore.from_url(redis_server.url, unique_prefix)
        service = PredictorService(settings, nc, store)
        service.load_models()
        await service.start()
        subjects = Subjects(unique_prefix)
        before = await ask(nc, subjects, encode(PredictRequest(queries=queries(), thresholds=[0.9])))
        assert before.model_version == "uncalibrated:bound"
        cluster = LiveCluster(nats_server.url, redis_server.url, unique_prefix, policy="fixed")
        await cluster.start(num_workers=1)
        try:
            problems = TaskGenerator(seed=11).problems(36, max_shots=2, split=Split.HELD_OUT)
            outcomes = await asyncio.gather(*[cluster.submit(engine().encode(p.prompt)) for p in problems])
            assert all(o.final.usage.num_steps >= 1 for o in outcomes)
            await cluster.wait_for(lambda: any(o.swapped for o in service.retrain_outcomes), 60.0, "a swap")
            swap = next(o for o in service.retrain_outcomes if o.swapped)
            assert swap.new_error < swap.old_error and swap.num_rows >= 40

            after = await ask(nc, subjects, encode(PredictRequest(queries=queries(), thresholds=[0.9])))
            assert after.error is None and after.model_version.startswith("progress_confidence:")
            assert after.model_version == service._predictor(one_shot=False).version
            await cluster.submit(engine().encode(problems[0].prompt))  # the scheduler asks the new model
            await cluster.wait_for(lambda: cluster.scheduler.predictor_version == after.model_version, 10.0,
                                   "the scheduler to see the new version")

            steps = await store.load_steps(outcomes[0].request_id)
            assert steps and all(s.predicted_end is not None for s in steps)  # the worker stores the end
            registry = service.metrics.registry
            used = registry.get_sample_value("dls_predictor_served_requests_total", {"outcome": "used"})
            assert used is not None and used >= len(problems)
            assert registry.get_sample_value("dls_predictor_live_error") == pytest.approx(service.live.mre)
            assert registry.get_sample_value("dls_predictor_retrains_total", {"outcome": "swapped"}) >= 1
        finally:
            await cluster.close()
            await service.drain()
            await store.close()
            await nc.close()

    asyncio.run(main())
