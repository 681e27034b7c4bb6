"""Issue 10, finding 9: the VNC password reaches its owner and nobody else. The agent answers
``Subjects.vnc_query(host)`` with a VM's display and password only to the ledger's owner fence of
that VM (rule 9): a predecessor's fence, another key's fence and an unknown VM get the same refusal,
an answer would go to a reply subject others may read gets none, and the password is in no log line."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
from nats.aio.client import Client

from services.agent.config import VNC_BASE_PORT, AgentConfig
from services.agent.service import Agent
from services.cli.vnc import ask
from shared.bus.connect import Bus
from shared.fence.schema import CommandResult, Fence, Input
from shared.fence.vnc import VNC_REPLY_PREFIX, VncQuery
from shared.logs import setup_logging
from shared.subjects import Subjects
from tests.runtime.rfb import OPENSSL, SEC_VNC_AUTH, security_types, vnc_login

from .conftest import HOST, Reports, command, fence, send, sim_driver
from .test_vnc_reservation import QEMU_MISSING, qemu_leftovers  # noqa: F401 - a fixture: kills a VM a failed test leaves


def is_result(cid: str) -> Callable[[Input], bool]:
    return lambda i: isinstance(i, CommandResult) and i.command_id == cid


async def run(nc: Client, reports: Reports, cmd: object) -> str:
    await send(nc, cmd)  # type: ignore[arg-type]
    r = await reports.wait(is_result(cmd.id))  # type: ignore[attr-defined]
    assert isinstance(r, CommandResult)
    return r.outcome


async def test_vnc_password_only_to_the_owner_fence(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig], caplog: pytest.LogCaptureFixture
) -> None:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    setup_logging("json", "debug")  # as `vmfence agent --log-level debug` logs
    root.addHandler(caplog.handler)
    try:
        password = await _ask_as_owner_and_others(nc, reports, make_config)
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    logged = "\n".join(r.getMessage() + repr(r.__dict__) for r in caplog.records)
    assert "vnc query answered" in logged and "vnc query not_owner" in logged
    assert password not in logged, "a VNC password reached the log"


async def _ask_as_owner_and_others(nc: Client, reports: Reports, make_config: Callable[..., AgentConfig]) -> str:
    """Ask as the owner, a predecessor, another key and for an unknown VM; the owner's password."""
    cfg = make_config(vnc_listen="127.0.0.1")
    old, new = fence(1), fence(2)
    bus = Bus(nc=nc, js=nc.jetstream(), subjects=Subjects())
    async with Agent(cfg, driver=sim_driver(cfg)) as agent:
        assert await run(nc, reports, command("create", "v-1", old)) == "ok"
        assert await run(nc, reports, command("adopt", "v-1", new)) == "ok"  # the successor owns it now
        password = await agent.ledger.vnc_password("v-1")
        (display,) = [r for r in await agent.ledger.reservations("v-1") if r.kind == "vnc"]
        assert password

        answer = await ask(bus, HOST, VncQuery("v-1", new))
        assert answer.refused is None
        assert (answer.vm_id, answer.listen, answer.port, answer.password) == (
            "v-1", "127.0.0.1", VNC_BASE_PORT + int(display.resource), password)

        # the predecessor's fence, another key's fence (same uid and epoch), an unknown VM: refused alike
        for vm_id, asked in (("v-1", old), ("v-1", Fence("default/other", new.uid, new.epoch)),
                             ("v-1", Fence(new.key, "uid-forged", new.epoch)), ("v-9", new)):
            refused = await ask(bus, HOST, VncQuery(vm_id, asked))
            assert (refused.refused, refused.password, refused.port) == ("not_owner", "", 0), (vm_id, asked)

        # an answer on _INBOX.> (which every identity may read) carries no password
        reply = await nc.request(Subjects().vnc_query(HOST), b'{"vm_id": "v-1", "fence": ["default/web", "uid-2", 2]}',
                                 timeout=5)
        assert password.encode() not in reply.data and b"reply_not_private" in reply.data
        # a malformed question is refused, the agent goes on
        sub = await nc.subscribe(f"{VNC_REPLY_PREFIX}.bad", max_msgs=1)
        await nc.publish(Subjects().vnc_query(HOST), b"{not json", reply=f"{VNC_REPLY_PREFIX}.bad")
        bad = await sub.next_msg(timeout=5)
        assert b"bad_request" in bad.data and password.encode() not in bad.data
        assert (await ask(bus, HOST, VncQuery("v-1", new))).password == password
    return password


@pytest.mark.qemu
@pytest.mark.skipif(QEMU_MISSING, reason="qemu-system-x86_64 / qemu-img not installed")
@pytest.mark.skipif(OPENSSL is None, reason="openssl not installed")
@pytest.mark.usefixtures("qemu_leftovers")
async def test_the_answered_password_opens_the_qemu_vms_display(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig]
) -> None:
    """What `vmfence vnc` is told (address, port, password) opens the real VM's display; what a
    predecessor's fence is told opens nothing."""
    cfg = make_config(runtime="qemu", accel="tcg", vnc_range=range(80, 90), vnc_listen="127.0.0.1")  # 5980-5989
    old, new = fence(1), fence(2)
    bus = Bus(nc=nc, js=nc.jetstream(), subjects=Subjects())
    async with Agent(cfg):
        await send(nc, command("create", "q-ask", old))
        created = await reports.wait(is_result(command("create", "q-ask", old).id), 60)
        assert isinstance(created, CommandResult) and created.outcome == "ok", created
        assert await run(nc, reports, command("adopt", "q-ask", new)) == "ok"
        answer = await ask(bus, HOST, VncQuery("q-ask", new))
        assert answer.refused is None and answer.port == created.vnc_port
        assert await security_types(answer.listen, answer.port) == [SEC_VNC_AUTH]
        assert await vnc_login(answer.listen, answer.port, answer.password)
        stale = await ask(bus, HOST, VncQuery("q-ask", old))
        assert stale.refused == "not_owner" and not stale.password
        assert (await run(nc, reports, command("remove", "q-ask", new))) == "ok"
