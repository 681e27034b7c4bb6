"""The development server refuses pod status writes the real one refuses (services/apiserver/podstatus.py,
after ValidatePodStatusUpdate), and every status vmfence's gateway writes — each phase and reason
decide produces — passes it: a status the real server would reject fails here."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from services.reconciler.kube import K8sGateway
from shared.fence.keys import Key
from shared.fence.schema import Fence, KubeWrite, PodStatusIntent

from .conftest import pod_body

NS = "default"
MERGE = "application/merge-patch+json"

INTENTS = [
    PodStatusIntent("Pending", reason="Unschedulable", message="node vmfence-host-b is not a live vmfence host"),
    PodStatusIntent("Running", ready=False, vm_id="v-1", host="host-a", ip="10.240.1.7"),
    PodStatusIntent("Running", ready=True, vm_id="v-1", host="host-a", ip="10.240.1.7", restart_count=2),
    PodStatusIntent("Pending", reason="FailedCreate", message="image missing"),
    PodStatusIntent("Running", vm_id="v-2", hibernated=True, reason="Hibernated"),
    PodStatusIntent("Failed", reason="InvalidSpec", message="bad", invalid="vmfence.io/cpus: bad"),
    PodStatusIntent("Succeeded", vm_id="v-1", host="host-a"),
]


async def test_every_status_vmfence_writes_is_accepted(api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    gw = K8sGateway(api, host_ip=lambda host: "192.168.50.1")
    for policy in ("Always", "Never"):
        name = f"st-{policy.lower()}"
        body = pod_body(name, nodeName="vmfence-host-a", restartPolicy=policy)
        body["spec"]["containers"].append({"name": "side", "image": "busybox"})
        pod = await core.create_namespaced_pod(NS, body)
        fence = Fence(f"{NS}/{name}", pod.metadata.uid, 3)
        for n, intent in enumerate(INTENTS):
            done = await gw.write(Key("pod", NS, name), KubeWrite(f"s{n}", "status", fence, status=intent))
            assert done.outcome == "ok", (policy, intent, done.detail)
        got = await core.read_namespaced_pod(name, NS)
        assert [c.name for c in got.status.container_statuses] == ["main", "side"]


async def _patch(core: client.CoreV1Api, name: str, status: dict[str, Any]) -> None:
    await core.patch_namespaced_pod_status(name, NS, {"status": status}, _content_type=MERGE)


@pytest.mark.parametrize(("status", "code", "words"), [
    ({"conditions": [{"type": "not a name!", "status": "True"}]}, 422, "status.conditions[0].Type"),
    ({"conditions": [{"type": "vmfence.io/SpecValid", "status": "True", "observedGeneration": -1}]}, 422,
     "observedGeneration"),
    ({"hostIP": "10.0.0.1", "hostIPs": [{"ip": "10.0.0.2"}]}, 422, "must be equal to `hostIP`"),
    ({"podIP": "10.0.0.999", "podIPs": [{"ip": "10.0.0.999"}]}, 422, "must be a valid IP address"),
    ({"podIPs": [{"ip": "10.0.0.1"}, {"ip": "10.0.0.2"}]}, 422, "no more than one IP for each IP family"),
    # a patch whose result does not decode: 422 naming the patch (an update would be 400)
    ({"containerStatuses": [{"name": "main", "ready": True, "restartCount": "x", "image": "b", "imageID": ""}]},
     422, "restartCount"),
    ({"conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "yesterday"}]}, 422, "parsing time"),
    ({"phase": 3}, 422, "PodStatus.phase"),
])
async def test_a_status_the_real_server_refuses_is_refused(
    core: client.CoreV1Api, status: dict[str, Any], code: int, words: str
) -> None:
    await core.create_namespaced_pod(NS, pod_body("bad"))
    with pytest.raises(ApiException) as err:
        await _patch(core, "bad", status)
    assert err.value.status == code and words in json.loads(err.value.body)["message"]


async def test_a_terminated_container_of_a_never_restarting_pod_stays_terminated(core: client.CoreV1Api) -> None:
    await core.create_namespaced_pod(NS, pod_body("done", restartPolicy="Never"))
    term = {"terminated": {"exitCode": 1, "reason": "Error"}}
    cs = {"name": "main", "ready": False, "restartCount": 0, "image": "busybox", "imageID": ""}
    await _patch(core, "done", {"phase": "Failed", "containerStatuses": [{**cs, "state": term}]})
    with pytest.raises(ApiException) as err:
        await _patch(core, "done", {"phase": "Running", "containerStatuses": [
            {**cs, "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}]})
    assert err.value.status == 422 and "may not be transitioned to non-terminated state" in err.value.body


async def test_a_vm_without_a_reachable_address_says_its_hosts_network(api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    networks = {"host-a": "user"}
    gw = K8sGateway(api, host_ip=lambda host: "192.168.50.1", host_network=networks.get)
    pod = await core.create_namespaced_pod(NS, pod_body("net", nodeName="vmfence-host-a"))
    fence = Fence(f"{NS}/net", pod.metadata.uid, 1)
    up = PodStatusIntent("Running", ready=True, vm_id="v-1", host="host-a")  # user networking: no ip
    assert (await gw.write(Key("pod", NS, "net"), KubeWrite("n1", "status", fence, status=up))).outcome == "ok"
    got = await core.read_namespaced_pod("net", NS)
    assert got.metadata.annotations["vmfence.io/network"] == "user" and got.status.pod_ip is None
    networks["host-a"] = "bridge"
    bridged = PodStatusIntent("Running", ready=True, vm_id="v-2", host="host-a", ip="10.240.1.9")
    assert (await gw.write(Key("pod", NS, "net"), KubeWrite("n2", "status", fence, status=bridged))).outcome == "ok"
    got = await core.read_namespaced_pod("net", NS)
    assert "vmfence.io/network" not in (got.metadata.annotations or {}) and got.status.pod_ip == "10.240.1.9"
