"""Fixtures for the Kubernetes-side tests: a real dev API server on an ephemeral port, real
kubernetes-asyncio clients over HTTP, and (from tests/conftest.py) a real nats-server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest
from kubernetes_asyncio import client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from services.apiserver.server import ApiServer, ApiServerConfig, start_apiserver, write_kubeconfig
from services.reconciler.kube import K8sGateway, load_api_client
from shared.bus.provision import StreamsConfig, provision
from shared.bus.wire import H_MSG_ID
from shared.fence.schema import Observed, decode_input
from shared.subjects import Subjects

NS = "default"
MERGE = "application/merge-patch+json"
WAIT_S = 10.0
VM_ARGS = ("vmfence.io", "v1alpha1", NS, "virtualmachines")


@pytest.fixture
async def server() -> AsyncIterator[ApiServer]:
    srv = await start_apiserver(ApiServerConfig(bookmark_interval_s=0.2, watch_window=1000))
    try:
        yield srv
    finally:
        await srv.stop()


@pytest.fixture
def kubeconfig(server: ApiServer, tmp_path: Path) -> str:
    return write_kubeconfig(server.url, str(tmp_path / "kubeconfig"))


@pytest.fixture
async def api(kubeconfig: str) -> AsyncIterator[client.ApiClient]:
    api_client = await load_api_client(kubeconfig)
    async with api_client:
        yield api_client


@pytest.fixture
def core(api: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api)


@pytest.fixture
def custom(api: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api)


@pytest.fixture
async def gateway(kubeconfig: str) -> AsyncIterator[K8sGateway]:
    gw = await K8sGateway.connect(kubeconfig, host_ip={"host-a": "10.0.0.1"}.get, call_timeout_s=15.0)
    try:
        yield gw
    finally:
        await gw.close()


@pytest.fixture
def subjects() -> Subjects:
    return Subjects(partitions=4)


@pytest.fixture
async def provisioned(js: JetStreamContext, subjects: Subjects) -> JetStreamContext:
    await provision(js, subjects, StreamsConfig(partitions=subjects.partitions))
    return js


@dataclass
class Seen:
    subject: str
    msg_id: str
    obs: Observed


class Tap:
    """Every observation published (core NATS subscription: duplicates included), with waits."""

    def __init__(self) -> None:
        self.seen: list[Seen] = []
        self.changed = asyncio.Condition()

    async def on_msg(self, msg: Msg) -> None:
        obs = decode_input(msg.data)
        assert isinstance(obs, Observed)
        self.seen.append(Seen(msg.subject, (msg.headers or {}).get(H_MSG_ID, ""), obs))
        async with self.changed:
            self.changed.notify_all()

    async def wait(self, pred: Callable[[Seen], bool], count: int = 1) -> list[Seen]:
        async def matched() -> list[Seen]:
            async with self.changed:
                await self.changed.wait_for(lambda: len([s for s in self.seen if pred(s)]) >= count)
                return [s for s in self.seen if pred(s)]

        return await asyncio.wait_for(matched(), WAIT_S)

    def of(self, uid: str) -> list[Seen]:
        return [s for s in self.seen if s.obs.uid == uid]


@pytest.fixture
async def tap(nats_url: str, subjects: Subjects, provisioned: JetStreamContext) -> AsyncIterator[Tap]:
    nc = await nats.connect(nats_url)
    t = Tap()
    await nc.subscribe(subjects.in_all, cb=t.on_msg)
    await nc.flush()
    try:
        yield t
    finally:
        await nc.close()


def pod_body(
    name: str,
    *,
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    node: str | None = "vmfence-host-a",
    containers: int = 1,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [{"name": f"c{i}", "image": "busybox"} for i in range(containers)],
    }
    if node:
        spec["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}, "annotations": annotations or {}},
        "spec": spec,
    }


def vm_body(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "vmfence.io/v1alpha1",
        "kind": "VirtualMachine",
        "metadata": {"name": name},
        "spec": {"image": "debian", **spec},
    }
