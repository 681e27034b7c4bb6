"""A failed bring-up (a missing image) is placed again after a backoff that doubles per failure in a
row up to CREATE_BACKOFF_MAX_S, not once a second forever; the pod's condition names the real cause
(not Unschedulable); its Events are one per cause with a repeat count (issue 10, finding 12)."""

from __future__ import annotations

from shared.fence.decide import CREATE_BACKOFF_MAX_S, create_backoff_s
from shared.fence.schema import BringUpFailed, Command, Spec, TimerArmed, TimerFired, WriteRequested
from tests.unit.driver import Driver, of

CAUSE = "image debian-99 not found in /var/lib/vmfence/images"


def _fail(d: Driver, create: Command) -> tuple[TimerArmed, list[WriteRequested]]:
    out = d.answer(create, "failed", error=CAUSE)
    (timer,) = [x for x in of(out, TimerArmed) if x.purpose == "place"]
    return timer, of(out, WriteRequested)


def _failing(d: Driver, times: int) -> list[tuple[TimerArmed, list[WriteRequested]]]:
    d.admit("u1", Spec(image="debian-99"))
    seen = []
    for _ in range(times):
        (create,) = d.commands("create")
        timer, writes = _fail(d, create)
        seen.append((timer, writes))
        d.feed(TimerFired(timer.fence, timer.timer_id))
    return seen


def test_failed_creates_back_off_exponentially_up_to_the_bound() -> None:
    seen = _failing(Driver(), 12)
    delays = [timer.delay_s for timer, _ in seen]
    assert delays == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300, 300]
    assert max(delays) == CREATE_BACKOFF_MAX_S and create_backoff_s(10**6) == CREATE_BACKOFF_MAX_S


def test_the_condition_names_the_real_cause_not_unschedulable() -> None:
    d = Driver()
    _failing(d, 1)
    assert d.state.cur is not None and d.state.cur.status is not None
    status = d.state.cur.status
    assert status.reason == "FailedCreate" and status.message == CAUSE, status
    statuses = [w.write.status for entry in d.log for w in of(entry.decisions, WriteRequested)
                if w.write.verb == "status" and w.write.status is not None]
    assert all(s.reason != "Unschedulable" for s in statuses), "a missing image is not a full cluster"


def test_one_event_per_cause_counts_its_repeats() -> None:
    seen = _failing(Driver(), 5)
    events = [w.write for _, writes in seen for w in writes if w.write.verb == "event"]
    assert [(e.event_reason, e.message, e.count) for e in events] == [("FailedCreate", CAUSE, n) for n in range(1, 6)]


def test_a_bound_vm_ends_the_backoff() -> None:
    d = Driver()
    _failing(d, 3)
    assert d.state.cur is not None and d.state.cur.failures == 3
    (create,) = d.commands("create")
    d.answer(create, ip="10.0.0.7")
    assert d.state.cur.bound and d.state.cur.failures == 0 and d.state.cur.failure is None
    assert d.state.cur.status is not None and d.state.cur.status.reason is None


def test_the_backoff_is_in_the_log() -> None:
    d = Driver()
    _failing(d, 2)
    logged = [x for e in d.log for x in of(e.decisions, BringUpFailed)]
    assert [(b.failures, b.backoff_s, b.cause) for b in logged] == [(1, 1.0, CAUSE), (2, 2.0, CAUSE)]
