"""The predictor service serving several models (``DLS_PREDICTOR_MODEL_DIRS``): each query answered by its
own model's predictor, a model not served refused by name, and a retraining window, live error and
retraining per model. The models: the bundled one (calibrated) and a copy of its directory without its
calibration (answered by ``BoundPredictor``); real LightGBM, the in-process state store."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import msgspec
import pytest

from services.predictor.core.model import StepModel
from services.predictor.core.predictor import BoundPredictor
from services.predictor.core.retraining import RetrainConfig
from services.predictor.core.training import TrainParams
from services.predictor.service import PredictorService, model_version, to_core_query
from shared.messages import encode
from shared.messages.predictor import PredictionQuery, PredictRequest
from shared.settings import PredictorSettings
from shared.state import InMemoryStateStore
from tests.unit.predictor.served_builders import served_run

REPO = Path(__file__).resolve().parents[3]
BUNDLED = REPO / "models" / "dls-tiny"
CALIBRATED = model_version(BUNDLED / "calibration" / "predictor",
                           StepModel.load(BUNDLED / "calibration" / "predictor"))
FAST = RetrainConfig(window_rows=10_000, min_rows=20, holdout_share=0.25,
                     params=TrainParams(num_rounds=30, min_data_in_leaf=3))


@pytest.fixture
def copy(tmp_path) -> Path:
    """The bundled model's directory under another name, with no calibration."""
    target = tmp_path / "dls-copy"
    shutil.copytree(BUNDLED, target, ignore=shutil.ignore_patterns("calibration", "replay"))
    return target


def two_models(copy: Path, **settings) -> PredictorService:
    service = PredictorService(PredictorSettings(model_dirs=f"{BUNDLED},{copy}", **settings), nc=None,
                               store=InMemoryStateStore())
    service.load_models()
    return service


def query(request_id: str, model: str) -> PredictionQuery:
    return PredictionQuery(request_id=request_id, num_steps_done=2, gen_length=16, prompt_length=30, block_length=8,
                           num_committed=5, block_committed=5, block_size=8, confidence=(0.2, 0.35, 0.5, 0.5, 0.7),
                           threshold=0.9, model=model)


def ask(service: PredictorService, queries: list[PredictionQuery], one_shot: bool = False):
    return asyncio.run(service.answer(encode(PredictRequest(queries=queries, thresholds=[0.5, 0.9],
                                                            one_shot=one_shot))))


def test_each_query_is_answered_by_its_own_models_predictor(copy):
    service = two_models(copy)
    assert list(service.models) == ["dls-tiny", "dls-copy"]
    assert service.models["dls-copy"].calibration is None and service.calibration is not None
    queries = [query("t", "dls-tiny"), query("c", "dls-copy"), query("first", "")]
    reply = ask(service, queries)
    assert reply.error is None and [p.request_id for p in reply.predictions] == ["t", "c", "first"]
    assert reply.model_versions == {"dls-tiny": CALIBRATED, "dls-copy": BoundPredictor.version}
    assert reply.model_version == f"dls-copy={BoundPredictor.version},dls-tiny={CALIBRATED}"
    tiny, bound, first = (p.threshold_to_steps for p in reply.predictions)
    [expected] = BoundPredictor().predict([to_core_query(queries[1])], [0.5, 0.9])
    assert {t: (s.recompute_steps, s.cache_steps) for t, s in bound.items()} == expected.threshold_to_steps
    assert tiny != bound and first == tiny  # "" is the first served model
    alone = ask(service, [query("c", "dls-copy")])
    assert alone.model_version == BoundPredictor.version and alone.model_versions == {"dls-copy": alone.model_version}
    one_shot = ask(service, queries, one_shot=True)
    assert one_shot.model_versions["dls-tiny"] not in (CALIBRATED, BoundPredictor.version)  # its oneshot/ model
    assert one_shot.model_versions["dls-copy"] == BoundPredictor.version
    registry = service.metrics.registry
    assert registry.get_sample_value("dls_predictor_model_queries_total", {"model": "dls-copy"}) == 3
    assert registry.get_sample_value("dls_predictor_model_info", {"model": "dls-tiny", "kind": "online",
                                                                  "version": CALIBRATED}) == 1


def test_a_model_not_served_is_refused_naming_the_served_ones(copy):
    service = two_models(copy)
    reply = ask(service, [query("t", "dls-tiny"), query("x", "llada-8b")])
    assert not reply.predictions and "'llada-8b'" in reply.error and "served: dls-tiny, dls-copy" in reply.error
    assert (service.num_errors, service.num_requests) == (1, 0)
    # one model served: it answers whatever a query names, as before several models
    single = PredictorService(PredictorSettings(model_dir=str(BUNDLED)), nc=None)
    alone = ask(single, [query("x", "llada-8b"), query("t", "")])
    assert alone.error is None and alone.model_version == CALIBRATED and len(alone.predictions) == 2


def test_twice_the_same_name_is_refused(copy, tmp_path):
    other = tmp_path / "elsewhere" / "dls-tiny"
    shutil.copytree(copy, other)
    with pytest.raises(ValueError, match="DLS_PREDICTOR_MODEL_DIRS.*'dls-tiny'"):
        PredictorService(PredictorSettings(model_dirs=f"{BUNDLED},{other}"), nc=None)


def test_each_model_learns_from_its_own_finished_requests(copy):
    """Finished requests of each model join that model's window and live error (one of a model not
    served joins none); a retrain of the copy replaces its bound, and the bundled model's predictor stays."""
    service = two_models(copy, retrain_min_rows=20)
    service.retrain_config = FAST
    engine, rows = served_run(60, thresholds=(0.5, 0.6))  # low thresholds: several positions a step
    finish_order = list(dict.fromkeys(r["request_id"] for r in rows))
    models = ["dls-copy", "dls-tiny", "other"]

    async def serve_all():
        for i, rid in enumerate(finish_order):
            record = msgspec.structs.replace(engine.record(rid), model=models[i % 3])
            await service.store.create(record)
            await service.store.append_steps(rid, engine.rid_to_steps[rid])
        return [await service.served(rid) for rid in finish_order]

    states = asyncio.run(serve_all())
    copy_rows = sum(len(s) for s, rid in zip(states[::3], finish_order[::3], strict=True))
    tiny, copied = service.models["dls-tiny"], service.models["dls-copy"]
    assert copied.window.num_added == len(finish_order[::3]) and copied.window.num_rows == copy_rows
    assert tiny.window.num_added == len(finish_order[1::3])
    assert states[2::3] == [[]] * len(finish_order[2::3])  # "other" is not served here
    assert service.live.num_rows == copied.live.num_rows + tiny.live.num_rows
    registry = service.metrics.registry
    assert registry.get_sample_value("dls_predictor_served_requests_total", {"outcome": "not_served"}) == 20
    assert registry.get_sample_value("dls_predictor_model_live_error", {"model": "dls-copy"}) == copied.live.mre
    assert registry.get_sample_value("dls_predictor_model_retrain_window_rows", {"model": "dls-copy"}) == copy_rows

    outcome = asyncio.run(service.retrain_once("dls-copy"))
    assert outcome.swapped and copied.retrain_outcomes == [outcome] and not tiny.retrain_outcomes
    assert outcome.num_rows == copy_rows and outcome.model.card["served_model"] == "dls-copy"
    reply = ask(service, [query("t", "dls-tiny"), query("c", "dls-copy")])
    assert reply.model_versions["dls-tiny"] == CALIBRATED
    assert reply.model_versions["dls-copy"].startswith("progress_confidence:")
    assert asyncio.run(service.retrain_once("dls-copy")) is None  # nothing new since
    assert registry.get_sample_value("dls_predictor_model_retrains_total",
                                     {"model": "dls-copy", "outcome": "swapped"}) == 1


def test_the_gateways_default_slo_query_names_its_model(copy):
    """The gateway's one-shot SLO estimate for a model is answered by that model's predictor."""
    from services.gateway.slo import DefaultSlo, SloEstimator
    from shared.messages.base import CacheMode
    from shared.profiles import LatencyProfile

    service = two_models(copy)
    asked = []

    async def ask_service(request: PredictRequest):
        asked.append(request)
        return await service.answer(encode(request))

    profile = LatencyProfile.load(BUNDLED / "calibration" / "profile.json")
    slos = {m: DefaultSlo(SloEstimator(profile, 5.0, 0.0), ask_service, 9999.0, lambda: 0.0, model=m)
            for m in ("dls-tiny", "dls-copy")}
    tiny, copied = (asyncio.run(slos[m].slo_ms(30, 64, 8, CacheMode.DUAL)) for m in ("dls-tiny", "dls-copy"))
    assert [r.queries[0].model for r in asked] == ["dls-tiny", "dls-copy"] and all(r.one_shot for r in asked)
    assert copied > tiny  # the copy's bound: every position a step
