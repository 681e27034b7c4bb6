"""kubectl 1.35 against the development server (real binary, real HTTP)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from kubernetes_asyncio import client

KUBECTL = Path(__file__).resolve().parents[2] / ".venv" / "tools" / "kubectl"

pytestmark = pytest.mark.skipif(not KUBECTL.exists(), reason=f"kubectl binary not found at {KUBECTL}")

POD_YAML = """\
apiVersion: v1
kind: Pod
metadata:
  name: x
  labels: {app: demo}
spec:
  containers:
  - name: main
    image: busybox
"""

VM_YAML = """\
apiVersion: vmfence.io/v1alpha1
kind: VirtualMachine
metadata:
  name: vm1
spec:
  image: debian-12
  cpus: 2
  memory: 1Gi
"""


class Kubectl:
    """Runs kubectl as an asyncio subprocess (the server shares this event loop)."""

    def __init__(self, kubeconfig: str, home: Path) -> None:
        self.base = [str(KUBECTL), "--kubeconfig", kubeconfig, "--cache-dir", str(home / "cache")]
        self.env = {**os.environ, "HOME": str(home), "KUBECONFIG": kubeconfig}

    async def start(self, *args: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            *self.base, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=self.env
        )

    async def __call__(self, *args: str) -> str:
        proc = await self.start(*args)
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, f"kubectl {' '.join(args)} failed: {err.decode()}"
        return out.decode()


@pytest.fixture
def kubectl(kubeconfig: str, tmp_path: Path) -> Kubectl:
    return Kubectl(kubeconfig, tmp_path)


async def test_kubectl_pod_lifecycle(kubectl: Kubectl, core: client.CoreV1Api, tmp_path: Path) -> None:
    assert "No resources found" in await _stderr(kubectl, "get", "pods")
    (tmp_path / "pod.yaml").write_text(POD_YAML)
    assert "pod/x created" in await kubectl("create", "-f", str(tmp_path / "pod.yaml"))
    listing = await kubectl("get", "pods")
    assert listing.split("\n")[0].split()[:3] == ["NAME", "READY", "STATUS"]
    assert listing.split("\n")[1].split()[:3] == ["x", "0/1", "Pending"]
    single = await kubectl("get", "pod", "x", "-o", "wide", "--show-labels")
    assert single.split("\n")[1].split()[:3] == ["x", "0/1", "Pending"] and "app=demo" in single
    assert "annotated" in await kubectl("annotate", "pod", "x", "k=v")
    assert (await core.read_namespaced_pod("x", "default")).metadata.annotations == {"k": "v"}
    described = await kubectl("describe", "pod", "x")
    assert "Name:" in described and "k: v" in described and "busybox" in described

    # default kubectl delete waits for the pod to disappear, which needs the "kubelet": don't wait
    assert 'pod "x" deleted' in await kubectl("delete", "pod", "x", "--wait=false")
    assert "Terminating" in await kubectl("get", "pods")
    assert "force deleted" in await kubectl("delete", "pod", "x", "--force", "--grace-period=0")
    assert "No resources found" in await _stderr(kubectl, "get", "pods")


async def _stderr(kubectl: Kubectl, *args: str) -> str:
    proc = await kubectl.start(*args)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    return out.decode() + err.decode()


async def test_kubectl_get_watch(kubectl: Kubectl, core: client.CoreV1Api, tmp_path: Path) -> None:
    (tmp_path / "pod.yaml").write_text(POD_YAML)
    await kubectl("create", "-f", str(tmp_path / "pod.yaml"))
    proc = await kubectl.start("get", "pods", "-w")
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 15
        while len(lines) < 2:  # header + initial row
            lines.append(
                (await asyncio.wait_for(proc.stdout.readline(), deadline - time.monotonic())).decode()
            )
        await core.patch_namespaced_pod_status("x", "default", {"status": {"phase": "Running"}})
        while "Running" not in lines[-1]:
            lines.append(
                (await asyncio.wait_for(proc.stdout.readline(), deadline - time.monotonic())).decode()
            )
    finally:
        proc.kill()
        await proc.wait()
    assert lines[0].split()[:3] == ["NAME", "READY", "STATUS"]
    assert lines[1].split()[:3] == ["x", "0/1", "Pending"]
    assert lines[-1].split()[:3] == ["x", "0/1", "Running"]


async def test_kubectl_virtualmachines(kubectl: Kubectl, tmp_path: Path) -> None:
    (tmp_path / "vm.yaml").write_text(VM_YAML)
    assert "virtualmachine.vmfence.io/vm1 created" in await kubectl("create", "-f", str(tmp_path / "vm.yaml"))
    out = await kubectl("get", "vm")
    header, row = out.strip().split("\n")
    assert header.split() == ["NAME", "PHASE", "HOST", "IP", "RESTARTS", "AGE"]
    assert row.split()[0] == "vm1"
    assert "restartPolicy: Always" in await kubectl("get", "vm", "vm1", "-o", "yaml")
    assert "virtualmachines.vmfence.io" in await kubectl("get", "crd")
    assert "vm1" in await kubectl("get", "virtualmachines.vmfence.io", "-A")
