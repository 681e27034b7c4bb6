"""The scheduling contract in the kernel (issue 11 §3): a pod's ``spec.nodeName`` is law — its VM
runs on that host or nowhere — and a pod without one is bound through ``pods/binding`` before its VM
is made (or left to the scheduler). Each test fails when its rule is taken out of ``decide``."""

from __future__ import annotations

import msgspec

from shared.fence.audit import audit
from shared.fence.decide import DecideEnv, HostView
from shared.fence.schema import (
    Commanded,
    ConfirmRequested,
    Fence,
    LogEntry,
    Observed,
    Placed,
    Skipped,
    Spec,
    TimerArmed,
    TimerFired,
    WriteDone,
    WriteRequested,
)
from tests.unit.driver import KEY, Driver, of

A, B = HostView("host-a", 8, 8192), HostView("host-b", 8, 8192, vms=5)  # host-a is the emptier
ENV = DecideEnv(hosts=[A, B], restart_backoff_base_s=1)
ON_B = Spec(node="vmfence-host-b")


def _events(out: list, reason: str) -> list[str]:  # type: ignore[type-arg]
    return [w.write.message or "" for w in of(out, WriteRequested)
            if w.write.verb == "event" and w.write.event_reason == reason]


def _fire_place(d: Driver) -> list:  # type: ignore[type-arg]
    (timer,) = [t for t in d.timers() if t.purpose == "place"]
    return d.feed(TimerFired(timer.fence, timer.timer_id))


# ------------------------------------------------------------------------- nodeName is law


def test_a_bound_pod_runs_on_its_node_even_when_another_host_is_emptier() -> None:
    d = Driver(env=ENV)
    d.admit("u1", ON_B)
    (create,) = d.commands("create")
    assert create.host == "host-b", "placement ignored spec.nodeName"


def test_a_dead_node_gives_a_warning_and_a_condition_never_a_vm_elsewhere() -> None:
    d = Driver(env=DecideEnv(hosts=[A]))  # host-b has no heartbeat
    out = d.admit("u1", ON_B)
    assert d.commands("create") == [] and of(out, Placed) == []
    assert [s.reason for s in of(out, Skipped)] == ["no_host"]
    (why,) = _events(out, "FailedPlacement")
    assert "vmfence-host-b" in why and "not a live vmfence host" in why
    cur = d.state.cur
    assert cur is not None and cur.status is not None
    assert cur.status.reason == "Unschedulable" and cur.status.message == why
    # the timer re-checks: still dead -> no VM, and no second Warning for the same reason
    out = _fire_place(d)
    assert d.commands("create") == [] and _events(out, "FailedPlacement") == []
    # the node comes back: the VM is made there
    d.env = ENV
    _fire_place(d)
    (create,) = d.commands("create")
    assert create.host == "host-b"
    assert audit(d.log, final=False).clean


def test_a_full_node_waits_for_room_on_that_node() -> None:
    full_b = HostView("host-b", 0, 0)
    d = Driver(env=DecideEnv(hosts=[A, full_b]))
    out = d.admit("u1", Spec(cpus=2, node="vmfence-host-b"))
    assert d.commands("create") == []
    (why,) = _events(out, "FailedPlacement")
    assert "vmfence-host-b has no room" in why and "2 CPUs" in why


def test_a_pod_bound_to_a_node_that_is_not_vmfences_is_never_placed() -> None:
    d = Driver(env=ENV)
    out = d.admit("u1", Spec(node="worker-1"))
    assert d.commands("create") == [] and _events(out, "FailedPlacement")
    assert not d.timers(), "a foreign node never becomes ours: no retry loop"


def test_the_audit_flags_a_vm_placed_off_its_node() -> None:
    d = Driver(env=ENV)
    d.admit("u1", ON_B)
    log = list(d.log)
    assert d.commands("create")
    forged = [msgspec.structs.replace(x, host="host-a") if isinstance(x, Placed) else x for x in log[-1].decisions]
    log[-1] = LogEntry(log[-1].key, log[-1].n, forged)
    assert "placed_off_node" in {v.rule for v in audit(log, final=False).violations}
    assert audit(d.log, final=False).clean


# ------------------------------------------------------------------- binding before the VM


def test_an_unscheduled_pod_is_bound_before_its_vm_is_made() -> None:
    d = Driver(env=ENV, auto_bind=False)
    out = d.admit("u1")
    (bind,) = [w.write for w in of(out, WriteRequested) if w.write.verb == "bind"]
    assert bind.node == "vmfence-host-a" and bind.fence == Fence(KEY, "u1", 1)
    assert d.commands() == [], "a VM was commanded before the pod's binding took"
    out = d.feed(WriteDone(bind.fence, bind.id, "ok", node=bind.node))
    (create,) = d.commands("create")
    assert create.host == "host-a" and create.spec.node == "vmfence-host-a"
    assert _events(out, "Scheduled") == [f"Successfully assigned {KEY} to vmfence-host-a"]
    # the observation of the bound pod changes nothing (no second VM, no second binding)
    out = d.feed(Observed(KEY, "u1", d.next_rv(), spec=Spec(node="vmfence-host-a")))
    assert of(out, Commanded) == [] and d.writes("bind") == []


def test_a_binding_someone_else_won_leads_to_their_node_never_to_ours() -> None:
    d = Driver(env=ENV, auto_bind=False)
    d.admit("u1")
    (bind,) = [w.write for w in d.writes("bind")]
    assert bind.node == "vmfence-host-a"
    # 409: the pod is already assigned to vmfence-host-b (a scheduler, another reconciler)
    d.feed(WriteDone(bind.fence, bind.id, "failed", "already bound", node="vmfence-host-b"))
    (create,) = d.commands("create")
    assert create.host == "host-b", "a refused binding produced a VM on the host it picked"
    assert audit(d.log, final=False).clean


def test_a_failed_binding_is_retried_and_a_superseded_one_asks_who_owns_the_name() -> None:
    d = Driver(env=ENV, auto_bind=False)
    d.admit("u1")
    (bind,) = [w.write for w in d.writes("bind")]
    d.feed(WriteDone(bind.fence, bind.id, "failed", "500"))
    assert d.commands() == [] and d.writes("bind") == []
    (timer,) = [t for t in d.timers() if t.purpose == "rewrite/bind"]
    d.feed(TimerFired(timer.fence, timer.timer_id))
    (again,) = [w.write for w in d.writes("bind")]
    out = d.feed(WriteDone(again.fence, again.id, "superseded"))
    assert of(out, ConfirmRequested) and d.commands() == []


def test_with_a_scheduler_an_unscheduled_pod_waits_for_its_binding() -> None:
    d = Driver(env=DecideEnv(hosts=[A, B], bind_unscheduled=False), auto_bind=False)
    out = d.admit("u1")
    assert d.commands() == [] and d.writes("bind") == [] and of(out, TimerArmed) == []
    assert d.state.cur is not None and d.state.cur.status is None, "the scheduler speaks for an unbound pod"
    d.feed(Observed(KEY, "u1", d.next_rv(), spec=ON_B))  # kube-scheduler bound it
    (create,) = d.commands("create")
    assert create.host == "host-b"


# ------------------------------------------------------------------------ VirtualMachines


def test_a_virtual_machine_honours_its_host_selector_and_names_an_unknown_host() -> None:
    d = Driver(key="vm:default/box", env=ENV)
    d.admit("v1", Spec(host_selector="host-b"))
    (create,) = d.commands("create")
    assert create.host == "host-b" and d.writes("bind") == [], "VirtualMachines are placed, never bound"
    d2 = Driver(key="vm:default/box2", env=ENV)
    out = d2.admit("v2", Spec(host_selector="host-z"))
    assert d2.commands("create") == []
    (why,) = _events(out, "FailedPlacement")
    assert "host host-z is not a live vmfence host" in why


# ---------------------------------------------------- a force-deleted pod on a dead host (rule 12)


def _on(host: str) -> Spec:
    return Spec(node=f"vmfence-{host}")


def test_after_a_force_delete_the_successor_starts_elsewhere_while_the_dead_hosts_remove_waits() -> None:
    d = Driver(env=ENV)
    first = d.run_up("u1", _on("host-a"))
    d.env = DecideEnv(hosts=[B])  # host-a's agent is dead; the operator force-deleted the pod
    out = d.admit("u2", _on("host-b"))  # the StatefulSet's replacement, scheduled to host-b
    (remove,) = d.commands("remove")
    assert (remove.vm_id, remove.host, remove.fence.uid) == (first.vm_id, "host-a", "u1")
    (create,) = d.commands("create")
    assert create.host == "host-b" and create.fence.uid == "u2"
    assert [s.detail for s in of(out, Skipped) if s.reason == "stranded"] == [first.vm_id]
    d.answer(create, ip="10.0.0.7")
    d.env = ENV  # host-a's agent returns and answers the queued remove: the predecessor's VM goes
    d.answer(remove)
    assert list(d.state.vms) == [create.vm_id]
    report = audit(d.log, final=True)
    assert report.clean, report.violations


def test_a_predecessors_removal_on_a_live_host_is_always_waited_for() -> None:
    d = Driver(env=ENV)
    d.run_up("u1", _on("host-a"))
    out = d.admit("u2", _on("host-b"))
    assert d.commands("create") == [] and not [s for s in of(out, Skipped) if s.reason == "stranded"]
    (remove,) = d.commands("remove")
    d.answer(remove)
    (create,) = d.commands("create")
    assert create.host == "host-b"


def test_the_audit_still_flags_a_vm_placed_beside_one_not_declared_stranded() -> None:
    d = Driver(env=ENV)
    d.run_up("u1", _on("host-a"))
    d.env = DecideEnv(hosts=[B])
    d.admit("u2", _on("host-b"))
    log = [LogEntry(e.key, e.n, [x for x in e.decisions if not (isinstance(x, Skipped) and x.reason == "stranded")])
           for e in d.log]
    assert "two_vms_for_key" in {v.rule for v in audit(log, final=False).violations}


# ------------------------------------------------------ a hibernated incarnation that ends (rule 9)


def _hibernated(d: Driver) -> str:
    create = d.run_up("u1", _on("host-a"))
    d.feed(Observed(KEY, "u1", d.next_rv(), spec=Spec(node="vmfence-host-a", hibernate=True)))
    (hib,) = d.commands("hibernate")
    d.answer(hib, snapshot="/snapshots/u1.mig")
    assert d.state.cur is not None and d.state.cur.hibernated
    return create.vm_id


def test_deleting_a_hibernated_pod_removes_its_saved_vm_before_the_object_goes() -> None:
    d = Driver(env=ENV)
    vm = _hibernated(d)
    d.feed(Observed(KEY, "u1", d.next_rv(), deleting=True, spec=Spec(node="vmfence-host-a", hibernate=True)))
    (remove,) = d.commands("remove")
    assert (remove.vm_id, remove.host, remove.fence.uid) == (vm, "host-a", "u1")
    assert d.writes("delete") == [], "the object went before its snapshot and address were collected"
    d.answer(remove)
    assert d.writes("delete")
    assert audit(d.log, final=False).clean


def test_a_superseded_hibernated_incarnation_has_its_saved_vm_removed() -> None:
    d = Driver(env=ENV)
    vm = _hibernated(d)
    d.admit("u2", _on("host-b"))
    removes = [c for c in d.commands("remove") if c.vm_id == vm]
    assert [(c.host, c.fence.uid) for c in removes] == [("host-a", "u1")]


def test_a_pod_evicted_from_a_dead_node_is_finalized_only_once_its_vm_is_confirmed_removed() -> None:
    """The node lifecycle controller's taint eviction is a graceful delete: the pod stays
    Terminating (no final delete) while the dead host's agent cannot confirm the VM removed, however
    long that takes (rule 12: no destructive step on a clock), and goes once it does."""
    d = Driver(env=ENV)
    first = d.run_up("u1", _on("host-a"))
    d.env = DecideEnv(hosts=[B])  # host-a's agent is dead: its Node went NotReady, the pod is evicted
    d.feed(Observed(KEY, "u1", d.next_rv(), deleting=True, spec=_on("host-a")))
    (remove,) = d.commands("remove")
    assert (remove.vm_id, remove.host) == (first.vm_id, "host-a")
    for timer in list(d.timers()):  # whatever re-checks fire meanwhile, none finalizes
        d.feed(TimerFired(timer.fence, timer.timer_id))
    assert d.writes("delete") == [], "finalized while its VM was not confirmed removed"
    d.env = ENV
    d.answer(remove)  # the agent is back and removed the VM
    assert d.writes("delete")
