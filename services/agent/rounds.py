"""What a host's inventory round names, item by item: every VM of the ledger and of the runtime's
listing, paced (``pace.py``), each read from the ledger when its item goes. A paced round lasts
longer than the listing stays true: a VM removed since the round began is not named (the
reconciler would discover a stale "running" of a VM its log forgot, and remove it again)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from services.agent.labels import labels_fence
from services.agent.ledger import TRANSIENT_STATES, Ledger
from services.agent.pace import Pace
from services.agent.runtime import VMInfo
from shared.fence.schema import Fence

log = logging.getLogger("vmfence.agent")


async def round_items(ledger: Ledger, listed: dict[str, VMInfo], rate: float, within_s: float,
                      sleep: Callable[[float], Awaitable[bool]]) -> AsyncIterator[tuple[str, Fence, str]]:
    """(vm_id, fence, state) of each VM the round names, at ``rate`` a second but never so slow that
    the round outlasts ``within_s`` (the interval: rounds then start at most two intervals apart, inside
    the reconciler's stale sweep); ends early when ``sleep`` says stop (the round is then left
    incomplete, as an agent that died in it would leave it). ``rate`` 0: unpaced."""
    in_ledger = {r.vm_id for r in ledger.vms()}
    named = sorted(in_ledger | listed.keys())
    pace = Pace(max(rate, len(named) / within_s) if rate > 0 else 0.0)
    for vm_id in named:
        if await pace.next(sleep):
            return
        row, info = ledger.vm(vm_id), listed.get(vm_id)
        if row is not None:
            yield vm_id, row.fence, row.state if row.state in TRANSIENT_STATES or info is None else info.state
        elif vm_id in in_ledger:
            continue  # removed since the round began (the ledger's row goes with the remove)
        elif info is not None:
            fence = labels_fence(info.labels)
            if fence is None:
                log.warning("inventory: VM without vmfence labels, not reported", extra={"vm_id": vm_id})
                continue
            yield vm_id, fence, info.state
