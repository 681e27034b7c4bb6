"""REST semantics through kubernetes-asyncio over real HTTP: CRUD, patches, conflicts, deletion."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from .conftest import pod_body

NS = "default"
MERGE = "application/merge-patch+json"


def status_of(exc: ApiException) -> dict[str, Any]:
    """The Kubernetes Status body of a failed call."""
    body: dict[str, Any] = json.loads(exc.body)
    assert body["kind"] == "Status" and body["apiVersion"] == "v1" and body["status"] == "Failure"
    assert body["code"] == exc.status
    return body


async def test_pod_crud_and_patch_dialects(core: client.CoreV1Api) -> None:
    created = await core.create_namespaced_pod(NS, pod_body("web-1", {"app": "web"}))
    assert created.metadata.uid and created.metadata.generation == 1
    assert created.metadata.creation_timestamp is not None
    assert created.status.phase == "Pending"
    rv1 = int(created.metadata.resource_version)

    got = await core.read_namespaced_pod("web-1", NS)
    assert got.metadata.uid == created.metadata.uid

    merged = await core.patch_namespaced_pod(
        "web-1", NS, {"metadata": {"annotations": {"a": "1"}}}, _content_type=MERGE
    )
    assert merged.metadata.annotations == {"a": "1"}
    assert int(merged.metadata.resource_version) > rv1
    assert merged.metadata.generation == 1  # metadata-only change

    # strategic merge (the client's default for dict bodies): containers merged by name
    smp = await core.patch_namespaced_pod(
        "web-1", NS, {"spec": {"containers": [{"name": "main", "image": "busybox:2"}]}}
    )
    assert [c.image for c in smp.spec.containers] == ["busybox:2"]
    assert smp.metadata.generation == 2  # spec change bumps generation

    jp = await core.patch_namespaced_pod(
        "web-1", NS, [{"op": "add", "path": "/metadata/labels/tier", "value": "front"}]
    )
    assert jp.metadata.labels == {"app": "web", "tier": "front"}

    jp.metadata.annotations["b"] = "2"
    replaced = await core.replace_namespaced_pod("web-1", NS, jp)
    assert replaced.metadata.annotations == {"a": "1", "b": "2"}

    pods = await core.list_namespaced_pod(NS)
    assert [p.metadata.name for p in pods.items] == ["web-1"]
    assert int(pods.metadata.resource_version) >= int(replaced.metadata.resource_version)
    everywhere = await core.list_pod_for_all_namespaces()
    assert len(everywhere.items) == 1

    deleted = await core.delete_namespaced_pod("web-1", NS, grace_period_seconds=0)
    assert deleted.metadata.name == "web-1"
    with pytest.raises(ApiException) as ei:
        await core.read_namespaced_pod("web-1", NS)
    body = status_of(ei.value)
    assert body["reason"] == "NotFound" and body["details"]["name"] == "web-1"


async def test_errors_have_status_bodies(core: client.CoreV1Api) -> None:
    await core.create_namespaced_pod(NS, pod_body("dup"))
    with pytest.raises(ApiException) as ei:
        await core.create_namespaced_pod(NS, pod_body("dup"))
    assert ei.value.status == 409 and status_of(ei.value)["reason"] == "AlreadyExists"
    with pytest.raises(ApiException) as ei:
        await core.create_namespaced_pod(NS, pod_body("Not_A_Name"))
    assert ei.value.status == 422 and status_of(ei.value)["reason"] == "Invalid"
    await core.create_namespaced_pod(NS, pod_body("dotted.name-ok"))
    with pytest.raises(ApiException) as ei:
        await core.create_namespaced_pod("nope", pod_body("p"))
    assert ei.value.status == 404
    with pytest.raises(ApiException) as ei:
        await core.patch_namespaced_pod("dup", NS, {"a": 1}, _content_type="application/apply-patch+yaml")
    assert ei.value.status == 415


async def test_conflicts_on_stale_rv_and_uid(core: client.CoreV1Api) -> None:
    first = await core.create_namespaced_pod(NS, pod_body("p"))
    await core.patch_namespaced_pod("p", NS, {"metadata": {"labels": {"x": "1"}}}, _content_type=MERGE)
    # stale resourceVersion on update
    with pytest.raises(ApiException) as ei:
        await core.replace_namespaced_pod("p", NS, first)
    assert ei.value.status == 409 and status_of(ei.value)["reason"] == "Conflict"
    # stale resourceVersion on a patch that carries it
    with pytest.raises(ApiException) as ei:
        await core.patch_namespaced_pod(
            "p", NS, {"metadata": {"resourceVersion": first.metadata.resource_version}}, _content_type=MERGE
        )
    assert ei.value.status == 409

    # the object is recreated under the same name: UID-carrying writes must fail
    await core.delete_namespaced_pod("p", NS, grace_period_seconds=0)
    second = await core.create_namespaced_pod(NS, pod_body("p"))
    assert second.metadata.uid != first.metadata.uid
    with pytest.raises(ApiException) as ei:
        await core.patch_namespaced_pod_status(
            "p",
            NS,
            {"metadata": {"uid": first.metadata.uid}, "status": {"phase": "Running"}},
            _content_type=MERGE,
        )
    body = status_of(ei.value)
    assert body["reason"] == "Conflict" and "UID" in body["message"]
    first.metadata.resource_version = None
    with pytest.raises(ApiException) as ei:
        await core.replace_namespaced_pod("p", NS, first)
    assert ei.value.status == 409
    ok = await core.patch_namespaced_pod(
        "p", NS, {"metadata": {"uid": second.metadata.uid, "labels": {"y": "2"}}}, _content_type=MERGE
    )
    assert ok.metadata.labels == {"y": "2"}
    assert (await core.read_namespaced_pod_status("p", NS)).status.phase == "Pending"


async def test_delete_preconditions_and_graceful_deletion(core: client.CoreV1Api) -> None:
    pod = await core.create_namespaced_pod(NS, pod_body("g", terminationGracePeriodSeconds=20))
    for pre in ({"uid": "not-the-uid"}, {"resourceVersion": "1"}):
        with pytest.raises(ApiException) as ei:
            await core.delete_namespaced_pod("g", NS, body=client.V1DeleteOptions(preconditions=pre))
        assert ei.value.status == 409 and status_of(ei.value)["reason"] == "Conflict"

    terminating = await core.delete_namespaced_pod("g", NS)
    assert terminating.metadata.deletion_timestamp is not None
    assert terminating.metadata.deletion_grace_period_seconds == 20
    still = await core.read_namespaced_pod("g", NS)  # stays until the "kubelet" confirms
    assert still.metadata.deletion_timestamp is not None
    await core.delete_namespaced_pod(
        "g",
        NS,
        body=client.V1DeleteOptions(grace_period_seconds=0, preconditions={"uid": pod.metadata.uid}),
    )
    with pytest.raises(ApiException) as ei:
        await core.read_namespaced_pod("g", NS)
    assert ei.value.status == 404


async def test_finalizers_hold_deletion(core: client.CoreV1Api) -> None:
    body = pod_body("f")
    body["metadata"]["finalizers"] = ["vmfence.io/vm"]
    await core.create_namespaced_pod(NS, body)
    held = await core.delete_namespaced_pod("f", NS, grace_period_seconds=0)
    assert held.metadata.deletion_timestamp is not None
    assert (await core.read_namespaced_pod("f", NS)).metadata.finalizers == ["vmfence.io/vm"]
    with pytest.raises(ApiException) as ei:  # no new finalizers on a terminating object
        await core.patch_namespaced_pod(
            "f", NS, {"metadata": {"finalizers": ["vmfence.io/vm", "other"]}}, _content_type=MERGE
        )
    assert ei.value.status == 422
    await core.patch_namespaced_pod("f", NS, {"metadata": {"finalizers": None}}, _content_type=MERGE)
    with pytest.raises(ApiException) as ei:
        await core.read_namespaced_pod("f", NS)
    assert ei.value.status == 404


async def test_eviction(core: client.CoreV1Api) -> None:
    pod = await core.create_namespaced_pod(NS, pod_body("ev"))
    bad = client.V1Eviction(
        metadata=client.V1ObjectMeta(name="ev", namespace=NS),
        delete_options=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid="other")),
    )
    with pytest.raises(ApiException) as ei:
        await core.create_namespaced_pod_eviction("ev", NS, bad)
    assert ei.value.status == 409
    good = client.V1Eviction(
        metadata=client.V1ObjectMeta(name="ev", namespace=NS),
        delete_options=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=pod.metadata.uid)),
    )
    await core.create_namespaced_pod_eviction("ev", NS, good)
    evicted = await core.read_namespaced_pod("ev", NS)
    assert evicted.metadata.deletion_timestamp is not None  # graceful, as a real eviction
    with pytest.raises(ApiException) as ei:
        await core.create_namespaced_pod_eviction("missing", NS, good)
    assert ei.value.status == 404


async def test_status_subresource_isolation(core: client.CoreV1Api) -> None:
    await core.create_namespaced_pod(NS, pod_body("s"))
    st = await core.patch_namespaced_pod_status(
        "s",
        NS,
        {
            "metadata": {"labels": {"kept": "yes"}},
            "spec": {"nodeName": "ignored"},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "False"}]},
        },
    )
    # as the real pod status strategy: the spec is the stored one, labels and annotations are written
    # (tests/apiserver/test_real_parity.py checks the same against the real kube-apiserver)
    assert st.status.phase == "Running" and st.metadata.labels == {"kept": "yes"} and not st.spec.node_name
    # strategic merge of conditions by type
    st = await core.patch_namespaced_pod_status(
        "s",
        NS,
        {"status": {"conditions": [{"type": "Ready", "status": "True"}, {"type": "X", "status": "True"}]}},
    )
    assert [(c.type, c.status) for c in st.status.conditions] == [("Ready", "True"), ("X", "True")]
    # main-resource writes do not touch status
    main = await core.patch_namespaced_pod(
        "s", NS, {"status": {"phase": "Failed"}, "metadata": {"labels": {"k": "v"}}}, _content_type=MERGE
    )
    assert main.status.phase == "Running" and main.metadata.labels == {"kept": "yes", "k": "v"}
    # a no-op write does not bump the resourceVersion
    again = await core.patch_namespaced_pod(
        "s", NS, {"metadata": {"labels": {"k": "v"}}}, _content_type=MERGE
    )
    assert again.metadata.resource_version == main.metadata.resource_version


async def test_label_and_field_selectors(core: client.CoreV1Api) -> None:
    await core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="other")))
    await core.create_namespaced_pod(NS, pod_body("a", {"app": "x", "tier": "web"}, nodeName="n1"))
    await core.create_namespaced_pod(NS, pod_body("b", {"app": "y"}, nodeName="n2"))
    await core.create_namespaced_pod("other", pod_body("c", {"app": "x"}))
    await core.patch_namespaced_pod_status("b", NS, {"status": {"phase": "Running"}})

    async def names(**kw: Any) -> list[str]:
        return [p.metadata.name for p in (await core.list_pod_for_all_namespaces(**kw)).items]

    assert await names(label_selector="app=x") == ["a", "c"]
    assert await names(label_selector="app!=x") == ["b"]
    assert await names(label_selector="app in (x,y),tier") == ["a"]
    assert await names(label_selector="app notin (y),!tier") == ["c"]
    assert await names(field_selector="spec.nodeName=n2") == ["b"]
    assert await names(field_selector="status.phase!=Running") == ["a", "c"]
    assert await names(field_selector="metadata.namespace=other") == ["c"]
    assert await names(field_selector="metadata.name=a,metadata.namespace=default") == ["a"]
    assert [p.metadata.name for p in (await core.list_namespaced_pod("other")).items] == ["c"]
    await core.delete_namespace("other")
    assert await names() == ["a", "b"]


async def test_nodes_leases_events(api: client.ApiClient, core: client.CoreV1Api) -> None:
    namespaces = {n.metadata.name for n in (await core.list_namespace()).items}
    assert {"default", "kube-system", "kube-node-lease"} <= namespaces
    node = await core.create_node(
        {
            "metadata": {"name": "vmfence-h1", "labels": {"vmfence.io/host": "h1"}},
            "spec": {"taints": [{"key": "vmfence.io/vm", "value": "true", "effect": "NoSchedule"}]},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        }
    )
    assert node.status.conditions[0].status == "True"
    upd = await core.patch_node_status(
        "vmfence-h1", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    )
    assert upd.status.conditions[0].status == "False"
    assert upd.spec.taints[0].key == "vmfence.io/vm"

    coord = client.CoordinationV1Api(api)
    lease = await coord.create_namespaced_lease(
        "kube-node-lease",
        client.V1Lease(
            metadata=client.V1ObjectMeta(name="fleet"),
            spec=client.V1LeaseSpec(holder_identity="r1", lease_duration_seconds=10),
        ),
    )
    lease.spec.holder_identity = "r2"
    renewed = await coord.replace_namespaced_lease("fleet", "kube-node-lease", lease)
    assert renewed.spec.holder_identity == "r2"
    with pytest.raises(ApiException) as ei:  # the loser of a lease race gets 409
        await coord.replace_namespaced_lease("fleet", "kube-node-lease", lease)
    assert ei.value.status == 409

    pod = await core.create_namespaced_pod(NS, pod_body("evpod"))
    await core.create_namespaced_event(
        NS,
        client.CoreV1Event(
            metadata=client.V1ObjectMeta(name="evpod.1"),
            involved_object=client.V1ObjectReference(
                kind="Pod", name="evpod", namespace=NS, uid=pod.metadata.uid
            ),
            reason="VMStarted",
            message="vm started",
            type="Normal",
        ),
    )
    evs = await core.list_namespaced_event(NS, field_selector=f"involvedObject.uid={pod.metadata.uid}")
    assert [e.reason for e in evs.items] == ["VMStarted"]


async def test_custom_resource_crud(api: client.ApiClient, custom: client.CustomObjectsApi) -> None:
    ext = client.ApiextensionsV1Api(api)
    crd = await ext.read_custom_resource_definition("virtualmachines.vmfence.io")
    assert crd.spec.names.short_names == ["vm"]
    args = ("vmfence.io", "v1alpha1", NS, "virtualmachines")
    vm = await custom.create_namespaced_custom_object(
        *args,
        {
            "apiVersion": "vmfence.io/v1alpha1",
            "kind": "VirtualMachine",
            "metadata": {"name": "vm1"},
            "spec": {"image": "debian", "cpus": 2},
        },
    )
    assert vm["spec"]["restartPolicy"] == "Always"  # schema default
    assert vm["metadata"]["generation"] == 1
    with pytest.raises(ApiException) as ei:
        await custom.create_namespaced_custom_object(
            *args, {"metadata": {"name": "bad"}, "spec": {"image": "x", "cpus": 100}}
        )
    assert ei.value.status == 422
    st = await custom.patch_namespaced_custom_object_status(
        *args, "vm1", {"status": {"phase": "Running", "epoch": 3}}, _content_type=MERGE
    )
    assert st["status"]["epoch"] == 3 and st["metadata"]["generation"] == 1
    sp = await custom.patch_namespaced_custom_object(
        *args, "vm1", {"spec": {"cpus": 4}, "status": {"epoch": 9}}, _content_type=MERGE
    )
    assert sp["metadata"]["generation"] == 2 and sp["status"]["epoch"] == 3
    with pytest.raises(ApiException) as ei:  # a dict body is json-patch for this client unless told
        await custom.patch_namespaced_custom_object(*args, "vm1", {"spec": {"cpus": 4}})
    assert ei.value.status == 400
    listed = await custom.list_cluster_custom_object("vmfence.io", "v1alpha1", "virtualmachines")
    assert [i["metadata"]["name"] for i in listed["items"]] == ["vm1"]
    sp["spec"]["hibernated"] = True
    rep = await custom.replace_namespaced_custom_object(*args, "vm1", sp)
    assert rep["spec"]["hibernated"] is True
    with pytest.raises(ApiException) as ei:
        await custom.replace_namespaced_custom_object(*args, "vm1", sp)
    assert ei.value.status == 409
    await custom.delete_namespaced_custom_object(*args, "vm1")
    with pytest.raises(ApiException) as ei:
        await custom.get_namespaced_custom_object(*args, "vm1")
    assert ei.value.status == 404
