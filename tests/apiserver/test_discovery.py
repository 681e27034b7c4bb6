"""Discovery documents and protocol details checked over plain HTTP."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from services.apiserver.server import ApiServer

from .conftest import pod_body


async def get_json(http: aiohttp.ClientSession, url: str, **kw: Any) -> tuple[int, Any]:
    async with http.get(url, **kw) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_discovery_documents(server: ApiServer) -> None:
    async with aiohttp.ClientSession() as http:
        _, version = await get_json(http, f"{server.url}/version")
        assert version["gitVersion"].startswith("v1.35")
        _, api = await get_json(http, f"{server.url}/api")
        assert api["versions"] == ["v1"]
        _, groups = await get_json(http, f"{server.url}/apis")
        names = {g["name"] for g in groups["groups"]}
        assert {
            "vmfence.io",
            "coordination.k8s.io",
            "apiextensions.k8s.io",
            "policy",
            "events.k8s.io",
        } <= names
        _, core = await get_json(http, f"{server.url}/api/v1")
        core_names = {r["name"] for r in core["resources"]}
        assert {
            "pods",
            "pods/status",
            "pods/eviction",
            "nodes",
            "nodes/status",
            "events",
            "namespaces",
        } <= core_names
        _, vm = await get_json(http, f"{server.url}/apis/vmfence.io/v1alpha1")
        vm_res = {r["name"]: r for r in vm["resources"]}
        assert vm_res["virtualmachines"]["shortNames"] == ["vm"] and "virtualmachines/status" in vm_res
        # aggregated discovery is not offered: plain JSON comes back, which clients accept
        aggregated = {
            "Accept": "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,application/json"
        }
        async with http.get(f"{server.url}/apis", headers=aggregated) as resp:
            assert resp.content_type == "application/json"
        status, _ = await get_json(http, f"{server.url}/openapi/v2")
        assert status == 404
        _, root = await get_json(http, f"{server.url}/openapi/v3")
        assert "apis/vmfence.io/v1alpha1" in root["paths"]
        for path in ("/livez", "/readyz", "/healthz"):
            async with http.get(f"{server.url}{path}") as resp:
                assert resp.status == 200


async def test_watch_list_initial_events_end_bookmark(server: ApiServer) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{server.url}/api/v1/namespaces/default/pods", json=pod_body("a")) as resp:
            assert resp.status == 201
        url = (
            f"{server.url}/api/v1/namespaces/default/pods?watch=1&sendInitialEvents=true"
            "&allowWatchBookmarks=true&resourceVersionMatch=NotOlderThan&timeoutSeconds=5"
        )
        async with http.get(url) as resp:
            added = json.loads(await resp.content.readline())
            end = json.loads(await resp.content.readline())
    assert added["type"] == "ADDED" and added["object"]["metadata"]["name"] == "a"
    assert end["type"] == "BOOKMARK"
    assert end["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}


async def test_unknown_paths_are_status_404(server: ApiServer) -> None:
    async with aiohttp.ClientSession() as http:
        for path in ("/api/v1/widgets", "/apis/nope.io/v1/things", "/api/v1/namespaces/default/pods/x/logs"):
            status, body = await get_json(http, f"{server.url}{path}")
            assert status == 404 and body["kind"] == "Status" and body["reason"] == "NotFound"
