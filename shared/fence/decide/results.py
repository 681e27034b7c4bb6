"""Agent results: one rule per (command op, outcome) cell of ``_RESULTS`` (``tables.py``)."""

from __future__ import annotations

import msgspec

from shared.fence.decide.run import (
    EFFECT_RETRY_S,
    MAX_CAUSE_CHARS,
    _arm,
    _command,
    _event,
    _Run,
    create_backoff_s,
    retry_backoff_s,
)
from shared.fence.schema import (
    Adopted,
    AdoptTimer,
    Bound,
    BringUpFailed,
    Command,
    CommandOp,
    CommandResult,
    Discovered,
    Hibernated,
    PlaceTimer,
    ReadyChanged,
    Released,
    ReleaseReason,
    RetryTimer,
    Skipped,
    SkipReason,
    SurveyTimer,
    VMExited,
    VMGone,
)
from shared.fence.state import Incarnation, KeyState, VMRec, survey_retry_armed


class _Answer(msgspec.Struct, frozen=True):
    """An agent's answer to a command still outstanding, with what its rule needs: the key's record
    of the VM on that host, the current incarnation, and whether a rebuild was under way before the
    answer's ``Done`` (the Done of a round's last survey answer ends the rebuild it belongs to)."""

    cmd: Command
    r: CommandResult
    rec: VMRec | None
    cur: Incarnation | None
    rebuilding: bool


def _fenced(run: _Run, a: _Answer) -> None:
    """The agent refused the command: its fence is older than the VM's owner there (rule 4)."""
    s, cmd, rec, cur = run.s, a.cmd, a.rec, a.cur
    run.add(Skipped("fenced", a.r.fence.uid, f"agent refused {cmd.op} of {cmd.vm_id}"))
    owner = next((i for i in a.r.found if i.vm_id == cmd.vm_id), None)
    if owner is not None and owner.fence.key == s.key:
        # the VM exists under a newer fence of this key (an adopt whose answer is still on
        # its way, or one the log lost): it is still this key's VM, never "gone". Record its
        # real owner; collect it under that fence unless that is the current incarnation.
        run.add(Discovered(owner.fence, owner.vm_id, owner.host))
        if cur is None or cur.fence != owner.fence or cur.deleting:
            _command(run, "remove", owner.fence, owner.host, owner.vm_id, None)
        elif cur.vm_id is None and len(s.vms) == 1:
            # the current fence already owns it and the log never bound it (an adopt of a lost
            # tail, re-decided otherwise): it is the incarnation's VM; adopt it (rule 8)
            _command(run, "adopt", cur.fence, owner.host, owner.vm_id, cur.spec)
        elif cur.vm_id != owner.vm_id:
            _command(run, "remove", owner.fence, owner.host, owner.vm_id, None)
        return
    # otherwise the VM does not exist for us (removed for good, or never made): our record of
    # it ends here; if it does exist after all, the next inventory brings it back
    if rec is not None and cmd.op != "survey":
        run.add(Released(rec.fence, cmd.vm_id, cmd.host, "fenced", cmd.id))
        if cur is not None and cur.fence == cmd.fence and not cur.deleting:
            _arm(run, cur.fence, PlaceTimer(), EFFECT_RETRY_S)
        else:
            _after_release(run)


def _retry(run: _Run, a: _Answer) -> None:
    """Inconclusive (or a remove that failed): the same op again for the VM's owner (rule 12), after
    a backoff (``retry_backoff_s``)."""
    if a.rec is not None:
        _arm(run, a.rec.fence, RetryTimer(a.cmd.op, a.cmd.vm_id), retry_backoff_s(a.rec.retries))


def _up_ok(run: _Run, a: _Answer) -> None:
    """A create, start or wake took: bound if its fence is current, else removed (no leak)."""
    s, cmd, rec, cur = run.s, a.cmd, a.rec, a.cur
    if rec is None or rec.state == "removing":
        return  # a remove is already queued behind it on the same host
    if cur is not None and cur.fence == cmd.fence and not cur.deleting and cur.vm_id == cmd.vm_id:
        run.add(Bound(cur.fence, cmd.vm_id, cmd.host, cmd.id, a.r.ip, a.r.vnc_port))
        _event(run, cur.fence, "Started", f"VM {cmd.vm_id} running on {cmd.host}")
        if cur.spec.hibernate:
            _hibernate(run, cur)
        elif a.r.ready and not cur.ready:
            # the runtime's probe right after the bring-up: ready with the binding, in one status
            # write (a ProbeChanged would say the same an append and a write later)
            run.add(ReadyChanged(cur.fence, True))
        return
    reason: SkipReason = "superseded" if s.is_tombstoned(cmd.fence.uid) else "stale_effect"
    run.add(Skipped(reason, cmd.fence.uid, f"{cmd.op} of {cmd.vm_id} finished after its fence ended"))
    if rec.fence == cmd.fence:
        # still the finished command's VM: remove it (no leak). One a successor adopted meanwhile
        # (a restart's answer re-sent from the agent's ledger after the adopt's) is the successor's
        # now: removing it would replace its VM for nothing (found by docs/mutants.md)
        _command(run, "remove", rec.fence, rec.host, rec.vm_id, None)


_UP_FAILED: dict[CommandOp, ReleaseReason] = {
    "create": "create_failed", "start": "start_failed", "wake": "wake_failed"
}


def _up_failed(run: _Run, a: _Answer) -> None:
    """A create, start or wake failed (or found no VM): release the claim, place again."""
    cmd, rec, cur = a.cmd, a.rec, a.cur
    cause = (a.r.error or f"{cmd.op} failed ({a.r.outcome})")[:MAX_CAUSE_CHARS]
    if rec is not None and rec.fence == cmd.fence:
        # a failed bring-up releases only a claim it still owns (rule 2): a start of a VM that a
        # successor adopted meanwhile (its answer re-sent from the agent's ledger after the
        # adopt's) must not release the successor's VM (tests/unit/test_rule2_claim.py)
        run.add(Released(cmd.fence, cmd.vm_id, cmd.host, _UP_FAILED[cmd.op], cmd.id))
    if cur is not None and cur.fence == cmd.fence and not cur.deleting:
        failures = cur.failures + 1
        backoff = create_backoff_s(failures)
        repeats = cur.failure_repeats + 1 if cause == cur.failure else 1
        run.add(BringUpFailed(cur.fence, cmd.vm_id, failures, backoff, cause, repeats))
        # one Event per cause, counting its repeats (Kubernetes' aggregation), not one per failure
        _event(run, cur.fence, "FailedCreate", cause, warning=True, count=repeats)
        _arm(run, cur.fence, PlaceTimer(), backoff)
    else:
        _after_release(run)


def _removed(run: _Run, a: _Answer) -> None:
    """The VM is gone from its host: released; a delete finishes or a successor comes up."""
    if a.rec is not None:
        run.add(Released(a.rec.fence, a.cmd.vm_id, a.cmd.host, "removed", a.cmd.id))
        _after_release(run)


def _hibernated(run: _Run, a: _Answer) -> None:
    """The snapshot is made and recorded in the log (rule 10); an answer without one failed."""
    cmd, rec, cur, snapshot = a.cmd, a.rec, a.cur, a.r.snapshot
    if rec is None:
        return
    if snapshot is None:
        _hibernate_failed(run, a)
        return
    run.add(Hibernated(rec.fence, cmd.vm_id, cmd.host, snapshot))
    if cur is not None and cur.fence == rec.fence:
        _event(run, cur.fence, "Hibernated", f"snapshot {snapshot} on {cmd.host}")
    _after_release(run)  # finishes a delete, or wakes if unhibernated meanwhile


def _hibernate_failed(run: _Run, a: _Answer) -> None:
    """The VM keeps running: bound again if its fence is current, else removed."""
    cmd, rec, cur = a.cmd, a.rec, a.cur
    if rec is None:
        return
    run.add(Skipped("hibernate_failed", a.r.fence.uid, a.r.error or ""))
    if cur is not None and cur.fence == rec.fence and not cur.deleting:
        run.add(Bound(cur.fence, cmd.vm_id, cmd.host, cmd.id, cur.ip, cur.vnc_port))
    else:
        _command(run, "remove", rec.fence, rec.host, rec.vm_id, None)


def _adopted(run: _Run, a: _Answer) -> None:
    """The agent's inspect confirmed the VM (rule 8): it is the current incarnation's, or removed."""
    cmd, cur = a.cmd, a.cur
    if a.rec is None:
        return
    run.add(Adopted(cmd.fence, cmd.vm_id, cmd.host, cmd.id))
    if cur is None or cur.fence != cmd.fence or cur.deleting:
        _command(run, "remove", cmd.fence, cmd.host, cmd.vm_id, None)
        return
    run.add(Bound(cur.fence, cmd.vm_id, cmd.host, cmd.id, a.r.ip, a.r.vnc_port))
    _event(run, cur.fence, "Adopted", f"VM {cmd.vm_id} on {cmd.host}")
    state = next((i.state for i in a.r.found if i.vm_id == cmd.vm_id), "running")
    if state == "exited":
        # adopted while it was down (its predecessor's restart died with that
        # fence): the successor's restart policy takes over, or it stays down forever
        _on_exited(run, VMExited(cur.fence, cmd.host, cmd.vm_id, None))
    elif cur.spec.hibernate:
        _hibernate(run, cur)


def _adopt_lost(run: _Run, a: _Answer) -> None:
    """The runtime does not know the VM: it leaves the index; a new one is made (rule 8)."""
    if a.rec is not None:
        run.add(Released(a.rec.fence, a.cmd.vm_id, a.cmd.host, "lost", a.cmd.id))
        _after_release(run)


def _adopt_again(run: _Run, a: _Answer) -> None:
    """An inconclusive inspect is retried, never trusted (rule 8), after a backoff (``retry_backoff_s``)."""
    if run.s.is_current(a.cmd.fence):
        retries = a.rec.retries if a.rec is not None else 0
        _arm(run, a.cmd.fence, AdoptTimer(a.cmd.vm_id), retry_backoff_s(retries))
    else:
        _retry(run, a)


def _inspected(run: _Run, a: _Answer) -> None:
    """The runtime knows the VM: the inventory that lacked it was wrong (or raced a change); the
    binding stands and nothing else is done."""


def _inspect_gone(run: _Run, a: _Answer) -> None:
    """The runtime confirmed the VM is gone: the VM-gone path (rule 7), as if its host had said so."""
    _on_gone(run, VMGone(a.cmd.fence, a.cmd.host, a.cmd.vm_id))


def _surveyed(run: _Run, a: _Answer) -> None:
    """A host said what it has of the key: each VM unknown to the log is discovered."""
    s = run.s
    for item in a.r.found:
        if item.vm_id not in s.vms:
            _discover(run, item, a.rebuilding)
    if not s.rebuilding and not _verifying(s):
        _after_release(run)  # (still unverified after a round from an older epoch: another)


def _resurvey(run: _Run, a: _Answer) -> None:
    """A survey without an answer is asked again: no VM is made on a guess. One retry at a time (its
    round asks every host again), after a backoff per round with a failed answer
    (``retry_backoff_s``): a retry per failed answer, each asking every host, doubled the surveys
    every round while hosts did not answer."""
    if survey_retry_armed(run.s):
        return
    _arm(run, a.cmd.fence, SurveyTimer(), retry_backoff_s(run.s.survey_failures - 1))


def _rec_on(s: KeyState, vm_id: str, host: str) -> VMRec | None:
    """The key's record of ``vm_id`` if it is the VM on ``host``: after a cut nobody saw, a name the
    lost tail gave a VM (since lost or removed) may be given again on another host; news about the
    old one must not touch the new one's record."""
    rec = s.vms.get(vm_id)
    return rec if rec is not None and rec.host == host else None


def _after_release(run: _Run) -> None:
    """A VM left the key: finish a delete, or bring up the successor that waited for it."""
    s = run.s
    cur = s.cur
    if cur is None:
        return
    if cur.delete_claim:
        if not s.rebuilding and not _vms_of(s, cur) and not _verify_first(run):
            _finish_delete(run, cur)
        return
    _bring_up(run)


# The sections' rules call each other (a bring-up may wake, a wake may survey first, a VM found
# gone is brought up again): each imports the others' after its own definitions, so the
# package imports in any order.
from shared.fence.decide.bringup import _bring_up, _verify_first, _verifying  # noqa: E402
from shared.fence.decide.deletes import _finish_delete, _vms_of  # noqa: E402
from shared.fence.decide.hibernation import _hibernate  # noqa: E402
from shared.fence.decide.inventory import _discover  # noqa: E402
from shared.fence.decide.lifecycle import _on_exited, _on_gone  # noqa: E402
