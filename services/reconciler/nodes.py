"""Virtual Nodes: one ``vmfence-<host>`` Node per agent host, Ready following its heartbeat.

Called periodically by whichever reconciler holds the ``fleet`` lease. Each call:

- creates or updates ``vmfence-<host>`` for every heartbeat: labels ``type=virtual-kubelet``,
  ``kubernetes.io/role=agent``, ``vmfence.io/host=<host>``; taint ``vmfence.io/vm=true:NoSchedule``;
  capacity and allocatable from the heartbeat's totals (the scheduler subtracts pods' requests
  itself; free figures go to ``vmfence.io/*-free`` annotations); InternalIP from the heartbeat;
- sets ``Ready``: ``True`` while the heartbeat is fresh (its KV entry age < ``stale_after_s``),
  ``False`` (reason ``HostHeartbeatStale``) once it is older;
- renews the node Lease in ``kube-node-lease`` for fresh hosts (a stale host's lease is left to
  expire, as a dead kubelet's would);
- marks ``Ready=Unknown`` (reason ``HostHeartbeatMissing``) on every ``vmfence-*`` Node labelled
  with a host that has no heartbeat at all. Nodes are never deleted automatically.

Failures for one host are logged and do not stop the others; the next sync retries.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from shared.fence.heartbeat import HostHeartbeat
from shared.fence.podspec import NODE_PREFIX

log = logging.getLogger(__name__)

JSON = dict[str, Any]
LABEL_HOST = "vmfence.io/host"
TAINT = {"key": "vmfence.io/vm", "value": "true", "effect": "NoSchedule"}
LEASE_NAMESPACE = "kube-node-lease"
REQUEST_TIMEOUT_S = 10.0
MAX_PODS = 110
MERGE_PATCH = "application/merge-patch+json"
KUBELET_VERSION = "vmfence"


def node_name(host: str) -> str:
    return f"{NODE_PREFIX}{host}"


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _micro_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _labels(host: str) -> dict[str, str]:
    return {
        "type": "virtual-kubelet",
        "kubernetes.io/role": "agent",
        "kubernetes.io/hostname": node_name(host),
        "kubernetes.io/os": "linux",
        LABEL_HOST: host,
    }


def _ready(cur: JSON | None, status: str, reason: str, message: str) -> JSON:
    prev = next(
        (c for c in ((cur or {}).get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), None
    )
    now = _now()
    ltt = prev.get("lastTransitionTime") if prev and prev.get("status") == status else None
    return {
        "type": "Ready",
        "status": status,
        "reason": reason,
        "message": message,
        "lastHeartbeatTime": now,
        "lastTransitionTime": ltt or now,
    }


# the conditions besides Ready a kubelet reports (a node lifecycle controller and kube-scheduler read
# them: True would taint the node); a VM host's agent reports no pressure of its own
_PRESSURE = (("MemoryPressure", "KubeletHasSufficientMemory", "the agent has sufficient memory available"),
             ("DiskPressure", "KubeletHasNoDiskPressure", "the agent has no disk pressure"),
             ("PIDPressure", "KubeletHasSufficientPID", "the agent has sufficient PID available"))


def _pressure(cur: JSON | None, ctype: str, reason: str, message: str) -> JSON:
    c = _ready(cur, "False", reason, message)
    c["type"] = ctype
    prev = next((x for x in ((cur or {}).get("status") or {}).get("conditions") or [] if x.get("type") == ctype), None)
    if prev and prev.get("status") == "False" and prev.get("lastTransitionTime"):
        c["lastTransitionTime"] = prev["lastTransitionTime"]
    return c


def _status(hb: HostHeartbeat, cur: JSON | None, fresh: bool, age_s: float) -> JSON:
    """Capacity: the host's own CPUs and memory; allocatable: what the agent offers VMs (capacity
    minus its reserve), which kube-scheduler fits pods' requests against."""
    alloc = {"cpu": str(hb.cpus_total), "memory": f"{hb.memory_total_mib}Mi", "pods": str(MAX_PODS)}
    cap = {"cpu": str(max(hb.cpus_total, hb.cpus_capacity or 0)),
           "memory": f"{max(hb.memory_total_mib, hb.memory_capacity_mib or 0)}Mi", "pods": str(MAX_PODS)}
    if fresh:
        ready = _ready(cur, "True", "HostHeartbeatFresh", f"agent {hb.host} heartbeat {age_s:.1f}s ago")
    else:
        ready = _ready(cur, "False", "HostHeartbeatStale", f"agent {hb.host} heartbeat {age_s:.1f}s ago")
    addresses = [{"type": "Hostname", "address": hb.host}]
    if hb.ip:
        addresses.insert(0, {"type": "InternalIP", "address": hb.ip})
    out: JSON = {
        "capacity": cap,
        "allocatable": alloc,
        "conditions": [*(_pressure(cur, t, r, m) for t, r, m in _PRESSURE), ready],
        "addresses": addresses,
        "nodeInfo": {
            "kubeletVersion": KUBELET_VERSION,
            "operatingSystem": "linux",
            "architecture": "amd64",
            "containerRuntimeVersion": f"vmfence://{hb.runtime}",
            "kernelVersion": "",
            "osImage": "",
            "kubeProxyVersion": "",
            "machineID": "",
            "systemUUID": "",
            "bootID": "",
        },
        "phase": "Running",
    }
    if hb.kubelet_port:  # where the API server reaches the agent's kubelet endpoint (kubectl logs)
        out["daemonEndpoints"] = {"kubeletEndpoint": {"Port": hb.kubelet_port}}
    return out


async def _raw(fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> JSON:
    """Call a kubernetes-asyncio method for raw JSON; ApiException on non-2xx."""
    resp = await fn(*args, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S, **kwargs)
    try:
        body = await resp.read()
        status = int(resp.status)
    finally:
        resp.release()
    if not 200 <= status <= 299:
        exc = ApiException(status=status, reason=body[:200].decode(errors="replace"))
        raise exc
    data = json.loads(body) if body.strip() else {}
    return data if isinstance(data, dict) else {}


async def _get_node(core: client.CoreV1Api, name: str) -> JSON | None:
    try:
        return await _raw(core.read_node, name)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


async def _sync_host(
    core: client.CoreV1Api, coord: client.CoordinationV1Api, hb: HostHeartbeat, age_s: float, stale_after_s: float
) -> None:
    name = node_name(hb.host)
    fresh = age_s < stale_after_s
    cur = await _get_node(core, name)
    annotations = {
        "vmfence.io/cpus-free": str(hb.cpus_free),
        "vmfence.io/memory-free-mib": str(hb.memory_free_mib),
        "vmfence.io/vms": str(hb.vms),
    }
    meta = {"name": name, "labels": _labels(hb.host), "annotations": annotations}
    spec = {"taints": [TAINT]}
    status = _status(hb, cur, fresh, age_s)
    if cur is None:
        body = {"apiVersion": "v1", "kind": "Node", "metadata": meta, "spec": spec, "status": status}
        try:
            cur = await _raw(core.create_node, body)
        except ApiException as exc:
            if exc.status != 409:  # AlreadyExists: another sync created it; patch below
                raise
    else:
        taints = [t for t in (cur.get("spec") or {}).get("taints") or [] if t.get("key") != TAINT["key"]]
        patch = {
            "metadata": {"labels": meta["labels"], "annotations": annotations},
            "spec": {"taints": [*taints, TAINT]},
        }
        await _raw(core.patch_node, name, patch, _content_type=MERGE_PATCH)
    await _raw(core.patch_node_status, name, {"status": status}, _content_type=MERGE_PATCH)
    if fresh:
        await _renew_lease(coord, name)


async def _renew_lease(coord: client.CoordinationV1Api, name: str) -> None:
    spec = {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": _micro_now()}
    try:
        await _raw(coord.patch_namespaced_lease, name, LEASE_NAMESPACE, {"spec": spec}, _content_type=MERGE_PATCH)
    except ApiException as exc:
        if exc.status != 404:
            raise
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": name, "namespace": LEASE_NAMESPACE},
            "spec": spec,
        }
        await _raw(coord.create_namespaced_lease, LEASE_NAMESPACE, body)


async def _mark_missing(core: client.CoreV1Api, live_hosts: set[str]) -> None:
    nodes = await _raw(core.list_node, label_selector=LABEL_HOST)
    for node in nodes.get("items") or []:
        m = node.get("metadata") or {}
        host = (m.get("labels") or {}).get(LABEL_HOST)
        name = str(m.get("name") or "")
        if not host or host in live_hosts or not name.startswith(NODE_PREFIX):
            continue
        prev = next((c for c in (node.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), None)
        if prev and prev.get("status") == "Unknown" and prev.get("reason") == "HostHeartbeatMissing":
            continue
        ready = _ready(node, "Unknown", "HostHeartbeatMissing", f"agent {host} has no heartbeat")
        try:
            await _raw(core.patch_node_status, name, {"status": {"conditions": [ready]}}, _content_type=MERGE_PATCH)
        except ApiException as exc:
            log.warning("node %s: cannot mark NotReady: %s", name, exc)


async def sync_nodes(
    api_client: client.ApiClient,
    heartbeats: list[tuple[HostHeartbeat, float]],
    *,
    stale_after_s: float,
) -> None:
    """One virtual Node per host; ``heartbeats`` holds each host's last heartbeat and its KV
    entry's age in seconds (computed by the caller from the entry's timestamp)."""
    core = client.CoreV1Api(api_client)
    coord = client.CoordinationV1Api(api_client)
    latest: dict[str, tuple[HostHeartbeat, float]] = {}
    for hb, age in heartbeats:
        if hb.host not in latest or age < latest[hb.host][1]:
            latest[hb.host] = (hb, age)
    results = await asyncio.gather(
        *(_sync_host(core, coord, hb, age, stale_after_s) for hb, age in latest.values()),
        return_exceptions=True,
    )
    for host, res in zip(latest, results, strict=True):
        if isinstance(res, BaseException):
            log.warning("node %s: sync failed: %r", node_name(host), res, extra={"host": host})
    try:
        await _mark_missing(core, set(latest))
    except Exception as exc:
        log.warning("virtual nodes: cannot list nodes: %r", exc)
