"""`vmfence vnc` on a whole local stack, as an operator runs it: the pod's fence read from the API,
the host's agent asked as the NATS user ``operator``; the address and password on stdout, and one
clear line (exit 2, no password) for each mistake — no such pod, a VM without a display, a user that
may not ask."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from services.agent.config import VNC_BASE_PORT, AgentConfig
from services.agent.service import Agent
from tests.e2e.conftest import NS, Env

HOST = "host-c"  # a third host of the stack's accounts, started here with VNC displays


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VMFENCE_")}
    return subprocess.run([sys.executable, "-m", "services.cli", "vnc", *args], capture_output=True, text=True,
                          env={**clean, **env}, timeout=120)


@pytest.fixture
async def vnc_agent(env: Env, tmp_path: Path) -> AsyncIterator[Agent]:
    stack = env.stack
    url, password = stack.identity(f"agent-{HOST}")
    cfg = AgentConfig(
        nats_url=[url], nats_user=f"agent-{HOST}", nats_password=password, host=HOST, runtime="sim",
        data_dir=str(tmp_path / "agent-c"), http_port=0, http_host="127.0.0.1", partitions=stack.partitions,
        heartbeat_interval=1.0, inventory_interval=30.0, probe_interval=1.0, vnc_range=range(70, 80),
        vnc_listen="127.0.0.1", cleanup_on_stop=True, shutdown_timeout=10.0,
        cpus=stack.host_cpus, memory_mib=4 * stack.host_memory_mib,  # the roomiest host: placed here first
    ).validate()
    async with Agent(cfg) as agent:
        async def has_node() -> bool:
            try:
                await env.core.read_node(f"vmfence-{HOST}")
            except ApiException:
                return False
            return True

        await env.wait_for(f"node vmfence-{HOST}", has_node)  # the reconcilers know the host
        yield agent

async def test_vnc_gives_the_owner_the_display_and_one_line_for_each_mistake(env: Env, vnc_agent: Agent) -> None:
    await env.create("console")
    running = await env.wait_running("console")
    vm_id = running.metadata.annotations["vmfence.io/vm-id"]
    assert running.metadata.annotations["vmfence.io/host"] == HOST, running.metadata.annotations
    password = await vnc_agent.ledger.vnc_password(vm_id)
    (display,) = [r for r in await vnc_agent.ledger.reservations(vm_id) if r.kind == "vnc"]
    assert password

    url, operator_password = env.stack.identity("operator")
    kube = ["--kubeconfig", env.stack.kubeconfig_path]
    operator = {"VMFENCE_NATS_URL": url, "VMFENCE_NATS_USER": "operator", "VMFENCE_NATS_PASSWORD": operator_password}
    ok = await asyncio.to_thread(_cli, operator, f"{NS}/console", *kube)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout == f"vnc://127.0.0.1:{VNC_BASE_PORT + int(display.resource)}\n{password}\n"

    # a pod on a host without displays, a pod that does not exist, a user that may not ask
    await env.create("plain")  # on a host with fewer VMs: host-a or host-b, without displays
    plain = await env.wait_running("plain")
    assert plain.metadata.annotations["vmfence.io/host"] != HOST
    _, audit_password = env.stack.identity("audit")
    audit = {"VMFENCE_NATS_URL": url, "VMFENCE_NATS_USER": "audit", "VMFENCE_NATS_PASSWORD": audit_password}
    mistakes = ((operator, "plain", "has no VNC display"), (operator, "nobody", "no pod default/nobody"),
                (audit, "console", "may not ask for VNC passwords"))
    for who, pod_name, says in mistakes:
        out = await asyncio.to_thread(_cli, who, f"{NS}/{pod_name}", *kube)
        assert out.returncode == 2 and out.stdout == "", (pod_name, out.stdout, out.stderr)
        assert out.stderr.count("\n") == 1 and says in out.stderr, (pod_name, out.stderr)
        assert password not in out.stderr
    assert (await asyncio.to_thread(_cli, operator, "no-slash", *kube)).stderr.count("\n") == 1
