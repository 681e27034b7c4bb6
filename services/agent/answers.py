"""Answers the agent gives on core NATS request/reply (not streams): what it has right now, and a
VM's VNC display to its owner fence.

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

from services.agent.config import VNC_BASE_PORT
from services.agent.labels import labels_fence
from services.agent.ledger import Ledger
from services.agent.runtime.base import RuntimeDriver
from shared.fence.drift import HostVM, InventoryAnswer
from shared.fence.vnc import MAX_VNC_QUERY_BYTES, VNC_REPLY_PREFIX, VncAnswer, VncQuery

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


_vnc_query = msgspec.json.Decoder(VncQuery)


async def vnc_answer(query: VncQuery, ledger: Ledger, listen: str) -> VncAnswer:
    """The display of ``query.vm_id`` and its password, only to the ledger's owner fence of that VM
    and of its display's reservation (rule 9). An unknown VM gets the same refusal as a wrong fence:
    the answer tells a stranger nothing about which VMs exist."""
    owner = ledger.owner(query.vm_id)
    if owner is None or owner != query.fence:
        return VncAnswer(query.vm_id, refused="not_owner")
    display = [r for r in await ledger.reservations(query.vm_id) if r.kind == "vnc"]
    if not display or display[0].fence != query.fence or not display[0].secret:
        return VncAnswer(query.vm_id, refused="no_display")
    res = display[0]
    return VncAnswer(query.vm_id, listen=listen, port=VNC_BASE_PORT + int(res.resource), password=res.secret or "")


def vnc_responder(host: str, ledger: Ledger, listen: str) -> Callable[[Msg], Awaitable[None]]:
    """Answer ``vmfence vnc`` (``Subjects.vnc_query(host)``). Logs who asked for what and the
    outcome, never the password; answers only on a reply subject under VNC_REPLY_PREFIX."""

    async def respond(msg: Msg) -> None:
        if not msg.reply:
            return
        extra: dict[str, object] = {"host": host, "event": "vnc_query"}
        if not msg.reply.startswith(VNC_REPLY_PREFIX + "."):
            log.warning("vnc query refused: its reply subject is not private", extra=extra)
            await msg.respond(_encode(VncAnswer("", refused="reply_not_private")))
            return
        try:
            if len(msg.data) > MAX_VNC_QUERY_BYTES:
                raise msgspec.ValidationError(f"{len(msg.data)} bytes > {MAX_VNC_QUERY_BYTES}")
            query = _vnc_query.decode(msg.data)
        except msgspec.MsgspecError as exc:
            log.warning("vnc query refused: %s", exc, extra=extra)
            await msg.respond(_encode(VncAnswer("", refused="bad_request")))
            return
        try:
            answer = await vnc_answer(query, ledger, listen)
        except Exception as exc:  # the question failed, the agent goes on
            log.warning("vnc query not answered: %r", exc, extra={**extra, "vm_id": query.vm_id})
            return
        log.info("vnc query %s", answer.refused or "answered",
                 extra={**extra, "vm_id": query.vm_id, "key": query.fence.key, "uid": query.fence.uid,
                        "epoch": query.fence.epoch})
        await msg.respond(_encode(answer))

    return respond
