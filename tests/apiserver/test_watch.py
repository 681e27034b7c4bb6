"""Watch protocol through kubernetes-asyncio's ``watch.Watch`` over real HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client.exceptions import ApiException

from services.apiserver.server import ApiServer

from .conftest import pod_body

NS = "default"
MERGE = "application/merge-patch+json"


class Events:
    """Pulls watch events with a per-event deadline so a missing event fails instead of hanging."""

    def __init__(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.w = watch.Watch()
        self.it: AsyncIterator[dict[str, Any]] = self.w.stream(func, *args, **kwargs).__aiter__()

    async def next(self, wait_s: float = 3.0) -> dict[str, Any]:
        return await asyncio.wait_for(self.it.__anext__(), wait_s)

    async def next_non_bookmark(self, wait_s: float = 3.0) -> dict[str, Any]:
        while True:
            ev = await self.next(wait_s)
            if ev["type"] != "BOOKMARK":
                return ev

    async def close(self) -> None:
        await self.w.close()


async def test_pod_watch_initial_live_deleted_and_bookmarks(core: client.CoreV1Api) -> None:
    await core.create_namespaced_pod(NS, pod_body("w1"))
    ev = Events(core.list_namespaced_pod, NS, allow_watch_bookmarks=True, timeout_seconds=10)
    try:
        first = await ev.next()
        assert first["type"] == "ADDED" and first["object"].metadata.name == "w1"
        await core.patch_namespaced_pod("w1", NS, {"metadata": {"labels": {"a": "b"}}}, _content_type=MERGE)
        mod = await ev.next_non_bookmark()
        assert mod["type"] == "MODIFIED" and mod["object"].metadata.labels == {"a": "b"}
        await core.delete_namespaced_pod("w1", NS)  # graceful: MODIFIED with deletionTimestamp
        term = await ev.next_non_bookmark()
        assert term["type"] == "MODIFIED" and term["object"].metadata.deletion_timestamp is not None
        await core.delete_namespaced_pod("w1", NS, grace_period_seconds=0)
        gone = await ev.next_non_bookmark()
        assert gone["type"] == "DELETED" and gone["object"].metadata.deletion_timestamp is not None
        assert int(gone["object"].metadata.resource_version) > int(term["object"].metadata.resource_version)
        bookmark = await ev.next(wait_s=2.0)  # nothing else happens: the 0.2 s bookmark arrives
        assert bookmark["type"] == "BOOKMARK"
        assert (
            bookmark["raw_object"]["metadata"]["resourceVersion"] == gone["object"].metadata.resource_version
        )
    finally:
        await ev.close()


async def test_watch_from_list_rv_and_timeout(core: client.CoreV1Api) -> None:
    await core.create_namespaced_pod(NS, pod_body("old"))
    listed = await core.list_namespaced_pod(NS)
    await core.create_namespaced_pod(NS, pod_body("new"))
    ev = Events(
        core.list_namespaced_pod, NS, resource_version=listed.metadata.resource_version, timeout_seconds=1
    )
    try:
        got = await ev.next()
        assert (got["type"], got["object"].metadata.name) == ("ADDED", "new")
        with pytest.raises(StopAsyncIteration):  # timeoutSeconds ends the stream
            await ev.next(wait_s=3.0)
    finally:
        await ev.close()


async def test_selector_watch_sees_transitions(core: client.CoreV1Api) -> None:
    await core.create_namespaced_pod(NS, pod_body("t"))
    ev = Events(core.list_namespaced_pod, NS, label_selector="vm=yes", timeout_seconds=10)
    try:
        await core.patch_namespaced_pod("t", NS, {"metadata": {"labels": {"vm": "yes"}}}, _content_type=MERGE)
        assert (await ev.next())["type"] == "ADDED"
        await core.patch_namespaced_pod("t", NS, {"metadata": {"labels": {"vm": "no"}}}, _content_type=MERGE)
        assert (await ev.next())["type"] == "DELETED"
    finally:
        await ev.close()


async def test_expired_resource_version_gets_410(server: ApiServer, core: client.CoreV1Api) -> None:
    start = await core.list_namespaced_pod(NS)
    await core.create_namespaced_pod(NS, pod_body("churn"))
    for i in range(60):  # window is 50 events in the fixture
        await core.patch_namespaced_pod(
            "churn", NS, {"metadata": {"labels": {"i": str(i)}}}, _content_type=MERGE
        )
    ev = Events(
        core.list_namespaced_pod, NS, resource_version=start.metadata.resource_version, timeout_seconds=5
    )
    try:
        with pytest.raises(ApiException) as ei:
            await ev.next()
        assert ei.value.status == 410 and "Expired" in str(ei.value.reason)
    finally:
        await ev.close()
    # a list with an old resourceVersion is still fine, and a relist+watch works
    relist = await core.list_namespaced_pod(NS, resource_version=start.metadata.resource_version)
    assert len(relist.items) == 1


async def test_custom_object_and_node_watch(core: client.CoreV1Api, custom: client.CustomObjectsApi) -> None:
    args = ("vmfence.io", "v1alpha1", NS, "virtualmachines")
    # watches are opened lazily on the first next(): start them from a listed resourceVersion
    rv = (await custom.list_namespaced_custom_object(*args))["metadata"]["resourceVersion"]
    ns_ev = Events(custom.list_namespaced_custom_object, *args, resource_version=rv, timeout_seconds=10)
    cl_ev = Events(
        custom.list_cluster_custom_object,
        "vmfence.io",
        "v1alpha1",
        "virtualmachines",
        resource_version=rv,
        timeout_seconds=10,
    )
    node_ev = Events(core.list_node, timeout_seconds=10)
    try:
        await custom.create_namespaced_custom_object(
            *args, {"metadata": {"name": "vm1"}, "spec": {"image": "d"}}
        )
        await custom.patch_namespaced_custom_object_status(
            *args, "vm1", {"status": {"phase": "Running"}}, _content_type=MERGE
        )
        for ev in (ns_ev, cl_ev):
            added = await ev.next()
            assert added["type"] == "ADDED" and added["object"]["metadata"]["name"] == "vm1"
            mod = await ev.next()
            assert mod["type"] == "MODIFIED" and mod["object"]["status"]["phase"] == "Running"
        await core.create_node({"metadata": {"name": "vmfence-h1"}})
        got = await node_ev.next()
        assert got["type"] == "ADDED" and got["object"].metadata.name == "vmfence-h1"
    finally:
        for ev in (ns_ev, cl_ev, node_ev):
            await ev.close()
