"""Fixed regressions for fence checks that only a random interleaving (or nothing) used to reach
(issue 16). Each test drives ``decide`` into the one situation where its check is the only thing
standing between a late input and the current incarnation; each was seen to fail with the check
taken out (the mutants catalogue, services/testbed/mutant_catalogue.py, keeps that so)."""

from __future__ import annotations

import copy

from shared.fence.audit import audit
from shared.fence.decide import DecideEnv
from shared.fence.schema import (
    Adopted,
    Bound,
    Commanded,
    CommandResult,
    ConfirmRequested,
    DeleteClaimed,
    Done,
    Failed,
    Fence,
    Forgotten,
    Observed,
    ProbeChanged,
    ReadyChanged,
    Restarting,
    Skipped,
    Spec,
    TimerArmed,
    TimerFired,
    VMExited,
    WriteDone,
)
from shared.fence.state import fold_all
from tests.unit.driver import ENV, KEY, Driver, of


def test_a_superseded_incarnations_final_delete_answer_never_forgets_the_successor() -> None:
    """u1 is deleted and its final pod delete is written; u2 is admitted before that write is
    answered; then u1's ``WriteDone(ok)`` arrives. It must finish nothing of u2's (guards the
    ``cur.fence != w.fence`` check in ``_on_write_done``)."""
    d = Driver()
    d.run_up("u1")
    d.feed(Observed(KEY, "u1", d.next_rv(), deleting=True))
    (remove,) = d.commands("remove")
    d.answer(remove)
    (final,) = d.writes("delete")
    assert final.write.fence.uid == "u1"
    d.admit("u2")  # the name is taken by a new incarnation before the delete's answer comes back
    assert d.state.cur is not None and d.state.cur.fence.uid == "u2"
    (create,) = d.commands("create")
    out = d.feed(WriteDone(final.write.fence, final.write.id, "ok"))
    assert [x.effect_id for x in of(out, Done)] == [final.write.id], "the answer completes u1's write"
    assert of(out, Forgotten) == [], "u1's delete answer tombstoned its successor"
    cur = d.state.cur
    assert cur is not None and cur.fence == Fence(KEY, "u2", 2) and not cur.delete_claim
    assert "u2" not in d.state.tombstones
    assert d.commands("create") == [create], "u2's bring-up is still under way"


def test_a_predecessors_probe_after_adoption_never_makes_the_successor_ready() -> None:
    """u2 adopts u1's VM (``on-recreate: adopt``) and is bound to it; a probe result then arrives
    under u1's fence — same VM, same host. It is skipped (guards the fence comparison in
    ``_on_probe``; the rule-4 test sends its stale probe before u2 is bound)."""
    d = Driver()
    c1 = d.run_up("u1", Spec(on_recreate="adopt"))
    d.admit("u2", Spec(on_recreate="adopt"))
    (adopt,) = d.commands("adopt")
    d.answer(adopt, ip="10.0.0.9")
    cur = d.state.cur
    assert cur is not None and cur.fence.uid == "u2" and cur.bound and cur.vm_id == c1.vm_id
    assert cur.host == c1.host and not cur.ready
    out = d.feed(ProbeChanged(c1.fence, c1.host, c1.vm_id, True))
    assert of(out, ReadyChanged) == [], "u1's probe made u2 ready"
    assert [s.reason for s in of(out, Skipped)] == ["superseded"]
    assert not d.state.cur.ready  # type: ignore[union-attr]
    # u2's own probe of the same VM is applied
    out = d.feed(ProbeChanged(adopt.fence, c1.host, c1.vm_id, True))
    assert [r.ready for r in of(out, ReadyChanged)] == [True]


def test_a_restart_timer_firing_after_a_delete_claim_starts_nothing() -> None:
    """The VM exits and its restart is armed; the pod is deleted before the timer fires (the
    claim queues the VM's remove). The timer re-checks and does nothing: no ``start`` behind the
    remove, the VM's record stays ``removing`` (rule 12; guards ``not cur.deleting`` in the restart
    branch of ``_on_timer`` — the rule-12 test covers only the place timer)."""
    d = Driver()
    c = d.run_up("u1")
    out = d.feed(VMExited(c.fence, c.host, c.vm_id, 1))
    (timer,) = of(out, TimerArmed)
    assert timer.purpose == f"restart/{c.vm_id}"
    out = d.feed(Observed(KEY, "u1", d.next_rv(), deleting=True))
    assert of(out, DeleteClaimed)
    (remove,) = d.commands("remove")
    assert remove.vm_id == c.vm_id and d.state.vms[c.vm_id].state == "removing"
    out = d.feed(TimerFired(timer.fence, timer.timer_id))
    assert [x.effect_id for x in of(out, Done)] == [timer.timer_id]
    assert of(out, Commanded) == [], "a restart timer sent a command after the delete claim"
    assert d.commands("start") == []
    assert d.state.vms[c.vm_id].state == "removing", "the VM's record flipped from removing"
    # the delete then completes as if the timer had never fired
    d.answer(remove)
    assert len(d.writes("delete")) == 1


def test_the_restart_backoff_doubles_up_to_its_cap_of_300_s() -> None:
    """Exponential restart backoff from the base, capped at ``restart_backoff_max_s`` (300 s by
    default): 10, 20, 40, 80, 160, then 300 and 300 again — never 320, 640... (rule 7)."""
    env = DecideEnv(hosts=ENV.hosts)  # the defaults: base 10 s, cap 300 s
    assert (env.restart_backoff_base_s, env.restart_backoff_max_s) == (10.0, 300.0)
    d = Driver(env=env)
    c = d.run_up("u1")
    seen: list[tuple[int, float, float]] = []
    for _ in range(7):
        out = d.feed(VMExited(c.fence, c.host, c.vm_id, 1))
        (restart,) = of(out, Restarting)
        (timer,) = of(out, TimerArmed)
        seen.append((restart.restart_count, restart.backoff_s, timer.delay_s))
        d.feed(TimerFired(timer.fence, timer.timer_id))
        (start,) = d.commands("start")
        d.answer(start, ip="10.0.0.9")
    assert seen == [
        (1, 10, 10), (2, 20, 20), (3, 40, 40), (4, 80, 80), (5, 160, 160), (6, 300, 300), (7, 300, 300)
    ]
    assert d.state.cur is not None and d.state.cur.restart_count == 7


def test_a_deleted_incarnations_late_observation_is_skipped_as_superseded() -> None:
    """A deleted incarnation is tombstoned when it is forgotten: a late (relisted, lagging-cache)
    observation of it is ``Skipped(superseded)`` and asks for no read that could admit it again
    (rule 3; guards the tombstone in ``fold``'s ``Forgotten``)."""
    d = Driver()
    d.run_up("u1")
    before = Observed(KEY, "u1", d.next_rv())
    d.feed(before)
    d.feed(Observed(KEY, "u1", d.next_rv(), deleting=True))
    d.answer(d.commands("remove")[0])
    (final,) = d.writes("delete")
    assert of(d.feed(WriteDone(final.write.fence, final.write.id, "ok")), Forgotten)
    assert d.state.cur is None
    out = d.feed(before)  # the watch cache replays an observation from before the delete
    assert [s.reason for s in of(out, Skipped)] == ["superseded"]
    assert of(out, ConfirmRequested) == [] and d.pending(ConfirmRequested) == []


def test_a_decision_under_a_fence_that_is_not_current_never_changes_the_successor() -> None:
    """``fold`` applies an incarnation's decisions only under its own fence: a log a stale writer
    appended to (or the audit replaying any log) never moves a predecessor's readiness, failure or
    delete claim onto the successor (rule 4; guards the fence comparison in ``_cur_for``)."""
    d = Driver()
    c1 = d.run_up("u1")
    d.admit("u2")
    cur = d.state.cur
    assert cur is not None and cur.fence.uid == "u2"
    before = copy.deepcopy(cur)
    fold_all(d.state, [ReadyChanged(c1.fence, True), Failed(c1.fence, "VMExited", "late"), DeleteClaimed(c1.fence)])
    assert d.state.cur == before
    assert not cur.ready and cur.phase == "Pending" and not cur.delete_claim and not cur.deleting


def test_a_forgotten_incarnations_adopt_answered_late_still_collects_the_vm() -> None:
    """u2 adopts u1's VM; u2 is deleted (and forgotten) while the adopt is in flight, then the agent
    answers it: ownership moved to u2 there, so the VM is removed under u2's fence — the forgotten
    incarnation's command stays outstanding until answered (never a leak; guards ``Forgotten``
    keeping ``Commanded`` effects)."""
    d = Driver()
    c1 = d.run_up("u1", Spec(on_recreate="adopt"))
    d.admit("u2", Spec(on_recreate="adopt"))
    (adopt,) = d.commands("adopt")
    d.feed(Observed(KEY, "u2", d.next_rv(), deleting=True))
    (final,) = d.writes("delete")
    assert of(d.feed(WriteDone(final.write.fence, final.write.id, "ok")), Forgotten)
    assert d.state.cur is None and d.commands("adopt") == [adopt]
    out = d.answer(adopt, ip="10.0.0.9")
    assert of(out, Adopted), "the late adopt answer was dropped: the VM the agent now holds for u2 leaks"
    (remove,) = d.commands("remove")
    assert (remove.vm_id, remove.fence) == (c1.vm_id, adopt.fence)
    d.answer(remove)
    assert d.state.vms == {}
    report = audit(d.log, final=True)
    assert report.clean, report.violations


def test_a_result_that_contradicts_its_command_is_skipped_and_never_applied() -> None:
    """A result names its command by id; one whose fence or VM is not that command's (a corrupt or
    misrouted report) contradicts the log: ``Skipped(stale_effect)``, the command stays
    outstanding, nothing is bound (DESIGN: "a report that contradicts the log is Skipped with a
    reason, never acted on"; guards the fence/VM comparison at the top of ``_on_result``)."""
    d = Driver()
    d.run_up("u1")
    d.admit("u2")
    d.answer(d.commands("remove")[0])
    (create,) = d.commands("create")
    assert create.fence == Fence(KEY, "u2", 2)
    for fence, vm_id in ((Fence(KEY, "u1", 1), create.vm_id), (create.fence, "web-v1-other-1")):
        out = d.feed(CommandResult(fence, create.id, "create", create.host, vm_id, "ok", ip="10.0.0.9"))
        assert [s.reason for s in of(out, Skipped)] == ["stale_effect"], (fence, vm_id, out)
        assert of(out, Bound) == [] and of(out, Done) == []
        assert d.commands("create") == [create] and not d.state.cur.bound  # type: ignore[union-attr]
    assert of(d.answer(create, ip="10.0.0.9"), Bound), "the command's own answer still binds it"


def test_a_predecessors_start_answered_ok_after_the_adoption_is_never_bound_to_the_successor() -> None:
    """u1's VM exits and its restart (``start`` under u1's fence) is out when u2 adopts the VM; the
    adopt is answered first, then the start's ``ok`` (the agent re-sends it from its ledger after a
    lost publish). The start's answer is never applied under u2's fence: no ``Bound`` cites u1's
    command, the successor's adopted VM is not removed (guards ``rec.fence == cmd.fence`` in
    ``_up_ok``, a defect the mutants found), and the log stays auditable (rule 4; guards
    ``cur.fence == cmd.fence`` in ``_up_ok``)."""
    d = Driver()
    c1 = d.run_up("u1", Spec(on_recreate="adopt"))
    out = d.feed(VMExited(c1.fence, c1.host, c1.vm_id, 1))
    (timer,) = of(out, TimerArmed)
    d.feed(TimerFired(timer.fence, timer.timer_id))
    (start,) = d.commands("start")
    d.admit("u2", Spec(on_recreate="adopt"))
    (adopt,) = d.commands("adopt")
    d.answer(adopt, ip="10.0.0.9")
    assert d.state.cur is not None and d.state.cur.bound and d.state.cur.vm_id == c1.vm_id
    out = d.answer(start, ip="10.0.0.9")
    assert [b for b in of(out, Bound) if b.command_id == start.id] == [], "u1's start was applied to u2"
    removes = [c.command for c in of(out, Commanded) if c.command.op == "remove"]
    assert removes == [], f"the successor's adopted VM was removed: {removes}"
    assert d.state.cur is not None and d.state.cur.bound and d.state.cur.vm_id == c1.vm_id
    report = audit(d.log, final=False)
    assert report.clean, report.violations
