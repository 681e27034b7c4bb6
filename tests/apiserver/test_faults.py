"""Fault injection, switched in-process and over ``/_dev/faults``."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client.exceptions import ApiException

from services.apiserver.server import ApiServer

from .conftest import pod_body

NS = "default"
MERGE = "application/merge-patch+json"


async def raw_labels(server: ApiServer, name: str, rv: str | None = None) -> dict[str, str] | None:
    """GET a pod over plain HTTP; the generated client cannot send resourceVersion on a get."""
    query = {"resourceVersion": rv} if rv is not None else {}
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{server.url}/api/v1/namespaces/{NS}/pods/{name}", params=query) as resp:
            assert resp.status == 200, await resp.text()
            labels: dict[str, str] | None = (await resp.json())["metadata"].get("labels")
            return labels


async def label(core: client.CoreV1Api, name: str, value: str) -> client.V1Pod:
    return await core.patch_namespaced_pod(
        name, NS, {"metadata": {"labels": {"v": value}}}, _content_type=MERGE
    )


async def test_stale_reads_only_where_kubernetes_allows_them(
    server: ApiServer, core: client.CoreV1Api
) -> None:
    await core.create_namespaced_pod(NS, pod_body("s"))
    await label(core, "s", "1")
    server.faults.set_stale(events=2)
    await label(core, "s", "2")
    await label(core, "s", "3")
    assert await raw_labels(server, "s", rv="0") == {"v": "1"}
    assert await raw_labels(server, "s") == {"v": "3"}
    consistent = await core.read_namespaced_pod("s", NS)
    assert consistent.metadata.labels["v"] == "3"
    cached_list = await core.list_namespaced_pod(NS, resource_version="0")
    assert cached_list.items[0].metadata.labels["v"] == "1"
    assert int(cached_list.metadata.resource_version) < int(consistent.metadata.resource_version)
    assert (await core.list_namespaced_pod(NS)).items[0].metadata.labels["v"] == "3"
    # a watch from "now" (the lagging cache's now) replays the lagging state first
    w = watch.Watch()
    it = w.stream(core.list_namespaced_pod, NS, timeout_seconds=5).__aiter__()
    try:
        first = await asyncio.wait_for(it.__anext__(), 3)
        assert first["object"].metadata.labels["v"] == "1"
        server.faults.set_stale(0)  # releasing the lag delivers the held events in order
        seen = [(await asyncio.wait_for(it.__anext__(), 3))["object"].metadata.labels["v"] for _ in range(2)]
        assert seen == ["2", "3"]
    finally:
        await w.close()
    assert await raw_labels(server, "s", rv="0") == {"v": "3"}


async def test_time_lagged_cache_catches_up(server: ApiServer, core: client.CoreV1Api) -> None:
    await core.create_namespaced_pod(NS, pod_body("t"))
    server.faults.set_stale(ms=300)
    await label(core, "t", "late")
    assert not await raw_labels(server, "t", rv="0")
    assert await raw_labels(server, "t") == {"v": "late"}
    deadline = time.monotonic() + 3
    while not await raw_labels(server, "t", rv="0"):
        assert time.monotonic() < deadline, "lagging cache never caught up"
        await asyncio.sleep(0.05)


async def test_injected_errors_in_process_and_over_http(server: ApiServer, core: client.CoreV1Api) -> None:
    await core.create_namespaced_pod(NS, pod_body("e"))
    server.faults.inject_error("patch", "pods/*", 409, count=1)
    with pytest.raises(ApiException) as ei:
        await label(core, "e", "x")
    assert ei.value.status == 409
    await label(core, "e", "x")  # count exhausted
    server.faults.inject_error("get", "pods", 500, probability=1.0, count=None)
    with pytest.raises(ApiException) as ei:
        await core.read_namespaced_pod("e", NS)
    assert ei.value.status == 500
    await core.read_namespaced_pod_status("e", NS)  # "pods" does not match the status subresource
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{server.url}/_dev/faults",
            json={
                "reset": True,
                "seed": 7,
                "errors": [{"verb": "list", "resource": "pods", "code": 429, "count": 2}],
            },
        ) as resp:
            assert resp.status == 200
        async with http.get(f"{server.url}/_dev/faults") as resp:
            state = await resp.json()
    assert state["errors"][0]["code"] == 429 and state["seed"] == 7
    for _ in range(2):
        with pytest.raises(ApiException) as ei:
            await core.list_namespaced_pod(NS)
        assert ei.value.status == 429 and ei.value.headers["Retry-After"] == "1"
    assert len((await core.list_namespaced_pod(NS)).items) == 1


async def test_latency(server: ApiServer, core: client.CoreV1Api) -> None:
    await core.create_namespaced_pod(NS, pod_body("l"))
    server.faults.add_latency("get", 150)
    t0 = time.monotonic()
    await core.read_namespaced_pod("l", NS)
    assert time.monotonic() - t0 >= 0.15


async def test_dropped_watches(server: ApiServer, core: client.CoreV1Api) -> None:
    for name in ("a", "b", "c"):
        await core.create_namespaced_pod(NS, pod_body(name))
    server.faults.drop_watches_every(2)
    w = watch.Watch()
    events = [e async for e in w.stream(core.list_namespaced_pod, NS, timeout_seconds=5)]
    await w.close()
    assert len(events) == 2  # the server ended the stream after 2 events

    server.faults.drop_watches_every(None)
    w = watch.Watch()
    it = w.stream(core.list_namespaced_pod, NS, timeout_seconds=5).__aiter__()
    try:
        for _ in range(3):
            await asyncio.wait_for(it.__anext__(), 3)
        assert server.faults.drop_watches() == 1
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(it.__anext__(), 3)
    finally:
        await w.close()


async def test_response_lost_after_write(server: ApiServer, core: client.CoreV1Api) -> None:
    await core.create_namespaced_pod(NS, pod_body("r"))
    server.faults.lose_response("patch", "pods", count=1)
    with pytest.raises(ApiException) as ei:
        await label(core, "r", "applied")
    assert ei.value.status == 500
    assert (await core.read_namespaced_pod("r", NS)).metadata.labels == {"v": "applied"}

    server.faults.lose_response("create", "pods", mode="close")
    with pytest.raises(aiohttp.ClientError):
        await core.create_namespaced_pod(NS, pod_body("r2"))
    with pytest.raises(ApiException) as ei:  # the retry finds the first attempt applied
        await core.create_namespaced_pod(NS, pod_body("r2"))
    assert ei.value.status == 409
