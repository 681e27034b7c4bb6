"""One way for every vmfence service to build its Kubernetes client.

kubernetes-asyncio opens its aiohttp session with ``trust_env=True``: on every request aiohttp then
looks up the proxy variables and parses ``~/.netrc`` in a worker thread. In the process bench that
was 29 % of a reconciler's CPU per pod (22.4 -> 15.9 ms, ``python -m services.testbed.bench.fleet
1000``). The environment does not change while a service runs, so it is read once here: with no
proxy variable set the session stops consulting it; with one set it is honoured as before (a
kubeconfig's ``proxy-url`` goes through the client configuration either way).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlencode

import aiohttp
import msgspec
from kubernetes_asyncio import client, config

PROXY_VARIABLES = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy")


def proxy_from_environment(environ: dict[str, str] | None = None) -> bool:
    """True when a proxy variable is set (then aiohttp must keep reading the environment)."""
    env = os.environ if environ is None else environ
    return any(env.get(name) for name in PROXY_VARIABLES)


def api_client(cfg: client.Configuration) -> client.ApiClient:
    """An ApiClient for ``cfg`` whose session reads the environment only if a proxy is set in it."""
    api = client.ApiClient(configuration=cfg)
    if not proxy_from_environment():
        session = api.rest_client.pool_manager
        session._trust_env = False  # aiohttp has no public setter; the attribute is read per request
    return api


async def load_api_client(kubeconfig: str | None) -> client.ApiClient:
    """An ApiClient from a kubeconfig file, or from the in-cluster service account when None."""
    cfg = client.Configuration()
    if kubeconfig:
        await config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    else:
        config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    return api_client(cfg)


JSON_TYPE = "application/json"


def path_of(*segments: str) -> str:
    """An API path from its segments, each quoted whole (a name is one segment, whatever it holds)."""
    return "".join("/" + quote(seg, safe="") for seg in segments)


class Requests:
    """Requests by path over an :class:`ApiClient`'s own session, configuration and credentials.

    kubernetes-asyncio's generated calls walk every body and parameter through its model layer
    (``sanitize_for_serialization``), serialise with the standard ``json`` and build a timeout and
    a header set per call: ~45 µs of a status patch's 165 µs of client CPU here, on a path every
    pod takes eight times. This sends what the caller already holds as JSON (encoded by msgspec),
    with the same authentication (``update_params_for_auth``: a refreshed bearer token included),
    proxy and TLS server name as the generated calls, and answers the raw status and body."""

    def __init__(self, api: client.ApiClient) -> None:
        self.api = api
        rest = api.rest_client
        # what the generated calls pass too, when the client was made with it (fixed from then on)
        given = {"proxy": rest.proxy, "proxy_headers": rest.proxy_headers, "server_hostname": rest.server_hostname}
        self._extra: dict[str, Any] = {k: v for k, v in given.items() if v}

    async def send(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str = JSON_TYPE,
        query: Mapping[str, str | int] | None = None,
        timeout_s: float,
    ) -> tuple[int, bytes]:
        """One request; ``(status, body)`` for any answer, aiohttp's exceptions for none."""
        api = self.api
        headers: dict[str, str] = {**api.default_headers, "Accept": JSON_TYPE}
        queries: list[tuple[str, Any]] = list((query or {}).items())
        await api.update_params_for_auth(headers, queries, ["BearerToken"])
        url = f"{api.configuration.host}{path}"
        if queries:
            url += "?" + urlencode(queries)
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = msgspec.json.encode(body)
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with api.rest_client.pool_manager.request(method, url, headers=headers, data=data, timeout=timeout,
                                                        **self._extra) as resp:
            return resp.status, await resp.read()
