"""Events aggregate as Kubernetes' recorder does (issue 10, finding 12): the repeats of one text for
one incarnation are one Event whose ``count`` and ``lastTimestamp`` follow them, not one Event each;
a redelivered write changes nothing. Against the dev API server over real HTTP."""

from __future__ import annotations

from typing import Any

from kubernetes_asyncio import client

from services.reconciler.kube import K8sGateway
from shared.fence.keys import Key
from shared.fence.schema import Fence, KubeWrite, PodStatusIntent

from .conftest import NS, pod_body

CAUSE = "image debian-99 not found in /var/lib/vmfence/images"


async def _uid(core: client.CoreV1Api, name: str) -> str:
    resp = await core.create_namespaced_pod(NS, pod_body(name), _preload_content=False)
    body: dict[str, Any] = dict(await resp.json())
    return str(body["metadata"]["uid"])


def _failed_create(uid: str, n: int, message: str = CAUSE) -> KubeWrite:
    return KubeWrite(id=f"ev-{n}-{message[:5]}", verb="event", fence=Fence(f"{NS}/p", uid, 1),
                     event_reason="FailedCreate", event_type="Warning", message=message, count=n)


async def test_repeats_of_one_cause_are_one_event_with_a_count(core: client.CoreV1Api, gateway: K8sGateway) -> None:
    uid = await _uid(core, "p")
    key = Key("pod", NS, "p")
    for n in range(1, 45):
        assert (await gateway.write(key, _failed_create(uid, n))).outcome == "ok"
    assert (await gateway.write(key, _failed_create(uid, 44))).outcome == "ok"  # a redelivery
    events = (await core.list_namespaced_event(NS)).items
    assert len(events) == 1, [e.metadata.name for e in events]
    (e,) = events
    assert e.reason == "FailedCreate" and e.message == CAUSE and e.type == "Warning"
    assert e.count == 44 and e.last_timestamp >= e.first_timestamp
    # another cause is another Event
    assert (await gateway.write(key, _failed_create(uid, 1, "disk full"))).outcome == "ok"
    counts = sorted((ev.message, ev.count) for ev in (await core.list_namespaced_event(NS)).items)
    assert counts == sorted([(CAUSE, 44), ("disk full", 1)])


async def test_a_failed_create_names_its_cause_in_the_condition(core: client.CoreV1Api, gateway: K8sGateway) -> None:
    uid = await _uid(core, "p")
    intent = PodStatusIntent(phase="Pending", reason="FailedCreate", message=CAUSE)
    write = KubeWrite(id="w-1", verb="status", fence=Fence(f"{NS}/p", uid, 1), status=intent)
    assert (await gateway.write(Key("pod", NS, "p"), write)).outcome == "ok"
    resp = await core.read_namespaced_pod("p", NS, _preload_content=False)
    st = dict(await resp.json())["status"]
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["Initialized"]["status"] == "False"
    assert conds["Initialized"]["reason"] == "FailedCreate" and conds["Initialized"]["message"] == CAUSE
    assert all(c.get("reason") != "Unschedulable" for c in st["conditions"])
    (cs,) = st["containerStatuses"]
    assert cs["state"]["waiting"] == {"reason": "FailedCreate", "message": CAUSE}
    assert st["reason"] == "FailedCreate" and st["message"] == CAUSE
