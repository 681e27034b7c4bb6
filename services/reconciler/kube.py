"""The Kubernetes side of the reconciler's effects: consistent reads and fenced writes.

``KubeGateway`` is what the reconciler calls; :class:`K8sGateway` implements it over the raw JSON
API with kubernetes-asyncio's configuration, credentials and session, by path
(:class:`shared.kubeclient.Requests`); :class:`NullGateway` without any Kubernetes (benchmarks).

Rules this module keeps (DESIGN.md, "Kubernetes side" and rules 3, 4 and 6):

- ``confirm`` is a *consistent* read: a GET with no ``resourceVersion`` parameter — never
  ``resourceVersion=0``, never a list or an informer cache, which may lag.
- Every write carries the incarnation: ``metadata.uid`` in patch bodies, ``preconditions.uid`` in
  deletes and evictions. A write never lands on a successor that reuses the name.
- Errors mean different things (rule 6). After a 409 (or 422) on a UID-carrying write the object
  is re-read with a consistent GET: a different uid → ``superseded``; no object → ``gone``; the same
  uid → it was a resourceVersion conflict, and the *intended* change (the ``PodStatusIntent``) is
  rebuilt against the fresh object and sent again — the fresh object is never re-sent unchanged —
  at most ``CONFLICT_ATTEMPTS`` times. 404 → ``gone``. 429/5xx/transport errors/timeouts are
  retried with bounded backoff (``TRANSIENT_ATTEMPTS``), then the outcome is ``failed``. A 422 whose
  re-read shows the *same* uid is our own invalid body, reported as ``failed`` (not as
  ``superseded``, which would tombstone a live incarnation).
- Status writes are built from the current object plus the intent and sent as a merge patch
  carrying both ``metadata.uid`` and ``metadata.resourceVersion``: a concurrent change makes the
  write fail with 409 instead of silently overwriting it, and the retry re-applies the intent to
  the object the 409's consistent re-read returned. Unchanged status or annotations are not
  written at all.
- The current object is the one the key's last successful consistent read or write returned
  (a patch answers with the updated object), kept per key (:class:`_LastSeen`, at most
  ``LAST_SEEN_MAX`` objects, least recently used dropped first); without one, a consistent GET.
  A confirm's read of a pod not yet bound to a node is not kept: its binding (a scheduler's or
  ours) changes it before any status write, so keeping it would only buy a 409.
  It is used only for its own incarnation (uid == the fence's uid), taken out while a write is
  in flight and put back only on success, and dropped after a delete, an eviction, a binding, or
  any outcome but ``ok``. It is trusted only through the status patch's resourceVersion
  precondition: a stale one gets a 409 (or 404 when the pod is gone) and the path above. When
  the status it shows already matches the intent, nothing would carry that precondition, so the
  object is read again consistently instead: "unchanged" is never judged from memory.
- Events never change a decision: outcome ``ok`` or ``failed``, failures only logged. An event's
  name is derived from the write id so a retried event is created once.

The caller counts outcomes (``vmfence_k8s_writes_total``); this module does not, to avoid
double counting. Every call is bounded by ``call_timeout_s`` overall and ``request_timeout_s`` per request.
``confirm`` raises :class:`KubeUnavailable` when no answer could be had (rule 12: the caller
re-checks later; it never decides on a guess).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import aiohttp
import msgspec
from kubernetes_asyncio import client

from services.reconciler.status import (
    ANN_NETWORK,
    JSON,
    merge_diff,
    meta,
    now_rfc3339,
    pod_status,
    runtime_annotations,
    vm_status,
)
from shared import kubeclient
from shared.fence.keys import Key
from shared.fence.podspec import VM_GROUP, VM_PLURAL, VM_VERSION, spec_of_pod, spec_of_vm
from shared.fence.schema import ConfirmedRead, Fence, KubeWrite, PodStatusIntent, Spec, WriteDone

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 10.0  # one HTTP request
CALL_TIMEOUT_S = 30.0  # one confirm() or write(), all retries included
TRANSIENT_ATTEMPTS = 5  # tries of one request on 429/5xx/transport errors
CONFLICT_ATTEMPTS = 5  # re-read + re-apply rounds after resourceVersion conflicts
LAST_SEEN_MAX = 1024  # objects kept for the next status write of their key (LRU past it): ~10 KiB each
# for a development-server pod (more with a real server's managedFields); the pods between their binding
# and their Running write at the fleet bench's rates are a few hundred
BACKOFF_BASE_S = 0.05
BACKOFF_MAX_S = 2.0
TRANSIENT_CODES = frozenset({0, 429, 500, 502, 503, 504})  # 0: transport error or request timeout

MERGE_PATCH = "application/merge-patch+json"
COMPONENT = "vmfence"



NAMESPACE_TERMINATING = "because it is being terminated"  # NamespaceLifecycle admission's refusal
DEV_SERVER_MARK = "-vmfence-dev"  # in the development server's gitVersion (services/apiserver)


def _object_path(key: Key, *sub: str) -> str:
    """The API path of the key's object (a pod, or a VirtualMachine), or of its subresource."""
    if key.kind == "pod":
        return kubeclient.path_of("api", "v1", "namespaces", key.namespace, "pods", key.name, *sub)
    return kubeclient.path_of("apis", VM_GROUP, VM_VERSION, "namespaces", key.namespace, VM_PLURAL, key.name, *sub)


class KubeGateway(Protocol):
    async def confirm(self, key: Key, request: str) -> ConfirmedRead: ...

    async def write(self, key: Key, write: KubeWrite) -> WriteDone: ...

    async def close(self) -> None: ...


class KubeError(Exception):
    """A non-2xx answer (``status`` 0: transport error or timeout)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class KubeUnavailable(Exception):
    """``confirm`` could not get a consistent answer within its bounds."""


def backoff_delay(attempt: int) -> float:
    cap = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2.0 ** min(attempt, 16))
    return cap / 2 + random.uniform(0, cap / 2)


async def load_api_client(kubeconfig: str | None) -> client.ApiClient:
    """An ApiClient from a kubeconfig file, or from the in-cluster service account when None."""
    return await kubeclient.load_api_client(kubeconfig)


# ---------------------------------------------------------------------------------- the gateway


class _LastSeen:
    """Per key, the object the last successful consistent read or write returned, for the key's
    next status write (bounded: at most ``limit`` keys, least recently used dropped first)."""

    def __init__(self, limit: int = LAST_SEEN_MAX) -> None:
        self.limit = max(0, limit)
        self._objs: OrderedDict[Key, JSON] = OrderedDict()

    def __len__(self) -> int:
        return len(self._objs)

    def keep(self, key: Key, obj: JSON) -> None:
        if not meta(obj).get("uid") or not meta(obj).get("resourceVersion"):
            self._objs.pop(key, None)
            return
        self._objs[key] = obj
        self._objs.move_to_end(key)
        while len(self._objs) > self.limit:
            self._objs.popitem(last=False)

    def take(self, key: Key, uid: str) -> JSON | None:
        """The key's object if it is of incarnation ``uid``; removed either way (a write in flight
        puts back only what it got on success)."""
        obj = self._objs.pop(key, None)
        return obj if obj is not None and meta(obj).get("uid") == uid else None

    def drop(self, key: Key) -> None:
        self._objs.pop(key, None)


def _unanswered(exc: BaseException | None) -> bool:
    """The API server did not answer (after ``_retrying``'s bounded tries): not a refusal."""
    return isinstance(exc, KubeError) and exc.status in TRANSIENT_CODES


class _Outcome(Exception):
    """Internal: ends a write with this outcome."""

    def __init__(self, outcome: str, detail: str | None = None, node: str | None = None) -> None:
        super().__init__(outcome)
        self.outcome = outcome
        self.detail = detail
        self.node = node  # a binding's answer: the node the pod is bound to


class K8sGateway:
    """kubernetes-asyncio implementation of :class:`KubeGateway` (one per reconciler process).

    ``host_ip`` maps an agent host name to the IP from its heartbeat (for ``status.hostIP``);
    without it hostIP stays unset. Safe for concurrent calls on different keys; calls on one key
    are expected to be serialized by the reconciler (one writer per key).
    """

    def __init__(
        self,
        api_client: client.ApiClient,
        *,
        owns_client: bool = False,
        host_ip: Callable[[str], str | None] | None = None,
        host_network: Callable[[str], str | None] | None = None,
        instance: str = "",
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        call_timeout_s: float = CALL_TIMEOUT_S,
        last_seen_max: int = LAST_SEEN_MAX,
    ) -> None:
        self.api = api_client
        self.http = kubeclient.Requests(api_client)
        self._owns = owns_client
        self.host_ip = host_ip
        self.host_network = host_network  # host -> its heartbeat's pod network (bridge | user | none)
        self.instance = instance
        self.request_timeout_s = request_timeout_s
        self.call_timeout_s = call_timeout_s
        self.last_seen = _LastSeen(last_seen_max)

    @classmethod
    async def connect(cls, kubeconfig: str | None = None, **kwargs: Any) -> K8sGateway:
        """From a kubeconfig path, or in-cluster when None; the gateway owns the client."""
        return cls(await load_api_client(kubeconfig), owns_client=True, **kwargs)

    async def close(self) -> None:
        if self._owns:
            await self.api.close()

    async def git_version(self) -> str:
        """The API server's ``/version`` gitVersion ("" when it cannot be read in time)."""
        try:
            async with asyncio.timeout(self.call_timeout_s):
                body = await self._retrying("GET", "/version")
        except (KubeError, TimeoutError) as exc:
            log.warning("cannot read the API server's version: %s", exc)
            return ""
        return str(body.get("gitVersion") or "")

    # --- requests -------------------------------------------------------------------------
    async def _request(self, method: str, path: str, body: JSON | None = None, *,
                       content_type: str = kubeclient.JSON_TYPE, query: dict[str, str | int] | None = None) -> JSON:
        """One HTTP request, raw JSON back; KubeError on any non-2xx or transport failure."""
        try:
            status, raw = await self.http.send(method, path, body=body, content_type=content_type, query=query,
                                               timeout_s=self.request_timeout_s)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise KubeError(0, "Transport", repr(exc)) from exc
        try:
            body = msgspec.json.decode(raw) if raw.strip() else {}  # half of json.loads's cost
        except msgspec.DecodeError:
            body = {"message": raw[:200].decode(errors="replace")}
        if not 200 <= status <= 299:
            raise KubeError(status, str(body.get("reason", "")), str(body.get("message", "")))
        return body if isinstance(body, dict) else {}

    async def _retrying(self, method: str, path: str, body: JSON | None = None, **kwargs: Any) -> JSON:
        """``_request`` with bounded retries on 429/5xx/transport errors."""
        attempt = 0
        while True:
            try:
                return await self._request(method, path, body, **kwargs)
            except KubeError as exc:
                attempt += 1
                if exc.status not in TRANSIENT_CODES or attempt >= TRANSIENT_ATTEMPTS:
                    raise
                log.info("kubernetes request failed (%s), retrying", exc)
                await asyncio.sleep(backoff_delay(attempt - 1))

    async def _get(self, key: Key) -> JSON | None:
        """Consistent read: GET with no resourceVersion. None when the object does not exist."""
        try:
            return await self._retrying("GET", _object_path(key))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    # --- confirm --------------------------------------------------------------------------
    async def confirm(self, key: Key, request: str) -> ConfirmedRead:
        try:
            async with asyncio.timeout(self.call_timeout_s):
                obj = await self._get(key)
        except (KubeError, TimeoutError) as exc:
            raise KubeUnavailable(f"confirm {key}: {exc!r}") from exc
        if obj is None:
            self.last_seen.drop(key)
            return ConfirmedRead(key=str(key), request=request, uid=None)
        if key.kind == "pod" and not (obj.get("spec") or {}).get("nodeName"):
            self.last_seen.drop(key)  # a scheduler (or our own binding) changes it next: not worth keeping
        else:
            self.last_seen.keep(key, obj)
        spec, invalid = spec_of_pod(obj) if key.kind == "pod" else spec_of_vm(obj)
        m = meta(obj)
        try:
            rv = int(str(m.get("resourceVersion")))
        except ValueError:
            rv = 0
        return ConfirmedRead(
            key=str(key),
            request=request,
            uid=str(m.get("uid") or "") or None,
            resource_version=rv,
            deleting=bool(m.get("deletionTimestamp")),
            spec=spec,
            invalid=invalid,
        )

    # --- write ----------------------------------------------------------------------------
    async def write(self, key: Key, write: KubeWrite) -> WriteDone:
        outcome, detail, node, unanswered = "failed", None, None, False
        try:
            async with asyncio.timeout(self.call_timeout_s):
                if not write.fence.uid:
                    raise _Outcome("failed", "write without a uid fence refused")
                if write.verb == "bind":
                    node = await self._bind(key, write)
                elif write.verb == "status":
                    await self._write_status(key, write)
                elif write.verb == "evict":
                    await self._evict(key, write.fence)
                elif write.verb == "delete":
                    await self._delete(key, write.fence)
                elif write.verb == "event":
                    await self._event(key, write)
                else:
                    raise _Outcome("failed", f"unknown verb {write.verb!r}")
                outcome = "ok"
        except _Outcome as out:
            outcome, detail, node = out.outcome, out.detail, out.node
            unanswered = outcome == "failed" and _unanswered(out.__cause__)
        except KubeError as exc:
            outcome, detail, unanswered = "failed", str(exc), _unanswered(exc)
        except TimeoutError:
            outcome, detail, unanswered = "failed", f"timed out after {self.call_timeout_s}s", True
        if write.verb != "event" and (write.verb != "status" or outcome != "ok"):
            # a delete, eviction or binding changed (or removed) the object; any other outcome
            # than ok leaves nothing worth trusting: the next status write reads it again
            self.last_seen.drop(key)
        if write.verb == "event" and outcome != "ok":
            # an Event in a namespace being deleted is refused by the real server's NamespaceLifecycle
            # admission (403 "... because it is being terminated"): expected while its pods end
            terminating = NAMESPACE_TERMINATING in (detail or "")
            (log.info if terminating else log.warning)(
                "event %s for %s not written: %s", write.event_reason, key, detail, extra={"key": str(key)})
            outcome = "failed"
        return WriteDone(fence=write.fence, write_id=write.id, outcome=outcome, detail=detail,  # type: ignore[arg-type]
                         node=node, unanswered=unanswered)

    async def _bind(self, key: Key, write: KubeWrite) -> str:
        """``pods/binding`` to ``write.node``, as a scheduler binds (the Binding's uid is the
        incarnation's: a precondition). A 409 is read back consistently: another uid → superseded,
        no pod → gone, the pod already on our node → ok (a retry of a binding whose answer was
        lost), on another node → failed naming that node (the VM goes there or nowhere)."""
        if key.kind != "pod" or not write.node:
            raise _Outcome("failed", "only a pod is bound, and only to a named node")
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": key.name, "namespace": key.namespace, "uid": write.fence.uid},
            "target": {"apiVersion": "v1", "kind": "Node", "name": write.node},
        }
        try:
            await self._retrying("POST", _object_path(key, "binding"), body)
            return write.node
        except KubeError as exc:
            if exc.status == 404:
                raise _Outcome("gone", str(exc)) from exc
            if exc.status not in (409, 422):
                raise
            fresh = self._current(await self._get(key), write.fence)
            bound = (fresh.get("spec") or {}).get("nodeName")
            if bound == write.node:
                return write.node
            if isinstance(bound, str) and bound:
                raise _Outcome("failed", f"already bound to {bound}", node=bound) from exc
            raise _Outcome("failed", f"binding refused: {exc}") from exc

    async def _classify(self, key: Key, fence: Fence, exc: KubeError) -> JSON:
        """After a 409/422 on a UID-carrying write: re-read consistently and name the outcome.

        Raises _Outcome(superseded|gone) when another incarnation owns the name or nothing does;
        returns the fresh object when the uid still matches (a resourceVersion conflict: re-apply
        the intent to it)."""
        fresh = await self._get(key)
        if fresh is None:
            raise _Outcome("gone", f"{exc.status} {exc.reason}, then not found")
        uid = meta(fresh).get("uid")
        if uid != fence.uid:
            raise _Outcome("superseded", f"{exc.status} {exc.reason}: {key} is now uid {uid}")
        return fresh

    def _current(self, obj: JSON | None, fence: Fence) -> JSON:
        if obj is None:
            raise _Outcome("gone", "not found")
        uid = meta(obj).get("uid")
        if uid != fence.uid:
            raise _Outcome("superseded", f"uid is now {uid}")
        return obj

    async def _write_status(self, key: Key, write: KubeWrite) -> None:
        intent = write.status
        if intent is None:
            raise _Outcome("failed", "status write without a status intent")
        fence = write.fence
        # the object this incarnation's last read or write returned: usable only when the status
        # patch it leads to carries its resourceVersion (a stale one then gets a 409 or a 404)
        obj = self.last_seen.take(key, fence.uid)
        diff = self._status_diff(key, obj, intent, fence) if obj is not None else {}
        if not diff:
            obj = None
        for _round in range(CONFLICT_ATTEMPTS):
            if obj is None:
                obj = self._current(await self._get(key), fence)
                diff = self._status_diff(key, obj, intent, fence)
            try:
                latest = await self._apply_status(key, obj, diff, fence)
            except KubeError as exc:
                if exc.status == 404:
                    raise _Outcome("gone", str(exc)) from exc
                if exc.status not in (409, 422):
                    raise
                obj = await self._classify(key, fence, exc)
                if exc.status == 422:
                    raise _Outcome("failed", f"rejected as invalid: {exc.message}") from exc
                log.info("status of %s: resourceVersion conflict, re-applying the intent", key)
                diff = self._status_diff(key, obj, intent, fence)
                continue
            self.last_seen.keep(key, latest)
            return
        raise _Outcome("failed", f"still conflicting after {CONFLICT_ATTEMPTS} re-reads")

    def _status_diff(self, key: Key, obj: JSON, intent: PodStatusIntent, fence: Fence) -> JSON:
        """The merge patch that turns ``obj`` into the intended status: its ``status`` and, for a
        pod, the runtime annotations under ``metadata`` (a pods/status write changes a pod's
        annotations on the real kube-apiserver, so both go in one request). Empty: nothing to write."""
        cur = obj.get("status") or {}
        if key.kind != "pod":
            status = merge_diff(cur, vm_status(obj, intent, fence.epoch))
            return {"status": status} if status else {}
        host_ip = self.host_ip(intent.host) if self.host_ip and intent.host else None
        patch: JSON = {}
        status = merge_diff(cur, pod_status(obj, intent, host_ip))
        if status:
            patch["status"] = status
        have = meta(obj).get("annotations") or {}
        network = self.host_network(intent.host) if self.host_network and intent.host else None
        want_ann = runtime_annotations(intent, fence.epoch)
        want_ann[ANN_NETWORK] = network if network in ("user", "none") and intent.ip is None else None
        ann = {k: v for k, v in want_ann.items() if have.get(k) != v}
        if ann:
            patch["metadata"] = {"annotations": ann}
        return patch

    async def _apply_status(self, key: Key, obj: JSON, diff: JSON, fence: Fence) -> JSON:
        """One merge patch of the status subresource by ``diff``, under the uid and resourceVersion
        of ``obj``. Returns the object as the server left it (``obj`` itself when ``diff`` is empty)."""
        if not diff:
            return obj
        precondition = {"uid": fence.uid, "resourceVersion": meta(obj).get("resourceVersion")}
        body = {**diff, "metadata": {**diff.get("metadata", {}), **precondition}}
        return await self._retrying("PATCH", _object_path(key, "status"), body, content_type=MERGE_PATCH)

    async def _deleting_write(self, key: Key, fence: Fence, send: Callable[[], Awaitable[JSON]]) -> None:
        for _round in range(CONFLICT_ATTEMPTS):
            try:
                await send()
                return
            except KubeError as exc:
                if exc.status == 404:
                    raise _Outcome("gone", str(exc)) from exc
                if exc.status not in (409, 422):
                    raise
                await self._classify(key, fence, exc)
                if exc.status == 422:
                    raise _Outcome("failed", f"rejected as invalid: {exc.message}") from exc
        raise _Outcome("failed", f"still conflicting after {CONFLICT_ATTEMPTS} attempts")

    async def _evict(self, key: Key, fence: Fence) -> None:
        if key.kind != "pod":
            raise _Outcome("failed", "eviction is not defined for VirtualMachine objects")
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": key.name, "namespace": key.namespace},
            "deleteOptions": {"preconditions": {"uid": fence.uid}},
        }
        await self._deleting_write(
            key,
            fence,
            lambda: self._retrying("POST", _object_path(key, "eviction"), body),
        )

    async def _delete(self, key: Key, fence: Fence) -> None:
        """Final deletion, as a kubelet does: grace 0 with the uid precondition."""
        if key.kind == "pod":
            body: JSON = {"gracePeriodSeconds": 0, "preconditions": {"uid": fence.uid}}
            query: dict[str, str | int] | None = {"gracePeriodSeconds": 0}
        else:
            body, query = {"preconditions": {"uid": fence.uid}}, None
        await self._deleting_write(key, fence, lambda: self._retrying("DELETE", _object_path(key), body, query=query))

    async def _event(self, key: Key, write: KubeWrite) -> None:
        """One Event per (incarnation, type, reason, message), as a kubelet's recorder aggregates:
        ``write.count`` says which repeat of that text this is (decide counts them: a failed bring-up's
        cause, repeated in a row). The first write creates the Event; a later repeat finds it and sets
        ``count`` and ``lastTimestamp`` on it, so a redelivered write changes nothing and no read
        (no ``get`` permission) is needed."""
        digest = hashlib.sha256(
            "/".join((write.fence.uid, write.event_type, write.event_reason or "", write.message or "")).encode()
        ).hexdigest()[:16]
        name = f"{key.name[:200]}.{digest}"
        now = now_rfc3339()
        involved: JSON = {
            "kind": "Pod" if key.kind == "pod" else "VirtualMachine",
            "apiVersion": "v1" if key.kind == "pod" else f"{VM_GROUP}/{VM_VERSION}",
            "namespace": key.namespace,
            "name": key.name,
            "uid": write.fence.uid,
        }
        body: JSON = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": key.namespace},
            "involvedObject": involved,
            "reason": write.event_reason or "Vmfence",
            "message": write.message or "",
            "type": write.event_type,
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.instance or COMPONENT,
            "count": write.count,
            "firstTimestamp": now,
            "lastTimestamp": now,
        }
        try:
            await self._retrying("POST", kubeclient.path_of("api", "v1", "namespaces", key.namespace, "events"), body)
            return
        except KubeError as exc:
            if exc.status != 409:
                raise _Outcome("failed", str(exc)) from exc
        if write.count <= 1:
            return  # AlreadyExists for a first occurrence: a retry of this very event
        try:
            await self._retrying(
                "PATCH", kubeclient.path_of("api", "v1", "namespaces", key.namespace, "events", name),
                {"count": write.count, "lastTimestamp": now}, content_type=MERGE_PATCH,
            )
        except KubeError as exc:
            raise _Outcome("failed", str(exc)) from exc


# ------------------------------------------------------------------------------------- no k8s


class NullGateway:
    """No Kubernetes (benchmarks): confirm answers from ``objects`` ({key: (uid, rv, spec)}, keys
    as :class:`Key` or their string form), every write succeeds and is counted."""

    def __init__(self, objects: dict[Any, tuple[str, int, Spec]] | None = None, *, keep_last: int = 1000) -> None:
        self.objects: dict[Any, tuple[str, int, Spec]] = objects if objects is not None else {}
        self.counts: Counter[str] = Counter()
        self.last_writes: deque[tuple[Key, KubeWrite]] = deque(maxlen=keep_last)

    async def confirm(self, key: Key, request: str) -> ConfirmedRead:
        found = self.objects.get(key) or self.objects.get(str(key))
        if found is None:
            return ConfirmedRead(key=str(key), request=request, uid=None)
        uid, rv, spec = found
        return ConfirmedRead(key=str(key), request=request, uid=uid, resource_version=rv, spec=spec)

    async def write(self, key: Key, write: KubeWrite) -> WriteDone:
        self.counts[write.verb] += 1
        self.last_writes.append((key, write))
        return WriteDone(fence=write.fence, write_id=write.id, outcome="ok")

    async def close(self) -> None:
        return None
