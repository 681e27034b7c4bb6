"""An agent down for longer than the node grace period, against the real controller-manager: the
Node turns NotReady, its pods are taint-evicted after their ``tolerationSeconds``, a Deployment's
replacements run on the live host at once, a StatefulSet's pod stays Terminating (its VM is not
confirmed gone: rule 12) until an operator force-deletes it, and once the agent is back no VM of a
deleted pod is left on it. Never two VMs for one incarnation; two for one StatefulSet identity only
across the operator's force delete.
"""

from __future__ import annotations

import time
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from tests.kube_real.conftest import KubeEnv
from tests.kube_real.test_workloads import deployment, statefulset, wait_app

TOLERATION_S = 3  # how long the test pods stay bound to a NotReady node (DefaultTolerationSeconds: 300)
TERMINATING_HOLD_S = 4.0  # the StatefulSet pod is watched staying Terminating this long


def with_toleration(obj: dict[str, Any], kenv: KubeEnv) -> dict[str, Any]:
    obj["spec"]["template"]["spec"] = kenv.pod_spec(TOLERATION_S)
    return obj


async def test_an_agent_down_past_the_node_grace_period(kenv: KubeEnv) -> None:
    await kenv.apps.create_namespaced_deployment(kenv.ns, with_toleration(deployment(kenv, "d", 4), kenv))
    await kenv.apps.create_namespaced_stateful_set(kenv.ns, with_toleration(statefulset(kenv, "s", 2), kenv))
    await wait_app(kenv, "d", 4)
    sts = await wait_app(kenv, "s", 2)
    victim = sts[0]
    node = victim.spec.node_name
    host = node.removeprefix("vmfence-")
    live_host = next(h for h in kenv.stack.agents if h != host)
    on_host = {p.metadata.name: p.metadata.uid for p in await kenv.pods() if p.spec.node_name == node}
    deployment_on_host = [n for n in on_host if n.startswith("d-")]

    await kenv.stack.stop_agent(host)  # its VMs keep running, as on a host whose agent died
    down_at = time.monotonic()

    async def node_not_ready() -> bool:
        n = await kenv.core.read_node(node)
        taints = {t.key for t in (n.spec.taints or [])}
        return kenv.conditions(n).get("Ready") != "True" and bool(
            taints & {"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"})

    await kenv.wait_for(f"{node} NotReady and tainted by the node lifecycle controller", node_not_ready)
    not_ready_s = time.monotonic() - down_at

    async def evicted(name: str) -> bool:
        p = await kenv.get(name)
        return p is None or p.metadata.deletion_timestamp is not None or p.metadata.uid != on_host[name]

    for name in on_host:
        await kenv.wait_for(f"{name} taint-evicted", lambda n=name: evicted(n))  # type: ignore[misc]
    events = (await kenv.core.list_namespaced_event(kenv.ns)).items
    by_taint = {e.involved_object.name for e in events if e.reason == "TaintManagerEviction"}
    assert set(on_host) <= by_taint, f"not evicted by the controller-manager's taint manager: {set(on_host) - by_taint}"
    # the Deployment's replacements run on the live host at once
    def replaced(ps: list[Any]) -> bool:
        return all(p.spec.node_name == f"vmfence-{live_host}" for p in ps)

    async def d_replaced() -> bool:
        live = [p for p in await kenv.pods("app=d") if p.metadata.deletion_timestamp is None]
        return len(live) == 4 and replaced(live) and all(kenv.is_running_ready(p) for p in live)

    await kenv.wait_for("the Deployment's 4 pods Running on the live host", d_replaced, 60.0)
    # the StatefulSet pod waits: Terminating while its VM is not confirmed gone, no successor anywhere
    hold_until = time.monotonic() + TERMINATING_HOLD_S
    while time.monotonic() < hold_until:
        p = await kenv.get(victim.metadata.name)
        assert p is not None and p.metadata.uid == victim.metadata.uid, "finalized without its VM confirmed gone"
        assert p.metadata.deletion_timestamp is not None
        assert await kenv.vms(victim.metadata.name) == [], "a second VM for the StatefulSet identity"
    # the operator force-deletes it: the controller starts the successor on the live host
    kenv.force_deleted.add(f"{kenv.ns}/{victim.metadata.name}")
    await kenv.core.delete_namespaced_pod(victim.metadata.name, kenv.ns, grace_period_seconds=0)
    succ = await kenv.wait_running(victim.metadata.name)
    assert succ.metadata.uid != victim.metadata.uid and succ.spec.node_name == f"vmfence-{live_host}"
    # the agent returns: every VM of a deleted pod on it is removed, the Terminating pods finish
    await kenv.stack.start_agent(host)

    async def settled() -> bool:
        pods = await kenv.pods()
        return all(p.metadata.deletion_timestamp is None for p in pods) and not any(
            p.metadata.uid in on_host.values() for p in pods)

    await kenv.wait_for("the evicted pods finalized after the agent returned", settled, 60.0)
    await kenv.settle()
    for name in deployment_on_host:
        try:
            p = await kenv.core.read_namespaced_pod(name, kenv.ns)
            raise AssertionError(f"{name} (uid {p.metadata.uid}) still exists")
        except ApiException as exc:
            assert exc.status == 404
    await kenv.check_runtime_matches_api()
    await kenv.audit()
    print(f"node NotReady {not_ready_s:.1f}s after the agent stopped")
