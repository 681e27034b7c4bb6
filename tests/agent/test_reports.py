"""A runtime event happens once: its report survives a bus that loses publishes for longer than
one publish's retry budget (the agent reaches nats-server through the client-boundary fault proxy)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from urllib.parse import urlparse

import pytest
from nats.aio.client import Client

from services.agent.config import AgentConfig
from services.agent.service import Agent
from services.testbed.chaos.busfaults import CALM, BusProxy, Weather
from services.testbed.natsserver import NatsServer
from shared.bus import retry as bus_retry
from shared.fence.schema import CommandResult, Inventoried, ProbeChanged, Spec, VMExited, VMGone
from shared.subjects import Subjects

from .conftest import Reports, command, fence, send, sim_driver


async def test_an_exit_report_is_retried_until_stored_across_lost_publishes(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig], nats_server: NatsServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    u = urlparse(nats_server.url)
    proxy = BusProxy("agent", (u.hostname or "127.0.0.1", u.port or 4222))
    await proxy.start()
    try:
        cfg = make_config(nats_url=proxy.url)
        driver = sim_driver(cfg)
        f = fence(1)
        async with Agent(cfg, driver=driver):
            c = command("create", "x-1", f)
            await send(nc, c)
            await reports.wait(lambda i: isinstance(i, CommandResult) and i.command_id == c.id)
            monkeypatch.setattr(bus_retry.Retry.__init__, "__defaults__", (2, 0.2))  # one publish gives up fast
            retried = asyncio.Event()  # a second publish of the report: the first one gave up
            proxy.on_fault = lambda component, kind: retried.set() if proxy.counts["publish_lost"] >= 2 else None
            proxy.set_weather(1, Weather(publish_lost=1.0))  # no publish is stored
            driver.crash_vm("x-1", exit_code=7)
            await asyncio.wait_for(retried.wait(), 30)
            proxy.set_weather(1, CALM)
            ex = await reports.wait(lambda i: isinstance(i, VMExited) and i.vm_id == "x-1", timeout=30)
            assert isinstance(ex, VMExited) and ex.fence == f and ex.exit_code == 7
    finally:
        await proxy.stop()


async def test_inventories_repeat_a_vm_the_runtime_lost(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig]
) -> None:
    """The VMGone may never have been stored (the agent died right after burying the VM): every
    inventory round says the VM is lost, so the reconciler learns it from the next round."""
    cfg = make_config()
    driver = sim_driver(cfg)
    f = fence(1)
    async with Agent(cfg, driver=driver) as agent:
        c = command("create", "y-1", f)
        await send(nc, c)
        await reports.wait(lambda i: isinstance(i, CommandResult) and i.command_id == c.id)
        driver.lose_vm("y-1")
        await driver.reconcile()  # the runtime notices: VMGone
        await reports.wait(lambda i: isinstance(i, VMGone) and i.vm_id == "y-1")
        round_1 = await agent.inventory()
        round_2 = await agent.inventory()
        for r in (round_1, round_2):
            lost = await reports.wait(lambda i, r=r: isinstance(i, Inventoried) and i.round == r and i.vm_id == "y-1")
            assert isinstance(lost, Inventoried) and lost.state == "lost" and lost.fence == f


async def test_inventories_repeat_the_last_readiness_published(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig]
) -> None:
    """A ProbeChanged decided before its VM's binding (a redelivery reordered them) is dropped, and
    the prober publishes only changes: inventories carry the readiness last stored for the fence."""
    cfg = make_config()
    driver = sim_driver(cfg)
    f = fence(1)
    async with Agent(cfg, driver=driver) as agent:
        c = command("create", "z-1", f)
        await send(nc, c)
        # the readiness its result carried (the runtime's probe right after the bring-up)
        res = await reports.wait(lambda i: isinstance(i, CommandResult) and i.command_id == c.id)
        assert isinstance(res, CommandResult) and res.ready is True
        r = await agent.inventory()
        inv = await reports.wait(lambda i: isinstance(i, Inventoried) and i.round == r and i.vm_id == "z-1")
        assert isinstance(inv, Inventoried) and inv.ready is True and inv.fence == f


async def test_a_lost_ack_is_retried_instead_of_waiting_out_ack_wait(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig], nats_server: NatsServer,
) -> None:
    """A command whose ack is lost (a nats node away) stayed unfinished for a whole ack_wait (60 s)
    before its redelivery was answered from the ledger; process chaos waited for that to settle."""
    u = urlparse(nats_server.url)
    proxy = BusProxy("agent", (u.hostname or "127.0.0.1", u.port or 4222))
    await proxy.start()
    try:
        cfg = make_config(nats_url=proxy.url, ack_wait=60.0)
        lost_twice = asyncio.Event()
        proxy.on_fault = lambda component, kind: lost_twice.set() if proxy.counts["ack_lost"] >= 2 else None
        async with Agent(cfg, driver=sim_driver(cfg)):
            proxy.set_weather(1, Weather(ack_lost=1.0))
            c = command("create", "z-1", fence(1))
            await send(nc, c)
            await reports.wait(lambda i: isinstance(i, CommandResult) and i.command_id == c.id)
            await asyncio.wait_for(lost_twice.wait(), 10)  # the ack was sent again
            proxy.set_weather(1, CALM)
            js, durable = nc.jetstream(), f"agent-{cfg.host}"
            deadline = asyncio.get_running_loop().time() + 15.0  # far inside ack_wait
            while (await js.consumer_info(Subjects().stream_cmd, durable)).num_ack_pending:
                assert asyncio.get_running_loop().time() < deadline, "the command waited for ack_wait"
                await asyncio.sleep(0.1)
    finally:
        await proxy.stop()


async def test_a_vm_whose_readiness_is_its_guests_is_not_judged_at_its_bring_up(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig]
) -> None:
    """A VM with a probe port is ready when its guest answers there, which a guest still booting
    does not: its result carries no verdict (probing then would only hold the result back), and the
    sweep reports its readiness when it comes."""
    cfg = make_config()
    f = fence(1)
    async with Agent(cfg, driver=sim_driver(cfg)):
        c = command("create", "g-1", f, spec=Spec(cpus=1, memory_mib=64, probe_port=8080))
        await send(nc, c)
        res = await reports.wait(lambda i: isinstance(i, CommandResult) and i.command_id == c.id)
        assert isinstance(res, CommandResult) and res.outcome == "ok" and res.ready is None
        await reports.wait(lambda i: isinstance(i, ProbeChanged) and i.vm_id == "g-1" and i.ready and i.fence == f)


async def test_a_round_is_paced_and_names_no_vm_removed_while_it_went_on(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig]
) -> None:
    """A round's items go at ``--inventory-rate`` (a host's whole round at once queued every pod's
    input behind it at the reconcilers: p99 to Bound 0.25 s at 50 pods/s, 25 ms paced). Paced, a
    round lasts longer, so each item is read from the ledger when it goes: a VM removed meanwhile is
    not named (the reconciler would take a stale "running" for a VM it does not know)."""
    cfg = make_config(inventory_rate=1.0)  # an item a second: each after the first waits its turn
    driver = sim_driver(cfg)
    fences = [fence(1, key=f"default/pod-{i}") for i in range(3)]
    async with Agent(cfg, driver=driver) as agent:
        for i, f in enumerate(fences):
            c = command("create", f"p-{i}", f)
            await send(nc, c)
            await reports.wait(lambda x, c=c: isinstance(x, CommandResult) and x.command_id == c.id)
        waits: list[float] = []
        turn = asyncio.Event()

        async def paced(seconds: float) -> bool:
            waits.append(seconds)
            await turn.wait()
            return False

        agent._sleep = paced  # type: ignore[method-assign]
        rnd = asyncio.create_task(agent.inventory())
        first = await reports.wait(lambda x: isinstance(x, Inventoried) and x.vm_id == "p-0")
        assert isinstance(first, Inventoried)
        remove = command("remove", "p-2", fences[2])
        await send(nc, remove)
        await reports.wait(lambda x: isinstance(x, CommandResult) and x.command_id == remove.id)
        assert not rnd.done() and waits, "the second item waits for its turn"
        turn.set()
        round_id = await asyncio.wait_for(rnd, 10)
        named = {x.vm_id for x in reports.items if isinstance(x, Inventoried) and x.round == round_id}
        assert named == {"p-0", "p-1"}
        assert 0.5 < waits[0] <= 1.0
