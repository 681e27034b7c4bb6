"""K8sGateway against the dev API server over real HTTP: consistent confirms and rule-6 writes."""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client

from services.apiserver.server import ApiServer
from services.reconciler.kube import K8sGateway, KubeUnavailable, NullGateway
from shared.fence.keys import Key
from shared.fence.schema import Fence, KubeWrite, PodStatusIntent, Spec

from .conftest import MERGE, NS, VM_ARGS, pod_body, vm_body

RUNNING = PodStatusIntent(
    phase="Running", ready=True, vm_id="vm-1", host="host-a", ip="10.1.0.5", vnc_port=5901, restart_count=2
)


async def create(core: client.CoreV1Api, name: str, **kw: Any) -> dict[str, Any]:
    resp = await core.create_namespaced_pod(NS, pod_body(name, **kw), _preload_content=False)
    return dict(await resp.json())


async def raw_pod(core: client.CoreV1Api, name: str) -> dict[str, Any]:
    resp = await core.read_namespaced_pod(name, NS, _preload_content=False)
    assert resp.status == 200, resp.status
    return dict(await resp.json())


def status_write(uid: str, intent: PodStatusIntent, key: str = f"{NS}/p", epoch: int = 3) -> KubeWrite:
    return KubeWrite(id=f"w-{intent.phase}", verb="status", fence=Fence(key, uid, epoch), status=intent)


async def test_confirm_is_consistent_under_stale_reads(
    server: ApiServer, core: client.CoreV1Api, gateway: K8sGateway
) -> None:
    old = await create(core, "p")
    server.faults.set_stale(events=10)
    await core.delete_namespaced_pod("p", NS, grace_period_seconds=0)
    new = await create(core, "p", annotations={"vmfence.io/cpus": "lots"})
    # the lagging cache lies: an rv=0 read still answers with the predecessor
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{server.url}/api/v1/namespaces/{NS}/pods/p", params={"resourceVersion": "0"}) as resp,
    ):
        stale = await resp.json()
    assert stale["metadata"]["uid"] == old["metadata"]["uid"]
    got = await gateway.confirm(Key("pod", NS, "p"), "r1")
    assert got.uid == new["metadata"]["uid"] and got.request == "r1" and got.key == f"{NS}/p"
    assert got.resource_version == int(new["metadata"]["resourceVersion"])
    assert got.invalid is not None and "vmfence.io/cpus" in got.invalid
    missing = await gateway.confirm(Key("pod", NS, "nope"), "r2")
    assert missing.uid is None


async def test_confirm_deleting_and_vm(
    core: client.CoreV1Api, custom: client.CustomObjectsApi, gateway: K8sGateway
) -> None:
    await create(core, "p")
    await core.delete_namespaced_pod("p", NS)  # graceful: deletionTimestamp set
    assert (await gateway.confirm(Key("pod", NS, "p"), "r")).deleting
    vm = await custom.create_namespaced_custom_object(*VM_ARGS, vm_body("db", cpus=2, memory="1Gi"))
    got = await gateway.confirm(Key("vm", NS, "db"), "r")
    assert got.uid == vm["metadata"]["uid"] and got.spec == Spec(cpus=2, memory_mib=1024, image="debian")


async def test_confirm_unavailable_raises(server: ApiServer, core: client.CoreV1Api, kubeconfig: str) -> None:
    server.faults.inject_error("get", "pods", 500, count=None)
    gw = await K8sGateway.connect(kubeconfig, call_timeout_s=5.0)
    try:
        try:
            await gw.confirm(Key("pod", NS, "p"), "r")
        except KubeUnavailable:
            pass
        else:
            raise AssertionError("confirm answered without a consistent read")
    finally:
        await gw.close()


async def test_status_write_sets_everything(core: client.CoreV1Api, gateway: K8sGateway) -> None:
    pod = await create(core, "p", containers=2)
    uid = pod["metadata"]["uid"]
    done = await gateway.write(Key("pod", NS, "p"), status_write(uid, RUNNING))
    assert done.outcome == "ok", done
    assert done.write_id == "w-Running" and done.fence.uid == uid
    got = await raw_pod(core, "p")
    st = got["status"]
    assert st["phase"] == "Running" and st["podIP"] == "10.1.0.5" and st["hostIP"] == "10.0.0.1"
    assert st["startTime"]
    conds = {c["type"]: c["status"] for c in st["conditions"]}
    assert conds == {
        "PodScheduled": "True",
        "Initialized": "True",
        "ContainersReady": "True",
        "Ready": "True",
    }
    assert [c["name"] for c in st["containerStatuses"]] == ["c0", "c1"]
    for cs in st["containerStatuses"]:
        assert cs["ready"] is True and cs["restartCount"] == 2 and cs["containerID"] == "vmfence://vm-1"
        assert cs["state"]["running"]["startedAt"] and cs["image"] == "busybox" and cs["imageID"]
    ann = got["metadata"]["annotations"]
    assert ann["vmfence.io/vm-id"] == "vm-1" and ann["vmfence.io/host"] == "host-a"
    assert ann["vmfence.io/ip"] == "10.1.0.5" and ann["vmfence.io/vnc-port"] == "5901"
    assert ann["vmfence.io/epoch"] == "3"
    # the same intent again is a no-op: no new resourceVersion
    rv = got["metadata"]["resourceVersion"]
    assert (await gateway.write(Key("pod", NS, "p"), status_write(uid, RUNNING))).outcome == "ok"
    assert (await raw_pod(core, "p"))["metadata"]["resourceVersion"] == rv


async def test_hibernated_and_invalid_conditions(core: client.CoreV1Api, gateway: K8sGateway) -> None:
    uid = (await create(core, "p"))["metadata"]["uid"]
    key = Key("pod", NS, "p")
    hib = PodStatusIntent(phase="Running", ready=True, host="host-a", hibernated=True)
    assert (await gateway.write(key, status_write(uid, hib))).outcome == "ok"
    st = (await raw_pod(core, "p"))["status"]
    conds = {c["type"]: c for c in st["conditions"]}
    assert st["phase"] == "Running" and conds["Ready"]["status"] == "False"
    assert conds["vmfence.io/Hibernated"]["status"] == "True"
    assert st["containerStatuses"][0]["state"]["waiting"]["reason"] == "Hibernated"
    ann = (await raw_pod(core, "p"))["metadata"]["annotations"]
    assert "vmfence.io/vm-id" not in ann
    bad = PodStatusIntent(phase="Pending", invalid='vmfence.io/cpus: "lots" is not an integer between 1 and 64')
    assert (await gateway.write(key, status_write(uid, bad))).outcome == "ok"
    st = (await raw_pod(core, "p"))["status"]
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["vmfence.io/SpecValid"]["status"] == "False"
    assert conds["vmfence.io/SpecValid"]["reason"] == "InvalidSpec"
    assert "vmfence.io/cpus" in conds["vmfence.io/SpecValid"]["message"]
    assert conds["vmfence.io/Hibernated"]["status"] == "False"  # woken back
    assert st["containerStatuses"][0]["state"]["waiting"]["reason"] == "InvalidSpec"


async def test_write_to_recreated_pod_is_superseded(core: client.CoreV1Api, gateway: K8sGateway) -> None:
    old_uid = (await create(core, "p"))["metadata"]["uid"]
    await core.delete_namespaced_pod("p", NS, grace_period_seconds=0)
    await create(core, "p")
    done = await gateway.write(Key("pod", NS, "p"), status_write(old_uid, RUNNING))
    assert done.outcome == "superseded", done
    succ = await raw_pod(core, "p")
    assert succ["status"]["phase"] == "Pending" and not succ["metadata"].get("annotations")


async def test_write_to_deleted_pod_is_gone(core: client.CoreV1Api, gateway: K8sGateway) -> None:
    uid = (await create(core, "p"))["metadata"]["uid"]
    await core.delete_namespaced_pod("p", NS, grace_period_seconds=0)
    key = Key("pod", NS, "p")
    for verb in ("evict", "delete"):
        done = await gateway.write(key, KubeWrite(id=verb, verb=verb, fence=Fence(str(key), uid, 1)))
        assert done.outcome == "gone", (verb, done)
    assert (await gateway.write(key, status_write(uid, RUNNING))).outcome == "gone"


async def test_conflict_reapplies_intent_on_fresh_object(
    server: ApiServer, core: client.CoreV1Api, gateway: K8sGateway
) -> None:
    """An injected 409 with the same uid: the intent (not the fresh object) is written again."""
    uid = (await create(core, "p"))["metadata"]["uid"]
    status_rule = server.faults.inject_error("patch", "pods/status", 409)
    done = await gateway.write(Key("pod", NS, "p"), status_write(uid, RUNNING))
    assert done.outcome == "ok", done
    assert status_rule.fired == 1
    got = await raw_pod(core, "p")
    assert got["metadata"]["uid"] == uid
    assert got["status"]["phase"] == "Running"
    assert got["status"]["containerStatuses"][0]["containerID"] == "vmfence://vm-1"
    assert got["metadata"]["annotations"]["vmfence.io/vm-id"] == "vm-1"


async def test_concurrent_change_between_read_and_write_is_not_lost(
    core: client.CoreV1Api, gateway: K8sGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """Someone else writes status right after the gateway's read: the rv-carrying patch gets a real
    409, and the retry re-applies the intent to the fresh object, keeping their condition."""
    uid = (await create(core, "p"))["metadata"]["uid"]
    other = {"status": {"conditions": [{"type": "example.com/Other", "status": "True"}]}}
    real_get = gateway._get
    reads = 0

    async def get_then_race(key: Key) -> dict[str, Any] | None:
        nonlocal reads
        obj = await real_get(key)
        reads += 1
        if reads == 1:
            await core.patch_namespaced_pod_status("p", NS, other, _content_type=MERGE)
        return obj

    gateway._get = get_then_race  # type: ignore[method-assign]
    caplog.set_level(logging.INFO, "services.reconciler.kube")
    done = await gateway.write(Key("pod", NS, "p"), status_write(uid, RUNNING))
    assert done.outcome == "ok", done
    assert reads >= 2 and "resourceVersion conflict" in caplog.text
    conds = {c["type"]: c["status"] for c in (await raw_pod(core, "p"))["status"]["conditions"]}
    assert conds["example.com/Other"] == "True" and conds["Ready"] == "True"


async def test_invalid_with_same_uid_is_failed_not_superseded(
    server: ApiServer, core: client.CoreV1Api, gateway: K8sGateway
) -> None:
    uid = (await create(core, "p"))["metadata"]["uid"]
    server.faults.inject_error("patch", "pods/status", 422)
    done = await gateway.write(Key("pod", NS, "p"), status_write(uid, RUNNING))
    assert done.outcome == "failed" and done.detail is not None and "invalid" in done.detail
    assert not done.unanswered, "a refusal is an answer: nothing waits for the server to answer again"


async def test_transient_errors_retried_then_failed(
    server: ApiServer, core: client.CoreV1Api, gateway: K8sGateway
) -> None:
    uid = (await create(core, "p"))["metadata"]["uid"]
    key = Key("pod", NS, "p")
    server.faults.inject_error("patch", "pods/status", 500, count=2)
    assert (await gateway.write(key, status_write(uid, RUNNING))).outcome == "ok"
    server.faults.inject_error("patch", "pods/status", 429, count=None)
    done = await gateway.write(key, status_write(uid, PodStatusIntent(phase="Failed")))
    assert done.outcome == "failed" and done.detail is not None and "429" in done.detail
    assert done.unanswered, "the server did not take it for as long as the gateway tried: written again once it does"
    server.faults.reset()
    done = await gateway.write(key, status_write(uid, PodStatusIntent(phase="Failed")))
    assert done.outcome == "ok" and not done.unanswered


async def test_eviction_fenced_by_uid(core: client.CoreV1Api, gateway: K8sGateway) -> None:
    old_uid = (await create(core, "p"))["metadata"]["uid"]
    await core.delete_namespaced_pod("p", NS, grace_period_seconds=0)
    succ = await create(core, "p")
    key = Key("pod", NS, "p")
    done = await gateway.write(key, KubeWrite(id="e1", verb="evict", fence=Fence(str(key), old_uid, 1)))
    assert done.outcome == "superseded", done
    after = await raw_pod(core, "p")
    assert after["metadata"]["uid"] == succ["metadata"]["uid"]
    assert not after["metadata"].get("deletionTimestamp")
    assert after["metadata"]["resourceVersion"] == succ["metadata"]["resourceVersion"]
    # evicting the current incarnation works
    done = await gateway.write(key, KubeWrite(id="e2", verb="evict", fence=Fence(str(key), succ["metadata"]["uid"], 2)))
    assert done.outcome == "ok", done
    assert (await raw_pod(core, "p"))["metadata"]["deletionTimestamp"]


async def test_final_delete_grace_zero(core: client.CoreV1Api, gateway: K8sGateway) -> None:
    uid = (await create(core, "p"))["metadata"]["uid"]
    await core.delete_namespaced_pod("p", NS)  # graceful: waits for the "kubelet"
    assert (await raw_pod(core, "p"))["metadata"]["deletionTimestamp"]
    key = Key("pod", NS, "p")
    done = await gateway.write(key, KubeWrite(id="d", verb="delete", fence=Fence(str(key), uid, 1)))
    assert done.outcome == "ok", done
    assert (await gateway.confirm(key, "r")).uid is None


async def test_final_delete_of_recreated_pod_is_superseded(core: client.CoreV1Api, gateway: K8sGateway) -> None:
    old_uid = (await create(core, "p"))["metadata"]["uid"]
    await core.delete_namespaced_pod("p", NS, grace_period_seconds=0)
    succ = await create(core, "p")
    key = Key("pod", NS, "p")
    done = await gateway.write(key, KubeWrite(id="d", verb="delete", fence=Fence(str(key), old_uid, 1)))
    assert done.outcome == "superseded"
    assert (await gateway.confirm(key, "r")).uid == succ["metadata"]["uid"]


async def test_events_listed_and_idempotent(server: ApiServer, core: client.CoreV1Api, gateway: K8sGateway) -> None:
    uid = (await create(core, "p"))["metadata"]["uid"]
    key = Key("pod", NS, "p")
    ev = KubeWrite(
        id="ev-1",
        verb="event",
        fence=Fence(str(key), uid, 1),
        event_reason="InvalidSpec",
        event_type="Warning",
        message='vmfence.io/cpus: "lots" is not an integer between 1 and 64',
    )
    assert (await gateway.write(key, ev)).outcome == "ok"
    assert (await gateway.write(key, ev)).outcome == "ok"  # a redelivered effect: still one Event
    events = (await core.list_namespaced_event(NS)).items
    assert len(events) == 1
    e = events[0]
    assert e.involved_object.uid == uid and e.involved_object.name == "p" and e.involved_object.kind == "Pod"
    assert e.reason == "InvalidSpec" and e.type == "Warning" and e.source.component == "vmfence"
    assert e.count == 1 and e.first_timestamp and e.last_timestamp
    server.faults.inject_error("create", "events", 500, count=None)
    assert (await gateway.write(key, KubeWrite(id="ev-2", verb="event", fence=ev.fence))).outcome == "failed"


async def test_vm_status_and_supersede(custom: client.CustomObjectsApi, gateway: K8sGateway) -> None:
    vm = await custom.create_namespaced_custom_object(*VM_ARGS, vm_body("db"))
    uid = vm["metadata"]["uid"]
    key = Key("vm", NS, "db")
    done = await gateway.write(key, status_write(uid, RUNNING, key=str(key), epoch=4))
    assert done.outcome == "ok", done
    st = (await custom.get_namespaced_custom_object(*VM_ARGS, "db"))["status"]
    assert st["phase"] == "Running" and st["host"] == "host-a" and st["vmID"] == "vm-1"
    assert st["ip"] == "10.1.0.5" and st["restartCount"] == 2 and st["epoch"] == 4
    assert {c["type"]: c["status"] for c in st["conditions"]} == {"Ready": "True"}
    await custom.delete_namespaced_custom_object(*VM_ARGS, "db")
    await custom.create_namespaced_custom_object(*VM_ARGS, vm_body("db"))
    assert (await gateway.write(key, status_write(uid, RUNNING, key=str(key)))).outcome == "superseded"
    done = await gateway.write(key, KubeWrite(id="d", verb="delete", fence=Fence(str(key), uid, 4)))
    assert done.outcome == "superseded"


async def test_null_gateway() -> None:
    key = Key("pod", NS, "p")
    gw = NullGateway({key: ("u1", 5, Spec(cpus=2))})
    got = await gw.confirm(key, "r")
    assert (got.uid, got.resource_version, got.spec.cpus) == ("u1", 5, 2)
    assert (await gw.confirm(Key("pod", NS, "q"), "r")).uid is None
    assert (await gw.write(key, status_write("u1", RUNNING))).outcome == "ok"
    assert gw.counts["status"] == 1
    await gw.close()


async def test_write_bounded_by_call_timeout(server: ApiServer, core: client.CoreV1Api, kubeconfig: str) -> None:
    uid = (await create(core, "p"))["metadata"]["uid"]
    server.faults.add_latency("patch", 2000, "pods/status")
    gw = await K8sGateway.connect(kubeconfig, call_timeout_s=0.5)
    try:
        done = await gw.write(Key("pod", NS, "p"), status_write(uid, RUNNING))
        assert done.outcome == "failed" and done.detail is not None and "timed out" in done.detail
    finally:
        await gw.close()
