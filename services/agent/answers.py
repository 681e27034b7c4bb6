"""Answers the agent gives on core NATS request/reply (not streams): what it has right now.

``vmfence verify`` asks every live host for its inventory and compares it with the log. The answer
is read-only — the ledger's rows and the runtime's list, nothing probed, checked or published — so
asking can never change what the agent does; NATS permissions let only read-only identities ask
and only this host's agent answer (deploy/nats/accounts.conf).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import msgspec
from nats.aio.msg import Msg

from services.agent.labels import labels_fence
from services.agent.ledger import Ledger
from services.agent.runtime.base import RuntimeDriver
from shared.fence.drift import HostVM, InventoryAnswer

log = logging.getLogger(__name__)

ANSWER_TIMEOUT_S = 10.0  # the runtime's list, bounded: a hung driver answers nothing, not forever
_encode = msgspec.json.Encoder().encode


async def inventory_answer(host: str, ledger: Ledger, driver: RuntimeDriver) -> InventoryAnswer:
    """The ledger's VMs with their owners and the runtime's states, plus VMs only the runtime has
    (known by their labels)."""
    listed = {i.vm_id: i for i in await asyncio.wait_for(driver.list(), ANSWER_TIMEOUT_S)}
    vms: list[HostVM] = []
    for row in ledger.vms():
        info = listed.pop(row.vm_id, None)
        # a row the runtime does not list is no VM: "absent" is not a live state for drift
        vms.append(HostVM(row.vm_id, row.fence.key, row.fence.uid, info.state if info is not None else "absent"))
    for vm_id, info in sorted(listed.items()):
        fence = labels_fence(info.labels)
        vms.append(HostVM(vm_id, fence.key if fence else "", fence.uid if fence else "", info.state))
    return InventoryAnswer(host=host, vms=vms)


def inventory_responder(host: str, ledger: Ledger, driver: RuntimeDriver) -> Callable[[Msg], Awaitable[None]]:
    async def respond(msg: Msg) -> None:
        if not msg.reply:
            return
        try:
            answer = await inventory_answer(host, ledger, driver)
        except Exception as exc:  # the question failed, the agent goes on
            log.warning("inventory query not answered: %r", exc, extra={"host": host, "event": "inventory_query"})
            return
        await msg.respond(_encode(answer))

    return respond
