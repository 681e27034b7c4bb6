"""Ops that take a VM away: remove (collect) and hibernate (snapshot it into the store, rule 10).
Both record their intent first, so the exit they cause is expected, not news, and put the row back
when the runtime fails."""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

from services.agent.labels import labels_fence
from services.agent.ops.base import Step

if TYPE_CHECKING:
    from services.agent.executor import Executor
    from services.agent.ledger import VMRow
    from shared.fence.schema import Command, CommandResult, Fence, ResultOutcome


class Remove(Step):
    """No VM under this vm_id, and a tombstone so a late create is refused."""

    async def run(self, ex: Executor, cmd: Command, row: VMRow | None) -> CommandResult:
        owner: Fence | None
        if row is not None:
            owner = row.fence
        else:
            info = await ex.inspect(cmd.vm_id)
            if info is None:
                tomb = ex.ledger.tombstone(cmd.vm_id)
                if tomb is not None and tomb.reason == "hibernated" and _may_collect(cmd.fence, tomb.fence):
                    # the pod of a hibernated VM went: its snapshot and the address it kept go too
                    snapshot = os.path.join(ex.snapshot_dir, f"{cmd.vm_id}.snap")
                    await ex.drop_snapshot(snapshot, cmd, successor_ok=True)
                    await ex.release_address(cmd.vm_id, tomb.fence)
                # unknown (or already removed): tombstone anyway so a late create is refused
                outcome: ResultOutcome = "ok" if tomb else "not_found"
                return await ex.record(cmd, outcome, bury=("removed", cmd.fence))
            owner = labels_fence(info.labels)
            ex.check_owner(cmd, owner)
        await ex.transition(row, "removing", "remove", lambda: ex.driver.remove(cmd.vm_id))
        return await ex.record(cmd, "ok", bury=("removed", owner or cmd.fence))


def _may_collect(fence: Fence, owner: Fence) -> bool:
    """A remove under ``fence`` may collect what the hibernated VM of ``owner`` kept: the same
    incarnation, or a later epoch of the same key."""
    return fence.key == owner.key and (fence.uid == owner.uid or fence.epoch > owner.epoch)


class Hibernate(Step):
    """The VM's memory and disk in the snapshot store, the VM gone, the snapshot's path answered."""

    async def run(self, ex: Executor, cmd: Command, row: VMRow | None) -> CommandResult:
        row = ex.require(cmd, row)
        dest = os.path.join(ex.snapshot_dir, f"{cmd.vm_id}.snap")
        info = await ex.inspect(cmd.vm_id)
        if info is None and row.state == "hibernating" and await asyncio.to_thread(os.path.exists, dest):
            # look: a previous attempt finished the snapshot and died before recording it
            return await ex.record(cmd, "ok", snapshot=dest, bury=("hibernated", row.fence))
        if info is None:
            return await ex.lost(cmd, row, "the runtime no longer knows this VM")
        await ex.ledger.reserve("snapshot", dest, cmd.vm_id, row.fence)
        snap = await ex.transition(row, "hibernating", "snapshot", lambda: ex.driver.snapshot(cmd.vm_id, dest))
        return await ex.record(cmd, "ok", snapshot=snap.path, bury=("hibernated", row.fence))
