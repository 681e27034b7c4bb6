"""A bring-up's result may carry the runtime probe's verdict (``CommandResult.ready``): the pod is
then Running and Ready in one status write, not Running first and Ready an input, an append and a
write later (issue 14: a status write and a bus input fewer per pod). Readiness is still only ever
decided for the fence that owns the VM, and a hibernating pod is never made Ready by it."""

from __future__ import annotations

from shared.fence.schema import Bound, Command, ProbeChanged, ReadyChanged, Spec, WriteRequested
from tests.unit.driver import Driver, of


def _statuses(decisions: list) -> list:  # type: ignore[type-arg]
    return [w.write.status for w in of(decisions, WriteRequested) if w.write.verb == "status"]


def _created(d: Driver, uid: str = "u1", spec: Spec | None = None) -> Command:
    d.admit(uid, spec)
    (create,) = d.commands("create")
    return create


def test_a_result_that_says_ready_makes_the_pod_running_and_ready_in_one_write() -> None:
    d = Driver()
    out = d.answer(_created(d), ip="10.0.0.9", ready=True)
    assert of(out, Bound) and of(out, ReadyChanged) == [ReadyChanged(of(out, Bound)[0].fence, True)]
    (status,) = _statuses(out)
    assert status is not None and status.phase == "Running" and status.ready
    # the sweep's later ProbeChanged saying the same decides nothing
    cur = d.state.cur
    assert cur is not None and cur.vm_id is not None and cur.host is not None
    assert d.feed(ProbeChanged(cur.fence, cur.host, cur.vm_id, True)) == []


def test_a_result_without_a_verdict_leaves_readiness_to_the_probe() -> None:
    for ready in (None, False):
        d = Driver()
        out = d.answer(_created(d), ip="10.0.0.9", ready=ready)
        assert of(out, Bound) and not of(out, ReadyChanged)
        (status,) = _statuses(out)
        assert status is not None and status.phase == "Running" and not status.ready
        cur = d.state.cur
        assert cur is not None and cur.vm_id is not None and cur.host is not None
        later = d.feed(ProbeChanged(cur.fence, cur.host, cur.vm_id, True))
        assert of(later, ReadyChanged) and [s.ready for s in _statuses(later)] == [True]


def test_a_superseded_incarnations_result_makes_nothing_ready() -> None:
    d = Driver()
    old = _created(d, "u1")
    d.admit("u2")  # a successor took the name before the old create's answer
    out = d.answer(old, ip="10.0.0.9", ready=True)
    assert not of(out, ReadyChanged) and not of(out, Bound)
    assert all(not s.ready for s in _statuses(out))
    assert d.state.cur is not None and d.state.cur.fence.uid == "u2" and not d.state.cur.ready


def test_a_hibernating_pod_is_not_made_ready_by_its_bring_up() -> None:
    d = Driver()
    create = _created(d, spec=Spec(hibernate=True))
    out = d.answer(create, ip="10.0.0.9", ready=True)
    assert not of(out, ReadyChanged)
