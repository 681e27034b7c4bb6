"""Issue 10, finding 8: a command that keeps failing is redelivered with exponential backoff up to a
named bound (``command_attempts``) and then answered ``failed`` with its reason; an error that will
not heal is answered ``failed`` at once; an agent whose ledger cannot be written says it is not ready,
offers no capacity in its heartbeat and takes no new VM — and recovers when the ledger heals.

The fault is real SQLite: ``PRAGMA query_only`` on the agent's own connection makes every write fail
with ``attempt to write a readonly database`` (OperationalError), as a read-only or full disk does.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Callable
from pathlib import Path

import aiohttp
import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.agent.config import AgentConfig
from services.agent.delivery import heals, retry_delay
from services.agent.ledger import Ledger
from services.agent.runtime import VMInfo
from services.agent.runtime.sim import SimDriver
from services.agent.service import Agent
from shared.fence.heartbeat import HostHeartbeat
from shared.fence.schema import CommandResult, Input

from .conftest import HOST, Reports, command, fence, send, sim_driver


def is_result(cid: str) -> Callable[[Input], bool]:
    return lambda i: isinstance(i, CommandResult) and i.command_id == cid


async def readyz(agent: Agent) -> int:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{agent.http_port}/readyz") as resp:
        return resp.status


async def beat(nc: Client) -> HostHeartbeat:
    kv = await nc.jetstream().key_value("vmfence_hosts")
    entry = await kv.get(HOST)
    assert entry.value is not None
    return msgspec.json.decode(entry.value, type=HostHeartbeat)


class Acks:
    """What the agent answers JetStream for each delivery (an empty payload or ``+ACK``: acked;
    ``-NAK {"delay": ns}``), seen on the ack subjects themselves: the event the test waits on."""

    def __init__(self) -> None:
        self.items: list[bytes] = []
        self.cond = asyncio.Condition()

    async def on_msg(self, msg: Msg) -> None:
        async with self.cond:
            self.items.append(msg.data)
            self.cond.notify_all()

    async def wait_acked(self) -> None:
        async with asyncio.timeout(10.0), self.cond:
            await self.cond.wait_for(lambda: any(i in (b"", b"+ACK") for i in self.items))

    def nak_delays(self) -> list[float]:
        return [json.loads(i[len(b"-NAK"):])["delay"] / 1e9 for i in self.items if i.startswith(b"-NAK")]


def test_retry_delay_doubles_up_to_its_bound() -> None:
    assert [retry_delay(n, 1.0, 60.0) for n in range(1, 9)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert retry_delay(10_000, 1.0, 60.0) == 60.0  # no overflow on a huge delivery count
    assert retry_delay(0, 0.5, 4.0) == 0.5


async def test_unwritable_ledger_backs_off_fails_and_takes_no_new_vm(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig]
) -> None:
    cfg = make_config(command_attempts=3, retry_base=0.1, retry_max=0.2, heartbeat_interval=300.0)
    driver = sim_driver(cfg)
    f = fence(1)
    async with Agent(cfg, driver=driver) as agent:
        up = command("create", "web-1", f)
        await send(nc, up)
        r0 = await reports.wait(is_result(up.id))
        assert isinstance(r0, CommandResult) and r0.outcome == "ok"
        assert await readyz(agent) == 200

        await agent.ledger.run(lambda db: db.execute("PRAGMA query_only = ON"))  # every write now fails
        acks = Acks()
        await nc.subscribe("$JS.ACK.VMFENCE_CMD.>", cb=acks.on_msg)
        await nc.flush()
        rm = command("remove", "web-1", f)
        await send(nc, rm)
        r = await reports.wait(is_result(rm.id))
        await acks.wait_acked()
        assert isinstance(r, CommandResult) and r.outcome == "failed" and r.fence == f
        assert r.error is not None and "after 3 deliveries" in r.error and "readonly" in r.error
        assert "ledger cannot be written" in r.error
        # deliveries 1 and 2 were NAKed with a doubling delay, the 3rd (the bound) answered and acked
        assert acks.nak_delays() == [0.1, 0.2]
        assert agent.metrics.command_retries._value.get() == 2
        assert driver.running_vms() == ["web-1"]  # nothing was removed behind the ledger's back
        # everything is acked: the command does not spin on the work queue (the server applies the
        # ack we saw go by a moment later: a bounded poll of the stream, no event says when)
        deadline = asyncio.get_running_loop().time() + 10.0
        while (await nc.jetstream().stream_info("VMFENCE_CMD")).state.messages:
            assert asyncio.get_running_loop().time() < deadline, "a command left on the work queue"
            await asyncio.sleep(0.02)

        # not ready, and no capacity offered: no VM is placed here
        assert not agent.ledger.writable and await readyz(agent) == 503
        await agent.heartbeat()
        hb = await beat(nc)
        assert hb.cpus_free == 0 and hb.memory_free_mib == 0 and hb.cpus_total == 8

        # a new VM is refused at once (first delivery), without touching the runtime
        mk = command("create", "web-2", f)
        await send(nc, mk)
        r2 = await reports.wait(is_result(mk.id))
        assert isinstance(r2, CommandResult) and r2.outcome == "failed"
        assert r2.error is not None and r2.error.startswith("not taking new VMs")
        assert "web-2" not in driver.all_vms()
        assert agent.metrics.command_retries._value.get() == 2

        # the disk heals: the next heartbeat's probe notices without any command
        await agent.ledger.run(lambda db: db.execute("PRAGMA query_only = OFF"))
        await agent.heartbeat()
        assert agent.ledger.writable and await readyz(agent) == 200
        hb = await beat(nc)
        assert hb.cpus_free == 7 and hb.memory_free_mib == 8192 - 64
        again = command("create", "web-3", f)
        await send(nc, again)
        r3 = await reports.wait(is_result(again.id))
        assert isinstance(r3, CommandResult) and r3.outcome == "ok"


class BrokenInspect(SimDriver):
    """A runtime whose inspect has a bug: the error is the same however often it is retried."""

    async def inspect(self, vm_id: str) -> VMInfo | None:
        raise ValueError(f"bad state for {vm_id}")


async def test_error_that_will_not_heal_fails_at_first_delivery(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig]
) -> None:
    cfg = make_config(command_attempts=5, retry_base=30.0, retry_max=60.0)
    driver = BrokenInspect(state_dir=cfg.runtime_dir, vnc_displays=range(10, 20))
    async with Agent(cfg, driver=driver) as agent:
        c = command("create", "bug-1", fence(1))
        await send(nc, c)
        r = await reports.wait(is_result(c.id))  # well before the 30 s a retry would wait
        assert isinstance(r, CommandResult) and r.outcome == "failed"
        assert r.error == "cannot be executed: ValueError: bad state for bug-1"
        assert agent.metrics.command_retries._value.get() == 0
        assert agent.ledger.writable and await readyz(agent) == 200
        # stored by command id: a redelivery gets the same answer (rule 11)
        assert await agent.ledger.result(c.id) == r


@pytest.mark.parametrize(
    ("error", "heal"),
    [
        (TimeoutError(), True),
        (OSError(28, "No space left on device"), True),
        (ValueError("x"), False),
        (sqlite3.OperationalError("database or disk is full"), True),
        (sqlite3.IntegrityError("UNIQUE constraint failed"), False),
        (OverflowError("Python int too large to convert to SQLite INTEGER"), False),
    ],
)
def test_which_errors_may_heal(error: Exception, heal: bool) -> None:
    assert heals(error) is heal


async def test_a_full_ledger_is_unwritable_until_it_has_room(tmp_path: Path) -> None:
    """SQLITE_FULL ("database or disk is full") from a real size limit: the write fails, the ledger
    says it is not writable, nothing half-done stays open, and once there is room it heals."""
    ledger = Ledger(str(tmp_path / "ledger.sqlite3"))
    await ledger.open()
    try:
        row = await ledger.run(lambda db: db.execute("PRAGMA page_count").fetchone())
        assert row is not None
        await ledger.run(lambda db: db.execute(f"PRAGMA max_page_count = {int(row[0])}"))  # the disk is full now
        f = fence(1)
        big = CommandResult(fence=f, command_id="c-big", op="create", host=HOST, vm_id="v-1", outcome="failed",
                            error="x" * 200_000)
        with pytest.raises(sqlite3.OperationalError, match="full"):
            await ledger.record(big)
        assert not ledger.writable and ledger.write_error is not None and "full" in ledger.write_error
        assert not await ledger.run(lambda db: db.in_transaction)
        await ledger.run(lambda db: db.execute("PRAGMA max_page_count = 1073741823"))  # room again
        assert await ledger.probe_write() and ledger.writable
        await ledger.record(big)
        assert await ledger.result("c-big") == big
    finally:
        await ledger.close()
