"""Virtual Nodes against the dev API server: creation, taint, Ready following heartbeats, Lease."""

from __future__ import annotations

from typing import Any

from kubernetes_asyncio import client

from services.apiserver.server import ApiServer
from services.reconciler.nodes import sync_nodes
from shared.fence.heartbeat import HostHeartbeat


def hb(host: str, **kw: Any) -> HostHeartbeat:
    base: dict[str, Any] = {
        "host": host,
        "runtime": "sim",
        "cpus_total": 8,
        "cpus_free": 6,
        "memory_total_mib": 16384,
        "memory_free_mib": 12000,
        "vms": 2,
        "at": 0.0,
        "ip": "10.0.0.1",
    }
    return HostHeartbeat(**{**base, **kw})


async def node(core: client.CoreV1Api, name: str) -> dict[str, Any]:
    resp = await core.read_node(name, _preload_content=False)
    assert resp.status == 200
    return dict(await resp.json())


def ready(n: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in n["status"]["conditions"] if c["type"] == "Ready")


async def test_node_created_tainted_ready_with_lease(api: client.ApiClient, core: client.CoreV1Api) -> None:
    await sync_nodes(api, [(hb("host-a"), 1.0)], stale_after_s=15.0)
    n = await node(core, "vmfence-host-a")
    labels = n["metadata"]["labels"]
    assert labels["type"] == "virtual-kubelet" and labels["kubernetes.io/role"] == "agent"
    assert labels["vmfence.io/host"] == "host-a"
    assert n["spec"]["taints"] == [{"key": "vmfence.io/vm", "value": "true", "effect": "NoSchedule"}]
    assert n["status"]["capacity"] == {"cpu": "8", "memory": "16384Mi", "pods": "110"}
    assert n["status"]["allocatable"]["cpu"] == "8"
    assert {"type": "InternalIP", "address": "10.0.0.1"} in n["status"]["addresses"]
    assert ready(n)["status"] == "True"
    lease = await client.CoordinationV1Api(api).read_namespaced_lease("vmfence-host-a", "kube-node-lease")
    assert lease.spec.holder_identity == "vmfence-host-a" and lease.spec.renew_time is not None
    first_renew = lease.spec.renew_time
    # a second sync renews the lease and updates capacity
    await sync_nodes(api, [(hb("host-a", cpus_total=16), 0.5)], stale_after_s=15.0)
    n = await node(core, "vmfence-host-a")
    assert n["status"]["capacity"]["cpu"] == "16" and len(n["spec"]["taints"]) == 1
    lease = await client.CoordinationV1Api(api).read_namespaced_lease("vmfence-host-a", "kube-node-lease")
    assert lease.spec.renew_time >= first_renew


async def test_stale_and_missing_heartbeats(api: client.ApiClient, core: client.CoreV1Api) -> None:
    await sync_nodes(api, [(hb("host-a"), 1.0), (hb("host-b"), 1.0)], stale_after_s=15.0)
    assert ready(await node(core, "vmfence-host-a"))["status"] == "True"
    await sync_nodes(api, [(hb("host-a"), 20.0)], stale_after_s=15.0)
    a = ready(await node(core, "vmfence-host-a"))
    assert a["status"] == "False" and a["reason"] == "HostHeartbeatStale"
    b = ready(await node(core, "vmfence-host-b"))  # no heartbeat at all: NotReady, not deleted
    assert b["status"] == "Unknown" and b["reason"] == "HostHeartbeatMissing"
    await sync_nodes(api, [(hb("host-a"), 0.1), (hb("host-b"), 0.1)], stale_after_s=15.0)
    assert ready(await node(core, "vmfence-host-b"))["status"] == "True"


async def test_one_failing_host_does_not_block_others(
    server: ApiServer, api: client.ApiClient, core: client.CoreV1Api
) -> None:
    server.faults.inject_error("create", "nodes", 500, count=1)
    await sync_nodes(api, [(hb("host-a"), 1.0)], stale_after_s=15.0)  # logged, not raised
    await sync_nodes(api, [(hb("host-a"), 1.0), (hb("host-c"), 1.0)], stale_after_s=15.0)
    assert ready(await node(core, "vmfence-host-a"))["status"] == "True"
    assert ready(await node(core, "vmfence-host-c"))["status"] == "True"


async def test_capacity_is_the_hosts_and_allocatable_what_the_agent_offers(
    api: client.ApiClient, core: client.CoreV1Api
) -> None:
    """A kubelet's split: capacity the host's own (before the agent's reserve), allocatable the rest;
    the pressure conditions a node lifecycle controller reads are present and False."""
    await sync_nodes(api, [(hb("host-c", cpus_total=2, memory_total_mib=23000, cpus_capacity=2,
                               memory_capacity_mib=23512), 1.0)], stale_after_s=15.0)
    n = await node(core, "vmfence-host-c")
    assert n["status"]["capacity"] == {"cpu": "2", "memory": "23512Mi", "pods": "110"}
    assert n["status"]["allocatable"] == {"cpu": "2", "memory": "23000Mi", "pods": "110"}
    conds = {c["type"]: c for c in n["status"]["conditions"]}
    assert {t: conds[t]["status"] for t in ("MemoryPressure", "DiskPressure", "PIDPressure")} == \
        {"MemoryPressure": "False", "DiskPressure": "False", "PIDPressure": "False"}
    assert all(c.get("reason") and c.get("lastHeartbeatTime") for c in conds.values())
