"""A command re-sent by its RetryTimer carries what the first one carried: the incarnation's spec
(a retried create is the pod's VM, not a default one) and, for a wake, the snapshot in the log
(rule 10: a retried wake restores, the agent never refuses it for lack of a snapshot)."""

from __future__ import annotations

from shared.fence.schema import Command, Observed, Spec, TimerArmed, TimerFired
from tests.unit.driver import KEY, Driver

# bound (its nodeName), as every command of it says
SPEC = Spec(cpus=3, memory_mib=512, image="debian-12", probe_port=8080, node="vmfence-host-a")


def _fire_retry(d: Driver) -> None:
    (timer,) = [t for t in d.timers() if t.purpose.startswith("retry/")]
    assert isinstance(timer, TimerArmed)
    d.feed(TimerFired(timer.fence, timer.timer_id))


def test_a_retried_create_carries_the_pods_spec() -> None:
    d = Driver()
    d.admit("u1", SPEC)
    (create,) = d.commands("create")
    assert create.spec == SPEC
    d.answer(create, "inconclusive")
    assert d.commands("create") == []
    _fire_retry(d)
    (again,) = d.commands("create")
    assert again.id != create.id and again.vm_id == create.vm_id
    assert again.spec == SPEC, "a retried create lost the pod's spec"


def _woken(d: Driver) -> Command:
    d.run_up("u1", SPEC)
    d.feed(Observed(KEY, "u1", d.next_rv(), spec=Spec(**{**_fields(SPEC), "hibernate": True})))
    (hib,) = d.commands("hibernate")
    assert hib.spec.hibernate
    d.answer(hib, snapshot="/snapshots/u1.mig")
    d.feed(Observed(KEY, "u1", d.next_rv(), spec=SPEC))
    (wake,) = d.commands("wake")
    assert wake.snapshot == "/snapshots/u1.mig"
    return wake


def _fields(spec: Spec) -> dict[str, object]:
    return {f: getattr(spec, f) for f in spec.__struct_fields__}


def test_a_retried_wake_carries_the_snapshot_and_the_spec() -> None:
    d = Driver()
    wake = _woken(d)
    d.answer(wake, "inconclusive")
    _fire_retry(d)
    (again,) = d.commands("wake")
    assert again.id != wake.id and again.vm_id == wake.vm_id and again.host == wake.host
    assert again.snapshot == "/snapshots/u1.mig", "a retried wake lost its snapshot"
    assert again.spec == SPEC


def test_a_retried_remove_still_carries_no_spec() -> None:
    d = Driver()
    create = d.run_up("u1", SPEC)
    d.feed(Observed(KEY, "u1", d.next_rv(), spec=SPEC, deleting=True))
    (remove,) = d.commands("remove")
    d.answer(remove, "failed", error="busy")
    _fire_retry(d)
    (again,) = d.commands("remove")
    assert again.vm_id == create.vm_id and again.spec == Spec() and again.snapshot is None
