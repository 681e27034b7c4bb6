"""One test per fence rule of DESIGN.md that lives in the pure core. Each drives ``decide`` through
the situation the rule exists for and fails if the rule's row is taken out of the table."""

from __future__ import annotations

import pytest

from shared.fence.audit import audit
from shared.fence.decide import DecideEnv, decide
from shared.fence.schema import (
    NO_INCARNATION,
    Admitted,
    Bound,
    Command,
    Commanded,
    CommandResult,
    ConfirmedRead,
    ConfirmRequested,
    DeleteClaimed,
    Discovered,
    Done,
    EvictionDeferred,
    EvictionRequested,
    Failed,
    Fence,
    Forgotten,
    Inventoried,
    Observed,
    ProbeChanged,
    ReadyChanged,
    Rebuilt,
    Released,
    Restarting,
    Skipped,
    Spec,
    Superseded,
    TimerArmed,
    TimerFired,
    VMExited,
    VMGone,
    WriteDone,
    WriteRequested,
)
from shared.fence.state import KeyState, fold_all
from tests.unit.driver import KEY, Driver, answer_surveys, cut_unseen, lose_tail, of


def test_rule2_claim_before_bring_up() -> None:
    d = Driver()
    first = d.feed(Observed(KEY, "u1", 1))
    assert of(first, Commanded) == [], "an observation alone must never start a VM"
    assert len(of(first, ConfirmRequested)) == 1
    decisions = d.feed(ConfirmedRead(KEY, of(first, ConfirmRequested)[0].request, "u1", 1))
    kinds = [type(x).__name__ for x in decisions]
    assert kinds.index("Admitted") < kinds.index("Commanded")
    (create,) = d.commands("create")
    assert create.fence == Fence(KEY, "u1", 1)


def test_rule2_failed_bring_up_releases_only_its_own_claim() -> None:
    d = Driver()
    d.admit("u1")
    (create1,) = d.commands("create")
    d.admit("u2")  # u1 superseded while its create is in flight; its VM must be removed first
    assert d.state.cur is not None and d.state.cur.fence.uid == "u2"
    out = d.answer(create1, "failed", error="boom")
    released = of(out, Released)
    assert [r.fence.uid for r in released] == ["u1"]
    assert d.state.cur.fence.uid == "u2"
    assert d.commands("create") and d.commands("create")[0].fence.uid == "u2"


def test_rule3_supersede_only_on_a_confirmed_read() -> None:
    d = Driver()
    d.run_up("u1")
    out = d.feed(Observed(KEY, "u2", d.next_rv()))
    assert of(out, Superseded) == [] and of(out, Admitted) == []
    assert d.state.cur is not None and d.state.cur.fence.uid == "u1", "a watch event must not supersede"
    req = d.pending(ConfirmRequested)[-1]
    out = d.feed(ConfirmedRead(KEY, req.request, "u2", d.next_rv()))
    assert [s.fence.uid for s in of(out, Superseded)] == ["u1"]
    assert of(out, Admitted)[0].fence == Fence(KEY, "u2", 2)
    # every later input for u1 is skipped as superseded, logged, never applied
    late = d.feed(ProbeChanged(Fence(KEY, "u1", 1), "host-a", "x", True))
    assert [s.reason for s in of(late, Skipped)] == ["superseded"]
    late = d.feed(Observed(KEY, "u1", d.next_rv(), deleting=True))
    assert [s.reason for s in of(late, Skipped)] == ["superseded"]


def test_rule3_a_stale_consistent_answer_never_resurrects_an_older_uid() -> None:
    d = Driver()
    d.feed(Observed(KEY, "u1", 1))
    d.feed(Observed(KEY, "u2", 5))
    r1, r2 = d.pending(ConfirmRequested)
    d.feed(ConfirmedRead(KEY, r2.request, "u2", 5))  # the later read answered first
    out = d.feed(ConfirmedRead(KEY, r1.request, "u1", 1))
    assert of(out, Admitted) == []
    assert d.state.cur is not None and d.state.cur.fence.uid == "u2"


def test_rule4_reports_for_a_fence_that_is_not_current_are_skipped() -> None:
    d = Driver()
    create = d.run_up("u1")
    old = create.fence
    d.admit("u2")
    for late in (
        ProbeChanged(old, "host-a", create.vm_id, True),
        VMExited(old, "host-a", create.vm_id, 1),
    ):
        out = d.feed(late)
        assert of(out, Restarting) == [] and of(out, Bound) == []
        assert any(s.reason == "superseded" for s in of(out, Skipped))


def test_rule4_every_command_carries_the_current_fence() -> None:
    d = Driver()
    d.run_up("u1")
    d.admit("u2")
    (remove,) = d.commands("remove")
    assert remove.fence.uid == "u1", "cleanup of the predecessor's VM carries the predecessor's fence"
    d.answer(remove)
    (create,) = d.commands("create")
    assert create.fence == d.state.cur.fence  # type: ignore[union-attr]
    assert audit(d.log, final=False).clean


def test_rule5_delete_claims_in_order() -> None:
    d = Driver()
    create = d.run_up("u1")
    # delete of u1 -> claim and remove
    out = d.feed(Observed(KEY, "u1", d.next_rv(), deleting=True))
    assert of(out, DeleteClaimed) and len(d.commands("remove")) == 1
    # the same delete again while in flight -> wait (skipped), no second remove
    out = d.feed(Observed(KEY, "u1", d.next_rv(), deleting=True))
    assert [s.reason for s in of(out, Skipped)] == ["delete_in_flight"]
    assert len(d.commands("remove")) == 1
    # remove done -> final delete with the uid precondition
    d.answer(d.commands("remove")[0])
    (final,) = d.writes("delete")
    assert final.write.fence.uid == "u1"
    assert create.fence.uid == "u1"


def test_rule5_superseded_delete_touches_no_fence() -> None:
    d = Driver()
    d.run_up("u1")
    d.admit("u2")
    d.answer(d.commands("remove")[0])
    d.answer(d.commands("create")[0])
    before = d.state.cur
    out = d.feed(Observed(KEY, "u1", d.next_rv(), deleting=True, gone=True))
    assert [s.reason for s in of(out, Skipped)] == ["superseded"]
    assert of(out, DeleteClaimed) == [] and of(out, Commanded) == []
    assert d.state.cur == before and not d.state.cur.delete_claim  # type: ignore[union-attr]


def test_rule6_conflict_means_superseded_and_not_found_means_gone() -> None:
    d = Driver()
    d.run_up("u1")
    (status,) = d.writes("status")
    out = d.feed(WriteDone(status.write.fence, status.write.id, "superseded"))
    assert of(out, ConfirmRequested), "Conflict/Invalid on a uid write asks who owns the name now"
    assert of(out, Commanded) == [], "and destroys nothing on its own"
    d2 = Driver()
    d2.run_up("u1")
    (status,) = d2.writes("status")
    out = d2.feed(WriteDone(status.write.fence, status.write.id, "gone"))
    assert of(out, DeleteClaimed) and [c.command.op for c in of(out, Commanded)] == ["remove"]
    assert d2.state.cur is not None, "the VM binding is kept until the delete path removes the VM"


def test_rule7_exit_restarts_with_backoff_and_never_fails_on_policy_never() -> None:
    d = Driver()
    create = d.run_up("u1")
    out = d.feed(VMExited(create.fence, create.host, create.vm_id, 1))
    (restart,) = of(out, Restarting)
    assert restart.restart_count == 1 and restart.backoff_s == 1
    (timer,) = of(out, TimerArmed)
    out = d.feed(VMExited(create.fence, create.host, create.vm_id, 1))
    assert of(out, Restarting) == [], "one exit, one restart"
    out = d.feed(TimerFired(create.fence, timer.timer_id))
    assert [c.command.op for c in of(out, Commanded)] == ["start"]
    d.answer(d.commands("start")[0])
    out = d.feed(VMExited(create.fence, create.host, create.vm_id, 1))
    assert of(out, Restarting)[0].backoff_s == 2, "exponential backoff"
    never = Driver()
    c = never.run_up("u1", Spec(restart_policy="Never"))
    out = never.feed(VMExited(c.fence, c.host, c.vm_id, 3))
    assert of(out, Failed) and [x.command.op for x in of(out, Commanded)] == ["remove"]


def test_rule7_an_exit_whose_report_was_lost_is_taken_from_the_inventory() -> None:
    d = Driver()
    create = d.run_up("u1")
    out = d.feed(Inventoried(create.fence, create.host, create.vm_id, "exited", round="h-1"))
    (restart,) = of(out, Restarting)
    assert restart.restart_count == 1, "the inventory showing the VM exited restarts it as an exit would"
    out = d.feed(Inventoried(create.fence, create.host, create.vm_id, "exited", round="h-2"))
    assert of(out, Restarting) == [], "one exit, one restart, however many rounds show it"
    # an unknown exit code is a failure: OnFailure restarts it, Never fails the pod
    on_failure = Driver()
    c = on_failure.run_up("u1", Spec(restart_policy="OnFailure"))
    assert of(on_failure.feed(VMExited(c.fence, c.host, c.vm_id, None)), Restarting)
    never = Driver()
    c = never.run_up("u1", Spec(restart_policy="Never"))
    (failed,) = of(never.feed(Inventoried(c.fence, c.host, c.vm_id, "exited")), Failed)
    assert "unknown" in failed.message
    # another host's namesake or another fence's report changes nothing
    other = Driver()
    c = other.run_up("u1")
    assert of(other.feed(Inventoried(c.fence, "host-z", c.vm_id, "exited")), Restarting) == []


def test_rule7_a_vm_lost_whose_report_was_lost_is_taken_from_the_inventory() -> None:
    d = Driver()
    c = d.run_up("u1")
    out = d.feed(Inventoried(c.fence, c.host, c.vm_id, "lost", round="h-1"))
    assert of(out, EvictionRequested), "a lost VM shown by an inventory is handled as VMGone"
    out = d.feed(Inventoried(c.fence, c.host, c.vm_id, "lost", round="h-2"))
    assert of(out, Discovered) == [] and of(out, Commanded) == [], "later rounds neither discover nor act"
    fresh = Driver()
    c = fresh.run_up("u1")
    out = fresh.feed(Inventoried(c.fence, c.host, "someone-else-1", "lost"))
    assert of(out, Discovered) == [] and of(out, Commanded) == [], "an unknown lost VM is nobody's business"


def test_readiness_whose_probe_was_decided_before_the_binding_is_taken_from_the_inventory() -> None:
    d = Driver()
    d.admit("u1")
    (create,) = d.commands("create")
    early = d.feed(ProbeChanged(create.fence, create.host, create.vm_id, True))  # redelivery reordered it
    assert of(early, ReadyChanged) == []
    d.answer(create)
    assert d.state.cur is not None and d.state.cur.bound and not d.state.cur.ready
    out = d.feed(Inventoried(create.fence, create.host, create.vm_id, "running", round="h-1", ready=True))
    assert [r.ready for r in of(out, ReadyChanged)] == [True]
    again = d.feed(Inventoried(create.fence, create.host, create.vm_id, "running", round="h-2", ready=True))
    assert of(again, ReadyChanged) == [], "a readiness already known is not decided again"
    stale = Driver()
    c = stale.run_up("u1")
    old = Fence(c.fence.key, "u0", 0)
    assert of(stale.feed(Inventoried(old, c.host, c.vm_id, "running", ready=False)), ReadyChanged) == []
    down = Driver()
    c = down.run_up("u1")
    down.feed(ProbeChanged(c.fence, c.host, c.vm_id, True))
    down.feed(VMExited(c.fence, c.host, c.vm_id, 1))  # restarting: not ready
    out = down.feed(Inventoried(c.fence, c.host, c.vm_id, "exited", ready=True))
    assert of(out, ReadyChanged) == [], "readiness a host probed before the VM went down is not taken"


def test_rule7_vm_gone_evicts_with_uid_precondition_or_defers_under_a_delete_claim() -> None:
    d = Driver()
    c = d.run_up("u1")
    out = d.feed(VMGone(c.fence, c.host, c.vm_id))
    assert of(out, EvictionRequested)
    (evict,) = [w for w in of(out, WriteRequested) if w.write.verb == "evict"]
    assert evict.write.fence.uid == "u1"
    # under a delete claim: deferred, and resolved (not dropped) when the delete completes
    d2 = Driver()
    c = d2.run_up("u1")
    d2.feed(Observed(KEY, "u1", d2.next_rv(), deleting=True))
    out = d2.feed(VMGone(c.fence, c.host, c.vm_id))
    assert of(out, EvictionDeferred) and of(out, EvictionRequested) == []
    out = d2.answer(d2.commands("remove")[0], "not_found")
    (final,) = d2.writes("delete")
    out = d2.feed(WriteDone(final.write.fence, final.write.id, "ok"))
    assert any(x.effect_id == f"eviction:{c.vm_id}" for x in of(out, Done)), "deferred, never dropped"
    assert of(out, Forgotten)


def test_rule7_vm_gone_of_a_superseded_incarnation_never_evicts_the_successor() -> None:
    d = Driver()
    c1 = d.run_up("u1")
    d.admit("u2")
    out = d.feed(VMGone(c1.fence, c1.host, c1.vm_id))
    assert of(out, EvictionRequested) == []
    assert all(w.write.verb != "evict" for w in of(out, WriteRequested))


def test_rule8_adopt_only_after_the_agent_confirms() -> None:
    d = Driver()
    c1 = d.run_up("u1")
    out = d.admit("u2", Spec(on_recreate="adopt"))
    assert [c.command.op for c in of(out, Commanded)] == ["adopt"], "adopt asks the runtime first"
    assert of(out, Bound) == []
    (adopt,) = d.commands("adopt")
    out = d.answer(adopt, "inconclusive")
    assert of(out, Bound) == [] and of(out, TimerArmed), "an inconclusive inspect is retried, not trusted"
    timer = d.timers()[0]
    d.feed(TimerFired(timer.fence, timer.timer_id))
    (adopt,) = d.commands("adopt")
    out = d.answer(adopt, "not_found")
    assert of(out, Released) and [c.command.op for c in of(out, Commanded)] == ["create"]
    assert c1.vm_id not in d.state.vms


def test_rule8_inventory_adopts_own_and_removes_foreign_vms() -> None:
    d = Driver()
    d.admit("u1")
    d.answer(d.commands("create")[0], "failed")  # log now believes u1 has no VM
    out = d.feed(Inventoried(Fence(KEY, "u0", 0), "host-b", "stray-vm", "running"))
    # an incarnation the log does not know: who owns the name is asked before anything is touched
    assert of(out, Commanded) == [] and [r.seen_uid for r in of(out, ConfirmRequested)] == ["u0"]
    (read,) = [r for r in d.pending(ConfirmRequested) if r.seen_uid == "u0"]
    out = d.feed(ConfirmedRead(KEY, read.request, "u1", 1))
    assert [(c.command.op, c.command.vm_id) for c in of(out, Commanded)] == [("remove", "stray-vm")]


def test_rule10_hibernation_survives_a_restart_and_wakes_from_the_snapshot() -> None:
    d = Driver()
    c = d.run_up("u1")
    d.feed(Observed(KEY, "u1", d.next_rv(), spec=Spec(hibernate=True)))
    (hib,) = d.commands("hibernate")
    d.answer(hib, snapshot="/snapshots/x.mig")
    # a restarted reconciler re-derives state from the log alone
    rebuilt = KeyState(key=KEY)
    for entry in d.log:
        fold_all(rebuilt, entry.decisions)
        rebuilt.n = entry.n
    assert rebuilt == d.state
    d.state = rebuilt
    out = d.feed(Observed(KEY, "u1", d.next_rv(), spec=Spec(hibernate=False)))
    ops = [x.command for x in of(out, Commanded)]
    assert [x.op for x in ops] == ["wake"] and ops[0].snapshot == "/snapshots/x.mig"
    assert ops[0].vm_id != c.vm_id, "a restored VM is a new VM; names are never reused"


def test_rule11_command_ids_are_deterministic_and_redelivery_changes_nothing() -> None:
    a, b = Driver(), Driver()
    ca, cb = a.run_up("u1"), b.run_up("u1")
    assert ca.id == cb.id
    again = a.answer(ca, ip="10.0.0.9")
    assert again == [], "a redelivered result is dropped"
    for inp in (Observed(KEY, "u1", 1),):
        assert decide(a.state, inp) == []


def test_rule12_timers_only_trigger_rechecks() -> None:
    d = Driver(env=DecideEnv(hosts=()))  # no host fits: placement waits on a timer
    out = d.admit("u1")
    assert [s.reason for s in of(out, Skipped)] == ["no_host"]
    (pending,) = d.writes("status")
    assert pending.write.status is not None and pending.write.status.reason == "Unschedulable"
    (timer,) = d.timers()
    out = d.feed(TimerFired(timer.fence, timer.timer_id))
    assert of(out, Commanded) == [] and of(out, Failed) == [], "a timer re-checks, never destroys"
    assert [s.reason for s in of(out, Skipped)] == ["no_host"]


def test_replay_rederives_the_writers_state_exactly() -> None:
    d = Driver()
    c = d.run_up("u1")
    d.feed(VMExited(c.fence, c.host, c.vm_id, 1))
    d.admit("u2", Spec(on_recreate="adopt"))
    d.answer(d.commands("adopt")[0])
    replayed = KeyState(key=KEY)
    for entry in d.log:
        fold_all(replayed, entry.decisions)
        replayed.n = entry.n
    assert replayed == d.state
    assert audit(d.log).clean


# ------------------------------------------------- found by the fault campaign (chaos_sim)


def test_a_lost_log_tail_is_rebuilt_above_every_known_epoch_and_surveyed_before_any_vm() -> None:
    from shared.fence.decide import rebuild
    from shared.fence.schema import CommandResult, Discovered, Inventoried, Rebuilt

    d = Driver()
    c1 = d.run_up("u1")
    known_epoch = d.state.epoch
    lost = KeyState(key=KEY)  # the whole log was lost; the writer still knew epoch 1
    d.state = lost
    out = rebuild(lost, known_epoch, d.env, "tail lost")
    fold_all(d.state, out)
    d.state.n += 1
    assert isinstance(out[0], Rebuilt) and d.state.epoch > known_epoch
    surveys = d.commands("survey")
    assert {s.host for s in surveys} == {"host-a", "host-b"}
    assert all(s.fence.epoch == d.state.epoch for s in surveys)
    # the pod is observed again before the surveys answer: admitted, but no VM is made yet
    d.admit("u1")
    assert d.commands("create") == [] and d.state.cur is not None and d.state.cur.fence.epoch > known_epoch
    # host-a still runs the VM the lost tail made: it is discovered and adopted, not duplicated
    for s in surveys:
        found = [Inventoried(c1.fence, s.host, c1.vm_id, "running")] if s.host == c1.host else []
        out = d.feed(CommandResult(s.fence, s.id, "survey", s.host, s.vm_id, "ok", found=found))
    assert any(isinstance(x, Discovered) for x in d.log[-2].decisions + d.log[-1].decisions)
    assert [c.op for c in d.commands()] == ["adopt"] and d.commands("create") == []


def test_a_fenced_answer_naming_a_newer_owner_is_never_taken_for_a_gone_vm() -> None:
    from shared.fence.schema import CommandResult, Discovered, Inventoried

    d = Driver()
    c1 = d.run_up("u1")
    d.admit("u2", Spec(on_recreate="adopt"))
    (adopt,) = d.commands("adopt")  # lands at the agent; its answer is still on its way
    d.admit("u3")
    (remove,) = d.commands("remove")
    assert remove.fence == c1.fence
    newer = adopt.fence  # a newer fence of this key than the remove's holds the VM
    out = d.feed(CommandResult(remove.fence, remove.id, "remove", remove.host, remove.vm_id, "fenced",
                               found=[Inventoried(newer, remove.host, c1.vm_id, "running")]))
    assert of(out, Released) == [], "the VM still exists"
    assert of(out, Discovered)[0].fence == newer
    (again,) = [c for c in d.commands("remove")]
    assert again.fence == newer and d.commands("create") == [], "collected under its real owner first"


def test_an_absent_answer_to_a_read_asked_before_an_admission_deletes_nothing() -> None:
    d = Driver()
    d.feed(Observed(KEY, "u0", 1))
    (old_read,) = d.pending(ConfirmRequested)
    d.feed(Observed(KEY, "u1", 2))
    new_read = d.pending(ConfirmRequested)[-1]
    d.feed(ConfirmedRead(KEY, new_read.request, "u1", 2))
    assert d.state.cur is not None and d.state.cur.fence.uid == "u1"
    out = d.feed(ConfirmedRead(KEY, old_read.request, None))
    assert of(out, DeleteClaimed) == [] and [s.reason for s in of(out, Skipped)] == ["stale_read"]


def test_effect_ids_differ_across_a_rebuild_at_the_same_log_position() -> None:
    from shared.fence.decide import rebuild

    a = Driver()
    a.feed(Observed(KEY, "u1", 1))
    before = a.pending(ConfirmRequested)[0].request
    b = Driver()
    fold_all(b.state, rebuild(b.state, 7, b.env))  # same position, but after a rebuild
    b.state.n = 0
    b.feed(Observed(KEY, "u1", 1))
    after = b.pending(ConfirmRequested)[0].request
    assert before != after


def test_an_invalid_annotation_on_a_running_pod_shows_a_condition_and_keeps_the_vm() -> None:
    from shared.fence.schema import SpecChanged, WriteRequested

    d = Driver()
    d.run_up("u1")
    out = d.feed(Observed(KEY, "u1", d.next_rv(), invalid='vmfence.io/cpus: "lots" is not an integer between 1 and 64'))
    assert of(out, SpecChanged)[0].invalid is not None and of(out, Commanded) == []
    writes = [w.write for w in of(out, WriteRequested)]
    assert {w.verb for w in writes} == {"event", "status"}
    status = next(w.status for w in writes if w.verb == "status")
    assert status is not None and status.phase == "Running" and status.invalid and status.reason == "InvalidSpec"


def test_a_vm_adopted_while_it_was_down_is_restarted_under_the_new_fence() -> None:
    from shared.fence.schema import CommandResult, Inventoried

    d = Driver()
    c1 = d.run_up("u1")
    d.feed(VMExited(c1.fence, c1.host, c1.vm_id, 1))  # down, its restart timer armed for u1
    d.admit("u2", Spec(on_recreate="adopt"))
    (adopt,) = d.commands("adopt")
    out = d.feed(CommandResult(adopt.fence, adopt.id, "adopt", adopt.host, adopt.vm_id, "ok",
                               found=[Inventoried(adopt.fence, adopt.host, adopt.vm_id, "exited")]))
    assert of(out, Bound) and of(out, Restarting), "the successor's restart policy applies"
    (timer,) = [t for t in d.timers() if t.fence == adopt.fence]
    out = d.feed(TimerFired(timer.fence, timer.timer_id))
    assert [c.command.op for c in of(out, Commanded)] == ["start"]


# ------------------------------------------- a lost log tail, found by tests/e2e/test_tail_loss.py


def test_a_delete_during_a_rebuild_keeps_the_object_until_the_surveyed_vm_is_removed() -> None:
    d = Driver()
    c1 = d.run_up("u1")
    lose_tail(d, keep=3)  # observed, admitted (bind), bound to its node (create commanded)
    # the pod is being deleted; the rebuilt log knows no VM yet, the hosts have not answered
    out = d.feed(Observed(KEY, "u1", d.next_rv(), deleting=True))
    assert of(out, DeleteClaimed) and d.writes("delete") == [], "object deleted before the survey"
    answer_surveys(d, {c1.host: [Inventoried(c1.fence, c1.host, c1.vm_id, "running")]})
    (remove,) = d.commands("remove")
    assert remove.vm_id == c1.vm_id and remove.fence == c1.fence
    assert d.writes("delete") == [], "object deleted while its VM is still being removed"
    d.answer(remove)
    assert len(d.writes("delete")) == 1
    assert audit(d.log, final=False).clean


@pytest.mark.parametrize("finders_last", [False, True], ids=["vm-host-first", "vm-host-last"])
def test_on_recreate_adopt_after_a_lost_tail_adopts_the_predecessors_surveyed_vm(finders_last: bool) -> None:
    # the answer that ends the survey round ends the rebuild; the VM it reports is still the
    # survey's find (CI once saw the VM's host answer last, and the VM removed despite adopt)
    for policy in ("adopt", "replace"):
        d = Driver()
        c1 = d.run_up("u1")
        lose_tail(d, keep=3)  # observed, admitted (bind), bound to its node (create commanded)
        d.admit("u2", Spec(on_recreate=policy))  # recreated under the name while the log was cut
        assert d.commands("create") == []
        answer_surveys(d, {c1.host: [Inventoried(c1.fence, c1.host, c1.vm_id, "running")]}, finders_last=finders_last)
        if policy == "adopt":
            (adopt,) = d.commands("adopt")
            assert adopt.vm_id == c1.vm_id and adopt.fence.uid == "u2"
            out = d.answer(adopt, ip="10.0.0.9")
            assert [b.vm_id for b in of(out, Bound)] == [c1.vm_id]
            assert d.commands("create") == [] and d.commands("remove") == []
        else:
            (remove,) = d.commands("remove")
            assert remove.vm_id == c1.vm_id and d.commands("adopt") == []
            d.answer(remove)
            (create,) = d.commands("create")
            assert create.fence.uid == "u2" and create.vm_id != c1.vm_id
        assert audit(d.log, final=False).clean


# ---------------------------------- a lost log tail no reconciler saw: the agents' epochs show it


def _live_vm_after_an_unseen_cut() -> tuple[Driver, Inventoried, int]:
    """u1 ran; the tail the log then lost recreated the pod twice (u2, u3: replace), so u3's VM runs
    under epoch 3 and the host's key mark is 3. The log keeps u1's entries only, and the reconciler
    restarted without any memory of more: the cut log looks like a normal, shorter one."""
    d = Driver()
    d.run_up("u1")
    keep = len(d.log)
    for uid in ("u2", "u3"):
        d.admit(uid)
        (remove,) = d.commands("remove")
        d.answer(remove)
        (create,) = d.commands("create")
        d.answer(create, ip="10.0.0.9")
    assert d.state.cur is not None and d.state.cur.fence == Fence(KEY, "u3", 3)
    cut_unseen(d, keep)
    assert d.state.epoch == 1 and d.state.cur is not None and d.state.cur.fence.uid == "u1"
    return d, Inventoried(create.fence, create.host, create.vm_id, "running"), keep


def _assert_live_vm_kept(d: Driver, vm: Inventoried, creates: int = 1) -> None:
    cur = d.state.cur
    assert cur is not None and cur.fence.uid == vm.fence.uid and cur.bound and cur.vm_id == vm.vm_id
    commanded = [x.command for e in d.log for x in e.decisions if isinstance(x, Commanded)]
    assert not [c for c in commanded if c.op == "remove" and c.vm_id == vm.vm_id], "live VM removed"
    # u1's create before the cut (and the refused one that showed the cut): no VM is made afresh
    assert [c.op for c in commanded if c.op in ("create", "wake")] == ["create"] * creates
    assert sum(1 for e in d.log for x in e.decisions if isinstance(x, Rebuilt)) == 1
    report = audit(d.log, final=True)
    assert report.clean, report.violations
    assert report.vms_bound_live == 1


def test_an_unseen_cut_shown_by_an_agents_inventory_is_rebuilt_and_the_live_vm_adopted() -> None:
    d, vm3, _ = _live_vm_after_an_unseen_cut()
    out = d.feed(vm3)  # the agent's inventory: a fence of the key above every epoch the log knows
    (rebuilt,) = of(out, Rebuilt)
    assert rebuilt.epoch_floor >= vm3.fence.epoch and d.state.epoch > vm3.fence.epoch
    assert {s.host for s in d.commands("survey")} == {"host-a", "host-b"}
    assert d.state.rebuilding and d.commands("remove") == []
    answer_surveys(d, {vm3.host: [vm3]})
    # a VM of an incarnation the log never admitted may be the live pod's: ask before touching it
    assert d.commands("remove") == [] and d.commands("create") == []
    assert [r.seen_uid for r in d.pending(ConfirmRequested)] == ["u3"]
    d.admit("u3")  # the consistent read: u3 owns the name
    (adopt,) = d.commands("adopt")
    assert adopt.vm_id == vm3.vm_id and adopt.fence.uid == "u3" and adopt.fence.epoch > vm3.fence.epoch
    d.answer(adopt, ip="10.0.0.9")
    _assert_live_vm_kept(d, vm3)


@pytest.mark.parametrize("evidence", ["remove_answer", "fenced_owner", "fenced_key_mark"])
def test_an_unseen_cut_shown_by_a_command_answer_is_rebuilt_before_any_vm_is_made(evidence: str) -> None:
    d, vm3, _ = _live_vm_after_an_unseen_cut()
    d.admit("u3")  # the relist comes first: u3 is admitted again, below the epoch it had
    assert d.state.cur is not None and d.state.cur.fence.epoch < vm3.fence.epoch
    (remove,) = d.commands("remove")  # u1's VM, which the lost tail already removed
    creates = 1
    if evidence == "remove_answer":
        # the host that removed it saw epoch 3 of the key: its answer says so (the key mark)
        out = d.answer(remove, "not_found", key_epoch=vm3.fence.epoch)
    else:
        d.answer(remove, "not_found")  # (a host that never saw the newer epoch answers it)
        (create,) = d.commands("create")
        creates = 2
        # the host refuses it: the VM of that name (or, under another name, the key) has a newer fence
        if evidence == "fenced_owner":
            assert create.vm_id == vm3.vm_id
            out = d.answer(create, "fenced", found=[vm3])
        else:
            out = d.answer(create, "fenced", key_epoch=vm3.fence.epoch)
    (rebuilt,) = of(out, Rebuilt)
    assert rebuilt.epoch_floor >= vm3.fence.epoch and d.state.epoch > vm3.fence.epoch
    assert of(out, Released) == []
    assert d.commands("remove") == [] and d.commands("create") == []
    answer_surveys(d, {vm3.host: [vm3]})
    (adopt,) = d.commands("adopt")
    assert adopt.vm_id == vm3.vm_id and adopt.fence.uid == "u3" and adopt.fence.epoch > vm3.fence.epoch
    d.answer(adopt, ip="10.0.0.9")
    _assert_live_vm_kept(d, vm3, creates=creates)


def test_an_unseen_cut_whose_unknown_incarnation_is_dead_removes_its_vm_after_asking() -> None:
    d, vm3, _ = _live_vm_after_an_unseen_cut()
    d.feed(VMExited(vm3.fence, vm3.host, vm3.vm_id, 1))  # any report carrying the newer fence shows it
    assert d.state.rebuilding
    answer_surveys(d, {vm3.host: [vm3]})
    assert d.commands("remove") == []
    (read,) = d.pending(ConfirmRequested)
    d.feed(ConfirmedRead(KEY, read.request, None))  # the pod was deleted meanwhile: nobody owns the name
    (remove,) = d.commands("remove")
    assert remove.vm_id == vm3.vm_id and remove.fence == vm3.fence
    d.answer(remove)
    assert d.state.cur is None and d.state.vms == {}
    assert d.commands("adopt") == [] and d.commands("create") == []
    report = audit(d.log, final=True)
    assert report.clean, report.violations


def test_reports_within_the_epochs_the_log_knows_never_rebuild() -> None:
    d = Driver()
    c1 = d.run_up("u1")
    d.admit("u2")
    for inp in (Inventoried(c1.fence, c1.host, c1.vm_id, "running"), VMExited(c1.fence, c1.host, c1.vm_id, 1),
                ProbeChanged(c1.fence, c1.host, c1.vm_id, True)):
        assert of(d.feed(inp), Rebuilt) == []
    assert not d.state.rebuilding


# ------------- an unseen cut that reuses an epoch, a key loaded from the log, answers to lost effects


def _reused_epoch() -> tuple[Driver, Command]:
    """u1 ran; the lost tail recreated the pod as u2 (epoch 2) and u2's VM runs on host-a. After
    the cut the pod is recreated again (u5): the cut log admits u5 at epoch 2 — the epoch the lost
    tail gave u2."""
    d = Driver()
    c1 = d.run_up("u1")
    keep = len(d.log)
    d.admit("u2")
    (remove,) = d.commands("remove")
    d.answer(remove)
    (c2,) = d.commands("create")
    d.answer(c2, ip="10.0.0.9")
    cut_unseen(d, keep)
    d.admit("u5")
    (remove,) = d.commands("remove")
    assert remove.vm_id == c1.vm_id
    d.answer(remove, "not_found", key_epoch=2, key_uid="u2")
    return d, c2


def test_an_agent_holding_the_logs_newest_epoch_for_another_uid_shows_an_unseen_cut() -> None:
    """Same epoch reused: the host that saw u2 at epoch 2 refuses u5's create at epoch 2 (its mark
    names u2); the refusal — or any answer carrying that mark — rebuilds the key instead of making a
    second VM beside u2's."""
    d, c2 = _reused_epoch()
    rebuilt = [x for e in d.log for x in e.decisions if isinstance(x, Rebuilt)]
    assert [r.epoch_floor for r in rebuilt] == [2], "u2 held at the epoch the log gave u5 must show the cut"
    assert d.state.rebuilding and d.state.epoch == 3 and d.state.epoch_uid == "u5"
    assert d.commands("create") == []
    vm2 = Inventoried(c2.fence, c2.host, c2.vm_id, "running")
    answer_surveys(d, {c2.host: [vm2]})
    assert [r.seen_uid for r in d.pending(ConfirmRequested)] == ["u2"]
    (read,) = d.pending(ConfirmRequested)
    d.feed(ConfirmedRead(KEY, read.request, "u5", d.next_rv()))  # u5 owns the name
    (remove,) = d.commands("remove")
    assert remove.vm_id == c2.vm_id and remove.fence == c2.fence
    d.answer(remove)
    (create,) = d.commands("create")
    assert create.fence.uid == "u5" and create.fence.epoch == d.state.epoch
    assert audit(d.log, final=False).clean


def test_a_key_loaded_from_the_log_surveys_every_host_before_its_first_vm() -> None:
    """A writer that loaded the key from the log cannot know whether the log lost a tail before: its
    first VM waits for a survey at the current fence (raising every host's key mark to it) — also
    for a delete with no VM known. A survey round sent before the load does not count."""
    d = Driver()
    d.state.unverified = True
    d.admit("u1")
    assert d.commands("create") == []
    surveys = d.commands("survey")
    assert {s.host for s in surveys} == {"host-a", "host-b"}
    assert all(s.fence == Fence(KEY, "u1", 1) for s in surveys)
    answer_surveys(d, {})
    assert not d.state.unverified
    (create,) = d.commands("create")
    assert create.fence == Fence(KEY, "u1", 1)
    # a delete of an unverified incarnation with no VM known keeps the object until the survey
    e = Driver()
    e.admit("u1")
    e.answer(e.commands("create")[0], "failed")
    e.state.unverified = True
    e.feed(Observed(KEY, "u1", e.next_rv(), deleting=True))
    assert e.writes("delete") == [] and len(e.commands("survey")) == 2
    answer_surveys(e, {})
    assert len(e.writes("delete")) == 1


def test_a_survey_round_from_before_the_load_does_not_verify_the_key() -> None:
    d = Driver()
    lose_tail_keep = len(d.log)
    d.run_up("u1")
    lose_tail(d, lose_tail_keep + 1)  # a seen cut: a survey round is out
    old = d.commands("survey")
    d.state.unverified = True  # the writer restarts; the round is re-sent from the outbox
    answer_surveys(d, {})
    assert d.state.unverified, "a round sent before the load may describe the hosts as they were"
    assert {s.id for s in d.commands("survey")}.isdisjoint({s.id for s in old})


def test_answers_to_effects_of_a_lost_tail_never_complete_the_cut_logs_effects() -> None:
    """After an unseen cut, positions and epochs repeat: the read the lost tail asked (for u7) must
    not answer the read the cut log asks at the same position (for u10)."""
    d = Driver()
    d.feed(Observed(KEY, "u7", d.next_rv()))
    (lost,) = d.pending(ConfirmRequested)
    cut_unseen(d, 0)
    d.feed(Observed(KEY, "u10", d.next_rv()))
    (asked,) = d.pending(ConfirmRequested)
    assert asked.request != lost.request
    assert d.feed(ConfirmedRead(KEY, lost.request, "u7", 1)) == []
    # the same input decided at the same position derives the same ids (rule 11)
    again = Driver()
    again.rv = 1
    again.feed(Observed(KEY, "u10", 2))
    assert again.pending(ConfirmRequested)[0].request == asked.request


def test_an_epoch_a_rebuild_gave_no_incarnation_shown_by_an_agent_under_a_uid_is_a_cut() -> None:
    """A seen rebuild with no incarnation current gives its epoch to nobody; agents hold it so
    (NO_INCARNATION) and refuse anything at it. An answer showing a uid at that epoch — a command of
    a lost tail — proves a cut."""
    d = Driver()
    d.feed(Observed(KEY, "u1", d.next_rv()))
    lose_tail(d, 0)
    assert d.state.cur is None and d.state.epoch_uid == NO_INCARNATION
    assert {s.fence for s in d.commands("survey")} == {Fence(KEY, "", 1)}
    out = d.feed(CommandResult(Fence(KEY, "u6", 1), "lost-create", "create", "host-a", "web-v1-u6-1", "ok"))
    (rebuilt,) = of(out, Rebuilt)
    assert rebuilt.epoch_floor == 1 and d.state.epoch == 2


def _adopting_the_live_vm_after_an_unseen_cut() -> tuple[Driver, Inventoried, Command]:
    """The inventory of u3's VM showed the cut; after the survey and u3's relist, its adopt is out."""
    d, vm3, _ = _live_vm_after_an_unseen_cut()
    d.feed(vm3)
    answer_surveys(d, {vm3.host: [vm3]})
    d.admit("u3")
    (adopt,) = d.commands("adopt")
    return d, vm3, adopt


def test_a_vm_lost_while_its_adopt_is_in_flight_is_released_and_made_again() -> None:
    d, _, adopt = _adopting_the_live_vm_after_an_unseen_cut()
    # the agent moved the VM to the adopting fence, then lost it; VM-gone comes before the answer
    out = d.feed(VMGone(adopt.fence, adopt.host, adopt.vm_id))
    assert [r.reason for r in of(out, Released)] == ["gone"]
    (create,) = d.commands("create")
    assert create.fence == adopt.fence and create.vm_id != adopt.vm_id
    d.answer(adopt, "not_found")
    assert d.commands("create") == [create]


def test_a_vm_name_a_lost_tail_gave_is_never_given_again_and_namesakes_stay_apart() -> None:
    d, vm3, adopt = _adopting_the_live_vm_after_an_unseen_cut()
    d.feed(VMGone(vm3.fence, vm3.host, vm3.vm_id))  # lost before the adopt reached it
    (create,) = d.commands("create")
    # the agents' tombstone of that name is per host: given again elsewhere, late news of the lost
    # VM (this adopt's answer) would land on the new VM's record
    assert create.vm_id != vm3.vm_id, "a lost tail's VM name is given again"
    d.answer(adopt, "fenced")
    assert d.commands("create") == [create] and create.vm_id in d.state.vms


def test_news_of_a_namesake_on_another_host_never_touches_the_record() -> None:
    d = Driver()
    c1 = d.run_up("u1")
    other = "host-b" if c1.host == "host-a" else "host-a"
    assert of(d.feed(VMGone(c1.fence, other, c1.vm_id)), Released) == []
    assert of(d.feed(VMExited(c1.fence, other, c1.vm_id, 1)), Restarting) == []
    assert d.state.cur is not None and d.state.cur.bound and d.state.cur.vm_id == c1.vm_id


def test_a_fenced_remove_showing_the_current_fence_owns_the_vm_adopts_it() -> None:
    """The lost tail admitted u2 at epoch 2 and adopted u1's VM; the cut log admits u2 at epoch 2
    again but, not knowing u1's VM was bound, removes it. The agent refuses (the owner is (u2, 2)):
    it is u2's VM — adopted, not left 'removing' forever."""
    d = Driver()
    c1 = d.run_up("u1", Spec(on_recreate="adopt"))
    keep = len(d.log)
    d.admit("u2", Spec(on_recreate="adopt"))
    (adopt,) = d.commands("adopt")
    cut_unseen(d, keep - 1)  # the log also lost u1's Bound: its VM was still 'creating'
    d.admit("u2", Spec(on_recreate="adopt"))
    assert d.state.cur is not None and d.state.cur.fence == adopt.fence
    (remove,) = d.commands("remove")
    out = d.answer(remove, "fenced", found=[Inventoried(adopt.fence, c1.host, c1.vm_id, "running")])
    assert of(out, Rebuilt) == []
    (again,) = d.commands("adopt")
    assert again.vm_id == c1.vm_id and again.fence == adopt.fence
    d.answer(again, ip="10.0.0.9")
    assert d.state.cur.bound and d.state.cur.vm_id == c1.vm_id
    assert audit(d.log, final=True).clean
