"""The development server answers pods/binding and pod status writes as the real kube-apiserver does:
the same requests go to both (the real one built by ``make kube``, started by
services/testbed/kubecp) and must get the same status codes. Differences this test found and the
development server now follows: an IPv4 podIP with leading zeros is accepted (a legacy form), and a
patch whose result does not decode is 422 naming the patch, not 400. About 10 s (the control plane's
start)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client, config

from services.apiserver.server import ApiServerConfig, start_apiserver, write_kubeconfig
from services.reconciler.kube import K8sGateway
from services.testbed.kubecp.launcher import KubeControlPlane, KubeUnavailable, binaries
from shared.fence.keys import Key
from shared.fence.schema import Fence, KubeWrite

from .test_pod_status import INTENTS

NS = "default"
MERGE = "application/merge-patch+json"
BAD_STATUSES: list[dict[str, Any]] = [
    {"conditions": [{"type": "not a name!", "status": "True"}]},
    {"conditions": [{"type": "vmfence.io/SpecValid", "status": "True", "observedGeneration": -1}]},
    {"hostIP": "10.0.0.1", "hostIPs": [{"ip": "10.0.0.2"}]},
    {"podIP": "10.0.0.999", "podIPs": [{"ip": "10.0.0.999"}]},
    {"podIPs": [{"ip": "010.0.0.1"}]},
    {"podIPs": [{"ip": "10.0.0.1"}, {"ip": "10.0.0.2"}]},
    {"containerStatuses": [{"name": "main", "ready": True, "restartCount": "x", "image": "b", "imageID": ""}]},
    {"conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "yesterday"}]},
    {"phase": 3},
]


async def _raw(fn: Any, *args: Any, **kwargs: Any) -> int:
    resp = await fn(*args, _preload_content=False, **kwargs)
    try:
        await resp.read()
        return int(resp.status)
    finally:
        resp.release()


async def _answers(api: client.ApiClient) -> list[tuple[str, object]]:
    """The same requests, in order, and what each got."""
    core = client.CoreV1Api(api)
    pod = {"metadata": {"name": "d1"}, "spec": {"containers": [{"name": "main", "image": "busybox"},
                                                               {"name": "side", "image": "busybox"}]}}
    uid = (await core.create_namespaced_pod(NS, pod)).metadata.uid

    def binding(node: str, u: str = uid) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "d1", "uid": u},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node}}

    out: list[tuple[str, object]] = [
        ("bind another uid", await _raw(core.create_namespaced_pod_binding, "d1", NS, binding("vmfence-x", "nope"))),
        ("bind", await _raw(core.create_namespaced_pod_binding, "d1", NS, binding("vmfence-x"))),
        ("bind a bound pod", await _raw(core.create_namespaced_pod_binding, "d1", NS, binding("vmfence-y"))),
    ]
    out.append(("bind a missing pod", await _raw(core.create_namespaced_pod_binding, "nope", NS,
                                                 {**binding("vmfence-x"), "metadata": {"name": "nope"}})))
    held = {"metadata": {"name": "held", "finalizers": ["example.com/hold"]},
            "spec": {"containers": [{"name": "main", "image": "busybox"}]}}
    await core.create_namespaced_pod(NS, held)
    await core.delete_namespaced_pod("held", NS)
    out.append(("bind a deleting pod", await _raw(core.create_namespaced_pod_binding, "held", NS,
                                                  {**binding("vmfence-x"), "metadata": {"name": "held"}})))
    await core.patch_namespaced_pod("held", NS, {"metadata": {"finalizers": None}}, _content_type=MERGE)
    out.append(("bind with another name", await _raw(core.create_namespaced_pod_binding, "d1", NS,
                                                     {**binding("vmfence-x"), "metadata": {"name": "other"}})))
    annotated = {"metadata": {"name": "annotated", "annotations": {"example.com/keep": "1", "example.com/drop": "1"}},
                 "spec": {"containers": [{"name": "main", "image": "busybox"}]}}
    await core.create_namespaced_pod(NS, annotated)
    through_status = {"metadata": {"annotations": {"example.com/new": "v", "example.com/drop": None},
                                   "labels": {"example.com/l": "x"}}, "status": {"message": "m"}}
    code = await _raw(core.patch_namespaced_pod_status, "annotated", NS, through_status, _content_type=MERGE)
    got = await core.read_namespaced_pod("annotated", NS)
    # the gateway writes a pod's runtime annotations in its status patch: the real server keeps them
    out.append(("annotations and labels through pods/status",
                (code, got.metadata.annotations, got.metadata.labels, got.status.message)))
    gw = K8sGateway(api, host_ip=lambda host: "192.168.50.1")
    for n, intent in enumerate(INTENTS):
        done = await gw.write(Key("pod", NS, "d1"), KubeWrite(f"w{n}", "status", Fence(f"{NS}/d1", uid, 1),
                                                              status=intent))
        out.append((f"vmfence's status {intent.phase}/{intent.reason}", done.outcome))
    out += await _kept_object_answers(core, gw, uid)
    for status in BAD_STATUSES:
        q = await core.create_namespaced_pod(NS, {"metadata": {"generateName": "bad-"},
                                                  "spec": {"containers": [{"name": "main", "image": "busybox"}]}})
        out.append((f"status {status}", await _raw(core.patch_namespaced_pod_status, q.metadata.name, NS,
                                                   {"status": status}, _content_type=MERGE)))
    return out


async def _kept_object_answers(core: client.CoreV1Api, gw: K8sGateway, uid: str) -> list[tuple[str, object]]:
    """What a status write from the gateway's kept object meets (issue 14): a status patch whose
    resourceVersion another client's write made stale is a 409 (then one re-read, then ok), and
    one carrying a deleted predecessor's uid (and resourceVersion) is a 409 on its successor."""
    key, fence = Key("pod", NS, "d1"), Fence(f"{NS}/d1", uid, 1)
    old_rv = (await core.read_namespaced_pod("d1", NS)).metadata.resource_version
    other = {"status": {"conditions": [{"type": "example.com/Other", "status": "True"}]}}
    await core.patch_namespaced_pod_status("d1", NS, other, _content_type=MERGE)
    out: list[tuple[str, object]] = [
        ("status patch with a stale resourceVersion", await _raw(
            core.patch_namespaced_pod_status, "d1", NS,
            {"metadata": {"uid": uid, "resourceVersion": old_rv}, "status": {"phase": "Running"}},
            _content_type=MERGE)),
    ]
    done = await gw.write(key, KubeWrite("k1", "status", fence, status=INTENTS[1]))
    out.append(("vmfence's status from a kept object gone stale", done.outcome))
    pred_rv = (await core.read_namespaced_pod("d1", NS)).metadata.resource_version
    await core.delete_namespaced_pod("d1", NS, grace_period_seconds=0)
    pod = {"metadata": {"name": "d1"}, "spec": {"containers": [{"name": "main", "image": "busybox"}]}}
    await core.create_namespaced_pod(NS, pod)
    # uid + resourceVersion, as a kept object's patch carries them: 409 on both servers (a uid alone
    # is a 422 "metadata.uid: field is immutable" on the real one and a 409 on the development
    # server; the gateway re-reads after either and names the write superseded)
    out.append(("status patch with a deleted predecessor's uid and resourceVersion", await _raw(
        core.patch_namespaced_pod_status, "d1", NS,
        {"metadata": {"uid": uid, "resourceVersion": pred_rv}, "status": {"phase": "Running"}}, _content_type=MERGE)))
    done = await gw.write(key, KubeWrite("k2", "status", fence, status=INTENTS[2]))
    out.append(("vmfence's status of a deleted predecessor, from its kept object", done.outcome))
    succ = await core.read_namespaced_pod("d1", NS)
    untouched = (succ.metadata.uid != uid, succ.status.phase, not succ.metadata.annotations)
    out.append(("the successor untouched", untouched))
    return out


async def _client(kubeconfig: str) -> client.ApiClient:
    cfg = client.Configuration()
    await config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    return client.ApiClient(configuration=cfg)


@pytest.fixture
async def real(tmp_path: Path) -> AsyncIterator[client.ApiClient]:
    try:
        binaries()
    except KubeUnavailable as exc:  # make test builds them first; a failed build says why
        pytest.skip(f"the real control plane is not built: {exc}")
    async with KubeControlPlane(tmp_path / "cp") as cp:
        api = await _client(str(cp.admin_kubeconfig))
        try:
            yield api
        finally:
            await api.close()


async def test_binding_and_status_answers_match_the_real_api_server(real: client.ApiClient, tmp_path: Path) -> None:
    real_answers = await _answers(real)
    srv = await start_apiserver(ApiServerConfig())
    try:
        api = await _client(write_kubeconfig(srv.url, str(tmp_path / "dev.kubeconfig")))
        try:
            dev_answers = await _answers(api)
        finally:
            await api.close()
    finally:
        await srv.stop()
    assert [a for _, a in real_answers if a == "ok"], "the real server accepted none of vmfence's statuses"
    kept = dict(real_answers)
    assert kept["status patch with a stale resourceVersion"] == 409
    assert kept["vmfence's status from a kept object gone stale"] == "ok"
    assert kept["status patch with a deleted predecessor's uid and resourceVersion"] == 409
    assert kept["vmfence's status of a deleted predecessor, from its kept object"] == "superseded"
    assert kept["the successor untouched"] == (True, "Pending", True)
    assert kept["annotations and labels through pods/status"] == (
        200, {"example.com/keep": "1", "example.com/new": "v"}, {"example.com/l": "x"}, "m")
    differ = [(what, r, d) for (what, r), (_, d) in zip(real_answers, dev_answers, strict=True) if r != d]
    assert not differ, f"the development server answers differently from the real one: {differ}"
