"""A pod's livenessProbe failing its threshold stops the VM under the fence that owns it and the
exit is reported as the VM's own (the reconciler then applies the restartPolicy), as a kubelet kills
a container. Real agent and nats-server, the sim runtime (its addresses are loopback ones, so the
probe's connection is refused at once)."""

from __future__ import annotations

from collections.abc import Callable

from nats.aio.client import Client

from services.agent.config import AgentConfig
from services.agent.service import Agent
from shared.fence.schema import CommandResult, Probe, Spec, VMExited

from .conftest import Reports, command, fence, send, sim_driver


async def test_a_failing_liveness_probe_stops_the_vm_and_reports_its_exit(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig]
) -> None:
    cfg = make_config()
    driver = sim_driver(cfg)
    f = fence(1)
    live = Probe("tcp", 8080, period_s=1, failure_threshold=1)
    async with Agent(cfg, driver=driver) as agent:
        cmd = command("create", "live-1", f, spec=Spec(cpus=1, memory_mib=64, liveness=live))
        await send(nc, cmd)
        r = await reports.wait(lambda i: isinstance(i, CommandResult) and i.command_id == cmd.id)
        assert isinstance(r, CommandResult) and r.outcome == "ok" and r.ip
        ex = await reports.wait(lambda i: isinstance(i, VMExited) and i.vm_id == "live-1", 15)
        assert isinstance(ex, VMExited) and ex.fence == f
        assert driver.running_vms() == [] and agent.ledger.vm("live-1") is not None
        assert agent.ledger.vm("live-1").state == "exited"  # type: ignore[union-attr]
