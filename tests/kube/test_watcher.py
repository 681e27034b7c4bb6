"""The watcher over real HTTP (dev API server) into a real JetStream: subjects, Msg-Ids, gone
observations, reconnects, 410 relists and two watchers at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from kubernetes_asyncio import client
from nats.js import JetStreamContext
from prometheus_client import REGISTRY

from services.apiserver.server import ApiServer, ApiServerConfig, start_apiserver, write_kubeconfig
from services.reconciler.kube import load_api_client
from services.watcher.watch import Watcher
from shared.bus.read import read_stream
from shared.bus.wire import H_MSG_ID
from shared.fence.keys import Key
from shared.subjects import Subjects

from .conftest import MERGE, NS, VM_ARGS, WAIT_S, Tap, pod_body, vm_body


@contextlib.asynccontextmanager
async def running_watcher(
    kubeconfig: str, js: JetStreamContext, subjects: Subjects, **kw: Any
) -> AsyncIterator[Watcher]:
    api = await load_api_client(kubeconfig)
    try:
        async with Watcher(api, js, subjects, **kw) as w:
            await asyncio.wait_for(w.ready.wait(), WAIT_S)
            for loop in w.loops:  # and every watch stream is open
                await asyncio.wait_for(loop.wait_streams(0), WAIT_S)
            yield w
    finally:
        await api.close()


async def create(core: client.CoreV1Api, name: str, **kw: Any) -> dict[str, Any]:
    resp = await core.create_namespaced_pod(NS, pod_body(name, **kw), _preload_content=False)
    return dict(await resp.json())


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def stored(js: JetStreamContext, subjects: Subjects) -> list[tuple[str, str]]:
    return [(m.subject, m.headers.get(H_MSG_ID, "")) async for m in read_stream(js, subjects.stream_in)]


async def test_observations_subjects_and_msg_ids(
    kubeconfig: str,
    core: client.CoreV1Api,
    custom: client.CustomObjectsApi,
    provisioned: JetStreamContext,
    subjects: Subjects,
    tap: Tap,
) -> None:
    listed = await create(core, "web.v1")  # dotted name, exists before the watcher starts
    other = await create(core, "plain", node=None)  # not vmfence's
    labelled = await create(core, "by-label", node=None, labels={"vmfence.io/managed": "true"})
    async with running_watcher(kubeconfig, provisioned, subjects):
        first = (await tap.wait(lambda s: s.obs.uid == listed["metadata"]["uid"]))[0]
        dotted = Key("pod", NS, "web.v1")
        assert first.subject == subjects.observation(dotted) and "web%2Ev1" in first.subject
        assert first.msg_id == f"{listed['metadata']['uid']}:{listed['metadata']['resourceVersion']}"
        assert first.obs.key == "default/web.v1" and first.obs.node == "vmfence-host-a"
        await tap.wait(lambda s: s.obs.uid == labelled["metadata"]["uid"])

        live = await create(core, "live", annotations={"vmfence.io/cpus": "lots"})
        uid = live["metadata"]["uid"]
        added = (await tap.wait(lambda s: s.obs.uid == uid))[0]
        assert added.obs.invalid is not None and "vmfence.io/cpus" in added.obs.invalid
        patched = await core.patch_namespaced_pod(
            "live", NS, {"metadata": {"annotations": {"vmfence.io/cpus": "2"}}}, _content_type=MERGE
        )
        mod = (await tap.wait(lambda s: s.obs.uid == uid and s.obs.spec.cpus == 2))[0]
        assert mod.obs.invalid is None and mod.msg_id == f"{uid}:{patched.metadata.resource_version}"
        await core.delete_namespaced_pod("live", NS)  # graceful: deleting=True
        await tap.wait(lambda s: s.obs.uid == uid and s.obs.deleting and not s.obs.gone)
        final = await core.delete_namespaced_pod("live", NS, grace_period_seconds=0, _preload_content=False)
        final_rv = (await final.json())["metadata"]["resourceVersion"]
        gone = (await tap.wait(lambda s: s.obs.uid == uid and s.obs.gone))[0]
        assert gone.msg_id == f"{uid}:{final_rv}" and gone.obs.resource_version == int(final_rv)

        vm = await custom.create_namespaced_custom_object(*VM_ARGS, vm_body("db.main", cpus=2))
        vuid = vm["metadata"]["uid"]
        vobs = (await tap.wait(lambda s: s.obs.uid == vuid))[0]
        assert vobs.subject == subjects.observation(Key("vm", NS, "db.main"))
        assert ".vm." in vobs.subject and vobs.obs.key == "vm:default/db.main" and vobs.obs.spec.cpus == 2
        await custom.delete_namespaced_custom_object(*VM_ARGS, "db.main")
        await tap.wait(lambda s: s.obs.uid == vuid and s.obs.gone)
    assert not tap.of(other["metadata"]["uid"])
    # every publish is stored exactly once
    msgs = await stored(provisioned, subjects)
    assert len(msgs) == len({m[1] for m in msgs}) == len(tap.seen)


async def test_own_status_write_is_not_republished(
    kubeconfig: str, core: client.CoreV1Api, provisioned: JetStreamContext, subjects: Subjects, tap: Tap
) -> None:
    async with running_watcher(kubeconfig, provisioned, subjects):
        uid = (await create(core, "p"))["metadata"]["uid"]
        await tap.wait(lambda s: s.obs.uid == uid)
        before = metric("vmfence_watch_events_total", kind="pod", type="UNCHANGED")
        await core.patch_namespaced_pod_status("p", NS, {"status": {"phase": "Running"}}, _content_type=MERGE)
        await core.patch_namespaced_pod("p", NS, {"metadata": {"labels": {"x": "y"}}}, _content_type=MERGE)
        # a relevant change after the irrelevant ones: once it is seen, the others were handled
        await core.patch_namespaced_pod(
            "p", NS, {"metadata": {"annotations": {"vmfence.io/memory": "1Gi"}}}, _content_type=MERGE
        )
        await tap.wait(lambda s: s.obs.uid == uid and s.obs.spec.memory_mib == 1024)
        assert len(tap.of(uid)) == 2
        assert metric("vmfence_watch_events_total", kind="pod", type="UNCHANGED") == before + 2


async def test_dropped_watch_reconnects_without_loss(
    server: ApiServer,
    kubeconfig: str,
    core: client.CoreV1Api,
    provisioned: JetStreamContext,
    subjects: Subjects,
    tap: Tap,
) -> None:
    async with running_watcher(kubeconfig, provisioned, subjects) as w:
        before = metric("vmfence_watch_restarts_total", reason="dropped")
        for round_ in range(3):
            opened = [loop.streams_opened for loop in w.loops]
            assert server.faults.drop_watches() >= 2
            # created while the watcher is between streams (backing off or reconnecting)
            pods = [await create(core, f"r{round_}-{i}") for i in range(3)]
            for p in pods:
                await tap.wait(lambda s, uid=p["metadata"]["uid"]: s.obs.uid == uid)
            for loop, n in zip(w.loops, opened, strict=True):
                await asyncio.wait_for(loop.wait_streams(n), WAIT_S)  # reconnected
        assert metric("vmfence_watch_restarts_total", reason="dropped") >= before + 3


async def test_expired_watch_relists_and_reports_missed_deletion(
    nats_url: str, provisioned: JetStreamContext, subjects: Subjects, tap: Tap, tmp_path: Any
) -> None:
    server = await start_apiserver(ApiServerConfig(bookmark_interval_s=60.0, watch_window=10))
    try:
        kubeconfig = write_kubeconfig(server.url, str(tmp_path / "kc"))
        api = await load_api_client(kubeconfig)
        core = client.CoreV1Api(api)
        try:
            keep = await create(core, "keep")
            doomed = await create(core, "doomed")
            async with running_watcher(kubeconfig, provisioned, subjects):
                await tap.wait(lambda s: s.obs.uid == doomed["metadata"]["uid"])
                expired_before = metric("vmfence_watch_restarts_total", reason="expired")
                # keep the watcher away while more than the window's worth of events happen
                rule = server.faults.inject_error("watch", "*", 500, count=None)
                assert server.faults.drop_watches() >= 1
                await core.delete_namespaced_pod("doomed", NS, grace_period_seconds=0)
                born = await create(core, "born")
                await create(core, "churn", node=None)
                for i in range(15):
                    await core.patch_namespaced_pod(
                        "churn", NS, {"metadata": {"labels": {"i": str(i)}}}, _content_type=MERGE
                    )
                rule.count = 0  # the API answers watches again; the old resourceVersion is expired
                gone = (await tap.wait(lambda s: s.obs.uid == doomed["metadata"]["uid"] and s.obs.gone))[0]
                assert gone.msg_id == f"{doomed['metadata']['uid']}:gone"
                await tap.wait(lambda s: s.obs.uid == born["metadata"]["uid"])
                # the relist republished every object (the duplicate of "keep" was absorbed)
                assert len(tap.of(keep["metadata"]["uid"])) >= 2
                assert metric("vmfence_watch_restarts_total", reason="expired") > expired_before
                msgs = await stored(provisioned, subjects)
                assert len(msgs) == len(set(msgs))
                assert sum(1 for m in msgs if m[1].startswith(keep["metadata"]["uid"])) == 1
        finally:
            await api.close()
    finally:
        await server.stop()


async def test_two_watchers_store_each_observation_once(
    kubeconfig: str, core: client.CoreV1Api, provisioned: JetStreamContext, subjects: Subjects, tap: Tap
) -> None:
    async with (
        running_watcher(kubeconfig, provisioned, subjects),
        running_watcher(kubeconfig, provisioned, subjects),
    ):
        uids = [(await create(core, f"twin-{i}"))["metadata"]["uid"] for i in range(4)]
        await core.patch_namespaced_pod(
            "twin-0", NS, {"metadata": {"annotations": {"vmfence.io/cpus": "3"}}}, _content_type=MERGE
        )
        await core.delete_namespaced_pod("twin-1", NS, grace_period_seconds=0)
        for uid in uids:
            await tap.wait(lambda s, uid=uid: s.obs.uid == uid, count=2)  # both watchers published
        await tap.wait(lambda s: s.obs.uid == uids[0] and s.obs.spec.cpus == 3, count=2)
        await tap.wait(lambda s: s.obs.uid == uids[1] and s.obs.gone, count=2)
    msgs = await stored(provisioned, subjects)
    per_id: dict[tuple[str, str], int] = {}
    for m in msgs:
        per_id[m] = per_id.get(m, 0) + 1
    assert per_id and all(n == 1 for n in per_id.values())
    published = {(s.subject, s.msg_id) for s in tap.seen}
    assert set(per_id) == published
    assert len(tap.seen) == 2 * len(msgs)


async def test_missing_crd_does_not_block_readiness(
    api: client.ApiClient,
    kubeconfig: str,
    core: client.CoreV1Api,
    provisioned: JetStreamContext,
    subjects: Subjects,
    tap: Tap,
) -> None:
    ext = client.ApiextensionsV1Api(api)
    await ext.delete_custom_resource_definition("virtualmachines.vmfence.io")
    watcher_api = await load_api_client(kubeconfig)
    try:
        async with Watcher(watcher_api, provisioned, subjects) as w:
            await asyncio.wait_for(w.ready.wait(), WAIT_S)
            uid = (await create(core, "still-works"))["metadata"]["uid"]
            await tap.wait(lambda s: s.obs.uid == uid)
    finally:
        await watcher_api.close()


async def test_one_unreadable_object_is_dead_lettered_and_the_watch_goes_on(
    kubeconfig: str,
    core: client.CoreV1Api,
    provisioned: JetStreamContext,
    subjects: Subjects,
    tap: Tap,
    monkeypatch: Any,
) -> None:
    """Issue 10, finding 1: a pod whose annotation made reading it raise stopped the watch for every
    pod (it restarted from the same resourceVersion forever). A 5000-digit number is now a spec
    error like any other; and any other failure to read one object dead-letters that object, in the
    list as in the watch, while later objects are still observed."""
    import services.watcher.watch as watch_mod

    real = watch_mod.pod_observation

    def flaky(obj: dict[str, Any], **kw: Any) -> Any:
        if (obj.get("metadata") or {}).get("name", "").startswith("cursed"):
            raise RuntimeError("an unforeseen defect in this object")
        return real(obj, **kw)

    monkeypatch.setattr(watch_mod, "pod_observation", flaky)
    await create(core, "cursed-listed")  # met by the first list
    async with running_watcher(kubeconfig, provisioned, subjects):
        huge = await create(core, "huge", annotations={"vmfence.io/cpus": "9" * 5000})
        bad = (await tap.wait(lambda s: s.obs.uid == huge["metadata"]["uid"]))[0]
        assert bad.obs.invalid is not None and "(5000 characters)" in bad.obs.invalid
        await create(core, "cursed-watched")  # met by the watch
        after = await create(core, "after")
        await tap.wait(lambda s: s.obs.uid == after["metadata"]["uid"])
    letters = [m async for m in read_stream(provisioned, subjects.stream_dlq)]
    names = sorted(json.loads(m.data)["name"] for m in letters)
    assert names == ["cursed-listed", "cursed-watched"]
    assert all("unreadable pod: RuntimeError" in m.headers["Vmfence-Reason"] for m in letters)
