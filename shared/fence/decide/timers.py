"""Timers (rule 12): the re-checks of ``_KEY_TIMERS``, ``_CURRENT_TIMERS`` and ``_REWRITES``
(``tables.py``): a timer re-checks, never destroys."""

from __future__ import annotations

from shared.fence.decide.bringup import _bring_up
from shared.fence.decide.deletes import _finish_delete
from shared.fence.decide.inventory import _survey
from shared.fence.decide.run import (
    _CARRIES_SNAPSHOT,
    _CARRIES_SPEC,
    _RETRY_WHILE_CURRENT,
    _command,
    _cur_of,
    _Run,
    status_of,
    wanted_status,
)
from shared.fence.schema import (
    AdoptTimer,
    Fence,
    KubeWrite,
    PlaceTimer,
    RestartTimer,
    RetryTimer,
    SurveyTimer,
    WriteRequested,
)
from shared.fence.state import Incarnation, status_write_out


def _timer_survey(run: _Run, fence: Fence, p: SurveyTimer) -> None:
    _survey(run)


def _timer_retry(run: _Run, fence: Fence, p: RetryTimer) -> None:
    """The op again, for the VM's owner as long as it still owns it (a predecessor's remove too),
    carrying what the first one carried: the incarnation's spec (a create must not come back as a
    default VM) and, for a wake, the snapshot in the log (rule 10: never a blank VM)."""
    s = run.s
    rec = s.vms.get(p.vm_id)
    if rec is not None and rec.fence == fence and (p.op not in _RETRY_WHILE_CURRENT or s.is_current(fence)):
        cur = _cur_of(s, fence)
        spec = cur.spec if cur is not None and p.op in _CARRIES_SPEC else None
        snapshot = cur.snapshot if cur is not None and p.op in _CARRIES_SNAPSHOT else None
        _command(run, p.op, rec.fence, rec.host, p.vm_id, spec, snapshot)


def _timer_place(run: _Run, fence: Fence, p: PlaceTimer) -> None:
    _bring_up(run)


def _timer_restart(run: _Run, fence: Fence, p: RestartTimer) -> None:
    """The backoff is over: start the VM in place, unless it changed or a delete began."""
    cur, rec = run.s.cur, run.s.vms.get(p.vm_id)
    if cur is not None and rec is not None and cur.vm_id == p.vm_id and not cur.deleting:
        _command(run, "start", cur.fence, rec.host, p.vm_id, cur.spec)


def _timer_adopt(run: _Run, fence: Fence, p: AdoptTimer) -> None:
    """Inspect again before adopting (rule 8). If the incarnation it was for is being deleted (or
    is gone) the VM was never taken over: it is collected under the fence that still owns it (an
    adopt that did land after all makes the host refuse this remove and name its owner, whose
    remove follows) -- never left half adopted beside a finished delete."""
    cur, rec = run.s.cur, run.s.vms.get(p.vm_id)
    if rec is None:
        return
    if cur is not None and not cur.deleting:
        _command(run, "adopt", cur.fence, rec.host, p.vm_id, cur.spec)
    elif rec.state == "adopting":
        _command(run, "remove", rec.fence, rec.host, p.vm_id, None)


def _rewrite_status(run: _Run, cur: Incarnation) -> None:
    # the status the pod should show, as _sync_status words it (a waiting pod's reason and message):
    # with bare status_of, _sync_status saw a difference and requested a second write beside this
    # one, and under failing writes each rewrite doubled the writes in flight. A status write
    # requested since (a change of status) already carries what is wanted: no second beside it.
    if status_write_out(run.s, cur.fence):
        return
    status = wanted_status(run.s, cur) or status_of(cur)
    write = KubeWrite(run.effect_id("status"), "status", cur.fence, status=status)
    run.add(WriteRequested(write))


def _rewrite_delete(run: _Run, cur: Incarnation) -> None:
    _finish_delete(run, cur)


def _rewrite_bind(run: _Run, cur: Incarnation) -> None:
    """A binding that failed for no named reason: place and bind again, unless the pod got its node
    meanwhile (a scheduler's binding observed) or needs none any more."""
    _bring_up(run)


def _rewrite_evict(run: _Run, cur: Incarnation) -> None:
    """Only while the eviction is still wanted: no delete claim came meanwhile (rule 7)."""
    if cur.evicting and not cur.delete_claim:
        run.add(WriteRequested(KubeWrite(run.effect_id("evict"), "evict", cur.fence, message="VM gone")))
