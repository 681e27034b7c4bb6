"""The services' Kubernetes client reads the proxy environment once, not on every request."""

from __future__ import annotations

import pytest
from kubernetes_asyncio import client

from shared.kubeclient import api_client, proxy_from_environment


def test_a_proxy_variable_is_recognised() -> None:
    assert not proxy_from_environment({})
    assert not proxy_from_environment({"HTTPS_PROXY": ""})
    assert proxy_from_environment({"https_proxy": "http://proxy:3128"})
    assert proxy_from_environment({"HTTP_PROXY": "http://proxy:3128"})


@pytest.mark.parametrize("proxy", [None, "http://127.0.0.1:9"])
async def test_the_session_consults_the_environment_only_when_a_proxy_is_set(
    proxy: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    if proxy:
        monkeypatch.setenv("HTTPS_PROXY", proxy)
    cfg = client.Configuration()
    cfg.host = "http://127.0.0.1:1"
    api = api_client(cfg)
    try:
        assert api.rest_client.pool_manager.trust_env is bool(proxy)
    finally:
        await api.close()


def test_every_kubernetes_client_is_built_by_the_shared_builder() -> None:
    """A client built by hand reads the environment on every request again (two worker-thread
    hops each: ~0.4 ms of CPU per request here), in the services and in the benches' harness alike,
    where it inflates the harness's share and the library floor the benches compare against."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    built = re.compile(r"\bApiClient\(")
    offenders = [
        f"{path.relative_to(root)}:{n}"
        for top in ("services", "shared")
        for path in sorted((root / top).rglob("*.py"))
        if path.name != "kubeclient.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if built.search(line) and not line.lstrip().startswith("#")
    ]
    assert offenders == []


async def test_requests_carry_the_clients_credentials_body_and_query_to_the_path() -> None:
    """``Requests`` sends what the generated calls would: the bearer token (refreshed through the
    configuration's hook before each request), a JSON body of the given type, the query, each path
    segment quoted whole; and answers the raw status and body, an error status included."""
    from aiohttp import web

    from shared.kubeclient import Requests, path_of

    seen: list[dict[str, object]] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append({"method": request.method, "path": request.raw_path, "auth": request.headers.get("Authorization"),
                     "type": request.headers.get("Content-Type"), "body": await request.read()})
        return web.json_response({"kind": "Status", "code": 409}, status=409)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    cfg = client.Configuration()
    cfg.host = f"http://127.0.0.1:{port}"
    cfg.api_key = {"BearerToken": "first"}
    cfg.api_key_prefix = {"BearerToken": "Bearer"}
    refreshed = [0]

    def refresh(c: client.Configuration) -> None:
        refreshed[0] += 1
        c.api_key["BearerToken"] = f"token-{refreshed[0]}"

    cfg.refresh_api_key_hook = refresh
    api = api_client(cfg)
    try:
        http = Requests(api)
        status, body = await http.send("DELETE", path_of("api", "v1", "namespaces", "ns", "pods", "a/b c"),
                                       body={"preconditions": {"uid": "u"}}, query={"gracePeriodSeconds": 0},
                                       timeout_s=5)
        assert status == 409 and b'"code":409' in body.replace(b" ", b"")
        await http.send("PATCH", "/x", body={"a": 1}, content_type="application/merge-patch+json", timeout_s=5)
        await http.send("GET", "/version", timeout_s=5)
    finally:
        await api.close()
        await runner.cleanup()
    assert seen[0] == {"method": "DELETE", "path": "/api/v1/namespaces/ns/pods/a%2Fb%20c?gracePeriodSeconds=0",
                       "auth": seen[0]["auth"], "type": "application/json", "body": b'{"preconditions":{"uid":"u"}}'}
    assert str(seen[0]["auth"]).startswith("Bearer token-")  # the hook's token, not the first one
    assert seen[1]["type"] == "application/merge-patch+json" and seen[1]["auth"] != seen[0]["auth"]
    assert seen[2]["method"] == "GET" and seen[2]["body"] == b"" and seen[2]["path"] == "/version"
