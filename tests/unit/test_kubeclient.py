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
