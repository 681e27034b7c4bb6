"""`kubectl logs` on a local stack (issue 12 §3): the development API server proxies pods/log to the
agent's kubelet endpoint (HTTPS, the API server's client certificate) on the port the Node
advertises, and the agent answers from the VM's console; --tail, -f, --previous after the VM was
killed and restarted in place; exec and port-forward answer a message naming vmfence console.
Real kubectl, real HTTP/TLS, the sim runtime's console files (about 15 s)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from tests.e2e.conftest import NS, Env

KUBECTL = Path(__file__).resolve().parents[2] / ".venv" / "tools" / "kubectl"

pytestmark = pytest.mark.skipif(not KUBECTL.exists(), reason="kubectl from the npm layer is not installed")


async def kubectl(env: Env, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:  # noqa: ASYNC109
    kc = env.stack.kubeconfig_path
    assert kc is not None
    return await asyncio.to_thread(subprocess.run, [str(KUBECTL), "--kubeconfig", kc, *args],
                                   capture_output=True, text=True, timeout=timeout)


def append(path: str, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


async def test_kubectl_logs_tail_follow_previous_and_clear_exec(env: Env) -> None:
    uid = await env.create("logs-0")
    pod = await env.wait_running("logs-0", uid)
    host = pod.metadata.annotations["vmfence.io/host"]
    vm_id = pod.metadata.annotations["vmfence.io/vm-id"]

    async def advertised() -> bool:  # the fleet reconciler writes the host's Node on its own schedule
        try:
            node = await env.core.read_node(f"vmfence-{host}")
        except ApiException:
            return False
        ep = node.status.daemon_endpoints
        return ep is not None and ep.kubelet_endpoint is not None and (ep.kubelet_endpoint.port or 0) > 0

    await env.wait_for(f"vmfence-{host} advertising its kubelet endpoint", advertised)

    out = await kubectl(env, "logs", "logs-0", "-n", NS)
    assert out.returncode == 0 and f"booting {vm_id}" in out.stdout and "VMFENCE-READY" in out.stdout, out
    out = await kubectl(env, "logs", "logs-0", "-n", NS, "--tail=1")
    assert out.stdout == "VMFENCE-READY sim\n", out
    out = await kubectl(env, "logs", "logs-0", "-n", NS, "--timestamps", "--since=1h")
    assert out.returncode == 0 and out.stdout.splitlines()[0][:2] == "20", out

    # -f follows the console as the guest writes it
    driver = env.stack.agents[host].driver
    console = driver.serial_log(vm_id)  # type: ignore[attr-defined]
    kc = env.stack.kubeconfig_path
    assert kc is not None
    follow = await asyncio.create_subprocess_exec(
        str(KUBECTL), "--kubeconfig", kc, "logs", "-f", "logs-0", "-n", NS, "--tail=1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        assert follow.stdout is not None
        assert await asyncio.wait_for(follow.stdout.readline(), 15) == b"VMFENCE-READY sim\n"
        await asyncio.to_thread(append, console, "a line the guest wrote later\n")
        assert await asyncio.wait_for(follow.stdout.readline(), 10) == b"a line the guest wrote later\n"
    finally:
        if follow.returncode is None:
            follow.kill()
        await follow.wait()

    # --previous: the VM is killed, restarted in place, and the boot before it is still readable
    out = await kubectl(env, "logs", "logs-0", "-n", NS, "--previous")
    assert out.returncode != 0 and "not restarted" in out.stderr, out
    first = (await kubectl(env, "logs", "logs-0", "-n", NS)).stdout
    driver.crash_vm(vm_id)  # type: ignore[attr-defined]

    async def restarted() -> bool:
        p = await env.get("logs-0")
        cs = (p.status.container_statuses or []) if p is not None and p.status else []
        return bool(cs) and (cs[0].restart_count or 0) >= 1 and env.is_running_ready(p, uid)

    await env.wait_for("logs-0 restarted in place", restarted)
    out = await kubectl(env, "logs", "logs-0", "-n", NS, "--previous")
    assert out.returncode == 0 and out.stdout == first, (out, first)
    now = (await kubectl(env, "logs", "logs-0", "-n", NS)).stdout
    assert now != first and "booting" in now

    # exec and port-forward: not a container, and they say what to use instead
    out = await kubectl(env, "exec", "logs-0", "-n", NS, "--", "sh", "-c", "true")
    assert out.returncode != 0 and "vmfence console" in out.stderr, out
    out = await kubectl(env, "port-forward", "logs-0", "-n", NS, "18080:8080", timeout=20)
    assert out.returncode != 0 and "vmfence console" in out.stderr, out
    # vmfence console: the sim's VMs have no interactive console, and it says so
    cli = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "services.cli", "console", f"{NS}/logs-0",
                                                   "--kubeconfig", kc], capture_output=True, text=True, timeout=30,
                                  stdin=subprocess.DEVNULL)
    assert cli.returncode == 2 and "no running VM of pod default/logs-0 with a serial console" in cli.stderr, cli
