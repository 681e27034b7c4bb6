"""The real control plane for the whole session (etcd, kube-apiserver, kube-scheduler and
kube-controller-manager built by ``make kube``), and per test a whole vmfence stack against it in a
namespace of the test's own, with the watcher and the reconcilers under the Helm chart's RBAC.

Without the binaries every test here is skipped with the build's own reason
(``.venv/kube/build-error``); under CI (``CI`` set) that is a failure instead: CI on this machine
must run them.

Pods here are plain Kubernetes pods: no ``vmfence.io/managed`` label, a toleration of vmfence's
node taint, so they become vmfence's only when the real kube-scheduler binds them to a
``vmfence-<host>`` Node, exactly as a kubelet's pods do.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import os
import re
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from services.testbed.chaos.oracles import scan_qemu
from services.testbed.kubecp import KubeControlPlane, KubeUnavailable, ServiceCredentials, binaries, start_control_plane
from services.testbed.stack import LocalStack
from shared.bus.read import read_stream
from shared.fence.schema import WriteDone, decode_input
from shared.tasks import cancel_and_wait
from tests.e2e.conftest import WAIT_S, Env

ROOT = Path(__file__).resolve().parents[2]
KUBECTL = ROOT / ".venv" / "tools" / "kubectl"
TAINT_TOLERATION = {"key": "vmfence.io/vm", "operator": "Exists", "effect": "NoSchedule"}
NAMESPACE_GONE_S = 90.0
# what a permission the chart forgot looks like in the real server's 403 (RBAC's own wording; a 403
# of NamespaceLifecycle for an Event in a namespace being deleted is no RBAC denial)
FORBIDDEN = re.compile(r'cannot [a-z]+ resource "')
# a write the real server refused as malformed: a status or body the development server took
REJECTED = re.compile(r"rejected as invalid|^(400|422)\b")
STARTUP: dict[str, float] = {}  # measured start-up costs, printed in the terminal summary
_counter = itertools.count(1)


def _in_thread(coro: Awaitable[Any]) -> Any:
    """Run a coroutine to completion on a loop of its own (session fixtures are synchronous: the
    control plane's processes outlive any one test's event loop)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()  # type: ignore[arg-type]


@pytest.fixture(scope="package")  # stopped after tests/kube_real: its processes would load every later test
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[KubeControlPlane, ServiceCredentials]]:
    try:
        binaries()
    except KubeUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the real control plane: {exc}", pytrace=False)
        pytest.skip(str(exc))
    t0 = time.monotonic()
    cp, creds = _in_thread(start_control_plane(tmp_path_factory.mktemp("kube")))
    STARTUP["control_plane_s"] = time.monotonic() - t0
    STARTUP.update({f"control_plane_{k}": v for k, v in cp.timings.items()})
    try:
        yield cp, creds
    finally:
        _in_thread(cp.stop())


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if STARTUP:
        terminalreporter.write_line("real control plane start-up: " + ", ".join(
            f"{k}={v:.1f}s" for k, v in sorted(STARTUP.items())))


class KubeEnv(Env):
    """:class:`tests.e2e.conftest.Env` in a namespace of its own on the real control plane."""

    def __init__(self, stack: LocalStack, ns: str, cp: KubeControlPlane, creds: ServiceCredentials) -> None:
        super().__init__(stack)
        assert stack.api is not None
        self.ns, self.cp, self.creds = ns, cp, creds
        self.apps = client.AppsV1Api(stack.api)
        self.policy = client.PolicyV1Api(stack.api)
        self.max_vms_per_incarnation = 0
        # keys an operator force-deleted while their VM's host was away: the successor may start
        # elsewhere before the predecessor's VM is removed (two per key then, never two per uid)
        self.force_deleted: set[str] = set()

    # ---------------------------------------------------------------- pods via the API
    @staticmethod
    def pod_spec(toleration_s: int | None = None) -> dict[str, Any]:
        tolerations: list[dict[str, Any]] = [dict(TAINT_TOLERATION)]
        if toleration_s is not None:  # how long a pod stays bound to a NotReady/unreachable node
            tolerations += [{"key": f"node.kubernetes.io/{t}", "operator": "Exists", "effect": "NoExecute",
                             "tolerationSeconds": toleration_s} for t in ("not-ready", "unreachable")]
        return {"tolerations": tolerations, "containers": [{"name": "main", "image": "vm"}],
                "terminationGracePeriodSeconds": 5}

    def pod(self, name: str, annotations: dict[str, str] | None = None,  # type: ignore[override]
            toleration_s: int | None = None) -> dict[str, Any]:
        return {"metadata": {"name": name, "annotations": annotations or {}},
                "spec": self.pod_spec(toleration_s)}

    async def create(self, name: str, annotations: dict[str, str] | None = None,
                     toleration_s: int | None = None) -> str:
        p = await self.core.create_namespaced_pod(self.ns, self.pod(name, annotations, toleration_s))
        return str(p.metadata.uid)

    async def get(self, name: str) -> Any | None:
        try:
            return await self.core.read_namespaced_pod(name, self.ns)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def force_delete(self, name: str) -> None:
        with contextlib.suppress(ApiException):
            await self.core.delete_namespaced_pod(name, self.ns, grace_period_seconds=0)

    async def annotate(self, name: str, key: str, value: str) -> None:
        await self.core.patch_namespaced_pod(name, self.ns, {"metadata": {"annotations": {key: value}}})

    async def pods(self, selector: str | None = None) -> list[Any]:
        return list((await self.core.list_namespaced_pod(self.ns, label_selector=selector)).items)

    # -------------------------------------------------------------------- the runtime
    async def vms(self, name: str | None = None) -> list[Any]:
        out = []
        for agent in self.stack.agents.values():
            for info in await agent.driver.list():
                key = info.labels.get("vmfence.io/key", "")
                if info.state in ("running", "paused", "creating") and key.startswith(f"{self.ns}/") and (
                        name is None or key == f"{self.ns}/{name}"):
                    out.append(info)
        return out

    async def vms_by_key(self) -> dict[str, list[tuple[str, str, str]]]:
        """key -> [(vm_id, host, uid)] of the VMs the runtimes hold in this namespace: for the sim
        runtime the agents' drivers, for qemu the OS process table."""
        out: dict[str, list[tuple[str, str, str]]] = {}
        if self.stack.runtime == "qemu":
            for seen in await asyncio.to_thread(scan_qemu, self.stack.root):
                if seen.key.startswith(f"{self.ns}/"):
                    out.setdefault(seen.key, []).append((seen.vm_id, seen.host, seen.uid8))
            return out
        for host, agent in self.stack.agents.items():
            for info in await agent.driver.list():
                key = info.labels.get("vmfence.io/key", "")
                if info.state in ("running", "paused", "creating") and key.startswith(f"{self.ns}/"):
                    uid = info.labels.get("vmfence.io/uid", "")
                    out.setdefault(key, []).append((info.vm_id, host, uid.replace("-", "")[:8]))
        return out

    async def oracle(self) -> None:
        """The runtimes' own records (the OS process table for qemu), 20 times a second: never two
        VMs for one key. A sample with two is confirmed by a second scan (VM names never repeat,
        so two VMs in both scans existed at one instant)."""
        while True:
            with contextlib.suppress(Exception):
                first = await self.vms_by_key()
                doubled = {k for k, v in first.items() if len(v) > 1}
                if doubled:
                    second = await self.vms_by_key()
                    for key in doubled:
                        both = [v for v in first[key] if v[0] in {w[0] for w in second.get(key, [])}]
                        per_uid = max((sum(1 for v in both if v[2] == u) for u in {v[2] for v in both}), default=0)
                        self.max_vms_per_incarnation = max(self.max_vms_per_incarnation, per_uid)
                        if key not in self.force_deleted and len(both) > self.max_vms_per_key:
                            self.max_vms_per_key, self.worst = len(both), (key, sorted(v[0] for v in both))
                elif first:
                    self.max_vms_per_key = max(self.max_vms_per_key, 1)
                    self.max_vms_per_incarnation = max(self.max_vms_per_incarnation, 1)
            await asyncio.sleep(0.05)

    async def audit(self) -> Any:
        report = await super().audit()
        assert self.max_vms_per_incarnation <= 1, "two VMs for one incarnation at once"
        return report

    # ----------------------------------------------------------------------- checks
    async def check_runtime_matches_api(self) -> None:
        """Every VM of the namespace belongs to a live pod's current uid on the host the pod is bound
        to (``spec.nodeName``), each live Running pod has exactly one; nothing of a deleted pod."""
        pods = {f"{self.ns}/{p.metadata.name}": p for p in await self.pods()}
        vms = await self.vms_by_key()
        for key, held in vms.items():
            pod = pods.get(key)
            assert pod is not None, f"VMs {held} left for the deleted pod {key}"
            uid8 = pod.metadata.uid.replace("-", "")[:8]
            assert len(held) == 1, f"{key}: {len(held)} VMs: {held}"
            vm_id, host, vm_uid8 = held[0]
            assert vm_uid8 == uid8, f"{key}: VM {vm_id} is not bound to the live uid {pod.metadata.uid}"
            assert pod.spec.node_name == f"vmfence-{host}", (
                f"{key}: bound to {pod.spec.node_name} but its VM {vm_id} runs on {host}")
        for key, pod in pods.items():
            if pod.status.phase == "Running" and pod.metadata.deletion_timestamp is None:
                assert key in vms, f"{key} is Running with no VM"

    async def explain(self, name: str, last: int = 12) -> str:
        """The pod as the API server has it and the last decisions of its key: a failure message."""
        pod = await self.get(name)
        lines = [f"pod {self.ns}/{name}: " + ("gone" if pod is None else
                 f"uid {pod.metadata.uid} node {pod.spec.node_name} phase {pod.status.phase} "
                 f"deleting {pod.metadata.deletion_timestamp} finalizers {pod.metadata.finalizers} "
                 f"annotations {pod.metadata.annotations}")]
        with contextlib.suppress(Exception):  # a Node NotReady or tainted stops kube-scheduler binding
            for node in (await self.core.list_node()).items:
                taints = [f"{t.key}:{t.effect}" for t in node.spec.taints or []]
                lines.append(f"  node {node.metadata.name}: Ready={self.conditions(node).get('Ready')} taints {taints}")
        with contextlib.suppress(Exception):
            entries = [r.entry for r in await self.records() if r.entry.key == f"{self.ns}/{name}"]
            for e in entries[-last:]:
                lines.append(f"  #{e.n} {e.input}: " + ", ".join(
                    f"{type(d).__name__}({getattr(d, 'reason', '') or getattr(d, 'outcome', '') or ''})"
                    for d in e.decisions))
        return "\n".join(lines)

    def kubectl(self, *args: str, as_user: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        kc = str(self.cp.admin_kubeconfig) if as_user is None else str(self.creds.kubeconfigs[as_user])
        return subprocess.run([str(KUBECTL), "--kubeconfig", kc, "-n", self.ns, *args],
                              capture_output=True, text=True, timeout=timeout, check=False)

    async def kubectl_ok(self, *args: str) -> str:
        out = await asyncio.to_thread(self.kubectl, *args)
        assert out.returncode == 0, f"kubectl {' '.join(args)}: {out.stderr}"
        return out.stdout

    async def wait_for(self, what: str, check: Callable[[], Awaitable[bool]], within_s: float = WAIT_S) -> None:
        await super().wait_for(what, check, within_s)


class ForbiddenLog(logging.Handler):
    """Every log record of the in-process services (watcher, agents) that reports a refused request."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            msg = record.getMessage()
            if FORBIDDEN.search(msg):
                self.lines.append(f"{record.name}: {msg[:300]}")


async def refused_requests(stack: LocalStack, handler: ForbiddenLog) -> list[str]:
    """The requests the API server refused to vmfence's services: every failed write the reconcilers
    reported into VMFENCE_IN (its detail holds the API server's answer) that RBAC denied or that the
    server rejected as invalid, and RBAC denials in the reconcilers' logs and the in-process watcher's
    records. Under the chart's RBAC a denial is a permission it forgot; a rejected write is a status
    or body vmfence must write the way the real server validates it."""
    lines = list(handler.lines)
    assert stack.bus is not None
    async for m in read_stream(stack.bus.js, stack.subjects.stream_in):
        if b"write_done" not in m.data:
            continue
        with contextlib.suppress(Exception):
            done = decode_input(m.data)
            if isinstance(done, WriteDone) and done.outcome == "failed" and (
                    FORBIDDEN.search(done.detail or "") or REJECTED.search(done.detail or "")):
                lines.append(f"{done.fence.key} write {done.write_id}: {(done.detail or '')[:300]}")
    for path in sorted((stack.root / "logs").glob("reconciler-*.log")):
        with contextlib.suppress(OSError):
            lines += [f"{path.name}: {line[:300]}" for line in path.read_text(errors="replace").splitlines()
                      if FORBIDDEN.search(line)]
    return lines


def namespace_for(request: pytest.FixtureRequest) -> str:
    base = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")
    return f"t{next(_counter)}-{base}"[:50].rstrip("-")


async def _empty_namespace(core: client.CoreV1Api, custom: client.CustomObjectsApi, ns: str) -> str | None:
    """Delete the namespace (no new pod can be made in it from then on: NamespaceLifecycle), ask for
    its pods and VirtualMachines to go at once, and wait until none is left (finalized by vmfence,
    which still runs, once their VMs are removed); the reason when they are not, or None. The
    namespace controller finishes the namespace in the background (its own pass takes ~5 s;
    test_workloads waits for it where that is the point)."""
    with contextlib.suppress(ApiException):
        await core.delete_namespace(ns)
    with contextlib.suppress(ApiException):
        await core.delete_collection_namespaced_pod(ns)
    with contextlib.suppress(ApiException):
        await custom.delete_collection_namespaced_custom_object("vmfence.io", "v1alpha1", ns, "virtualmachines")
    deadline = time.monotonic() + NAMESPACE_GONE_S
    pods: list[str] = []
    while time.monotonic() < deadline:
        pods = [p.metadata.name for p in (await core.list_namespaced_pod(ns)).items]
        vms = (await custom.list_namespaced_custom_object("vmfence.io", "v1alpha1", ns, "virtualmachines"))["items"]
        if not pods and not vms:
            return None
        await asyncio.sleep(0.2)
    return f"namespace {ns}: pods {pods} still there after {NAMESPACE_GONE_S:.0f}s"


@contextlib.asynccontextmanager
async def kube_env(control_plane: tuple[KubeControlPlane, ServiceCredentials], root: Path, ns: str,
                   **kw: Any) -> AsyncIterator[KubeEnv]:
    cp, creds = control_plane
    opts: dict[str, Any] = {"runtime": "sim", "partitions": 4, "restart_backoff_s": 0.2, "host_stale_s": 3.0}
    opts.update(kw)
    t0 = time.monotonic()
    refused = ForbiddenLog()
    logging.getLogger().addHandler(refused)
    stack = LocalStack(root, kubeconfig=str(cp.admin_kubeconfig),
                       service_kubeconfigs={c: str(p) for c, p in creds.kubeconfigs.items()}, **opts)
    try:
        await stack.start()
        STARTUP["stack_s_last"] = time.monotonic() - t0
        env = KubeEnv(stack, ns, cp, creds)
        await env.core.create_namespace({"metadata": {"name": ns}})
        await env.wait_for(f"the default ServiceAccount of {ns}", lambda: _has_default_sa(env.core, ns))
        oracle = asyncio.create_task(env.oracle(), name="oracle")
        leftover: str | None = None
        try:
            yield env
        finally:
            try:
                t1 = time.monotonic()
                leftover = await _empty_namespace(env.core, env.custom, ns)
                STARTUP["namespace_delete_s_last"] = time.monotonic() - t1
            finally:
                await cancel_and_wait([oracle], what="oracle")
        assert leftover is None, leftover
        forgotten = await refused_requests(stack, refused)
        assert not forgotten, "requests of vmfence's services refused by the real API server:\n" + "\n".join(forgotten)
    finally:
        logging.getLogger().removeHandler(refused)
        t2 = time.monotonic()
        await stack.stop()
        STARTUP["stack_stop_s_last"] = time.monotonic() - t2


async def _has_default_sa(core: client.CoreV1Api, ns: str) -> bool:
    try:
        await core.read_namespaced_service_account("default", ns)
        return True
    except ApiException:
        return False


@pytest.fixture
async def kenv(control_plane: tuple[KubeControlPlane, ServiceCredentials], tmp_path: Path,
               request: pytest.FixtureRequest) -> AsyncIterator[KubeEnv]:
    async with kube_env(control_plane, tmp_path / "stack", namespace_for(request)) as env:
        yield env
