"""A Kubernetes write that failed (an API server down or timing out, a role the chart forgot) is
written again after a delay that doubles per failure in a row, up to a cap, and starts again from
the first once a write of the incarnation takes: not an entry and a request every second per pod
for as long as the failure lasts."""

from __future__ import annotations

from shared.fence.audit import audit
from shared.fence.decide import REWRITE_MAX_S, DecideEnv, HostView, rewrite_backoff_s
from shared.fence.schema import ProbeChanged, Spec, TimerArmed, TimerFired, WriteDone
from tests.unit.driver import Driver, of

ENV = DecideEnv(hosts=[HostView("host-a", 8, 8192)])


def _rewrite_delays(out: list) -> list[float]:  # type: ignore[type-arg]
    return [t.delay_s for t in of(out, TimerArmed) if t.purpose == "rewrite/bind"]


def _fail_and_fire(d: Driver) -> list[float]:
    """The pending binding fails; its rewrite timer fires (the binding is requested again)."""
    (bind,) = [w.write for w in d.writes("bind")]
    delays = _rewrite_delays(d.feed(WriteDone(bind.fence, bind.id, "failed", "503")))
    (timer,) = [t for t in d.timers() if t.purpose == "rewrite/bind"]
    d.feed(TimerFired(timer.fence, timer.timer_id))
    return delays


def test_the_delay_doubles_from_one_second_up_to_the_cap() -> None:
    assert [rewrite_backoff_s(n) for n in range(1, 8)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert rewrite_backoff_s(10**6) == REWRITE_MAX_S


def test_each_failed_write_in_a_row_waits_twice_as_long_and_a_write_that_takes_starts_again() -> None:
    d = Driver(env=ENV, auto_bind=False)
    d.admit("u1")
    delays = [x for _ in range(7) for x in _fail_and_fire(d)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    (bind,) = [w.write for w in d.writes("bind")]
    d.feed(WriteDone(bind.fence, bind.id, "ok", node="vmfence-host-a"))
    cur = d.state.cur
    assert cur is not None and cur.write_failures == 0
    assert d.commands("create"), "the binding took: the VM is made"
    assert audit(d.log, final=False).clean


def test_a_rewritten_status_is_one_write_saying_why_the_pod_waits() -> None:
    """The rewrite writes the status the pod should show (a waiting pod's reason and message), once.
    It wrote the bare status before, beside which the status sync asked for a second write; under
    failing writes each rewrite then doubled the writes in flight."""
    d = Driver(env=DecideEnv(hosts=[]))  # host-a is not live: the pod waits
    d.admit("u1", Spec(node="vmfence-host-a"))
    for _ in range(4):
        (status,) = [w.write for w in d.writes("status")]
        assert status.status is not None and status.status.reason == "Unschedulable"
        d.feed(WriteDone(status.fence, status.id, "failed", "503"))
        (timer,) = [t for t in d.timers() if t.purpose == "rewrite/status"]
        d.feed(TimerFired(timer.fence, timer.timer_id))
    assert audit(d.log, final=False).clean


def _status_writes(d: Driver) -> list:  # type: ignore[type-arg]
    return [w.write for w in d.writes("status")]


def test_a_failed_status_write_is_rewritten_once_however_often_the_status_changed_meanwhile() -> None:
    """Through an API-server outage each change of a pod's status asked for a write of its own, and
    each of those that failed armed a rewrite of its own: a pod's status writes grew with its
    changes. A failed one is left to a newer write that is out, and a rewrite that fires after a
    change leaves the write to that change's; the status written is the one wanted last."""
    d = Driver()
    create = d.run_up("u1")
    (running,) = _status_writes(d)
    d.feed(WriteDone(running.fence, running.id, "failed", "503"))
    (rewrite,) = [t for t in d.timers() if t.purpose == "rewrite/status"]
    d.feed(ProbeChanged(create.fence, create.host, create.vm_id, True))  # a change: a write of its own
    (ready,) = _status_writes(d)
    assert ready.status is not None and ready.status.ready
    d.feed(TimerFired(rewrite.fence, rewrite.timer_id))
    assert _status_writes(d) == [ready], "the rewrite leaves it to the write of the change"
    d.feed(ProbeChanged(create.fence, create.host, create.vm_id, False))
    older, newest = _status_writes(d)
    d.feed(WriteDone(older.fence, older.id, "failed", "503"))
    assert not [t for t in d.timers() if t.purpose == "rewrite/status"], "the newer write is out"
    d.feed(WriteDone(newest.fence, newest.id, "failed", "503"))
    (rewrite,) = [t for t in d.timers() if t.purpose == "rewrite/status"]
    d.feed(TimerFired(rewrite.fence, rewrite.timer_id))
    (last,) = _status_writes(d)
    assert last.status is not None and not last.status.ready, "the status wanted last"
    assert audit(d.log, final=False).clean
