"""The workload monitor: classes by length buckets, rates over a sliding window, injected clock."""

from __future__ import annotations

import pytest

from services.reconfigurator.core.monitor import ArrivalEvent, LengthBuckets, MonitorSettings, WorkloadMonitor


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def settings(**overrides) -> MonitorSettings:
    base = dict(
        window_s=100.0,
        min_window_s=10.0,
        peak_windows=1,  # the sliding window alone; test_peak_memory_* turn the peak memory on
        safety_buffer=0.25,
        buckets=LengthBuckets(prompt_edges=(256,), output_edges=(128,)),
    )
    return MonitorSettings(**{**base, **overrides})


def test_rates_per_class_over_the_window():
    clock = FakeClock()
    monitor = WorkloadMonitor(clock, settings())
    for t in range(100):  # one short request per second, one long every 4 s
        monitor.observe(ArrivalEvent(float(t), prompt_tokens=100, output_tokens=64))
        if t % 4 == 0:
            monitor.observe(ArrivalEvent(float(t), prompt_tokens=900, output_tokens=500, slo_s=9.0))
    clock.now = 100.0
    workload = monitor.snapshot()
    name_to_class = {c.name: c for c in workload.classes}  # class name -> class
    assert set(name_to_class) == {"p0-256,o0-128", "p>256,o>128"}
    short, long_ = name_to_class["p0-256,o0-128"], name_to_class["p>256,o>128"]
    assert short.rate == pytest.approx(1.0)
    assert long_.rate == pytest.approx(0.25)
    assert (long_.prompt_tokens, long_.output_tokens, long_.slo_s) == (900, 500, 9.0)
    assert short.slo_s is None
    assert workload.planned_rate(short) == pytest.approx(1.25)  # safety buffer applied by Stage 1


def test_old_arrivals_leave_the_window():
    clock = FakeClock()
    monitor = WorkloadMonitor(clock, settings())
    for t in range(50):
        monitor.observe(ArrivalEvent(float(t), 100, 64))
    clock.now = 200.0
    assert monitor.snapshot().classes == ()
    monitor.observe(ArrivalEvent(199.0, 100, 64))
    assert monitor.snapshot().classes[0].rate == pytest.approx(1 / 100)


def test_warm_up_uses_time_observed_but_at_least_min_window():
    clock = FakeClock(now=1000.0)
    monitor = WorkloadMonitor(clock, settings())
    clock.now = 1002.0
    for _ in range(4):
        monitor.observe(ArrivalEvent(1001.0, 100, 64))
    assert monitor.snapshot().classes[0].rate == pytest.approx(4 / 10.0)
    clock.now = 1040.0
    assert monitor.snapshot().classes[0].rate == pytest.approx(4 / 40.0)


def test_late_event_is_placed_by_its_time():
    clock = FakeClock()
    monitor = WorkloadMonitor(clock, settings())
    monitor.observe(ArrivalEvent(50.0, 100, 64))
    monitor.observe(ArrivalEvent(10.0, 100, 64))
    clock.now = 105.0  # the window starts at 5 s: both count
    assert monitor.snapshot().classes[0].rate == pytest.approx(2 / 100)
    clock.now = 120.0  # the window starts at 20 s: the late one has left
    assert monitor.snapshot().classes[0].rate == pytest.approx(1 / 100)


def test_bucket_names_cover_every_range():
    buckets = LengthBuckets(prompt_edges=(256, 1024), output_edges=(128,))
    assert buckets.name_of(buckets.bucket_of(256, 129)) == "p0-256,o>128"
    assert buckets.name_of(buckets.bucket_of(257, 1)) == "p257-1024,o0-128"
    assert buckets.name_of(buckets.bucket_of(5000, 1)) == "p>1024,o0-128"


def test_high_rates_are_binned_not_stored_per_event():
    clock = FakeClock()
    monitor = WorkloadMonitor(clock, settings(window_s=100.0, bin_s=1.0))
    for i in range(200_000):  # 1,000 requests per second for 200 s
        monitor.observe(ArrivalEvent(i / 1000.0, 100, 64))
    clock.now = 200.0
    assert monitor.snapshot().classes[0].rate == pytest.approx(1000.0, rel=0.011)
    assert len(monitor._bins) <= 101


def test_peak_memory_keeps_the_last_bursts_rate_through_a_quiet_spell():
    """A burst of 300 arrivals in 10 s, then silence: the planned rate stays at the burst's window rate
    (3 req/s over a 100-s window) for ``peak_windows`` windows, then drops to nothing."""
    clock = FakeClock()
    monitor = WorkloadMonitor(clock, settings(peak_windows=3))
    for i in range(300):
        monitor.observe(ArrivalEvent(90.0 + i / 30.0, 100, 64))
    for now, expected in ((100.0, 3.0), (150.0, 3.0), (250.0, 3.0), (350.0, 3.0)):
        clock.now = now
        assert monitor.snapshot().classes[0].rate == pytest.approx(expected), now
    clock.now = 401.0  # the burst's bins ended 301 s ago: older than three windows
    assert monitor.snapshot().classes == ()


def test_peak_memory_takes_the_highest_window_per_class():
    clock = FakeClock()
    monitor = WorkloadMonitor(clock, settings(peak_windows=2))
    for t in range(100):  # window (0, 100]: 1 short/s; window (100, 200]: 2 short/s and 1 long/s
        monitor.observe(ArrivalEvent(float(t), 100, 64))
    for t in range(100, 200):
        monitor.observe(ArrivalEvent(float(t), 100, 64))
        monitor.observe(ArrivalEvent(t + 0.5, 100, 64))
        monitor.observe(ArrivalEvent(float(t), 900, 500))
    clock.now = 300.0  # the newest window (200, 300] is empty
    rates = {c.name: c.rate for c in monitor.snapshot().classes}
    assert rates == {"p0-256,o0-128": pytest.approx(2.0), "p>256,o>128": pytest.approx(1.0)}
    clock.now = 350.0  # (0, 100] and half of (100, 200] are out: the windows are (150, 250], (250, 350]
    rates = {c.name: c.rate for c in monitor.snapshot().classes}
    assert rates == {"p0-256,o0-128": pytest.approx(1.0), "p>256,o>128": pytest.approx(0.5)}
