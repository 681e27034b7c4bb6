"""Deletes (rule 5): the delete claim, the VMs removed, the final delete, the incarnation forgotten."""

from __future__ import annotations

from shared.fence.decide.run import _command, _Run
from shared.fence.schema import DeleteClaimed, Done, Forgotten, KubeWrite, Skipped, WriteRequested
from shared.fence.state import Incarnation, KeyState, VMRec


def _delete_path(run: _Run, cur: Incarnation, *, gone: bool) -> None:
    s = run.s
    if cur.delete_claim:
        if gone and not _vms_of(s, cur):
            _forget(run, cur)
            return
        run.add(Skipped("delete_in_flight", cur.fence.uid, "a delete for this incarnation is in flight"))
        return
    run.add(DeleteClaimed(cur.fence))
    mine = _vms_of(s, cur)
    for rec in mine:
        if rec.state != "removing":
            _command(run, "remove", rec.fence, rec.host, rec.vm_id, None)
    if not mine and _remove_hibernated(run, cur):
        mine = _vms_of(s, cur)
        if gone:
            _forget(run, cur)  # the object is gone; the remove of its saved VM goes on under its fence
        return
    if not mine:
        if gone:
            _forget(run, cur)
        elif not s.rebuilding and not _verify_first(run):
            _finish_delete(run, cur)
        # else: a survey is out after a lost log tail (or, loaded from the log, to find one nobody
        # saw); a VM the lost tail made may still run, so the object stays until every host
        # answered (its answer finishes the delete)


def _remove_hibernated(run: _Run, cur: Incarnation) -> bool:
    """A hibernated incarnation that ends: its saved VM's host is told to remove it (the snapshot
    files and the address it kept go with it, owned by its fence: rule 9). True if commanded."""
    if not cur.hibernated or cur.hibernated_vm is None or cur.snapshot_host is None:
        return False
    if cur.hibernated_vm in run.s.vms:
        return False
    _command(run, "remove", cur.fence, cur.snapshot_host, cur.hibernated_vm, None)
    return True


def _vms_of(s: KeyState, cur: Incarnation) -> list[VMRec]:
    """The incarnation's VMs, also those a survey found under an epoch from before a rebuild."""
    return [rec for rec in s.vms.values() if rec.fence.uid == cur.fence.uid]


def _finish_delete(run: _Run, cur: Incarnation) -> None:
    """VMs are gone: remove the object as a kubelet does (grace 0, UID precondition)."""
    if any(
        isinstance(e, WriteRequested) and e.write.verb == "delete" and e.write.fence == cur.fence
        for e in run.s.outbox.values()
    ):
        return
    run.add(WriteRequested(KubeWrite(run.effect_id("delete"), "delete", cur.fence)))


def _forget(run: _Run, cur: Incarnation) -> None:
    if cur.eviction_deferred is not None:
        # a deferred eviction is resolved by the delete it waited for, and says so
        run.add(Done(f"eviction:{cur.eviction_deferred}", "resolved_by_delete"))
    run.add(Forgotten(cur.fence))


# The sections' rules call each other (a bring-up may wake, a wake may survey first, a VM found
# gone is brought up again): each imports the others' after its own definitions, so the
# package imports in any order.
from shared.fence.decide.bringup import _verify_first  # noqa: E402
