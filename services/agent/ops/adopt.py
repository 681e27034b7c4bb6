"""Adopt: a newer fence takes over a VM it found by name, only after the runtime confirms the VM
exists (rule 8) — a ledger row alone is never trusted."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from services.agent.labels import labels_fence
from services.agent.ledger import VMRow
from services.agent.logs import fence_fields
from services.agent.ops.base import Answer, Step
from shared.fence.schema import Inventoried

if TYPE_CHECKING:
    from services.agent.executor import Executor
    from shared.fence.schema import Command, CommandResult

log = logging.getLogger("vmfence.agent.executor")


class Adopt(Step):
    """Ownership of the VM (row and reservations) moved to the command's fence."""

    async def run(self, ex: Executor, cmd: Command, row: VMRow | None) -> CommandResult:
        info = await ex.inspect(cmd.vm_id, failure="inconclusive")  # an unsure runtime: retried
        if info is None:
            return await ex.lost(cmd, row, "the runtime does not know this VM")
        tomb = ex.ledger.tombstone(cmd.vm_id)
        if tomb is not None:
            raise Answer("fenced", f"vm {cmd.vm_id} was {tomb.reason}")
        if row is None:
            ex.check_owner(cmd, labels_fence(info.labels))
        base = row or VMRow(vm_id=cmd.vm_id, fence=cmd.fence, state=info.state, spec=cmd.spec)
        # the adopter learns the VM's run state: an exited VM needs its restart policy applied
        result = await ex.record(
            cmd, "ok", info=info, found=[Inventoried(cmd.fence, ex.host, cmd.vm_id, info.state)],
            put=ex.row(base, info, fence=cmd.fence, command_id=cmd.id), transfer_to=cmd.fence,
            claim=ex.claims(info) if row is None else (),
        )
        log.info("adopted: ownership moved", extra=fence_fields(
            cmd.fence, cmd.vm_id, command_id=cmd.id, event="adopted",
            outcome=f"from epoch {row.fence.epoch if row else '?'}"))
        return result
