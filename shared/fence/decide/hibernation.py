"""Hibernation (rule 10): a hibernate records snapshot and host in the log; a wake restores from it."""

from __future__ import annotations

from shared.fence.decide.run import PLACE_RETRY_S, _arm, _command, _place_pending, _Run
from shared.fence.schema import Command, Commanded, Placed, PlaceTimer
from shared.fence.state import Incarnation
from shared.fence.state import vm_name as _vm_name


def _hibernate(run: _Run, cur: Incarnation) -> None:
    rec = run.s.vms.get(cur.vm_id or "")
    if rec is None or rec.state != "running" or not cur.bound or cur.deleting:
        return
    _command(run, "hibernate", cur.fence, rec.host, rec.vm_id, cur.spec)


def _wake(run: _Run, cur: Incarnation) -> None:
    """Waking restores from the snapshot in the log — never a blank VM."""
    s = run.s
    if not cur.hibernated or cur.snapshot is None or cur.deleting or cur.spec.hibernate or s.rebuilding:
        return
    if any(rec for rec in s.vms.values()):
        return
    if cur.vm_id is not None or _place_pending(s, cur.fence):
        return
    if _verify_first(run):
        return
    host = cur.snapshot_host or _place(run.env, cur.spec)[0]
    if host is None:
        _arm(run, cur.fence, PlaceTimer(), PLACE_RETRY_S)
        return
    # a restored VM is a new VM instance: it gets a new name, names are never reused
    vm_id = _vm_name(s.key, cur.fence.uid, cur.gen + 1)
    run.add(Placed(cur.fence, vm_id, host))
    cmd = Command(
        id=run.effect_id(cur.fence.uid, cur.fence.epoch, "wake", vm_id),
        op="wake",
        fence=cur.fence,
        host=host,
        vm_id=vm_id,
        spec=cur.spec,
        snapshot=cur.snapshot,
    )
    run.add(Commanded(cmd))


# The sections' rules call each other (a bring-up may wake, a wake may survey first, a VM found
# gone is brought up again): each imports the others' after its own definitions, so the
# package imports in any order.
from shared.fence.decide.bringup import _place, _verify_first  # noqa: E402
