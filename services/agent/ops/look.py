"""Ops that only read: inspect (one VM) and survey (every VM of a key). They change no VM, so an
unsure runtime answers ``inconclusive`` (asked again), never ``failed``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.agent.labels import LABEL_KEY, labels_fence
from services.agent.ops.base import Answer, Step
from shared.fence.schema import Inventoried

if TYPE_CHECKING:
    from services.agent.executor import Executor
    from services.agent.ledger import VMRow
    from shared.fence.schema import Command, CommandResult


class Inspect(Step):
    """What the runtime says of the VM now."""

    async def run(self, ex: Executor, cmd: Command, row: VMRow | None) -> CommandResult:
        info = await ex.inspect(cmd.vm_id, failure="inconclusive")
        if info is None:
            raise Answer("not_found", "the runtime does not know this VM")
        return await ex.answer(cmd, "ok", info=info)


class Survey(Step):
    """Every VM of the command's key on this host (ledger and runtime), with its owner fence: what
    a reconciler rebuilding a lost log tail needs before it makes any VM."""

    # a question about now: a redelivered one is answered afresh (it changes no VM), never from
    # the ledger — a stored answer may predate a VM a lost log tail made. So its answer is not
    # stored either (nothing would read it: a write with an fsync per survey, two per new pod); what
    # must be durable before it is sent, the key's raised mark, the executor wrote before run()
    replay = False
    quiet = True

    async def run(self, ex: Executor, cmd: Command, row: VMRow | None) -> CommandResult:
        key = cmd.fence.key
        found = {r.vm_id: Inventoried(r.fence, ex.host, r.vm_id, r.state) for r in ex.ledger.vms_of(key)}
        for info in await ex.effect("list", ex.driver.list_labelled(LABEL_KEY, key), failure="inconclusive"):
            owner = labels_fence(info.labels)
            if info.vm_id not in found and owner is not None and owner.key == key:
                found[info.vm_id] = Inventoried(owner, ex.host, info.vm_id, info.state)
        return ex.result(cmd, "ok", found=sorted(found.values(), key=lambda i: i.vm_id))
