"""The agent in-process against a real nats-server and the sim runtime."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import aiohttp
import msgspec
from nats.aio.client import Client

from services.agent.config import AgentConfig
from services.agent.runtime.sim import SimDriver
from services.agent.service import Agent
from shared.fence.heartbeat import HostHeartbeat
from shared.fence.schema import CommandResult, Fence, Input, Inventoried, ProbeChanged, VMExited, VMGone
from shared.subjects import Subjects

from .conftest import HOST, Reports, command, fence, send, sim_driver


def is_result(cid: str) -> Callable[[Input], bool]:
    return lambda i: isinstance(i, CommandResult) and i.command_id == cid


def creates(driver: SimDriver, vm_id: str) -> int:
    return sum(1 for op in driver.history if op.op == "create" and op.vm_id == vm_id and op.outcome == "ok")


async def test_create_redelivery_and_inventory_at_start(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig]
) -> None:
    cfg = make_config()
    f = fence(1)
    cmd = command("create", "web-1", f)
    driver = sim_driver(cfg)
    async with Agent(cfg, driver=driver) as agent:
        await send(nc, cmd)
        r = await reports.wait(is_result(cmd.id))
        assert isinstance(r, CommandResult) and r.outcome == "ok" and r.host == HOST and r.fence == f
        assert r.vnc_port is not None and r.vnc_port >= 5910
        assert driver.running_vms() == ["web-1"]
        assert agent.ledger.owner("web-1") == f
        # the same command again under a new Msg-Id: answered from the ledger, not executed twice
        await send(nc, cmd, msg_id="resend-1")
        await reports.wait(lambda i: len(reports.of(CommandResult, command_id=cmd.id)) >= 2)
        again = reports.of(CommandResult, command_id=cmd.id)
        # the first carries the runtime probe's verdict right after the bring-up (decided with the
        # binding); the ledger's answer does not: that VM's readiness is the sweep's to report now
        assert again[0].ready is True and again[1].ready is None
        assert msgspec.structs.replace(again[0], ready=None) == again[1]
        assert creates(driver, "web-1") == 1 and driver.running_vms() == ["web-1"]
        assert agent.metrics.redeliveries._value.get() == 1
    # restart: the inventory at start reports the VM with its ledger fence
    driver2 = sim_driver(cfg)
    async with Agent(cfg, driver=driver2) as agent2:
        inv = await reports.wait(lambda i: isinstance(i, Inventoried) and i.vm_id == "web-1")
        assert isinstance(inv, Inventoried) and inv.fence == f and inv.state == "running" and inv.round
        assert agent2.ledger.owner("web-1") == f
        assert driver2.running_vms() == ["web-1"]


async def test_stale_command_is_fenced(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig]
) -> None:
    cfg = make_config()
    new = fence(2)
    driver = sim_driver(cfg)
    async with Agent(cfg, driver=driver):
        create = command("create", "web-2", new)
        await send(nc, create)
        assert (await reports.wait(is_result(create.id))).outcome == "ok"  # type: ignore[union-attr]
        for op in ("start", "remove", "hibernate", "create"):
            stale = command(op, "web-2", fence(1))
            await send(nc, stale)
            r = await reports.wait(is_result(stale.id))
            assert isinstance(r, CommandResult) and r.outcome == "fenced", (op, r)
            assert r.fence == fence(1)  # a result always carries its command's fence
        assert driver.running_vms() == ["web-2"]
        # the owner's own remove is cleanup and allowed
        rm = command("remove", "web-2", new)
        await send(nc, rm)
        assert (await reports.wait(is_result(rm.id))).outcome == "ok"  # type: ignore[union-attr]
        assert driver.running_vms() == []


async def test_remove_then_redelivered_create_is_fenced(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig]
) -> None:
    cfg = make_config()
    f = fence(1)
    driver = sim_driver(cfg)
    async with Agent(cfg, driver=driver):
        # the remove overtakes its create (never executed): unknown -> not_found, tombstoned
        rm = command("remove", "web-3", f)
        await send(nc, rm)
        assert (await reports.wait(is_result(rm.id))).outcome == "not_found"  # type: ignore[union-attr]
        late = command("create", "web-3", f)
        await send(nc, late)
        assert (await reports.wait(is_result(late.id))).outcome == "fenced"  # type: ignore[union-attr]
        assert driver.all_vms() == []
        # and after a real create + remove, a redelivered create does not resurrect it
        c4 = command("create", "web-4", f)
        await send(nc, c4)
        assert (await reports.wait(is_result(c4.id))).outcome == "ok"  # type: ignore[union-attr]
        rm4 = command("remove", "web-4", f)
        await send(nc, rm4)
        assert (await reports.wait(is_result(rm4.id))).outcome == "ok"  # type: ignore[union-attr]
        c4b = command("create", "web-4", f, cid="another-id-for-web-4")
        await send(nc, c4b)
        assert (await reports.wait(is_result(c4b.id))).outcome == "fenced"  # type: ignore[union-attr]
        wake = command("wake", "web-4", f, snapshot="/nonexistent")
        await send(nc, wake)
        assert (await reports.wait(is_result(wake.id))).outcome == "fenced"  # type: ignore[union-attr]
        assert driver.all_vms() == []
        assert creates(driver, "web-4") == 1


async def test_adopt(nc: Client, reports: Reports, make_config: Callable[..., AgentConfig]) -> None:
    cfg = make_config()
    old, new = fence(1), fence(2)
    driver = sim_driver(cfg)
    async with Agent(cfg, driver=driver) as agent:
        for vm in ("a-1", "a-2", "a-3"):
            c = command("create", vm, old)
            await send(nc, c)
            assert (await reports.wait(is_result(c.id))).outcome == "ok"  # type: ignore[union-attr]
        # exists -> ownership moves; the old fence is now stale for it
        ad = command("adopt", "a-1", new)
        await send(nc, ad)
        r = await reports.wait(is_result(ad.id))
        assert isinstance(r, CommandResult) and r.outcome == "ok" and r.vnc_port is not None
        assert agent.ledger.owner("a-1") == new
        assert {x.fence for x in await agent.ledger.reservations("a-1")} == {new}
        st = command("start", "a-1", old)
        await send(nc, st)
        assert (await reports.wait(is_result(st.id))).outcome == "fenced"  # type: ignore[union-attr]
        back = command("adopt", "a-1", old, cid="adopt-back")
        await send(nc, back)
        assert (await reports.wait(is_result(back.id))).outcome == "fenced"  # type: ignore[union-attr]
        # the runtime lost it -> not_found (the ledger row alone is not trusted)
        driver.lose_vm("a-2")
        ad2 = command("adopt", "a-2", new)
        await send(nc, ad2)
        assert (await reports.wait(is_result(ad2.id))).outcome == "not_found"  # type: ignore[union-attr]
        assert agent.ledger.owner("a-2") is None
        # inconclusive inspect -> inconclusive, ownership unchanged
        driver.faults.inconclusive(vm_id="a-3")
        ad3 = command("adopt", "a-3", new)
        await send(nc, ad3)
        assert (await reports.wait(is_result(ad3.id))).outcome == "inconclusive"  # type: ignore[union-attr]
        assert agent.ledger.owner("a-3") == old


async def test_probe_of_superseded_fence_never_reports(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig]
) -> None:
    cfg = make_config()
    old, new = fence(1), fence(2)
    driver = sim_driver(cfg)
    async with Agent(cfg, driver=driver):
        c = command("create", "p-1", old)
        await send(nc, c)
        # its readiness comes with the result (the runtime's probe right after the bring-up)
        assert (await reports.wait(is_result(c.id))).ready is True  # type: ignore[union-attr]
        # hold the next probe inside the runtime: it starts under the old fence
        started, release = asyncio.Event(), asyncio.Event()
        orig = driver.probe

        async def gated(vm_id: str) -> bool:
            started.set()
            await release.wait()
            return await orig(vm_id)

        driver.probe = gated  # type: ignore[method-assign]
        await asyncio.wait_for(started.wait(), 5)
        ad = command("adopt", "p-1", new)
        await send(nc, ad)
        assert (await reports.wait(is_result(ad.id))).outcome == "ok"  # type: ignore[union-attr]
        driver.set_ready("p-1", False)
        driver.probe = orig  # type: ignore[method-assign]
        release.set()  # the old-fence probe now returns False: it must be dropped
        await reports.wait(lambda i: isinstance(i, ProbeChanged) and i.fence == new and not i.ready)
        assert reports.of(ProbeChanged, fence=old) == []


async def test_a_restarted_vm_is_probed_only_after_its_start_result_is_published(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig]
) -> None:
    """The new run's readiness must not reach the reconciler before the start's result: decided
    before the binding it is dropped (not bound yet), and the VM would stay not Ready until an
    inventory repeats it (a stack campaign saw a VirtualMachine Running, Ready=False)."""
    # no periodic sweep while the result is held: only the restart's own probe is in question
    # (a periodic one may go first; the restart's, after the result, then says it again)
    cfg = make_config(probe_interval=30.0)
    driver = sim_driver(cfg)
    f = fence(1)
    async with Agent(cfg, driver=driver) as agent:
        create = command("create", "r-1", f)
        await send(nc, create)
        assert (await reports.wait(is_result(create.id))).ready is True  # type: ignore[union-attr]
        driver.crash_vm("r-1", exit_code=1)
        await reports.wait(lambda i: isinstance(i, VMExited) and i.vm_id == "r-1")
        # the new run is not ready when its result is made (the result says so), and ready while
        # that result is held: only a probe can say it, and only after the result
        not_yet = True
        probe = driver.probe

        async def not_ready_yet(vm_id: str) -> bool:
            return False if not_yet else await probe(vm_id)

        driver.probe = not_ready_yet  # type: ignore[method-assign]
        mark = len(reports.items)
        report = agent._report

        def ready(i: Input) -> bool:  # the new run's (the old run's loop may still say not ready)
            return isinstance(i, ProbeChanged) and i.vm_id == "r-1" and i.ready

        def probed_since_mark(_: Input) -> bool:
            return any(ready(i) for i in reports.items[mark:])

        async def slow_result(kind: str, fence_: Fence, payload: msgspec.Struct, msg_id: str) -> None:
            if kind == "result":  # a slow bus: the result goes late; no probe of the new run may go first
                nonlocal not_yet
                assert isinstance(payload, CommandResult) and payload.ready is False
                not_yet = False
                with contextlib.suppress(TimeoutError):
                    await reports.wait(probed_since_mark, timeout=1.0)
            await report(kind, fence_, payload, msg_id)

        agent._report = slow_result  # type: ignore[method-assign]
        start = command("start", "r-1", f)
        await send(nc, start)
        assert (await reports.wait(is_result(start.id))).outcome == "ok"  # type: ignore[union-attr]
        await reports.wait(probed_since_mark)
        order = [type(i).__name__ for i in reports.items[mark:] if isinstance(i, CommandResult) or ready(i)]
        assert order == ["CommandResult", "ProbeChanged"], order


async def test_malformed_command_goes_to_dlq(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig]
) -> None:
    cfg = make_config()
    js = nc.jetstream()
    dlq = await js.subscribe("vmfence.dlq.>", stream="VMFENCE_DLQ")
    async with Agent(cfg, driver=sim_driver(cfg)) as agent:
        await send(nc, b"{not json", msg_id="garbage")
        await send(nc, command("create", "BAD_ID", fence(1)))
        good = command("create", "ok-1", fence(1))
        await send(nc, good)
        assert (await reports.wait(is_result(good.id))).outcome == "ok"  # type: ignore[union-attr]
        reasons = []
        for _ in range(2):
            m = await dlq.next_msg(timeout=5)
            reasons.append(m.headers["Vmfence-Reason"])
            assert m.headers["Vmfence-Original-Subject"] == Subjects().command(HOST)
        assert "malformed command" in reasons[0] and "vm_id" in reasons[1]
        assert agent.ledger.vm("ok-1") is not None
    # everything was acked (dead letters included): the work-queue stream is empty
    info = await js.stream_info("VMFENCE_CMD")
    assert info.state.messages == 0


async def test_exit_gone_heartbeat_http_and_hibernate(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig]
) -> None:
    cfg = make_config()
    f = fence(1)
    driver = sim_driver(cfg)
    async with Agent(cfg, driver=driver) as agent:
        for vm in ("e-1", "e-2", "e-3"):
            c = command("create", vm, f)
            await send(nc, c)
            await reports.wait(is_result(c.id))
        driver.crash_vm("e-1", exit_code=3)
        ex = await reports.wait(lambda i: isinstance(i, VMExited) and i.vm_id == "e-1")
        assert isinstance(ex, VMExited) and ex.fence == f and ex.exit_code == 3
        st = command("start", "e-1", f)
        await send(nc, st)
        assert (await reports.wait(is_result(st.id))).outcome == "ok"  # type: ignore[union-attr]
        driver.lose_vm("e-2")
        await agent.inventory()  # the inventory's look notices it
        gone = await reports.wait(lambda i: isinstance(i, VMGone) and i.vm_id == "e-2")
        assert gone.fence == f  # type: ignore[union-attr]
        # hibernate -> snapshot path; wake restores it as a new vm_id
        hb = command("hibernate", "e-3", f)
        await send(nc, hb)
        r = await reports.wait(is_result(hb.id))
        assert isinstance(r, CommandResult) and r.outcome == "ok" and r.snapshot
        assert "e-3" not in driver.all_vms()
        wk = command("wake", "e-4", f, snapshot=r.snapshot)
        await send(nc, wk)
        assert (await reports.wait(is_result(wk.id))).outcome == "ok"  # type: ignore[union-attr]
        assert "e-4" in driver.running_vms()
        # an exit of a VM being removed is not reported as an exit
        rm = command("remove", "e-4", f)
        await send(nc, rm)
        await reports.wait(is_result(rm.id))
        assert not reports.of(VMExited, vm_id="e-4")
        # heartbeat in KV, metrics and health endpoints
        kv = await nc.jetstream().key_value("vmfence_hosts")
        entry = await kv.get(HOST)
        beat = msgspec.json.decode(entry.value, type=HostHeartbeat)
        assert beat.host == HOST and beat.cpus_total == 8 and beat.runtime == "sim"
        async with aiohttp.ClientSession() as s:
            base = f"http://127.0.0.1:{agent.http_port}"
            async with s.get(base + "/metrics") as resp:
                text = await resp.text()
            assert 'vmfence_commands_total{op="create",result="ok"} 3.0' in text
            assert "vmfence_agent_reports_total" in text and "vmfence_vms" in text
            async with s.get(base + "/livez") as resp:
                assert resp.status == 200
            async with s.get(base + "/readyz") as resp:
                assert resp.status == 200


async def test_serial_per_vm_concurrent_across_vms(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig]
) -> None:
    cfg = make_config()
    f = fence(1)
    driver = sim_driver(cfg)
    driver.faults.delay("create", 1.0, vm_id="slow-1")
    async with Agent(cfg, driver=driver):
        slow, fast, rm = command("create", "slow-1", f), command("create", "fast-1", f), command("remove", "slow-1", f)
        for c in (slow, fast, rm):
            await send(nc, c)
        await reports.wait(is_result(rm.id))
        order = [i.command_id for i in reports.items if isinstance(i, CommandResult)]
        assert order == [fast.id, slow.id, rm.id]  # fast did not wait; the remove waited for its create
        assert reports.of(CommandResult, command_id=rm.id)[0].outcome == "ok"
        assert driver.all_vms() == ["fast-1"]


async def test_cleanup_on_stop_removes_own_vms(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig]
) -> None:
    cfg = make_config(cleanup_on_stop=True)
    driver = sim_driver(cfg)
    async with Agent(cfg, driver=driver):
        c = command("create", "tmp-1", fence(1))
        await send(nc, c)
        await reports.wait(is_result(c.id))
        assert driver.running_vms() == ["tmp-1"]
    assert driver.all_vms() == []
