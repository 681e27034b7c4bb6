"""Workload controllers of the real control plane driving vmfence: a StatefulSet's same-name
successors, a Deployment's scale, rollout and drain under a PodDisruptionBudget, a namespace's
deletion. The oracle is the runtimes' own records (never two VMs for one key at any sample, each
bound to the live uid on the node the pod is bound to, none for a deleted pod) and the audit.

``VMFENCE_KUBE_STS_ROUNDS`` sets the StatefulSet's delete rounds (default the issue's full 30: about 0.7 s a round).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from tests.kube_real.conftest import KubeEnv

STS_ROUNDS = int(os.environ.get("VMFENCE_KUBE_STS_ROUNDS", "30"))
ROUND_S = 60.0  # one delete round: the old pod finalized, the successor created


def statefulset(kenv: KubeEnv, name: str, replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": name},
        "spec": {"replicas": replicas, "serviceName": name, "selector": {"matchLabels": {"app": name}},
                 "podManagementPolicy": "Parallel",
                 "template": {"metadata": {"labels": {"app": name}}, "spec": kenv.pod_spec()}},
    }


def deployment(kenv: KubeEnv, name: str, replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                 "strategy": {"rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}},
                 "template": {"metadata": {"labels": {"app": name}}, "spec": kenv.pod_spec()}},
    }


async def running_pods(kenv: KubeEnv, app: str) -> list[Any]:
    return [p for p in await kenv.pods(f"app={app}")
            if p.metadata.deletion_timestamp is None and kenv.is_running_ready(p)]


async def wait_app(kenv: KubeEnv, app: str, count: int, within_s: float = 90.0, *,
                   extra: Any = None) -> list[Any]:
    """Exactly ``count`` pods of ``app``, all Running and Ready, none terminating."""
    async def ok() -> bool:
        pods = await kenv.pods(f"app={app}")
        live = [p for p in pods if p.metadata.deletion_timestamp is None and kenv.is_running_ready(p)]
        return len(pods) == count and len(live) == count and (extra is None or extra(pods))

    await kenv.wait_for(f"{count} pods of {app} Running", ok, within_s)
    return await kenv.pods(f"app={app}")


async def test_a_statefulset_of_3_through_delete_rounds_and_scaling(kenv: KubeEnv) -> None:
    await kenv.apps.create_namespaced_stateful_set(kenv.ns, statefulset(kenv, "web", 3))
    await wait_app(kenv, "web", 3)
    seen_uids: dict[str, set[str]] = {}
    started = time.monotonic()
    for r in range(STS_ROUNDS):
        name = f"web-{r % 3}"
        pod = await kenv.get(name)
        assert pod is not None, f"round {r}: {name} missing"
        seen_uids.setdefault(name, set()).add(pod.metadata.uid)
        # kubectl delete pod as a user types it, without kubectl's own wait: vmfence finalizes a pod in
        # some 20 ms, and kubectl 1.35's wait (a GET that still sees the deleting pod, then a watch
        # whose initial events already hold the controller's same-name successor) then waits for a
        # DELETED event that never comes (seen 3 times in 30 rounds). The test waits for the uid.
        out = await asyncio.to_thread(kenv.kubectl, "delete", "pod", name, "--wait=false")
        assert out.returncode == 0, f"round {r}: {out.stderr}"

        async def replaced(n: str = name, old: str = pod.metadata.uid) -> bool:
            p = await kenv.get(n)
            return p is not None and p.metadata.uid != old

        try:
            await kenv.wait_for(f"round {r}: {name} recreated", replaced, ROUND_S)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{await kenv.explain(name)}") from None
    rounds_s = time.monotonic() - started
    pods = await wait_app(kenv, "web", 3)
    await kenv.settle()
    await kenv.check_runtime_matches_api()
    for p in pods:  # the live incarnation is not one that was deleted
        assert p.metadata.uid not in seen_uids.get(p.metadata.name, set())
    # 3 -> 5 -> 2
    await kenv.apps.patch_namespaced_stateful_set_scale("web", kenv.ns, {"spec": {"replicas": 5}})
    await wait_app(kenv, "web", 5)
    await kenv.check_runtime_matches_api()
    await kenv.apps.patch_namespaced_stateful_set_scale("web", kenv.ns, {"spec": {"replicas": 2}})
    pods = await wait_app(kenv, "web", 2)
    assert sorted(p.metadata.name for p in pods) == ["web-0", "web-1"]
    await kenv.settle()
    await kenv.check_runtime_matches_api()
    for gone in ("web-2", "web-3", "web-4"):
        assert await kenv.vms(gone) == [], f"{gone} scaled away but its VM is left"
    report = await kenv.audit()
    assert report.decisions_by_type.get("admitted", 0) >= 3 + STS_ROUNDS + 2
    print(f"statefulset: {STS_ROUNDS} delete rounds in {rounds_s:.1f}s, max VMs per key {kenv.max_vms_per_key}")


async def test_a_deployment_scaled_0_20_0_rolled_out_and_drained_under_a_pdb(kenv: KubeEnv) -> None:
    await kenv.apps.create_namespaced_deployment(kenv.ns, deployment(kenv, "app", 0))
    await kenv.apps.patch_namespaced_deployment_scale("app", kenv.ns, {"spec": {"replicas": 20}})
    pods = await wait_app(kenv, "app", 20, 120.0)
    await kenv.check_runtime_matches_api()
    first_uids = {p.metadata.uid for p in pods}
    # rollout of a new template: every pod replaced by one of the new ReplicaSet's
    await kenv.apps.patch_namespaced_deployment(
        "app", kenv.ns, {"spec": {"template": {"metadata": {"annotations": {"rev": "2"}}}}})

    def all_new(ps: list[Any]) -> bool:
        return all((p.metadata.annotations or {}).get("rev") == "2" for p in ps)

    pods = await wait_app(kenv, "app", 20, 150.0, extra=all_new)
    assert not first_uids & {p.metadata.uid for p in pods}
    await kenv.settle()
    await kenv.check_runtime_matches_api()
    # drain one vmfence node: the eviction API, a PodDisruptionBudget honoured throughout
    pdb = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "app"},
           "spec": {"maxUnavailable": 4, "selector": {"matchLabels": {"app": "app"}}}}
    await kenv.policy.create_namespaced_pod_disruption_budget(kenv.ns, pdb)
    by_node: dict[str, int] = {}
    for p in pods:
        by_node[p.spec.node_name] = by_node.get(p.spec.node_name, 0) + 1
    node = max(by_node, key=lambda n: by_node[n])
    min_ready = 20

    async def watch_ready() -> None:
        nonlocal min_ready
        while True:
            min_ready = min(min_ready, len(await running_pods(kenv, "app")))
            await asyncio.sleep(0.1)

    async def pdb_allows() -> bool:
        st = (await kenv.policy.read_namespaced_pod_disruption_budget("app", kenv.ns)).status
        return st is not None and st.expected_pods == 20 and (st.disruptions_allowed or 0) > 0

    await kenv.wait_for("the PDB observed", pdb_allows)
    sampler = asyncio.create_task(watch_ready())
    try:
        out = await asyncio.to_thread(kenv.kubectl, "drain", node, "--ignore-daemonsets", "--timeout=120s",
                                      "--delete-emptydir-data", timeout=150)
        assert out.returncode == 0, f"kubectl drain {node}: {out.stderr}"
        pods = await wait_app(kenv, "app", 20, 90.0)
    finally:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    assert "evicting pod" in out.stderr + out.stdout
    assert min_ready >= 20 - 4, f"the PDB allowed 4 unavailable, {20 - min_ready} were"
    assert all(p.spec.node_name != node for p in pods), "a pod runs on the drained node"
    assert (await kenv.core.read_node(node)).spec.unschedulable
    await kenv.settle()
    await kenv.check_runtime_matches_api()
    await kenv.kubectl_ok("uncordon", node)
    await kenv.apps.patch_namespaced_deployment_scale("app", kenv.ns, {"spec": {"replicas": 0}})

    async def none_left() -> bool:
        return not await kenv.pods("app=app") and not await kenv.vms()

    await kenv.wait_for("scaled to 0, every VM removed", none_left, 90.0)
    await kenv.audit()


async def test_deleting_a_namespace_removes_its_vms_and_the_namespace_goes_away(kenv: KubeEnv) -> None:
    ns = f"{kenv.ns}-gone"
    await kenv.core.create_namespace({"metadata": {"name": ns}})

    async def sa() -> bool:
        try:
            await kenv.core.read_namespaced_service_account("default", ns)
            return True
        except ApiException:
            return False

    await kenv.wait_for("its default ServiceAccount", sa)
    for i in range(4):
        await kenv.core.create_namespaced_pod(ns, kenv.pod(f"p{i}"))
    await kenv.apps.create_namespaced_stateful_set(ns, statefulset(kenv, "db", 2))
    vm = {"apiVersion": "vmfence.io/v1alpha1", "kind": "VirtualMachine", "metadata": {"name": "box"},
          "spec": {"cpus": 1, "memory": "128Mi"}}
    await kenv.custom.create_namespaced_custom_object("vmfence.io", "v1alpha1", ns, "virtualmachines", vm)

    async def vms_in_ns() -> list[str]:
        return [i.vm_id for a in kenv.stack.agents.values() for i in await a.driver.list()
                if i.state in ("running", "paused", "creating")
                and i.labels.get("vmfence.io/key", "").split("/")[0] in (ns, f"vm:{ns}")]

    async def all_up() -> bool:
        return len(await vms_in_ns()) == 7

    await kenv.wait_for("4 pods, 2 StatefulSet pods and a VirtualMachine running", all_up, 90.0)
    await kenv.core.delete_namespace(ns)

    async def ns_gone() -> bool:
        try:
            await kenv.core.read_namespace(ns)
            return False
        except ApiException as exc:
            return exc.status == 404

    await kenv.wait_for("the namespace deleted by the namespace controller", ns_gone, 90.0)

    async def no_vms() -> bool:  # a VirtualMachine has no finalizer: its VM may go just after it
        return await vms_in_ns() == []

    await kenv.wait_for("no VM left of the deleted namespace", no_vms, 30.0)
    await kenv.audit()
