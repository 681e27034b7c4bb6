"""Fixed regressions for the gateway's uid fences that no other test reaches (issue 16, found by the
mutants catalogue): a pod recreated under its name while its status write is in flight."""

from __future__ import annotations

from typing import Any

from kubernetes_asyncio import client

from services.reconciler.kube import K8sGateway
from shared.fence.keys import Key
from shared.fence.schema import Fence, KubeWrite, PodStatusIntent

from .conftest import NS, pod_body

RUNNING = PodStatusIntent(phase="Running", ready=True, vm_id="vm-1", host="host-a", ip="10.1.0.5", vnc_port=5901)


async def test_a_pod_recreated_between_the_read_and_the_status_patch_is_superseded(
    core: client.CoreV1Api, gateway: K8sGateway
) -> None:
    """A status write reads the pod consistently, then sends one patch of pods/status carrying the
    status and the runtime annotations under the read's uid and resourceVersion. The pod is deleted
    and recreated under its name between the two: the patch is refused, so the successor never shows
    the predecessor's VM, host or IP, and the outcome is ``superseded`` (rule 4/6)."""
    old = await core.create_namespaced_pod(NS, pod_body("p"), _preload_content=False)
    old_uid = (await old.json())["metadata"]["uid"]
    successor: dict[str, Any] = {}
    send = gateway.http.send

    async def recreate_first(method: str, path: str, **kwargs: Any) -> Any:
        if method == "PATCH" and path.endswith("/status") and not successor:
            # the status patch is on its way: the name changes hands now
            await core.delete_namespaced_pod("p", NS, grace_period_seconds=0)
            resp = await core.create_namespaced_pod(NS, pod_body("p"), _preload_content=False)
            successor.update(await resp.json())
        return await send(method, path, **kwargs)

    gateway.http.send = recreate_first  # type: ignore[method-assign]
    key = Key("pod", NS, "p")
    done = await gateway.write(key, KubeWrite(id="w", verb="status", fence=Fence(str(key), old_uid, 1), status=RUNNING))
    assert successor, "the write never reached its status patch"
    assert done.outcome == "superseded", done
    resp = await core.read_namespaced_pod("p", NS, _preload_content=False)
    now = await resp.json()
    assert now["metadata"]["uid"] == successor["metadata"]["uid"] != old_uid
    assert not any(k.startswith("vmfence.io/") for k in now["metadata"].get("annotations") or {}), now["metadata"]
    assert (now.get("status") or {}).get("phase") != "Running", now["status"]


async def test_a_write_without_a_uid_fence_is_refused_before_any_request(
    core: client.CoreV1Api, gateway: K8sGateway
) -> None:
    """Rule 4: every Kubernetes write carries the incarnation. A write whose fence names no uid (a
    survey's fence, say) would carry an empty precondition, which the API server ignores: it is
    refused as ``failed`` and the pod is untouched, whatever the verb."""
    resp = await core.create_namespaced_pod(NS, pod_body("p"), _preload_content=False)
    pod = await resp.json()
    key = Key("pod", NS, "p")
    for verb in ("delete", "evict", "status"):
        w = KubeWrite(id=verb, verb=verb, fence=Fence(str(key), "", 1), status=RUNNING if verb == "status" else None)
        done = await gateway.write(key, w)
        assert done.outcome == "failed" and done.detail is not None and "uid" in done.detail, (verb, done)
    resp = await core.read_namespaced_pod("p", NS, _preload_content=False)
    now = await resp.json()
    assert now["metadata"]["uid"] == pod["metadata"]["uid"] and not now["metadata"].get("deletionTimestamp")
    assert now["metadata"]["resourceVersion"] == pod["metadata"]["resourceVersion"]
