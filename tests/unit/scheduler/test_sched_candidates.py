"""The scheduler service's candidate thresholds: DLS_SCHEDULER_THRESHOLDS within a quality budget on the
served model's calibrated quality curve (none: the highest threshold alone)."""

from __future__ import annotations

import pytest

from services.scheduler.service import ServedQuality, candidate_thresholds, load_policy, served_quality
from shared.settings import SchedulerSettings

CURVE = {"0.5": 0.712, "0.6": 0.85, "0.7": 0.994, "0.8": 0.998, "0.9": 0.998}


def settings(**overrides) -> SchedulerSettings:
    return SchedulerSettings(thresholds=[0.5, 0.6, 0.7, 0.8, 0.9], **overrides)


def curves(data: dict | None) -> ServedQuality:
    """The curves as a calibration bundle's quality.json holds them."""
    return ServedQuality(data, "calibration/quality.json" if data is not None else "m (uncalibrated)")


MEASURED = curves({"accuracy": CURVE, "problems": 500})


def test_the_budget_keeps_the_thresholds_near_the_top():
    assert candidate_thresholds(settings(), MEASURED) == (0.7, 0.8, 0.9)
    assert load_policy(settings(), MEASURED).grid.values == (0.7, 0.8, 0.9)
    assert candidate_thresholds(settings(quality_budget_pp=20.0), MEASURED) == (0.6, 0.7, 0.8, 0.9)


def test_a_negative_budget_keeps_them_all_and_no_curve_keeps_the_highest(tmp_path):
    assert candidate_thresholds(settings(quality_budget_pp=-1), MEASURED) == (0.5, 0.6, 0.7, 0.8, 0.9)
    assert candidate_thresholds(settings(), curves(None)) == (0.9,)  # quality first: no lowering unmeasured
    assert load_policy(settings(), curves(None)).grid.values == (0.9,)
    assert candidate_thresholds(settings(quality_budget_pp=-1), curves(None)) == (0.5, 0.6, 0.7, 0.8, 0.9)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    assert served_quality(settings(model_dir=str(tmp_path))).curves is None  # no calibration bundle
    assert load_policy(settings(model_dir=str(tmp_path))).grid.values == (0.9,)


def test_the_bundled_models_calibration_gives_its_candidates():
    served = served_quality(settings())
    assert served.where.endswith("models/dls-tiny/calibration/quality.json")
    assert served.profile.endswith("models/dls-tiny/calibration/profile.json")
    assert candidate_thresholds(settings(quality_curves=["accuracy"]), served) == (0.7, 0.8, 0.9)  # the short mix


def test_a_curve_without_a_candidate_is_refused_by_name():
    with pytest.raises(ValueError, match="DLS_SCHEDULER_QUALITY_BUDGET_PP.*0.5"):
        candidate_thresholds(settings(), curves({"accuracy": {"0.9": 1.0}}))


def test_every_family_curve_must_keep_within_the_budget():
    """A long family whose accuracy falls off sooner than the short mix narrows the candidates."""
    chain = {"0.5": 0.0, "0.6": 0.5, "0.7": 0.95, "0.8": 0.985, "0.9": 0.99}
    assert candidate_thresholds(settings(), curves({"accuracy": CURVE, "families": {"chain": chain},
                                                    "problems": 500})) == (0.8, 0.9)


def test_the_curves_the_deployment_serves_bound_the_candidates_alone():
    """DLS_SCHEDULER_QUALITY_CURVES names the workload's curves: the same rule as the simulator's."""
    chain = {"0.5": 0.0, "0.6": 0.5, "0.7": 0.95, "0.8": 0.985, "0.9": 0.99}
    data = curves({"accuracy": CURVE, "families": {"chain": chain}, "problems": 500})
    short = settings(quality_curves=["accuracy"])
    assert candidate_thresholds(short, data) == (0.7, 0.8, 0.9)
    assert candidate_thresholds(short.model_copy(update={"quality_curves": ["chain"]}), data) == (0.8, 0.9)
    with pytest.raises(ValueError, match="'poems'.*accuracy, chain"):
        candidate_thresholds(short.model_copy(update={"quality_curves": ["poems"]}), data)


def test_a_tight_canvas_has_a_curve_of_its_own():
    """The mix on a 16-token canvas can fall sooner than on the default one; naming it narrows the set."""
    tight = {"0.5": 0.655, "0.6": 0.865, "0.7": 0.935, "0.8": 0.995, "0.9": 1.0}
    data = curves({"accuracy": CURVE, "accuracy@16": tight, "problems": 500})
    served = settings(quality_curves=["accuracy@16"])
    assert candidate_thresholds(served, data) == (0.8, 0.9)
    assert candidate_thresholds(served.model_copy(update={"quality_curves": ["accuracy"]}), data) == (0.7, 0.8, 0.9)


def test_a_workload_names_its_curve_by_one_rule():
    from services.scheduler.core.threshold import quality_curve_key

    data = {"accuracy": CURVE, "accuracy_dual_cache": CURVE, "accuracy@16": CURVE,
            "families": {"chain": CURVE, "chain@32": CURVE}}
    assert quality_curve_key(data, family="chain", gen_len=128, block_len=32, no_cache=False) == "chain@32"
    assert quality_curve_key(data, family="chain", gen_len=128, block_len=16, no_cache=False) == "chain"
    assert quality_curve_key(data, family=None, gen_len=16, block_len=8, no_cache=True) == "accuracy@16"
    assert quality_curve_key(data, family=None, gen_len=24, block_len=8, no_cache=True) == "accuracy"
    assert quality_curve_key(data, family=None, gen_len=24, block_len=8, no_cache=False) == "accuracy_dual_cache"


def test_the_model_card_writes_the_mix_per_canvas():
    from bench.model_card import short_mix_by_canvas

    def fam(a16, a32):
        return {"16": {"accuracy": {"0.7": a16, "0.9": 1.0}}, "32": {"accuracy": {"0.7": a32, "0.9": 1.0}}}

    mix = short_mix_by_canvas({"by_canvas": {"add": fam(0.99, 0.99), "words": fam(0.88, 0.99),
                                             "chain": {"128": {"accuracy": {"0.7": 0.5}}}}})
    assert mix == {"accuracy@16": {"0.7": 0.935, "0.9": 1.0}, "accuracy@32": {"0.7": 0.99, "0.9": 1.0}}
    assert short_mix_by_canvas({"by_canvas": {"add": fam(0.99, 0.99)}}) == {}


def test_each_request_keeps_the_budget_on_its_own_canvas():
    """Candidates 0.7-0.9 on the default canvas; a request on the 16-token canvas, where 0.7 loses
    6.5 points, starts its range at 0.8; longer canvases, and a policy's own thresholds, are left as they are."""
    from services.scheduler.core.request import Request
    from services.scheduler.core.threshold import canvas_floor, canvas_floors

    tight = {"0.5": 0.655, "0.6": 0.865, "0.7": 0.935, "0.8": 0.995, "0.9": 1.0}
    roomy = {"0.5": 0.645, "0.6": 0.895, "0.7": 0.99, "0.8": 0.995, "0.9": 1.0}
    data = {"accuracy": CURVE, "accuracy@16": tight, "accuracy@32": roomy, "problems": 500}
    assert canvas_floors((0.7, 0.8, 0.9), data, 1.0) == {16: 0.8, 32: 0.7}
    floors = {16: 0.8, 32: 0.7}
    assert [canvas_floor(floors, n) for n in (8, 16, 24, 32, 128)] == [0.8, 0.8, 0.8, 0.7, 0.7]
    assert canvas_floor({}, 16) == 0.0

    policy = load_policy(settings(), curves(data))
    assert policy.grid.values == (0.7, 0.8, 0.9)

    def first(gen_len, floor=0.0):
        lo, hi = policy.grid.request_range(Request("r", 0.0, 20, gen_len, 5.0, block_len=8, min_threshold=floor))
        return policy.grid.values[lo], policy.grid.values[hi]

    assert first(16) == (0.8, 0.9) and first(128) == (0.7, 0.9)
    assert first(128, floor=0.9) == (0.9, 0.9)  # the client's own floor still counts
    off = load_policy(settings(quality_budget_pp=-1), curves(data))
    assert off.grid.canvas_floors == {}
