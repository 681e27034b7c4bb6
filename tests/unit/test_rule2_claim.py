"""Rule 2's second half: a failed bring-up releases only a claim it still owns.

The guard is reachable: a bring-up command whose VM changed owner while it was out. That happens
with a restart in place (a ``start`` of a bound VM) when the pod is recreated with
``vmfence.io/on-recreate: adopt``: the successor adopts the VM while the predecessor's start is in
flight, and the start's failure arrives after the adopt's answer (the agent works one VM serially,
but a lost publish makes it answer the redelivered start from its ledger, after the adopt's). The
VM is the successor's by then; releasing it under the dead fence would unbind the successor and
make a second VM beside the one still running.
"""

from __future__ import annotations

from shared.fence.audit import audit
from shared.fence.schema import (
    Adopted,
    Bound,
    Command,
    Fence,
    Placed,
    Released,
    Spec,
    TimerArmed,
    TimerFired,
    VMExited,
)
from tests.unit.driver import KEY, Driver, of

ADOPT = Spec(on_recreate="adopt")


def _start_in_flight_then_adopted() -> tuple[Driver, Command]:
    """u1's VM exits and its restart is out when u2 adopts the VM; the adopt is answered first."""
    d = Driver()
    create = d.run_up("u1")
    vm = create.vm_id
    d.feed(VMExited(create.fence, create.host, vm, exit_code=1))
    (restart,) = [t for t in d.timers() if t.fence == create.fence]
    d.feed(TimerFired(restart.fence, restart.timer_id))
    (start,) = d.commands("start")
    assert start.fence == Fence(KEY, "u1", 1) and start.vm_id == vm
    d.admit("u2", ADOPT)
    (adopt,) = d.commands("adopt")
    assert adopt.vm_id == vm and adopt.fence == Fence(KEY, "u2", 2)
    adopted = d.answer(adopt, ip="10.0.0.9")
    assert of(adopted, Adopted) and of(adopted, Bound)
    assert d.state.vms[vm].fence == adopt.fence, "the VM is the successor's now"
    return d, start


def test_a_failed_start_of_a_vm_a_successor_adopted_releases_nothing() -> None:
    d, start = _start_in_flight_then_adopted()
    out = d.answer(start, "failed", error="qemu exited")
    assert of(out, Released) == [], "the claim is no longer the start's to release"
    assert of(out, Placed) == [] and d.commands("create") == [], "no second VM beside the adopted one"
    cur = d.state.cur
    assert cur is not None and cur.fence.uid == "u2" and cur.bound and cur.vm_id == start.vm_id
    assert not [t for t in d.timers() if isinstance(t, TimerArmed) and t.fence.uid == "u1"]
    report = audit(d.log)
    assert report.clean, report.violations


def test_a_start_that_found_no_vm_after_the_adopt_releases_nothing_either() -> None:
    d, start = _start_in_flight_then_adopted()
    out = d.answer(start, "not_found")
    assert of(out, Released) == [] and of(out, Placed) == []
    assert d.state.cur is not None and d.state.cur.bound
    assert audit(d.log).clean
