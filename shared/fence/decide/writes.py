"""Kubernetes writes (rule 6): the rules of ``_WRITES`` (``tables.py``) for a write's outcome."""

from __future__ import annotations

import msgspec

from shared.fence.decide.bringup import _bring_up
from shared.fence.decide.deletes import _delete_path, _forget
from shared.fence.decide.observations import _request_confirm
from shared.fence.decide.run import _arm, _event, _Run, rewrite_backoff_s
from shared.fence.schema import KubeWrite, RewriteTimer, Skipped, SpecChanged
from shared.fence.state import Incarnation, status_write_out


def _written(run: _Run, cur: Incarnation, write: KubeWrite) -> None:
    """The write took; the final delete of the object ends the incarnation; a binding makes the
    pod's node true, and only then is its VM made, on that node."""
    if write.verb == "delete":
        _forget(run, cur)
    elif write.verb == "bind" and write.node is not None:
        _bound_to(run, cur, write.node)
        _event(run, cur.fence, "Scheduled", f"Successfully assigned {cur.fence.key} to {write.node}")


def _bound_to(run: _Run, cur: Incarnation, node: str) -> None:
    """The pod's nodeName is ``node`` (our binding took, or another binder's did): recorded, and
    the VM brought up there — on no other host."""
    if cur.spec.node is None:
        run.add(SpecChanged(cur.fence, msgspec.structs.replace(cur.spec, node=node), cur.rv))
    _bring_up(run)


def _write_superseded(run: _Run, cur: Incarnation, write: KubeWrite) -> None:
    """Conflict/Invalid on a uid-carrying write: another incarnation owns the name; ask who."""
    run.add(Skipped("superseded_write", cur.fence.uid, f"{write.verb} hit another incarnation"))
    _request_confirm(run, cur.fence.uid)


def _write_gone(run: _Run, cur: Incarnation, write: KubeWrite) -> None:
    """NotFound: the object is gone; the delete path removes the VM."""
    _delete_path(run, cur, gone=True)


def _write_failed(run: _Run, cur: Incarnation, write: KubeWrite, node: str | None = None) -> None:
    """Any other failure: the same write again later (a timer: re-check, never destroy), backing
    off per failure in a row (``rewrite_backoff_s``; the Done before this counted it). A binding
    refused because the pod is bound already (409: a scheduler, or another reconciler, was first)
    names that node: the VM goes there or nowhere, never to the host this binding picked. A
    failed status write is not retried while a newer one is out or a rewrite is armed: that one
    writes the status wanted when it goes."""
    if write.verb == "bind" and node is not None:
        _bound_to(run, cur, node)
        return
    if write.verb == "status" and status_write_out(run.s, cur.fence):
        return
    _arm(run, cur.fence, RewriteTimer(write.verb), rewrite_backoff_s(cur.write_failures))
