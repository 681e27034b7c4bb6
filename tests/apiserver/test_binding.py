"""``pods/binding`` on the development API server, with the real server's semantics (BindingREST in
k8s.io/kubernetes pkg/registry/core/pod/storage): the Binding's uid is a precondition, a bound or
deleting pod is refused with 409 on ``pods/binding``, the pod gets its nodeName and PodScheduled.
The reconciler's gateway binds through it and reads a lost race back as the winner's node."""

from __future__ import annotations

import json

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from services.reconciler.kube import K8sGateway
from shared.fence.keys import Key
from shared.fence.schema import Fence, KubeWrite

from .conftest import pod_body

NS = "default"


def _binding(name: str, node: str, uid: str | None = None) -> dict[str, object]:
    meta: dict[str, object] = {"name": name, "namespace": NS}
    if uid is not None:
        meta["uid"] = uid
    return {"apiVersion": "v1", "kind": "Binding", "metadata": meta,
            "target": {"apiVersion": "v1", "kind": "Node", "name": node}}


async def _bind(core: client.CoreV1Api, name: str, node: str, uid: str | None = None) -> None:
    """POST the binding raw (the client cannot decode the Status a binding answers into a V1Binding)."""
    resp = await core.create_namespaced_pod_binding(name, NS, _binding(name, node, uid), _preload_content=False)
    try:
        body = await resp.read()
        if not 200 <= resp.status <= 299:
            exc = ApiException(status=resp.status, reason=resp.reason)
            exc.body = body.decode()
            raise exc
        assert json.loads(body)["status"] == "Success"
    finally:
        resp.release()


async def test_a_binding_sets_node_name_and_pod_scheduled_once(core: client.CoreV1Api) -> None:
    pod = await core.create_namespaced_pod(NS, pod_body("b1"))
    await _bind(core, "b1", "vmfence-host-a", pod.metadata.uid)
    got = await core.read_namespaced_pod("b1", NS)
    assert got.spec.node_name == "vmfence-host-a"
    assert [(c.type, c.status) for c in got.status.conditions] == [("PodScheduled", "True")]
    with pytest.raises(ApiException) as err:
        await _bind(core, "b1", "vmfence-host-b", pod.metadata.uid)
    assert err.value.status == 409
    body = json.loads(err.value.body)
    assert body["reason"] == "Conflict" and 'pods/binding "b1"' in body["message"]
    assert 'already assigned to node "vmfence-host-a"' in body["message"]
    assert (await core.read_namespaced_pod("b1", NS)).spec.node_name == "vmfence-host-a", "a binding moved a pod"


async def test_a_binding_for_another_incarnation_or_a_deleting_pod_is_refused(core: client.CoreV1Api) -> None:
    await core.create_namespaced_pod(NS, pod_body("b2"))
    with pytest.raises(ApiException) as err:
        await _bind(core, "b2", "vmfence-host-a", "not-its-uid")
    assert err.value.status == 409 and "Precondition failed: UID" in json.loads(err.value.body)["message"]
    fin = pod_body("b3")
    fin["metadata"]["finalizers"] = ["test/hold"]
    await core.create_namespaced_pod(NS, fin)
    await core.delete_namespaced_pod("b3", NS)
    with pytest.raises(ApiException) as err:
        await _bind(core, "b3", "vmfence-host-a")
    assert err.value.status == 409 and "is being deleted" in json.loads(err.value.body)["message"]
    with pytest.raises(ApiException) as err:
        await _bind(core, "nope", "vmfence-host-a")
    assert err.value.status == 404
    with pytest.raises(ApiException) as err:
        await _bind(core, "b2", "")
    assert err.value.status == 422


async def test_the_gateway_binds_and_reads_a_lost_race_back_as_the_winners_node(api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    gw = K8sGateway(api)
    mine = await core.create_namespaced_pod(NS, pod_body("g1"))
    fence = Fence("default/g1", mine.metadata.uid, 1)
    done = await gw.write(Key("pod", NS, "g1"), KubeWrite("w1", "bind", fence, node="vmfence-host-a"))
    assert (done.outcome, done.node) == ("ok", "vmfence-host-a")
    # a retry of the same binding (its answer lost) is the same success, not a conflict
    again = await gw.write(Key("pod", NS, "g1"), KubeWrite("w1", "bind", fence, node="vmfence-host-a"))
    assert (again.outcome, again.node) == ("ok", "vmfence-host-a")
    # someone else bound g2 first: failed, naming their node (decide sends the VM there)
    other = await core.create_namespaced_pod(NS, pod_body("g2"))
    await _bind(core, "g2", "vmfence-host-b")
    lost = await gw.write(Key("pod", NS, "g2"), KubeWrite("w2", "bind", Fence("default/g2", other.metadata.uid, 1),
                                                         node="vmfence-host-a"))
    assert (lost.outcome, lost.node) == ("failed", "vmfence-host-b")
    # another incarnation owns the name: superseded (rule 6)
    stale = await gw.write(Key("pod", NS, "g2"), KubeWrite("w3", "bind", Fence("default/g2", "old-uid", 1),
                                                          node="vmfence-host-a"))
    assert stale.outcome == "superseded"
    assert "-vmfence-dev" in await gw.git_version()
