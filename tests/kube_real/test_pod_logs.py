"""`kubectl logs` against the real kube-apiserver (issue 12 §3): it proxies pods/log to the Node's
InternalIP and daemonEndpoints port with its kubelet client certificate (signed by the cluster CA,
which the agents are told to accept), exactly as for a kubelet. The same checks as
tests/e2e/test_pod_logs.py's first part, on the real control plane (about 40 s with its start)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.testbed.kubecp import KubeControlPlane, ServiceCredentials
from tests.kube_real.conftest import KubeEnv, kube_env, namespace_for


@pytest.fixture
async def lenv(control_plane: tuple[KubeControlPlane, ServiceCredentials], tmp_path: Path,
               request: pytest.FixtureRequest) -> AsyncIterator[KubeEnv]:
    cp, _ = control_plane
    assert cp.pki is not None
    async with kube_env(control_plane, tmp_path / "stack", namespace_for(request),
                        kubelet_client_ca=str(cp.pki.ca.cert)) as env:
        yield env


async def test_kubectl_logs_through_the_real_api_server(lenv: KubeEnv) -> None:
    env = lenv
    uid = await env.create("logs")
    pod = await env.wait_running("logs", uid)
    vm_id = pod.metadata.annotations["vmfence.io/vm-id"]
    out = await env.kubectl_ok("logs", "logs")
    assert f"booting {vm_id}" in out and "VMFENCE-READY" in out, out
    assert await env.kubectl_ok("logs", "logs", "--tail=1") == "VMFENCE-READY sim\n"
    # exec and port-forward through kube-apiserver: its stream translator takes kubectl's websocket,
    # dials the agent over SPDY and hands back the agent's refusal, which names vmfence console
    for args in (["exec", "logs", "--", "sh", "-c", "true"], ["exec", "-i", "logs", "--", "sh"],
                 ["port-forward", "pod/logs", "18080:8080"]):
        out = await asyncio.to_thread(env.kubectl, *args, timeout=40)
        assert out.returncode != 0, (args, out.stdout)
        assert "vmfence console" in out.stderr, (args, out.stderr[-2000:])
    await env.core.delete_namespaced_pod("logs", env.ns)
    await env.wait_gone("logs")
    await env.audit()
