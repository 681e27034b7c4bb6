"""Observations (a watch event for the key): admit nothing, ask (rule 3); a spec change of the
current incarnation."""

from __future__ import annotations

import msgspec

from shared.fence.decide.run import _event, _Run
from shared.fence.schema import ConfirmRequested, Observed, Skipped, Spec, SpecChanged
from shared.fence.state import Incarnation


def _on_observed(run: _Run, o: Observed) -> None:
    s = run.s
    if s.is_tombstoned(o.uid):
        run.add(Skipped("superseded", o.uid, "observation of a superseded incarnation"))
        return
    cur = s.cur
    if cur is not None and cur.fence.uid == o.uid:
        if o.resource_version <= cur.rv and not o.gone:
            return  # not newer than what we folded: dropped, counted by the shell
        if o.gone and not cur.delete_claim:
            # gone without a graceful phase (a force delete): ask who owns the name now, so a
            # successor created right behind it is seen — and its on-recreate policy applies —
            # before the predecessor's VM is touched
            _request_confirm(run, o.uid)
            return
        if o.gone or o.deleting:
            _delete_path(run, cur, gone=o.gone)
            return
        _spec_change(run, cur, o.spec, o.resource_version, o.invalid)
        return
    if o.gone:
        return  # deletion of an incarnation we never admitted: nothing of ours to undo
    _request_confirm(run, o.uid)


def _request_confirm(run: _Run, uid: str) -> None:
    """Ask for a consistent read. Reads for one key run in order, so each answer is at least as new
    as the observation that asked for it; one read per unknown uid is enough."""
    if any(isinstance(e, ConfirmRequested) and e.seen_uid == uid for e in run.s.outbox.values()):
        return
    run.add(ConfirmRequested(request=run.effect_id("confirm"), seen_uid=uid, at=run.next_n))


def _spec_change(run: _Run, cur: Incarnation, spec: Spec, rv: int, invalid: str | None) -> None:
    if spec == cur.spec and invalid == cur.invalid:
        return  # e.g. our own status write coming back: nothing changed
    if invalid is not None:
        # the running VM keeps its last valid spec; the pod says why the change was refused
        run.add(SpecChanged(cur.fence, cur.spec, rv, invalid))
        _event(run, cur.fence, "InvalidSpec", invalid, warning=True)
        return
    old = cur.spec
    if old.node is not None and spec.node != old.node:
        # nodeName is immutable once set (the API server refuses a change); a pod bound through our
        # own binding keeps the node the binding gave it, whatever a stale object says
        spec = msgspec.structs.replace(spec, node=old.node)
        if spec == old:
            return
    run.add(SpecChanged(cur.fence, spec, rv))
    if spec.unsupported is not None and spec.unsupported != old.unsupported:
        _event(run, cur.fence, "Unsupported", spec.unsupported, warning=True)
    if spec.hibernate and not old.hibernate:
        _hibernate(run, cur)
    elif old.hibernate and not spec.hibernate:
        _wake(run, cur)
    elif old.node is None and spec.node is not None:
        _bring_up(run)  # the scheduler bound it: its VM comes up on that node


# The sections' rules call each other (a bring-up may wake, a wake may survey first, a VM found
# gone is brought up again): each imports the others' after its own definitions, so the
# package imports in any order.
from shared.fence.decide.bringup import _bring_up  # noqa: E402
from shared.fence.decide.deletes import _delete_path  # noqa: E402
from shared.fence.decide.hibernation import _hibernate, _wake  # noqa: E402
