"""Fixtures: a real dev API server on an ephemeral port and real kubernetes-asyncio clients."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client, config

from services.apiserver.server import ApiServer, ApiServerConfig, start_apiserver, write_kubeconfig


@pytest.fixture
async def server() -> AsyncIterator[ApiServer]:
    srv = await start_apiserver(ApiServerConfig(bookmark_interval_s=0.2, watch_window=50))
    try:
        yield srv
    finally:
        await srv.stop()


@pytest.fixture
def kubeconfig(server: ApiServer, tmp_path: Path) -> str:
    return write_kubeconfig(server.url, str(tmp_path / "kubeconfig"))


@pytest.fixture
async def api(kubeconfig: str) -> AsyncIterator[client.ApiClient]:
    cfg = client.Configuration()
    await config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    async with client.ApiClient(configuration=cfg) as api_client:
        yield api_client


@pytest.fixture
def core(api: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api)


@pytest.fixture
def custom(api: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api)


def pod_body(name: str, labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    """A minimal valid pod manifest."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"containers": [{"name": "main", "image": "busybox"}], **spec},
    }
