from sim.events import EventQueue, SimEvent


def test_earlier_time_first():
    q = EventQueue()
    q.push(2.0, SimEvent.STEP_END, "late")
    q.push(1.0, SimEvent.SAMPLE, "early")
    assert [q.pop().payload for _ in range(2)] == ["early", "late"]


def test_ties_in_time_go_by_priority():
    q = EventQueue()
    for kind in (SimEvent.SAMPLE, SimEvent.ARRIVAL, SimEvent.RECONFIG, SimEvent.INSTANCE_UP, SimEvent.PREDICTION,
                 SimEvent.STEP_END):
        q.push(5.0, kind, kind.name)
    order = [q.pop().kind for _ in range(len(q))]
    assert order == sorted(order)
    assert order[0] == SimEvent.STEP_END and order[-1] == SimEvent.SAMPLE
    # a step's end frees its slots before an arrival at the same instant is placed
    assert order.index(SimEvent.STEP_END) < order.index(SimEvent.ARRIVAL)


def test_ties_in_time_and_priority_go_by_push_order():
    q = EventQueue()
    for name in ("a", "b", "c"):
        q.push(1.0, SimEvent.ARRIVAL, name)
    assert [q.pop().payload for _ in range(3)] == ["a", "b", "c"]
    assert [e.key.seq for e in (q.push(0.0, SimEvent.ARRIVAL), q.push(0.0, SimEvent.ARRIVAL))] == [3, 4]


def test_payload_never_compared():
    q = EventQueue()
    q.push(1.0, SimEvent.ARRIVAL, object())
    q.push(1.0, SimEvent.ARRIVAL, object())  # objects are not orderable: the key decides
    q.pop()
    q.pop()
    assert not q
