"""The calibration bundle (``shared.calibration``) and every service reading the one of the model it
serves: the worker's heartbeat names its profile (or carries the step times it measured), the
scheduler plans with them, the predictor answers with its predictor (or the model-free bound), the
gateway's model card and default SLOs, the reconfigurator's profile; a bundle made for other weights,
another tokenizer or another kind of device is refused, naming what differs."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.predictor.core.predictor import BoundPredictor, PredictionQuery
from shared import calibration
from shared.calibration import CalibrationError, CalibrationMismatch
from shared.messages import codec
from shared.messages.control import MeasuredSteps, WorkerHeartbeat
from shared.profiles import LatencyProfile
from shared.settings import (
    GatewaySettings,
    PredictorSettings,
    ReconfiguratorSettings,
    SchedulerSettings,
    WorkerSettings,
)

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "models" / "dls-tiny"


@pytest.fixture
def uncalibrated(tmp_path) -> Path:
    copy = tmp_path / "uncal"
    shutil.copytree(BUNDLED, copy, ignore=shutil.ignore_patterns("calibration", "replay", "MODEL_CARD.md"))
    return copy


@pytest.fixture
def recalibrated(tmp_path) -> Path:
    """A copy with the bundled calibration copied in (it matches: same weights and tokenizer)."""
    copy = tmp_path / "recal"
    shutil.copytree(BUNDLED, copy, ignore=shutil.ignore_patterns("replay", "MODEL_CARD.md"))
    return copy


def test_the_bundled_model_ships_a_calibration_that_matches_it():
    found = calibration.find(BUNDLED, device="cpu")
    assert found is not None and found.device == "cpu"
    assert found.made_for["weights"] == calibration.weights_fingerprint(BUNDLED)
    assert LatencyProfile.load(found.profile_path).tp_degrees == (1,)
    assert (found.predictor_dir / "model.txt").exists() and json.loads(found.quality_path.read_text())["accuracy"]


def test_a_model_without_a_bundle_is_uncalibrated_and_an_incomplete_one_is_an_error(uncalibrated, tmp_path):
    assert calibration.find(uncalibrated) is None
    (uncalibrated / "calibration").mkdir()
    assert calibration.find(uncalibrated) is None  # a stopped `dls calibrate` writes no manifest
    with pytest.raises(CalibrationError, match="no manifest.json"):
        calibration.find(uncalibrated, tmp_path / "elsewhere")  # one asked for by name must be there
    manifest = json.loads((BUNDLED / "calibration" / "manifest.json").read_text())
    (uncalibrated / "calibration" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CalibrationError, match="incomplete: no profile.json, quality.json, predictor/model.txt"):
        calibration.find(uncalibrated)


def test_a_bundle_for_other_weights_a_tokenizer_or_a_device_is_refused_naming_what_differs(recalibrated):
    assert calibration.find(recalibrated, device="cpu") is not None
    with pytest.raises(CalibrationMismatch, match=r"device cpu vs cuda.*dls calibrate --model .* --device cuda"):
        calibration.find(recalibrated, device="cuda:0")
    tokenizer = recalibrated / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text().replace('"', '"', 1) + " ")
    with pytest.raises(CalibrationMismatch, match="tokenizer") as refused:
        calibration.find(recalibrated)
    assert "weights" not in str(refused.value)
    weights = recalibrated / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[:4] = bytes(4)
    weights.write_bytes(bytes(data))
    with pytest.raises(CalibrationMismatch, match="weights [0-9a-f]+ \\(made for\\) vs [0-9a-f]+ \\(served\\)"):
        calibration.find(recalibrated)


def test_a_bundle_for_another_gpu_model_is_refused(recalibrated):
    bundle = calibration.load(recalibrated / "calibration")
    gpu = calibration.Calibration(bundle.directory, {**bundle.manifest, "made_for": {
        **bundle.made_for, "device": "cuda", "device_name": "NVIDIA H200"}})
    gpu.check(recalibrated, "cuda:0", "NVIDIA H200")
    with pytest.raises(CalibrationMismatch, match="GPU 'NVIDIA H200' vs 'NVIDIA H100 80GB HBM3'"):
        gpu.check(recalibrated, "cuda:0", "NVIDIA H100 80GB HBM3")
    assert gpu.profile_refusal("cuda:1", "NVIDIA H200") is None
    assert "GPU 'NVIDIA H200' vs 'NVIDIA H100 80GB HBM3'" in gpu.profile_refusal("cuda:0", "NVIDIA H100 80GB HBM3")
    assert "device cuda vs cpu" in gpu.profile_refusal("cpu")


# --- the worker ----------------------------------------------------------------------------------


def test_the_worker_announces_its_calibrations_profile(recalibrated):
    from services.worker.engine.fake import ZeroComputeEngine
    from services.worker.service.service import WorkerService
    from services.worker.service.startup import served_calibration, served_profile

    settings = WorkerSettings(model_dir=str(recalibrated))
    found = served_calibration(settings)
    profile, online = served_profile(settings, found, engine=None)
    assert profile == str(recalibrated / "calibration" / "profile.json") and online is None
    # the zero-compute fake engine (no model): the heartbeat's profile is the worker's, not the engine's
    worker = WorkerService(settings, ZeroComputeEngine(), nc=None, store=None, instance_id="i0",
                           profile=profile, online=online)
    beat = codec.decode(WorkerHeartbeat, worker.heartbeats.encoded())
    assert beat.profile == profile and beat.measured is None


def test_the_worker_of_an_uncalibrated_model_measures_its_step_times_and_sends_them(uncalibrated):
    from services.worker.engine.engine import DLMEngine
    from services.worker.service.service import WorkerService
    from services.worker.service.startup import served_calibration, served_profile

    settings = WorkerSettings(model_dir=str(uncalibrated), max_batch=4)
    assert served_calibration(settings) is None
    engine = DLMEngine.from_pretrained(uncalibrated)
    profile, online = served_profile(settings, None, engine)
    assert profile == "" and sorted(online.ms["cache_ms"]) == [1, 2, 4]
    worker = WorkerService(settings, engine, nc=None, store=None, instance_id="i0", profile=profile, online=online)
    beat = codec.decode(WorkerHeartbeat, worker.heartbeats.encoded())
    assert beat.profile == "" and beat.measured.cache_ms.keys() == {1, 2, 4}
    before = beat.measured.cache_ms[2]
    online.observe(before * 10 / 1000, [], 2, no_cache=False)  # a served cache step of 2, ten times as long
    online.observe(1.0, [100], 1, no_cache=False)  # a mixed step: its parts cannot be told apart
    beat = codec.decode(WorkerHeartbeat, worker.heartbeats.encoded())
    assert beat.measured.served_steps == 1 and beat.measured.cache_ms[2] == pytest.approx(before * 2.8, rel=1e-3)


def test_a_worker_on_another_device_refuses_the_calibrations_profile_and_measures_its_own(recalibrated, caplog):
    from services.worker.engine.engine import DLMEngine
    from services.worker.service.startup import served_calibration, served_profile

    settings = WorkerSettings(model_dir=str(recalibrated), device="cuda", max_batch=2)
    found = served_calibration(settings)  # its quality curve and predictor follow the weights: kept
    assert found is not None
    profile, online = served_profile(settings, found, DLMEngine.from_pretrained(recalibrated))
    assert profile == "" and sorted(online.ms["recompute_ms"]) == [1, 2]
    assert "measured on another device (device cpu vs cuda): not used" in caplog.text


# --- the scheduler -------------------------------------------------------------------------------


def _beat(seq: int = 1, **fields) -> WorkerHeartbeat:
    return WorkerHeartbeat(instance_id="w0", node="local", tp=1, max_batch=4, model="uncal", ttl_s=6.0,
                           sent_at=float(seq), seq=seq, started_at=1.0, **fields)


def test_the_scheduler_plans_an_uncalibrated_instance_with_the_step_times_it_measures(uncalibrated):
    from services.scheduler.core.policies import make_policy
    from services.scheduler.service import SchedulerService
    from shared.state import InMemoryStateStore

    settings = SchedulerSettings(model_dir=str(uncalibrated))
    service = SchedulerService(settings, nc=None, js=None, store=InMemoryStateStore(), clock=lambda: 100.0)
    assert service.fallback_profile == "" and service.loop.policy.grid.values == (0.9,)
    measured = MeasuredSteps(context_tokens=80, block_length=8, recompute_ms={1: 10.0, 4: 30.0},
                             cache_ms={1: 4.0, 4: 6.0, 2: 7.0}, full_ms={1: 9.0, 4: 28.0})
    profile = service._profile(_beat(measured=measured))
    assert profile.alpha(1, 4) == pytest.approx(0.030) and profile.beta(1, 2) == pytest.approx(0.006)  # smoothed
    calibrated = SchedulerService(SchedulerSettings(), nc=None, js=None, store=InMemoryStateStore(),
                                  policy=make_policy("fixed", {}))
    named = str(BUNDLED / "calibration" / "profile.json")
    assert calibrated._profile(_beat(profile=named)).beta(1, 1) == LatencyProfile.load(named).beta(1, 1)

    asyncio.run(service._on_heartbeat(SimpleNamespace(data=codec.encode(_beat(measured=measured)))))
    assert service.view.instances["w0"].profile.beta(1, 4) == pytest.approx(0.006)
    faster = MeasuredSteps(context_tokens=80, block_length=8, recompute_ms={1: 10.0, 4: 30.0},
                           cache_ms={1: 4.0, 4: 5.0}, served_steps=3)
    asyncio.run(service._on_heartbeat(SimpleNamespace(data=codec.encode(_beat(measured=faster, seq=2)))))
    assert service.view.instances["w0"].profile.beta(1, 4) == pytest.approx(0.005)  # kept current


def test_the_scheduler_refuses_a_calibration_made_for_other_weights(recalibrated):
    from services.scheduler.service import served_quality

    (recalibrated / "config.json").write_text((recalibrated / "config.json").read_text() + "\n")
    with pytest.raises(CalibrationMismatch, match="weights"):
        served_quality(SchedulerSettings(model_dir=str(recalibrated)))


# --- the predictor -------------------------------------------------------------------------------


def test_the_predictor_answers_with_the_calibrations_predictor_or_the_bound(recalibrated, uncalibrated, tmp_path):
    from services.predictor.core.model import StepModel
    from services.predictor.service import PredictorService, model_version

    service = PredictorService(PredictorSettings(model_dir=str(recalibrated)), nc=None)
    service.load_models()
    directory = recalibrated / "calibration" / "predictor"
    assert service._predictor(False).version == model_version(directory, StepModel.load(directory))
    unserved = PredictorService(PredictorSettings(model_dir=str(uncalibrated)), nc=None)
    unserved.load_models()
    assert unserved._predictor(False).version == unserved._predictor(True).version == "uncalibrated:bound"
    (recalibrated / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(CalibrationMismatch, match="weights"):
        PredictorService(PredictorSettings(model_dir=str(recalibrated)), nc=None)


def test_the_bound_is_the_most_steps_a_request_can_take():
    bound = BoundPredictor()
    fresh = PredictionQuery.arriving("a", gen_length=32, prompt_length=10, block_length=8)
    midway = PredictionQuery.from_counts("b", 5, 32, 10, 8, num_committed=12, confidence=None)
    no_cache = PredictionQuery.arriving("c", gen_length=32, prompt_length=10, block_length=8, uses_cache=False)
    [a, b, c] = bound.predict([fresh, midway, no_cache], [0.7, 0.9])
    assert a.threshold_to_steps[0.7] == a.threshold_to_steps[0.9] == (4.0, 28.0)  # 4 block starts, 32 tokens
    assert b.threshold_to_steps[0.9] == (2.0, 18.0) and b.made_at_step == 5  # block 1 open: 2 starts left
    assert c.threshold_to_steps[0.9] == (32.0, 0.0)


# --- the gateway and the reconfigurator ----------------------------------------------------------


def test_the_gateway_says_whether_the_model_is_calibrated_and_times_default_slos_with_it(recalibrated, uncalibrated):
    from services.gateway.answers import model_card
    from services.gateway.app import slo_estimator
    from services.gateway.models import ModelLoadError, load_served_model
    from services.gateway.schemas import ModelState

    served = load_served_model(recalibrated)
    card = model_card(served, ModelState.SERVING).calibration
    assert card.calibrated and card.device == "cpu" and card.quality_source == "labelled"
    assert slo_estimator(GatewaySettings(model_dir=str(recalibrated)), served) is not None
    bare = load_served_model(uncalibrated)
    card = model_card(bare, ModelState.SERVING).calibration
    assert not card.calibrated and card.how_to == f"dls calibrate --model {uncalibrated} (README: Serving your own checkpoint)"
    assert slo_estimator(GatewaySettings(model_dir=str(uncalibrated)), bare) is None  # DLS_GATEWAY_DEFAULT_SLO_MS
    (recalibrated / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(ModelLoadError, match="made for another model"):
        load_served_model(recalibrated)


def test_the_reconfigurator_plans_with_the_calibrations_profile_and_not_without_one(recalibrated, uncalibrated):
    from services.reconfigurator.service import planning_profile

    assert planning_profile(ReconfiguratorSettings(model_dir=str(recalibrated))) == \
        str(recalibrated / "calibration" / "profile.json")
    assert planning_profile(ReconfiguratorSettings(model_dir=str(uncalibrated))) is None
    assert planning_profile(ReconfiguratorSettings(model_dir=str(uncalibrated), profile="p.json")) == "p.json"


def test_dls_model_dir_tells_every_service_and_its_own_setting_wins(monkeypatch):
    monkeypatch.setenv("DLS_MODEL_DIR", "/m")
    monkeypatch.setenv("DLS_WORKER_MODEL_DIR", "/w")
    assert [cls().model_dir for cls in (GatewaySettings, SchedulerSettings, PredictorSettings,
                                        ReconfiguratorSettings)] == ["/m"] * 4
    assert WorkerSettings().model_dir == "/w"
