"""The planner's steps per request from the served model's measurement (``latency.StepTable``) instead of
counted from the canvas: the workload monitor fills each class's steps with it, and Stage 1 then plans
the GPUs the measured steps need."""

from __future__ import annotations

import pytest

from services.reconfigurator.core.example_profile import example_profile
from services.reconfigurator.core.latency import MeasuredSteps, StepTable, predicted_steps
from services.reconfigurator.core.monitor import ArrivalEvent, MonitorSettings, WorkloadMonitor
from services.reconfigurator.core.spec import ModelDemand, StepCounts, uniform_cluster
from services.reconfigurator.core.stage1 import Stage1Options, _gpus_needed, precompute_model

SHORT = MeasuredSteps(16, 8, {0.7: StepCounts(2.0, 0.4), 0.9: StepCounts(2.0, 4.0)}, kv_cache=True)
def counts(steps: StepCounts) -> tuple:
    return pytest.approx((steps.recompute, steps.cache))


LONG = MeasuredSteps(128, 32, {0.7: StepCounts(4.0, 12.0), 0.9: StepCounts(4.0, 30.0)}, kv_cache=True)


def test_the_measurement_of_the_same_block_and_nearest_canvas_answers_scaled_to_the_class():
    table = StepTable((SHORT, LONG))
    assert counts(table.steps(16, 8, 0.7, kv_cache=True)) == (2.0, 0.4)
    assert counts(table.steps(32, 8, 0.9, kv_cache=True)) == (4.0, 8.0)  # twice the canvas: twice the steps
    assert counts(table.steps(128, 32, 0.9, kv_cache=True)) == (4.0, 30.0)
    assert table.steps(100, 16, 0.7, kv_cache=True).total == pytest.approx(16.0 * 100 / 128)  # no block 16: nearest canvas


def test_thresholds_between_measured_ones_are_interpolated_and_outside_them_clamped():
    table = StepTable((SHORT,))
    assert table.steps(16, 8, 0.8, kv_cache=True).total == pytest.approx((2.4 + 6.0) / 2)
    assert counts(table.steps(16, 8, 0.5, kv_cache=True)) == (2.0, 0.4)
    assert counts(table.steps(16, 8, 0.95, kv_cache=True)) == (2.0, 4.0)


def test_without_a_cache_every_step_is_a_recompute_step():
    table = StepTable((SHORT,))
    assert counts(table.steps(16, 8, 0.9, kv_cache=False)) == (6.0, 0.0)
    uncached = StepTable((MeasuredSteps(16, 8, {0.9: StepCounts(6.0, 0.0)}, kv_cache=False),))
    assert counts(uncached.steps(16, 8, 0.9, kv_cache=True)) == (2.0, 4.0)  # one recompute step per block


def test_a_table_needs_measurements():
    with pytest.raises(ValueError, match="at least one measurement"):
        StepTable(())
    with pytest.raises(ValueError):
        StepTable((MeasuredSteps(16, 8, {}),))


def test_the_monitor_plans_with_the_measured_steps_and_so_asks_for_fewer_gpus_where_answers_stop_early():
    def workload(step_table):
        settings = MonitorSettings(window_s=10.0, block_length=8, kv_cache=False, thresholds=(0.7, 0.8, 0.9),
                                   step_table=step_table)
        now = [0.0]
        monitor = WorkloadMonitor(lambda: now[0], settings)
        for i in range(200):
            now[0] = i * 0.05
            monitor.observe(ArrivalEvent(now[0], 60, 16))
        now[0] = 10.0
        return monitor.snapshot()

    counted, measured = workload(None), workload(StepTable((SHORT,)))
    (c_class,), (m_class,) = counted.classes, measured.classes
    assert c_class.steps_by_threshold == {}
    assert predicted_steps(counted, c_class, 0.7).total == 6.0  # two blocks, three steps each, from the canvas
    assert counts(predicted_steps(measured, m_class, 0.7)) == (2.4, 0.0)  # measured, no cache: all recompute
    cluster = uniform_cluster(2, 8, (1, 2))
    options = Stage1Options()

    def gpus(w):
        return _gpus_needed(precompute_model(ModelDemand("m", w, example_profile()), cluster, options), 0.9)

    assert gpus(measured) < gpus(counted)
