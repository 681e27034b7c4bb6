"""List + watch pods and VirtualMachine objects and publish them as observations.

One :class:`ResourceLoop` per resource type (pods, virtualmachines.vmfence.io):

1. **list** (a consistent list: no ``resourceVersion`` parameter, never ``resourceVersion=0``),
   publish every object, and — because a relist can miss a deletion — publish ``gone=True`` for
   every uid known from before that is absent from the list;
2. **watch** from the list's resourceVersion with ``allowWatchBookmarks``; each event is published
   *before* the loop's resourceVersion advances past it, so a failed publish or dropped stream
   resumes without a gap. The object events of one chunk of the stream are published side by side
   as one run (one write and one round of acks, not a round trip each) and remembered only once
   all of them are stored;
3. on a 410 Gone (an ``ERROR`` event with code 410, or an HTTP 410) → relist; on a dropped stream
   or any error → reconnect from the last resourceVersion after an exponential backoff
   (``BACKOFF_BASE_S`` doubling to ``BACKOFF_MAX_S``, reset by a healthy stream); a normal
   server-side timeout reconnects at once.

Every observation goes to ``Subjects.observation(key)`` with ``Nats-Msg-Id = uid:resourceVersion``
(DELETED events carry the final object's resourceVersion), so several watchers publishing the
same event store it once within the stream's duplicate window. A deletion inferred from a relist
has no final object: it is published with the list's resourceVersion and the Msg-Id ``uid:gone``
(so every watcher that infers it stores it once).

A watch event whose observation differs from the last one published for that uid only in its
resourceVersion (typically the reconciler's own status write) is not published
(``skip_unchanged``, counted as ``UNCHANGED``); a relist publishes everything regardless.

Pods are vmfence's when ``spec.nodeName`` starts with ``vmfence-`` or they carry the label
``vmfence.io/managed=true`` (see :mod:`shared.fence.podspec`). Kubernetes selectors cannot express that OR,
so pods are watched without a selector and filtered here. A pod that was ours and stops matching
(label removed) is still followed by uid until it is deleted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import msgspec
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from nats.js import JetStreamContext
from prometheus_client import Counter

from shared.bus.append import publish_input
from shared.bus.deadletter import dead_letter
from shared.fence.keys import Key
from shared.fence.podspec import (
    VM_GROUP,
    VM_PLURAL,
    VM_VERSION,
    key_of_pod,
    key_of_vm,
    pod_observation,
    uid_of,
    vm_observation,
)
from shared.fence.schema import Observed, encode
from shared.subjects import Subjects
from shared.tasks import cancel_and_wait, sleep_unless_set

log = logging.getLogger(__name__)

JSON = dict[str, Any]
Kind = Literal["pod", "vm"]

WATCH_TIMEOUT_S = 300  # server-side timeoutSeconds of one watch request (jittered up to +20 %)
READ_SLACK_S = 60.0  # client read timeout = watch timeout + slack: a silent dead stream is noticed
CONNECT_TIMEOUT_S = 10.0
LIST_TIMEOUT_S = 60.0
BACKOFF_BASE_S = 0.1
BACKOFF_MAX_S = 10.0
HEALTHY_STREAM_S = 10.0  # a stream that lived this long resets the backoff
MAX_LINE_BYTES = 16 * 1024 * 1024  # one watch event; larger means a broken stream
REJECT_FIELD_MAX = 256  # characters of a name, uid or error kept in a dead letter

WATCH_EVENTS = Counter(
    "vmfence_watch_events_total",
    "Watch and list events handled, by resource kind and event type (LISTED, GONE: from a relist)",
    ["kind", "type"],
)
WATCH_REJECTED = Counter(
    "vmfence_watch_rejected_total",
    "Objects the watcher could not read into an observation (dead-lettered; the watch goes on)",
    ["kind"],
)
WATCH_RESTARTS = Counter(
    "vmfence_watch_restarts_total",
    "Watch restarts by reason (expired: 410 relist, dropped, timeout, error, missing: no such resource)",
    ["reason"],
)


class Expired(Exception):
    """The watch resourceVersion is too old (410 Gone): relist."""


class StreamError(Exception):
    """The API answered a watch or list with an error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


@dataclass
class _Known:
    key: Key
    rv: int
    seen: Observed | None = None  # last published observation with resource_version 0


def _unversioned(obs: Observed) -> Observed:
    return msgspec.structs.replace(obs, resource_version=0)


def backoff_delay(attempt: int) -> float:
    cap = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2.0 ** min(attempt, 16))
    return cap / 2 + random.uniform(0, cap / 2)


class ResourceLoop:
    """List/watch/publish for one resource type."""

    def __init__(
        self,
        kind: Kind,
        api_client: client.ApiClient,
        js: JetStreamContext,
        subjects: Subjects,
        *,
        namespace: str | None,
        stopping: asyncio.Event,
        watch_timeout_s: int = WATCH_TIMEOUT_S,
        skip_unchanged: bool = True,
    ) -> None:
        self.kind: Kind = kind
        self.skip_unchanged = skip_unchanged
        self.js = js
        self.subjects = subjects
        self.namespace = namespace
        self.stopping = stopping
        self.watch_timeout_s = watch_timeout_s
        self.rv: str | None = None
        self.known: dict[str, _Known] = {}
        self.listed = asyncio.Event()
        self.streams_opened = 0  # watch streams the API server accepted (200), for tests and status
        self._opened = asyncio.Condition()
        core, custom = client.CoreV1Api(api_client), client.CustomObjectsApi(api_client)
        self._list_fn: Callable[..., Awaitable[Any]]
        self._args: tuple[Any, ...]
        if kind == "pod":
            self._list_fn = core.list_namespaced_pod if namespace else core.list_pod_for_all_namespaces
            self._args = (namespace,) if namespace else ()
        elif namespace:
            self._list_fn = custom.list_namespaced_custom_object
            self._args = (VM_GROUP, VM_VERSION, namespace, VM_PLURAL)
        else:
            self._list_fn = custom.list_cluster_custom_object
            self._args = (VM_GROUP, VM_VERSION, VM_PLURAL)

    # --- observations ---------------------------------------------------------------------
    def _observe(self, obj: JSON, gone: bool) -> tuple[Key, Observed] | None:
        uid = uid_of(obj)
        if not uid:
            return None
        if self.kind == "vm":
            return key_of_vm(obj), vm_observation(obj, gone=gone)
        obs = pod_observation(obj, gone=gone)
        if obs is None and uid in self.known:  # was ours: keep following the incarnation
            labels = dict((obj.get("metadata") or {}).get("labels") or {})
            labels["vmfence.io/managed"] = "true"
            obs = pod_observation({**obj, "metadata": {**obj["metadata"], "labels": labels}}, gone=gone)
        return (key_of_pod(obj), obs) if obs is not None else None

    async def _publish(self, key: Key, obs: Observed, msg_id: str) -> None:
        await publish_input(self.js, self.subjects.observation(key), encode(obs), msg_id=msg_id)

    async def _reject(self, obj: JSON, exc: Exception) -> None:
        """Dead-letter an object that could not be read, naming it and why: one object's defect
        must never stop the watch (which would restart from the same resourceVersion forever)."""
        meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
        ident = {k: str(meta.get(k))[:REJECT_FIELD_MAX] for k in ("namespace", "name", "uid", "resourceVersion")}
        reason = f"unreadable {self.kind}: {type(exc).__name__}: {str(exc)[:REJECT_FIELD_MAX]}"
        log.warning("%s %s/%s (uid %s) dead-lettered: %s", self.kind, ident["namespace"], ident["name"],
                    ident["uid"], reason)
        WATCH_REJECTED.labels(self.kind).inc()
        await dead_letter(self.js, self.subjects, source="watcher", reason=reason,
                          subject=f"{self.kind}/{ident['namespace']}/{ident['name']}", data=json.dumps(ident).encode())

    async def _publish_run(self, events: list[tuple[str, JSON]]) -> None:
        """Publish the observations of a run of watch events side by side (one write, one round of
        acks, instead of a round trip each), then remember them, then advance the resourceVersion
        past them: a failed publish raises with nothing of the run remembered, so the watch resumes
        before it and publishes it all again (each stored once: its Msg-Id). Events of one uid in
        one run are judged in order against each other (``skip_unchanged``); a publish retried
        behind a later one of its key lands after it, and the reconciler drops an observation older
        than what it has."""
        if not events:
            return
        staged: dict[str, _Known | None] = {}  # uid -> what it will be known as (None: gone)
        unchanged: list[tuple[str, int]] = []
        sends: list[tuple[Key, Observed, str]] = []
        for etype, obj in events:
            gone = etype == "DELETED"
            try:
                got = self._observe(obj, gone)
            except Exception as exc:  # a defect of this object, not of the watch
                await self._reject(obj, exc)
                continue
            if got is None:
                continue
            key, obs = got
            seen = _unversioned(obs)
            prev = staged[obs.uid] if obs.uid in staged else self.known.get(obs.uid)
            if self.skip_unchanged and not gone and prev is not None and prev.seen == seen:
                # nothing the reconciler decides on changed (e.g. our own status write)
                unchanged.append((obs.uid, obs.resource_version))
                continue
            sends.append((key, obs, etype))
            staged[obs.uid] = None if gone else _Known(key, obs.resource_version, seen)
        if len(sends) == 1:
            key, obs, _ = sends[0]
            await self._publish(key, obs, f"{obs.uid}:{obs.resource_version}")
        elif sends:
            try:
                async with asyncio.TaskGroup() as tg:
                    for key, obs, _ in sends:
                        tg.create_task(self._publish(key, obs, f"{obs.uid}:{obs.resource_version}"))
            except ExceptionGroup as eg:
                raise eg.exceptions[0] from eg  # the watch's restart logs one cause
        for uid, known in staged.items():
            if known is None:
                self.known.pop(uid, None)
            else:
                self.known[uid] = known
        for uid, rv in unchanged:
            if (k := self.known.get(uid)) is not None:
                k.rv = max(k.rv, rv)
            WATCH_EVENTS.labels(self.kind, "UNCHANGED").inc()
        for _, _, etype in sends:
            WATCH_EVENTS.labels(self.kind, etype).inc()
        versions = [str((obj.get("metadata") or {}).get("resourceVersion") or "") for _, obj in events]
        if rv := next((v for v in reversed(versions) if v), ""):
            self.rv = rv  # only after the events were published

    # --- list -----------------------------------------------------------------------------
    async def relist(self) -> None:
        """Consistent list, publish every object, then gone=True for known uids not listed."""
        try:
            resp = await self._list_fn(*self._args, _preload_content=False, _request_timeout=LIST_TIMEOUT_S)
            body = await _read_json(resp)
        except ApiException as exc:
            raise StreamError(int(exc.status or 0), str(exc.reason)) from exc
        items = [i for i in body.get("items") or [] if isinstance(i, dict)]
        list_rv = str((body.get("metadata") or {}).get("resourceVersion") or "")
        kind = "Pod" if self.kind == "pod" else "VirtualMachine"
        listed: dict[str, _Known] = {}
        for item in items:
            item.setdefault("kind", kind)
            try:
                got = self._observe(item, False)
            except Exception as exc:  # one unreadable object must not fail the list for all
                await self._reject(item, exc)
                continue
            if got is None:
                continue
            key, obs = got
            await self._publish(key, obs, f"{obs.uid}:{obs.resource_version}")
            listed[obs.uid] = _Known(key, obs.resource_version, _unversioned(obs))
            WATCH_EVENTS.labels(self.kind, "LISTED").inc()
        # deletions the gap hid: published after the listed objects, so a successor under the same
        # name is observed first and the predecessor's gone is judged against it
        for uid, k in sorted(self.known.items()):
            if uid in listed:
                continue
            rv = int(list_rv) if list_rv.isdigit() else k.rv
            obs = Observed(key=str(k.key), uid=uid, resource_version=rv, gone=True)
            await self._publish(k.key, obs, f"{uid}:gone")
            WATCH_EVENTS.labels(self.kind, "GONE").inc()
            log.info("relist: %s uid %s is gone", k.key, uid, extra={"key": str(k.key), "uid": uid})
        self.known = listed
        self.rv = list_rv or None
        self.listed.set()

    # --- watch ----------------------------------------------------------------------------
    async def watch_once(self) -> bool:
        """One watch request from self.rv; True when it ended by its server-side timeout."""
        timeout_s = int(self.watch_timeout_s * random.uniform(1.0, 1.2))
        started = time.monotonic()
        try:
            resp = await self._list_fn(
                *self._args,
                watch=True,
                resource_version=self.rv,
                allow_watch_bookmarks=True,
                timeout_seconds=timeout_s,
                _preload_content=False,
                _request_timeout=aiohttp.ClientTimeout(
                    connect=CONNECT_TIMEOUT_S,
                    sock_connect=CONNECT_TIMEOUT_S,
                    sock_read=timeout_s + READ_SLACK_S,
                ),
            )
        except ApiException as exc:
            if exc.status == 410:
                raise Expired(str(exc.reason)) from exc
            raise StreamError(int(exc.status or 0), str(exc.reason)) from exc
        try:
            if resp.status == 410:
                raise Expired(f"HTTP 410: {(await resp.read())[:200]!r}")
            if resp.status != 200:
                raise StreamError(resp.status, (await resp.read())[:200].decode(errors="replace"))
            async with self._opened:
                self.streams_opened += 1
                self._opened.notify_all()
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                if b"\n" in chunk:
                    # every whole line at once (splitting one line off at a time copied the rest of
                    # a burst's buffer per line); msgspec decodes a pod in half json's time
                    *lines, buf = buf.split(b"\n")
                    await self._events([msgspec.json.decode(line) for line in lines if line.strip()])
                if self.stopping.is_set():
                    return False  # (a cancellation of this loop can be lost: see shared.tasks)
                if len(buf) > MAX_LINE_BYTES:
                    raise StreamError(0, "watch event larger than MAX_LINE_BYTES")
        finally:
            resp.release()
        return time.monotonic() - started >= timeout_s - 1

    async def _events(self, evs: list[JSON]) -> None:
        """A chunk's watch events: the object events between two others (an error, a bookmark)
        published as one run (``_publish_run``)."""
        run: list[tuple[str, JSON]] = []
        for ev in evs:
            etype = str(ev.get("type", ""))
            obj = ev.get("object") or {}
            if etype in ("ADDED", "MODIFIED", "DELETED"):
                run.append((etype, obj))
                continue
            await self._publish_run(run)
            run = []
            if etype == "ERROR":
                code = obj.get("code")
                if code == 410:
                    raise Expired(str(obj.get("message")))
                raise StreamError(int(code or 0), str(obj.get("message")))
            if etype == "BOOKMARK":
                WATCH_EVENTS.labels(self.kind, etype).inc()
            if rv := str((obj.get("metadata") or {}).get("resourceVersion") or ""):
                self.rv = rv
        await self._publish_run(run)

    async def wait_streams(self, more_than: int) -> None:
        """Until more than ``more_than`` watch streams have been opened."""
        async with self._opened:
            await self._opened.wait_for(lambda: self.streams_opened > more_than)

    # --- the loop -------------------------------------------------------------------------
    async def run(self) -> None:
        attempt = 0
        while not self.stopping.is_set():
            started = time.monotonic()
            reason: str
            try:
                if self.rv is None:
                    await self.relist()
                reason = "timeout" if await self.watch_once() else "dropped"
            except Expired as exc:
                log.info("%s watch expired (%s): relisting", self.kind, exc)
                self.rv, reason = None, "expired"
            except StreamError as exc:
                if exc.status == 404 and self.kind == "vm":
                    reason = "missing"
                    if not self.listed.is_set():
                        log.warning("the VirtualMachine CRD is not served (404); retrying")
                        self.listed.set()  # nothing to list: do not block readiness
                    self.rv = None
                else:
                    log.warning("%s watch failed: %s", self.kind, exc)
                    reason = "error"
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("%s watch failed: %r", self.kind, exc)
                reason = "error"
            WATCH_RESTARTS.labels(reason).inc()
            if self.stopping.is_set():
                return
            if reason == "timeout" or time.monotonic() - started >= HEALTHY_STREAM_S:
                attempt = 0
            if reason == "timeout" or (reason == "expired" and attempt == 0):
                attempt += 1 if reason == "expired" else 0  # a second 410 in a row backs off
                continue
            delay = backoff_delay(attempt)
            attempt += 1
            await sleep_unless_set(self.stopping, delay)


async def _read_json(resp: Any) -> JSON:
    try:
        raw = await resp.read()
        status = int(resp.status)
    finally:
        resp.release()
    if status != 200:
        raise StreamError(status, raw[:200].decode(errors="replace"))
    body = msgspec.json.decode(raw)
    return body if isinstance(body, dict) else {}


class Watcher:
    """Pods and VirtualMachines → observations. ``run(ready)`` until ``stop()``; or use it as an
    async context manager (``async with Watcher(...) as w: await w.ready.wait()``)."""

    def __init__(
        self,
        api_client: client.ApiClient,
        js: JetStreamContext,
        subjects: Subjects,
        *,
        namespace: str | None = None,
        watch_timeout_s: int = WATCH_TIMEOUT_S,
    ) -> None:
        self.stopping = asyncio.Event()
        self.loops = [
            ResourceLoop(
                kind,
                api_client,
                js,
                subjects,
                namespace=namespace,
                stopping=self.stopping,
                watch_timeout_s=watch_timeout_s,
            )
            for kind in ("pod", "vm")
        ]
        self.ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def is_ready(self) -> bool:
        return all(loop.listed.is_set() for loop in self.loops)

    async def run(self, ready: asyncio.Event | None = None) -> None:
        tasks = [asyncio.create_task(loop.run(), name=f"watch-{loop.kind}") for loop in self.loops]

        async def signal_ready() -> None:
            for loop in self.loops:
                await loop.listed.wait()
            self.ready.set()
            if ready is not None:
                ready.set()

        tasks.append(asyncio.create_task(signal_ready()))
        stop = asyncio.create_task(self.stopping.wait())
        try:
            await asyncio.wait([stop, *tasks[:-1]], return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_and_wait([*tasks, stop], what="watch loop")

    def stop(self) -> None:
        self.stopping.set()

    async def __aenter__(self) -> Watcher:
        self._task = asyncio.create_task(self.run())
        return self

    async def __aexit__(self, *_exc: object) -> None:
        self.stop()
        if self._task is not None:
            await self._task
