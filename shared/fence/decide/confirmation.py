"""Confirmation (rule 3): only a consistent read's answer admits a new uid or supersedes the old."""

from __future__ import annotations

from shared.fence.decide.bringup import _bring_up
from shared.fence.decide.deletes import _delete_path, _remove_hibernated
from shared.fence.decide.inventory import _collect_discovered
from shared.fence.decide.run import _command, _event, _Run
from shared.fence.schema import Admitted, ConfirmedRead, ConfirmRequested, Done, Failed, Fence, Skipped, Superseded


def _on_confirmed(run: _Run, r: ConfirmedRead) -> None:
    if not isinstance(run.s.outbox.get(r.request), ConfirmRequested):
        return  # a redelivered read
    _confirmed(run, r)
    _collect_discovered(run)


def _confirmed(run: _Run, r: ConfirmedRead) -> None:
    s = run.s
    asked = s.outbox.get(r.request)
    assert isinstance(asked, ConfirmRequested)
    run.add(Done(r.request, "confirmed" if r.uid else "absent"))
    seen = asked.seen_uid
    if seen != r.uid and not s.is_tombstoned(seen) and (s.cur is None or s.cur.fence.uid != seen):
        # seen before the read was issued, absent from it: that incarnation is already dead
        run.add(Superseded(Fence(s.key, seen, 0), by_uid=r.uid))
    cur = s.cur
    if r.uid is None:
        if cur is not None and asked.at < cur.admitted_at:
            # asked before the current incarnation was admitted: absence then says nothing now
            run.add(Skipped("stale_read", cur.fence.uid, "an older read found the name empty"))
        elif cur is not None:
            _delete_path(run, cur, gone=True)
    elif cur is not None and cur.fence.uid == r.uid:
        if r.deleting:
            _delete_path(run, cur, gone=False)
    elif s.is_tombstoned(r.uid):
        run.add(Skipped("superseded", r.uid, "consistent read returned a tombstoned uid"))
    elif r.resource_version < s.admitted_rv:
        # older than an incarnation already admitted (resourceVersions are etcd revisions): a read
        # answered before a later one was applied. Its uid is dead; never admit it.
        run.add(Superseded(Fence(s.key, r.uid, 0), by_uid=cur.fence.uid if cur else None))
    else:
        _admit(run, r)


def _admit(run: _Run, r: ConfirmedRead) -> None:
    s = run.s
    assert r.uid is not None
    prev = s.cur
    adopt_vm: str | None = None
    if prev is not None:
        _remove_hibernated(run, prev)  # its saved VM, snapshot and address: the successor never wakes it
        run.add(Superseded(prev.fence, by_uid=r.uid))
        _event(run, prev.fence, "Superseded", f"replaced by incarnation {r.uid}", warning=False)
        if r.spec.on_recreate == "adopt" and not r.deleting and prev.vm_id in s.vms and prev.bound:
            adopt_vm = prev.vm_id
    if adopt_vm is None and not r.deleting and r.invalid is None:
        # a VM known only from an agent (a lost log tail), waiting for this read: the admitted
        # incarnation's own, or with on-recreate adopt its predecessor's, is adopted (rule 8)
        found = [rec for rec in s.vms.values() if rec.state == "discovered"]
        own = [rec for rec in found if rec.fence.uid == r.uid]
        if own or (r.spec.on_recreate == "adopt" and len(found) == 1 and len(s.vms) == 1):
            adopt_vm = (own or found)[0].vm_id
    fence = Fence(s.key, r.uid, s.epoch + 1)
    run.add(Admitted(fence, r.spec, r.invalid, r.resource_version))
    cur = s.cur
    assert cur is not None
    # predecessor VMs: adopt the bound one if asked to, remove the rest (rule 8 default: replace)
    for rec in list(s.vms.values()):
        if rec.vm_id != adopt_vm and (rec.fence.uid == r.uid or rec.state == "removing"):
            continue
        if rec.vm_id == adopt_vm:
            _command(run, "adopt", fence, rec.host, rec.vm_id, cur.spec)
        else:
            _command(run, "remove", rec.fence, rec.host, rec.vm_id, None)
    if r.invalid is not None:
        run.add(Failed(fence, "InvalidSpec", r.invalid))
        _event(run, fence, "InvalidSpec", r.invalid, warning=True)
        if r.deleting:
            _delete_path(run, cur, gone=False)
        return
    if r.spec.unsupported is not None:
        _event(run, fence, "Unsupported", r.spec.unsupported, warning=True)
    if r.deleting:
        _delete_path(run, cur, gone=False)
        return
    _bring_up(run)
