"""Ops that make a VM run: create, start, wake. A vm_id that was buried is never brought back (the
executor's fence check refuses it before a step runs)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from services.agent.labels import labels_fence
from services.agent.ledger import VMRow
from services.agent.ops.base import UP_STATES, Answer, Step

if TYPE_CHECKING:
    from services.agent.executor import Executor
    from shared.fence.schema import Command, CommandResult


class Create(Step):
    """A VM for the command's fence; the one the runtime already has if it has it."""

    async def run(self, ex: Executor, cmd: Command, row: VMRow | None) -> CommandResult:
        if row is None:
            # look: the runtime may have it although the ledger does not (ledger lost/replaced)
            info = await ex.inspect(cmd.vm_id)
            if info is not None:
                ex.check_owner(cmd, labels_fence(info.labels))
            row = VMRow(vm_id=cmd.vm_id, fence=cmd.fence, state="creating", spec=cmd.spec, command_id=cmd.id)
        elif row.state not in (*UP_STATES, "exited"):
            row = replace(row, state="creating", command_id=cmd.id)
        spec = await ex.spec_with_address(cmd)  # reserved before the VM starts (rule 9)
        return await ex.bring_up(cmd, row, "create", lambda: ex.driver.create(spec))


class Start(Step):
    """The ledger's VM running again (an exited VM restarted in place, rule 7)."""

    async def run(self, ex: Executor, cmd: Command, row: VMRow | None) -> CommandResult:
        row = ex.require(cmd, row)
        info = await ex.inspect(cmd.vm_id)
        if info is None:
            return await ex.lost(cmd, row, "the runtime no longer knows this VM")
        if info.state not in UP_STATES:
            info = await ex.effect("start", ex.driver.start(cmd.vm_id))
        return await ex.record_up(cmd, replace(row, command_id=cmd.id), info)


class Wake(Step):
    """A hibernated VM restored from its snapshot — never a blank VM (rule 10)."""

    async def run(self, ex: Executor, cmd: Command, row: VMRow | None) -> CommandResult:
        snapshot = cmd.snapshot
        if not snapshot:
            raise Answer("failed", "wake without a snapshot (never a blank VM)")
        if row is not None and row.state in UP_STATES:
            _, info = await ex.peek(cmd.vm_id)
            if info is not None and info.state in UP_STATES:
                return await ex.record(cmd, "ok", info=info, put=ex.row(row, info))
        intent = VMRow(vm_id=cmd.vm_id, fence=cmd.fence, state="waking", spec=cmd.spec, command_id=cmd.id)
        # the hibernated VM's address, which the restored guest has configured (same incarnation)
        spec = await ex.spec_with_address(cmd, snapshot=snapshot)
        result = await ex.bring_up(cmd, intent, "restore", lambda: ex.driver.restore(spec, snapshot))
        if result.outcome == "ok":
            # the woken VM runs from its own copy of the disk: the snapshot has served (issue 12 §4)
            await ex.drop_snapshot(snapshot, cmd)
        return result
