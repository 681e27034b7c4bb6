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
