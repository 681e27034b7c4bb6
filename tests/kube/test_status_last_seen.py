"""Status writes start from the object the key's last read or write returned (issue 14): counted on
the development API server over real HTTP. A kept object is trusted only through the status
patch's resourceVersion precondition; a stale one costs a 409 and one consistent GET, and a
predecessor's object never lets a write reach a same-name successor (rules 4 and 6)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes_asyncio import client

from services.apiserver.server import ApiServer
from services.reconciler.kube import K8sGateway
from shared.fence.keys import Key
from shared.fence.schema import Fence, KubeWrite, PodStatusIntent

from .conftest import MERGE, NS, VM_ARGS, pod_body, vm_body

KEY = Key("pod", NS, "p")
STARTING = PodStatusIntent(phase="Pending", host="host-a")
RUNNING = PodStatusIntent(phase="Running", ready=True, vm_id="vm-1", host="host-a", ip="10.1.0.5", vnc_port=5901)
FAILED = PodStatusIntent(phase="Failed", host="host-a", vm_id="vm-1", message="exit 1")


def status(uid: str, intent: PodStatusIntent, key: Key = KEY, epoch: int = 1) -> KubeWrite:
    return KubeWrite(id=f"w-{intent.phase}", verb="status", fence=Fence(str(key), uid, epoch), status=intent)


async def create(core: client.CoreV1Api, name: str = "p", **kw: Any) -> dict[str, Any]:
    resp = await core.create_namespaced_pod(NS, pod_body(name, **kw), _preload_content=False)
    return dict(await resp.json())


async def raw(core: client.CoreV1Api, name: str = "p") -> dict[str, Any]:
    resp = await core.read_namespaced_pod(name, NS, _preload_content=False)
    return dict(await resp.json())


class Tally:
    """Requests the dev server received since the last ``take()``, by "<verb> <resource>"."""

    def __init__(self, server: ApiServer) -> None:
        self.server = server
        self.base = dict(server.faults.requests)

    def take(self) -> dict[str, int]:
        now = dict(self.server.faults.requests)
        out = {k: v - self.base.get(k, 0) for k, v in now.items() if v != self.base.get(k, 0)}
        self.base = now
        return out


@pytest.fixture
async def small(kubeconfig: str) -> AsyncIterator[K8sGateway]:
    gw = await K8sGateway.connect(kubeconfig, host_ip={"host-a": "10.0.0.1"}.get, call_timeout_s=15.0,
                                  last_seen_max=2)
    try:
        yield gw
    finally:
        await gw.close()


async def test_two_status_writes_of_one_incarnation_read_once(
    server: ApiServer, core: client.CoreV1Api, gateway: K8sGateway
) -> None:
    uid = (await create(core))["metadata"]["uid"]
    tally = Tally(server)
    assert (await gateway.write(KEY, status(uid, STARTING))).outcome == "ok"
    assert tally.take() == {"get pods": 1, "patch pods/status": 1}
    # the second write starts from the first one's answers: no GET at all
    assert (await gateway.write(KEY, status(uid, RUNNING))).outcome == "ok"
    assert tally.take() == {"patch pods/status": 1}
    got = await raw(core)
    assert got["status"]["phase"] == "Running" and got["status"]["podIP"] == "10.1.0.5"
    assert got["metadata"]["annotations"]["vmfence.io/vm-id"] == "vm-1"
    tally.take()  # the test's own read
    # and the one after it starts from the status patch's answer (annotations included)
    assert (await gateway.write(KEY, status(uid, FAILED))).outcome == "ok"
    assert tally.take() == {"patch pods/status": 1}
    assert (await raw(core))["status"]["phase"] == "Failed"


async def test_a_confirm_read_serves_the_first_status_write(
    server: ApiServer, core: client.CoreV1Api, gateway: K8sGateway
) -> None:
    uid = (await create(core))["metadata"]["uid"]
    tally = Tally(server)
    assert (await gateway.confirm(KEY, "r")).uid == uid
    assert (await gateway.write(KEY, status(uid, RUNNING))).outcome == "ok"
    assert tally.take() == {"get pods": 1, "patch pods/status": 1}


async def test_a_confirm_read_of_an_unbound_pod_is_not_kept(
    server: ApiServer, core: client.CoreV1Api, gateway: K8sGateway
) -> None:
    """An unbound pod is bound next (by a scheduler here): the status write after it reads the bound
    pod instead of spending a patch on the confirm's stale object."""
    uid = (await create(core, node=None))["metadata"]["uid"]
    assert (await gateway.confirm(KEY, "r")).uid == uid
    binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "p", "namespace": NS},
               "target": {"apiVersion": "v1", "kind": "Node", "name": "vmfence-host-a"}}
    await core.create_namespaced_pod_binding("p", NS, binding, _preload_content=False)
    tally = Tally(server)
    assert (await gateway.write(KEY, status(uid, RUNNING))).outcome == "ok"
    assert tally.take() == {"get pods": 1, "patch pods/status": 1}


async def test_a_write_by_another_client_in_between_gives_409_then_one_get(
    server: ApiServer, core: client.CoreV1Api, gateway: K8sGateway
) -> None:
    uid = (await create(core))["metadata"]["uid"]
    assert (await gateway.write(KEY, status(uid, STARTING))).outcome == "ok"
    other = {"status": {"conditions": [{"type": "example.com/Other", "status": "True"}]}}
    await core.patch_namespaced_pod_status("p", NS, other, _content_type=MERGE)
    tally = Tally(server)
    assert (await gateway.write(KEY, status(uid, RUNNING))).outcome == "ok"
    # the kept object is stale: its resourceVersion is refused, one consistent GET, the intent re-applied
    assert tally.take() == {"patch pods/status": 2, "get pods": 1}
    got = await raw(core)
    conds = {c["type"]: c["status"] for c in got["status"]["conditions"]}
    assert conds["example.com/Other"] == "True" and conds["Ready"] == "True"
    assert got["status"]["phase"] == "Running"


async def test_unchanged_is_never_judged_from_memory(
    server: ApiServer, core: client.CoreV1Api, gateway: K8sGateway
) -> None:
    """The same intent again, after another client changed the status: the kept object says
    nothing is to be written, which it cannot prove, so the object is read and the intent
    re-applied; with nothing changed, the read finds nothing to write."""
    uid = (await create(core))["metadata"]["uid"]
    assert (await gateway.write(KEY, status(uid, RUNNING))).outcome == "ok"
    await core.patch_namespaced_pod_status("p", NS, {"status": {"phase": "Unknown"}}, _content_type=MERGE)
    tally = Tally(server)
    assert (await gateway.write(KEY, status(uid, RUNNING))).outcome == "ok"
    assert tally.take() == {"get pods": 1, "patch pods/status": 1}
    assert (await raw(core))["status"]["phase"] == "Running"
    tally.take()
    rv = (await raw(core))["metadata"]["resourceVersion"]
    tally.take()
    assert (await gateway.write(KEY, status(uid, RUNNING))).outcome == "ok"
    assert tally.take() == {"get pods": 1}
    assert (await raw(core))["metadata"]["resourceVersion"] == rv


async def test_a_deleted_predecessors_object_never_reaches_its_successor(
    server: ApiServer, core: client.CoreV1Api, gateway: K8sGateway
) -> None:
    old_uid = (await create(core))["metadata"]["uid"]
    assert (await gateway.write(KEY, status(old_uid, STARTING))).outcome == "ok"  # kept: the old pod
    await core.delete_namespaced_pod("p", NS, grace_period_seconds=0)
    succ = await create(core)
    tally = Tally(server)
    done = await gateway.write(KEY, status(old_uid, RUNNING))
    assert done.outcome == "superseded", done
    # the predecessor's object led to one patch, refused by its uid; the re-read named the successor
    assert tally.take() == {"patch pods/status": 1, "get pods": 1}
    now = await raw(core)
    assert now["metadata"]["uid"] == succ["metadata"]["uid"] != old_uid
    assert now["metadata"]["resourceVersion"] == succ["metadata"]["resourceVersion"]
    assert now["status"]["phase"] == "Pending" and not now["metadata"].get("annotations")
    tally.take()  # the test's own read
    # nothing of the predecessor is kept: another late write of it reads, and is superseded again
    assert (await gateway.write(KEY, status(old_uid, FAILED))).outcome == "superseded"
    assert tally.take() == {"get pods": 1}
    assert (await raw(core))["metadata"]["resourceVersion"] == succ["metadata"]["resourceVersion"]
    tally.take()  # the test's own read
    # the successor's own first write reads its own object
    assert (await gateway.write(KEY, status(succ["metadata"]["uid"], RUNNING, epoch=2))).outcome == "ok"
    assert tally.take() == {"get pods": 1, "patch pods/status": 1}


async def test_a_kept_object_never_hides_gone(
    server: ApiServer, core: client.CoreV1Api, gateway: K8sGateway
) -> None:
    uid = (await create(core))["metadata"]["uid"]
    assert (await gateway.write(KEY, status(uid, STARTING))).outcome == "ok"
    await core.delete_namespaced_pod("p", NS, grace_period_seconds=0)
    tally = Tally(server)
    assert (await gateway.write(KEY, status(uid, RUNNING))).outcome == "gone"
    assert tally.take() == {"patch pods/status": 1}
    assert len(gateway.last_seen) == 0


async def test_a_confirm_of_a_successor_is_never_used_for_the_predecessor(
    server: ApiServer, core: client.CoreV1Api, gateway: K8sGateway
) -> None:
    old_uid = (await create(core))["metadata"]["uid"]
    await core.delete_namespaced_pod("p", NS, grace_period_seconds=0)
    succ = await create(core)
    assert (await gateway.confirm(KEY, "r")).uid == succ["metadata"]["uid"]  # kept: the successor
    tally = Tally(server)
    assert (await gateway.write(KEY, status(old_uid, RUNNING))).outcome == "superseded"
    assert tally.take() == {"get pods": 1}  # not the kept successor: a read, and no write at all
    assert (await raw(core))["metadata"]["resourceVersion"] == succ["metadata"]["resourceVersion"]


async def test_delete_evict_and_bind_drop_the_kept_object(
    server: ApiServer, core: client.CoreV1Api, gateway: K8sGateway
) -> None:
    uid = (await create(core, node=None))["metadata"]["uid"]
    assert (await gateway.write(KEY, status(uid, STARTING))).outcome == "ok"
    assert len(gateway.last_seen) == 1
    bind = KubeWrite(id="b", verb="bind", fence=Fence(str(KEY), uid, 1), node="vmfence-host-a")
    assert (await gateway.write(KEY, bind)).outcome == "ok"
    assert len(gateway.last_seen) == 0
    tally = Tally(server)
    assert (await gateway.write(KEY, status(uid, RUNNING))).outcome == "ok"
    assert tally.take() == {"get pods": 1, "patch pods/status": 1}  # no wasted 409
    for verb in ("evict", "delete"):
        assert len(gateway.last_seen) == 1
        assert (await gateway.write(KEY, KubeWrite(id=verb, verb=verb, fence=Fence(str(KEY), uid, 1)))).outcome == "ok"
        assert len(gateway.last_seen) == 0
        if verb == "evict":
            assert (await gateway.write(KEY, status(uid, FAILED))).outcome == "ok"


async def test_the_kept_objects_are_bounded(server: ApiServer, core: client.CoreV1Api, small: K8sGateway) -> None:
    uids = {n: (await create(core, n))["metadata"]["uid"] for n in ("a", "b", "c")}
    for n, uid in uids.items():
        assert (await small.write(Key("pod", NS, n), status(uid, STARTING, Key("pod", NS, n)))).outcome == "ok"
    assert len(small.last_seen) == 2
    tally = Tally(server)
    assert (await small.write(Key("pod", NS, "a"), status(uids["a"], RUNNING, Key("pod", NS, "a")))).outcome == "ok"
    assert tally.take()["get pods"] == 1  # "a" was the least recently used: dropped
    assert (await small.write(Key("pod", NS, "c"), status(uids["c"], RUNNING, Key("pod", NS, "c")))).outcome == "ok"
    assert "get pods" not in tally.take()
    assert len(small.last_seen) == 2


async def test_vm_status_writes_read_once(
    server: ApiServer, custom: client.CustomObjectsApi, gateway: K8sGateway
) -> None:
    uid = (await custom.create_namespaced_custom_object(*VM_ARGS, vm_body("db")))["metadata"]["uid"]
    key = Key("vm", NS, "db")
    tally = Tally(server)
    assert (await gateway.write(key, status(uid, STARTING, key))).outcome == "ok"
    assert (await gateway.write(key, status(uid, RUNNING, key))).outcome == "ok"
    assert tally.take() == {"get virtualmachines": 1, "patch virtualmachines/status": 2}
    await custom.delete_namespaced_custom_object(*VM_ARGS, "db")
    await custom.create_namespaced_custom_object(*VM_ARGS, vm_body("db"))
    tally.take()
    assert (await gateway.write(key, status(uid, FAILED, key))).outcome == "superseded"
    assert tally.take() == {"patch virtualmachines/status": 1, "get virtualmachines": 1}
    st = (await custom.get_namespaced_custom_object(*VM_ARGS, "db")).get("status") or {}
    assert st.get("phase") != "Failed"
