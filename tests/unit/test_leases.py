"""shared.leases: leases counted from arrival, whatever the worker's clock says; late heartbeats ignored."""

from __future__ import annotations

import pytest

from services.gateway.workers import WorkerRegistry
from shared.leases import LeaseTable, Observed, is_newer, step_stuck
from shared.messages.control import WorkerHeartbeat, WorkerStatus

TTL_S = 3.0
INTERVAL_S = 1.0


def beat(seq: int, sent_at: float, status: WorkerStatus = WorkerStatus.READY, started_at: float = 0.0,
         instance_id: str = "w1", step_running_s: float = 0.0) -> WorkerHeartbeat:
    return WorkerHeartbeat(instance_id=instance_id, node="n", tp=1, max_batch=4, model="m", status=status,
                           ttl_s=TTL_S, sent_at=sent_at, started_at=started_at, seq=seq,
                           step_running_s=step_running_s)


@pytest.mark.parametrize("offset_s", [-60.0, 60.0, 0.0])
def test_a_skewed_worker_is_kept_while_it_beats_and_dropped_once_it_stops(offset_s):
    """The worker's clock is ``offset_s`` off the receiver's: nothing about its lease changes."""
    table = LeaseTable()
    started = 1000.0 + offset_s
    now = 1000.0
    seq = 0
    while now < 1030.0:  # 30 s of heartbeats every second, each arriving 0.2 s after it was sent
        seq += 1
        observed = table.observe(beat(seq, now + offset_s, started_at=started), now + 0.2)
        assert observed is (Observed.JOINED if seq == 1 else Observed.RENEWED)
        for dt in (0.3, 0.6, 0.9):  # checked between beats: never dropped while alive
            assert [hb.instance_id for hb in table.live(now + dt)] == ["w1"]
        now += INTERVAL_S
    last_arrival = now - INTERVAL_S + 0.2
    assert table.expire(last_arrival + TTL_S - 0.01) == []
    assert [lease.instance_id for lease in table.expire(last_arrival + TTL_S)] == ["w1"]
    assert table.live(last_arrival + TTL_S) == [] and "w1" not in table


@pytest.mark.parametrize("offset_s", [-60.0, 60.0])
def test_every_reader_of_heartbeats_counts_from_arrival(offset_s):
    """The gateway's registry is the same table (the scheduler and reconfigurator hold a LeaseTable)."""
    registry = WorkerRegistry()
    registry.observe(beat(1, 500.0 + offset_s), now=500.0)
    assert [hb.instance_id for hb in registry.ready(500.0 + TTL_S - 0.01)] == ["w1"]
    assert registry.ready(500.0 + TTL_S) == []


def test_late_heartbeats_are_ignored():
    table = LeaseTable()
    assert table.observe(beat(1, 10.0), now=0.0) is Observed.JOINED
    assert table.observe(beat(3, 12.0, WorkerStatus.DRAINING), now=2.0) is Observed.RENEWED
    # seq 2 overtaken by seq 3: it neither brings READY back nor extends the lease
    assert table.observe(beat(2, 11.0), now=4.0) is Observed.IGNORED
    assert table.get("w1").heartbeat.status == WorkerStatus.DRAINING
    assert table.get("w1").expires_at == 2.0 + TTL_S
    assert table.observe(beat(3, 12.0, WorkerStatus.DRAINING), now=4.0) is Observed.IGNORED  # a duplicate


def test_a_clock_that_jumps_back_does_not_stop_the_lease():
    """Order within a process is by seq, so a sender's clock stepped back (NTP) changes nothing."""
    table = LeaseTable()
    table.observe(beat(1, 100.0), now=0.0)
    assert table.observe(beat(2, 40.0), now=1.0) is Observed.RENEWED
    assert table.live(1.0 + TTL_S - 0.01)


def test_a_restart_replaces_the_lease_and_the_old_process_is_ignored_after():
    table = LeaseTable()
    table.observe(beat(7, 50.0, started_at=10.0), now=0.0)
    assert table.observe(beat(1, 60.0, started_at=58.0), now=1.0) is Observed.RESTARTED
    assert table.observe(beat(8, 51.0, started_at=10.0), now=1.1) is Observed.IGNORED  # late, old process
    assert table.get("w1").heartbeat.started_at == 58.0


def test_stopping_ends_the_lease_and_a_late_ready_of_that_process_does_not_revive_it():
    table = LeaseTable()
    table.observe(beat(1, 5.0), now=0.0)
    assert table.observe(beat(2, 6.0, WorkerStatus.STOPPING), now=1.0) is Observed.ENDED
    assert "w1" not in table
    assert table.observe(beat(1, 5.0), now=1.1) is Observed.IGNORED
    assert table.observe(beat(9, 9.0, WorkerStatus.STOPPING, instance_id="w2"), now=1.2) is Observed.IGNORED
    assert table.observe(beat(1, 30.0, started_at=20.0), now=2.0) is Observed.JOINED  # restarted: back


def test_senders_without_seq_are_ordered_by_their_own_clock():
    old, new = beat(0, 5.0), beat(0, 6.0)
    assert is_newer(new, old) and not is_newer(old, new)


def test_step_stuck_reads_the_workers_own_duration():
    assert not step_stuck(beat(1, 0.0, step_running_s=0.0), 10.0)
    assert not step_stuck(beat(1, 0.0, step_running_s=9.9), 10.0)
    assert step_stuck(beat(1, -3600.0, step_running_s=10.5), 10.0)
