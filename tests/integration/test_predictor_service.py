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
