"""A host's complete inventory that lacks a VM the log binds there is VM-gone evidence — only after a
confirming inspect (rules 8 and 12): the absence asks the agent's runtime, only its not_found takes
the VM-gone path (eviction), an inconclusive answer is asked again and never trusted (issue 10,
finding 5)."""

from __future__ import annotations

from shared.fence.schema import (
    ABSENT,
    Command,
    Commanded,
    EvictionRequested,
    Fence,
    Inventoried,
    Observed,
    Released,
    Spec,
    TimerFired,
    WriteRequested,
)
from tests.unit.driver import KEY, Driver, of


def _bound_and_absent() -> tuple[Driver, Command, Command]:
    d = Driver()
    create = d.run_up("u1")
    out = d.feed(Inventoried(create.fence, create.host, create.vm_id, ABSENT, round="host-a-b1-7"))
    (cmd,) = [c.command for c in of(out, Commanded)]
    return d, create, cmd


def test_an_absent_bound_vm_is_inspected_not_evicted() -> None:
    d, create, inspect = _bound_and_absent()
    assert (inspect.op, inspect.vm_id, inspect.host, inspect.fence) == ("inspect", create.vm_id, create.host,
                                                                       create.fence)
    assert d.state.cur is not None and d.state.cur.bound, "absence alone destroys nothing (rule 12)"
    assert d.writes("evict") == []


def test_a_confirmed_absence_is_the_vm_gone_path() -> None:
    d, create, inspect = _bound_and_absent()
    out = d.answer(inspect, "not_found")
    assert [(r.vm_id, r.reason) for r in of(out, Released)] == [(create.vm_id, "gone")]
    assert of(out, EvictionRequested) and [w.write.verb for w in of(out, WriteRequested)].count("evict") == 1
    assert d.state.cur is not None and not d.state.cur.bound


def test_an_inspect_that_finds_the_vm_changes_nothing() -> None:
    d, _, inspect = _bound_and_absent()
    out = d.answer(inspect, "ok")
    assert of(out, Released) == [] and of(out, EvictionRequested) == [] and of(out, Commanded) == []
    assert d.state.cur is not None and d.state.cur.bound


def test_an_inconclusive_inspect_is_asked_again_never_trusted() -> None:
    d, create, inspect = _bound_and_absent()
    for outcome in ("inconclusive", "failed"):
        out = d.answer(inspect, outcome)
        assert of(out, Released) == [] and of(out, EvictionRequested) == []
        (timer,) = [t for t in d.timers() if t.purpose == f"retry/inspect/{create.vm_id}"]
        d.feed(TimerFired(timer.fence, timer.timer_id))
        (inspect,) = d.commands("inspect")
        assert inspect.vm_id == create.vm_id and inspect.fence == create.fence
    out = d.answer(inspect, "not_found")
    assert of(out, EvictionRequested)


def test_one_inspect_at_a_time_and_none_for_what_the_log_does_not_bind() -> None:
    d, create, _ = _bound_and_absent()
    again = d.feed(Inventoried(create.fence, create.host, create.vm_id, ABSENT, round="host-a-b1-8"))
    assert of(again, Commanded) == [], "an inspect is already out"
    other = Driver()
    other.admit("u1")
    (pending,) = other.commands("create")
    out = other.feed(Inventoried(pending.fence, pending.host, pending.vm_id, ABSENT))
    assert of(out, Commanded) == [], "a VM being made is not in a round yet: no evidence"
    out = other.feed(Inventoried(Fence(KEY, "u9", 0), "host-a", "not-ours", ABSENT))
    assert out == [], "absence of a VM the log does not know says nothing"


def test_an_inspect_retry_dies_with_its_fence() -> None:
    d, _, inspect = _bound_and_absent()
    d.answer(inspect, "inconclusive")
    d.feed(Observed(KEY, "u1", d.next_rv(), spec=Spec(), deleting=True))  # a delete began meanwhile
    (timer,) = [t for t in d.timers() if t.purpose.startswith("retry/inspect/")]
    d.admit("u2")
    out = d.feed(TimerFired(timer.fence, timer.timer_id))
    assert [c.command.op for c in of(out, Commanded)] == [], "no inspect under a fence no longer current"
