"""Object storage, the global resourceVersion, and the (optionally lagging) watch cache.

One process-wide integer counter orders every write, as etcd's revision does for a real server.
The store itself is always consistent; a :class:`WatchCache` follows it event by event and is
what watches and ``resourceVersion=0`` reads are served from. With the stale-read fault on, the
cache applies events late, which is exactly the staleness a real API server may show.

Stored objects are never mutated in place: every write stores a fresh dict, so events, cache
entries and responses can share references safely (reads hand out the stored objects, uncopied).
A write keeps no reference into the caller's body: what it keeps of it, it deep-copies.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import random
import re
import sqlite3
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from . import podstatus, schema
from .errors import STALE_DETAIL, ApiError, already_exists, conflict, not_found
from .faults import Faults
from .jsontree import decode, deep_copy, encode
from .patch import json_patch, merge_patch, strategic_merge_patch
from .resources import Registry, ResourceType, crd_resource_types, load_vm_crd

Obj = dict[str, Any]
ObjKey = tuple[str, str]  # (namespace, name); namespace "" for cluster-scoped

_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_SUFFIX_CHARS = "bcdfghjklmnpqrstvwxz2456789"
DEFAULT_NAMESPACES = ("default", "kube-system", "kube-node-lease", "kube-public")
SERVER_META = (
    "uid",
    "resourceVersion",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
    "selfLink",
    "managedFields",
)


def now_rfc3339(offset_s: float = 0.0) -> str:
    """Kubernetes timestamp format (second precision, UTC, ``Z``)."""
    return _rfc3339_second(math.floor(time.time() + offset_s))


@functools.lru_cache(maxsize=8)
def _rfc3339_second(second: int) -> str:
    # formatted once per second, not per call: every write stamps its object (managedFields too)
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(second))


def meta(obj: Obj) -> dict[str, Any]:
    m = obj.get("metadata")
    return m if isinstance(m, dict) else {}


def obj_key(obj: Obj) -> ObjKey:
    m = meta(obj)
    return (m.get("namespace") or "", m.get("name") or "")


def _without(obj: Obj, *keys: str) -> Obj:
    return {k: v for k, v in obj.items() if k not in keys}


def _same_ignoring_rv(a: Obj, b: Obj) -> bool:
    return _without(a, "metadata") == _without(b, "metadata") and _without(
        meta(a), "resourceVersion"
    ) == _without(meta(b), "resourceVersion")


@dataclass(frozen=True)
class Event:
    """One committed change; ``prev`` lets selector-filtered watches synthesize ADDED/DELETED."""

    rv: int
    type: str
    key: str
    obj: Obj
    prev: Obj | None
    at: float = field(default_factory=time.monotonic)


Predicate = Callable[[Obj], bool]


class Watcher:
    """One open watch stream's subscription to the cache."""

    def __init__(self, key: str, namespace: str | None, predicate: Predicate, min_rv: int) -> None:
        self.key = key
        self.namespace = namespace
        self.predicate = predicate
        self.min_rv = min_rv
        self.queue: asyncio.Queue[tuple[str, Obj] | None] = asyncio.Queue()
        self.closed = False

    def translate(self, ev: Event) -> tuple[str, Obj] | None:
        """The event as this watcher sees it (selector transitions become ADDED/DELETED)."""
        if ev.key != self.key or ev.rv <= self.min_rv:
            return None
        if self.namespace is not None and meta(ev.obj).get("namespace") != self.namespace:
            return None
        now = self.predicate(ev.obj)
        if ev.type == "MODIFIED":
            before = ev.prev is not None and self.predicate(ev.prev)
            if now and before:
                return ("MODIFIED", ev.obj)
            if now:
                return ("ADDED", ev.obj)
            if before:
                return ("DELETED", ev.obj)
            return None
        return (ev.type, ev.obj) if now else None

    def offer(self, ev: Event) -> None:
        if self.closed:
            return
        item = self.translate(ev)
        if item is not None:
            self.queue.put_nowait(item)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.queue.put_nowait(None)


class WatchCache:
    """A copy of the store that applies events after the configured lag, and fans them out."""

    def __init__(self, faults: Faults, window: int, objects: dict[str, dict[ObjKey, Obj]], rv: int) -> None:
        self.faults = faults
        self.objects: dict[str, dict[ObjKey, Obj]] = {k: dict(v) for k, v in objects.items()}
        self.rv = rv
        self.floor = rv  # every event with rv > floor is in history
        self.history: deque[Event] = deque(maxlen=max(1, window))
        self.pending: deque[Event] = deque()
        self.watchers: set[Watcher] = set()
        self._timer: asyncio.TimerHandle | None = None

    def feed(self, ev: Event) -> None:
        self.pending.append(ev)
        self.pump()

    def pump(self) -> None:
        """Apply every pending event whose lag has elapsed."""
        lag_n, lag_ms = self.faults.stale_events, self.faults.stale_ms
        now = time.monotonic()
        while self.pending:
            head = self.pending[0]
            if len(self.pending) - 1 < lag_n:
                break
            wait_s = lag_ms / 1000.0 - (now - head.at)
            if lag_ms > 0 and wait_s > 0:
                self._schedule(wait_s)
                break
            self.pending.popleft()
            self._apply(head)

    def _schedule(self, delay_s: float) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_later(delay_s + 0.001, self.pump)

    def _apply(self, ev: Event) -> None:
        bucket = self.objects.setdefault(ev.key, {})
        if ev.type == "DELETED":
            bucket.pop(obj_key(ev.obj), None)
        else:
            bucket[obj_key(ev.obj)] = ev.obj
        self.rv = ev.rv
        if len(self.history) == self.history.maxlen:
            self.floor = self.history[0].rv
        self.history.append(ev)
        for w in list(self.watchers):
            w.offer(ev)

    def subscribe(
        self, key: str, namespace: str | None, predicate: Predicate, resource_version: str | None
    ) -> tuple[Watcher, list[tuple[str, Obj]]]:
        """Register a watcher and return the events it must send first.

        Raises ApiError 410 (reason Expired) when ``resource_version`` is older than the window.
        """
        if resource_version in (None, "", "0"):
            w = Watcher(key, namespace, predicate, self.rv)
            initial = [
                ("ADDED", o)
                for k, o in sorted(self.objects.get(key, {}).items())
                if (namespace is None or k[0] == namespace) and predicate(o)
            ]
        else:
            try:
                since = int(resource_version)
            except ValueError as exc:
                raise ApiError(400, f"invalid resourceVersion {resource_version!r}", "BadRequest") from exc
            if since < self.floor:
                raise ApiError(410, f"too old resource version: {since} ({self.floor + 1})", "Expired")
            w = Watcher(key, namespace, predicate, since)
            initial = [item for ev in self.history if (item := w.translate(ev)) is not None]
            w.min_rv = max(since, self.rv)
        self.watchers.add(w)
        return w, initial

    def unsubscribe(self, w: Watcher) -> None:
        self.watchers.discard(w)

    def close_all(self) -> int:
        ws = list(self.watchers)
        for w in ws:
            w.close()
        return len(ws)


class SqlitePersistence:
    """Write-through persistence of objects and the rv counter (synchronous: it is a dev server)."""

    def __init__(self, path: str) -> None:
        self.conn = sqlite3.connect(path)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.execute(
            "CREATE TABLE IF NOT EXISTS objects (res TEXT, ns TEXT, name TEXT, body TEXT,"
            " PRIMARY KEY (res, ns, name))"
        )
        self.conn.execute("CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT)")
        self.conn.commit()

    def load(self) -> tuple[int, dict[str, dict[ObjKey, Obj]]]:
        row = self.conn.execute("SELECT v FROM meta WHERE k='rv'").fetchone()
        rv = int(row[0]) if row else 0
        objects: dict[str, dict[ObjKey, Obj]] = {}
        for res, ns, name, body in self.conn.execute("SELECT res, ns, name, body FROM objects"):
            try:
                obj = decode(body)
            except ValueError:  # written before bodies were decoded strictly (NaN, a lone surrogate)
                obj = json.loads(body)
            objects.setdefault(res, {})[(ns, name)] = obj
        return rv, objects

    def write(self, res: str, key: ObjKey, obj: Obj | None, rv: int) -> None:
        if obj is None:
            self.conn.execute("DELETE FROM objects WHERE res=? AND ns=? AND name=?", (res, *key))
        else:
            self.conn.execute(
                "INSERT OR REPLACE INTO objects VALUES (?, ?, ?, ?)", (res, *key, encode(obj).decode())
            )
        self.conn.execute("INSERT OR REPLACE INTO meta VALUES ('rv', ?)", (str(rv),))
        self.conn.commit()

    def close(self) -> None:
        self.conn.close()


class Store:
    """All objects of all resources, with Kubernetes write semantics."""

    def __init__(
        self, registry: Registry, faults: Faults, window: int = 1000, db_path: str | None = None
    ) -> None:
        self.registry = registry
        self.faults = faults
        self.db = SqlitePersistence(db_path) if db_path else None
        self.rv = 0
        self.objects: dict[str, dict[ObjKey, Obj]] = {}
        if self.db is not None:
            self.rv, self.objects = self.db.load()
        for crd in self.objects.get("customresourcedefinitions.apiextensions.k8s.io", {}).values():
            self._register_crd(crd)
        self.cache = WatchCache(faults, window, self.objects, self.rv)
        self._bootstrap()

    # --- bootstrap ------------------------------------------------------------------------
    def _bootstrap(self) -> None:
        ns_rt = self._rt("", "v1", "namespaces")
        for ns in DEFAULT_NAMESPACES:
            if ("", ns) not in self.objects.get(ns_rt.key, {}):
                self.create(ns_rt, None, {"metadata": {"name": ns}})
        crd_rt = self._rt("apiextensions.k8s.io", "v1", "customresourcedefinitions")
        crd = load_vm_crd()
        if ("", crd["metadata"]["name"]) not in self.objects.get(crd_rt.key, {}):
            self.create(crd_rt, None, crd)

    def _rt(self, group: str, version: str, plural: str) -> ResourceType:
        rt = self.registry.lookup(group, version, plural)
        assert rt is not None, (group, version, plural)
        return rt

    def close(self) -> None:
        if self.db is not None:
            self.db.close()

    # --- commit ---------------------------------------------------------------------------
    def _commit(self, rt: ResourceType, etype: str, obj: Obj, prev: Obj | None) -> Obj:
        """Assign the next rv, store, persist and publish one change; returns the stored object."""
        self.rv += 1
        obj = {**obj, "metadata": {**meta(obj), "resourceVersion": str(self.rv)}}
        bucket = self.objects.setdefault(rt.key, {})
        key = obj_key(obj)
        if etype == "DELETED":
            bucket.pop(key, None)
        else:
            bucket[key] = obj
        if self.db is not None:
            self.db.write(rt.key, key, None if etype == "DELETED" else obj, self.rv)
        if rt.key == "customresourcedefinitions.apiextensions.k8s.io":
            if etype == "DELETED":
                self._unregister_crd(obj)
            else:
                self._register_crd(obj)
        self.cache.feed(Event(self.rv, etype, rt.key, obj, prev))
        return obj

    def _register_crd(self, crd: Obj) -> None:
        try:
            types = crd_resource_types(crd)
        except (KeyError, TypeError):
            return
        for t in types:
            self.registry.remove_group_plural(t.group, t.plural)
        for t in types:
            self.registry.add(t)

    def _unregister_crd(self, crd: Obj) -> None:
        spec = crd.get("spec") or {}
        self.registry.remove_group_plural(spec.get("group", ""), (spec.get("names") or {}).get("plural", ""))

    # --- reads ----------------------------------------------------------------------------
    def _source(self, cached: bool) -> tuple[dict[str, dict[ObjKey, Obj]], int]:
        return (self.cache.objects, self.cache.rv) if cached else (self.objects, self.rv)

    def get(self, rt: ResourceType, namespace: str | None, name: str, cached: bool = False) -> Obj:
        objects, _rv = self._source(cached)
        obj = objects.get(rt.key, {}).get((namespace or "", name))
        if obj is None:
            raise not_found(rt.plural, name, rt.group)
        return obj

    def list(
        self, rt: ResourceType, namespace: str | None, predicate: Predicate, cached: bool = False
    ) -> tuple[list[Obj], int]:
        objects, rv = self._source(cached)
        items = [
            o
            for k, o in sorted(objects.get(rt.key, {}).items())
            if (namespace is None or k[0] == namespace) and predicate(o)
        ]
        return items, rv

    # --- writes ---------------------------------------------------------------------------
    def _check_name(self, rt: ResourceType, name: str) -> None:
        if rt.kind == "Namespace":
            ok, what = len(name) <= 63 and bool(_LABEL.match(name)), "RFC 1123 label"
        else:
            ok, what = len(name) <= 253 and bool(_SUBDOMAIN.match(name)), "RFC 1123 subdomain"
        if not ok:
            raise invalid(
                rt,
                name,
                "metadata.name",
                f'Invalid value: "{name}": a lowercase {what} must consist of lower case alphanumeric '
                "characters, '-' or '.', and must start and end with an alphanumeric character",
            )

    def create(self, rt: ResourceType, namespace: str | None, body: Any) -> Obj:
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object", "BadRequest")
        obj: Obj = deep_copy(body)
        if obj.get("kind") not in (None, "", rt.kind):
            raise ApiError(
                400, f"the kind {obj.get('kind')!r} does not match the URL ({rt.kind})", "BadRequest"
            )
        obj["kind"] = rt.kind
        obj["apiVersion"] = rt.api_version
        m = obj.setdefault("metadata", {})
        if not isinstance(m, dict):
            raise ApiError(400, "metadata must be an object", "BadRequest")
        name = m.get("name") or ""
        if not name and m.get("generateName"):
            name = m["generateName"] + "".join(random.choice(_SUFFIX_CHARS) for _ in range(5))
        if not name:
            raise invalid(rt, "", "metadata.name", "Required value: name or generateName is required")
        self._check_name(rt, name)
        m["name"] = name
        if rt.namespaced:
            ns = namespace or "default"
            if m.get("namespace") not in (None, "", ns):
                raise ApiError(
                    400,
                    "the namespace of the provided object does not match the namespace sent on the request",
                    "BadRequest",
                )
            m["namespace"] = ns
            if ("", ns) not in self.objects.get("namespaces", {}):
                raise not_found("namespaces", ns)
        else:
            m.pop("namespace", None)
        if obj_key(obj) in self.objects.get(rt.key, {}):
            raise already_exists(rt.plural, name, rt.group)
        for k in SERVER_META:
            m.pop(k, None)
        m["uid"] = str(uuid.uuid4())
        m["creationTimestamp"] = now_rfc3339()
        m["generation"] = 1
        self._defaults_on_create(rt, obj)
        return self._commit(rt, "ADDED", obj, None)

    def _defaults_on_create(self, rt: ResourceType, obj: Obj) -> None:
        """The per-type defaulting a real server does (the part clients can observe)."""
        if rt.custom:
            if rt.status_subresource:
                obj.pop("status", None)
            self._validate_custom(rt, obj)
        elif rt.kind == "Pod" and rt.group == "":
            spec = obj.setdefault("spec", {})
            spec.setdefault("restartPolicy", "Always")
            spec.setdefault("terminationGracePeriodSeconds", 30)
            spec.setdefault("dnsPolicy", "ClusterFirst")
            spec.setdefault("schedulerName", "default-scheduler")
            obj["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
        elif rt.kind == "Namespace":
            m = obj["metadata"]
            m["labels"] = {**(m.get("labels") or {}), "kubernetes.io/metadata.name": m["name"]}
            obj["spec"] = {"finalizers": ["kubernetes"]}
            obj["status"] = {"phase": "Active"}
        elif rt.kind == "CustomResourceDefinition":
            spec = obj.get("spec") or {}
            names = spec.get("names") or {}
            obj["status"] = {
                "acceptedNames": names,
                "storedVersions": [v["name"] for v in spec.get("versions") or [] if v.get("storage")],
                "conditions": [
                    {
                        "type": t,
                        "status": "True",
                        "reason": r,
                        "message": msg,
                        "lastTransitionTime": now_rfc3339(),
                    }
                    for t, r, msg in (
                        ("NamesAccepted", "NoConflicts", "no conflicts found"),
                        ("Established", "InitialNamesAccepted", "the initial names have been accepted"),
                    )
                ],
            }

    def _validate_custom(self, rt: ResourceType, obj: Obj) -> None:
        crd = self.objects.get("customresourcedefinitions.apiextensions.k8s.io", {}).get(
            ("", f"{rt.plural}.{rt.group}")
        )
        if crd is None:
            return
        for ver in (crd.get("spec") or {}).get("versions") or []:
            if ver.get("name") == rt.version:
                sch = (ver.get("schema") or {}).get("openAPIV3Schema")
                if sch:
                    errors = schema.validate_and_default(obj, sch, skip=("metadata", "apiVersion", "kind"))
                    if errors:
                        raise invalid(rt, meta(obj).get("name", ""), errors[0][0], errors[0][1], errors)

    def check_preconditions(
        self, rt: ResourceType, cur: Obj, uid: str | None, rv: str | None, for_delete: bool = False
    ) -> None:
        """409 Conflict when a write carries a UID or resourceVersion that is not the stored one."""
        m = meta(cur)
        if uid and uid != m.get("uid"):
            raise conflict(
                rt.plural,
                m["name"],
                f"Precondition failed: UID in precondition: {uid}, UID in object meta: {m.get('uid')}",
                rt.group,
                uid=m.get("uid"),
            )
        if rv and rv != m.get("resourceVersion"):
            detail = (
                f"Precondition failed: ResourceVersion in precondition: {rv}, "
                f"ResourceVersion in object meta: {m.get('resourceVersion')}"
                if for_delete
                else STALE_DETAIL
            )
            raise conflict(rt.plural, m["name"], detail, rt.group, uid=m.get("uid"))

    def update(
        self, rt: ResourceType, namespace: str | None, name: str, body: Any, subresource: str | None = None
    ) -> Obj:
        cur = self.get(rt, namespace, name)
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object", "BadRequest")
        m = body.get("metadata") or {}
        if not isinstance(m, dict):
            raise ApiError(400, "metadata must be an object", "BadRequest")
        if m.get("name") not in (None, name):
            raise ApiError(
                400,
                f"the name of the object ({m.get('name')}) does not match the name on the URL ({name})",
                "BadRequest",
            )
        if rt.namespaced and m.get("namespace") not in (None, "", namespace):
            raise ApiError(
                400,
                "the namespace of the provided object does not match the namespace sent on the request",
                "BadRequest",
            )
        self.check_preconditions(rt, cur, m.get("uid"), m.get("resourceVersion"))
        return self._write(rt, cur, body, subresource)

    def patch(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        content_type: str,
        patch: Any,
        subresource: str | None = None,
    ) -> Obj:
        cur = self.get(rt, namespace, name)
        ctype = content_type.split(";")[0].strip().lower()
        if ctype == "application/merge-patch+json":
            if not isinstance(patch, dict):
                raise ApiError(400, "merge patch must be a JSON object", "BadRequest")
            new = merge_patch(cur, patch)
        elif ctype == "application/strategic-merge-patch+json":
            if not isinstance(patch, dict):
                raise ApiError(400, "strategic merge patch must be a JSON object", "BadRequest")
            if rt.custom:
                raise ApiError(
                    415, "strategic merge patch is not supported for custom resources", "UnsupportedMediaType"
                )
            new = strategic_merge_patch(cur, patch)
        elif ctype == "application/json-patch+json":
            new = json_patch(cur, patch)
        else:
            raise ApiError(
                415,
                f"the development server does not support patch type {ctype!r}",
                "UnsupportedMediaType",
            )
        if not isinstance(new.get("metadata"), dict):
            raise ApiError(422, "patch removed metadata", "Invalid")
        nm = new["metadata"]
        if nm.get("name") != name or (rt.namespaced and nm.get("namespace") != namespace):
            raise ApiError(400, "a patch may not change the name or namespace", "BadRequest")
        self.check_preconditions(rt, cur, nm.get("uid"), nm.get("resourceVersion"))
        return self._write(rt, cur, new, subresource, patching=True)

    def _write(self, rt: ResourceType, cur: Obj, body: Obj, subresource: str | None, patching: bool = False) -> Obj:
        """Shared tail of update and patch: keep server-owned fields, bump generation, commit."""
        cm = meta(cur)
        if subresource == "status":
            # only new's top level and metadata are written below (podstatus.validate only reads), so the
            # rest may be shared with cur, which is stored and so never mutated
            new = {**cur, "metadata": dict(cm)}
            if "status" in body:
                new["status"] = deep_copy(body["status"])
            else:
                new.pop("status", None)
            if rt.kind == "Pod" and rt.group == "":
                # the real pod status strategy keeps only the spec, ownerReferences and deletion
                # fields of the stored pod: labels and annotations are written through pods/status
                bm = body.get("metadata") or {}
                for k in ("labels", "annotations"):
                    if isinstance(bm.get(k), dict):
                        new["metadata"][k] = deep_copy(bm[k])
                    else:
                        new["metadata"].pop(k, None)
                self._validate_pod_status(rt, cur, new, patching)
        elif subresource is not None:
            raise ApiError(405, f"subresource {subresource!r} does not support this verb", "MethodNotAllowed")
        else:
            new = deep_copy(body)
            new["apiVersion"], new["kind"] = cur["apiVersion"], cur["kind"]
            nm = new.setdefault("metadata", {})
            for k in (
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "generation",
                "name",
                "namespace",
            ):
                if k in cm:
                    nm[k] = cm[k]
                else:
                    nm.pop(k, None)
            if rt.status_subresource or (rt.kind == "Pod" and rt.group == ""):
                if "status" in cur:
                    new["status"] = deep_copy(cur["status"])
                else:
                    new.pop("status", None)
            if _without(new, "metadata", "status", "apiVersion", "kind") != _without(
                cur, "metadata", "status", "apiVersion", "kind"
            ):
                nm["generation"] = int(cm.get("generation") or 0) + 1
            if cm.get("deletionTimestamp"):
                added = set(nm.get("finalizers") or []) - set(cm.get("finalizers") or [])
                if added:
                    raise invalid(
                        rt,
                        cm["name"],
                        "metadata.finalizers",
                        f"Forbidden: no new finalizers can be added if the object is being deleted, "
                        f"found new finalizers {sorted(added)}",
                    )
            if rt.custom:
                self._validate_custom(rt, new)
        nm = new["metadata"]
        nm["resourceVersion"] = cm.get("resourceVersion")
        if _same_ignoring_rv(new, cur):
            return cur  # a no-op write does not create a new resourceVersion, as on a real server
        if (
            nm.get("deletionTimestamp")
            and not nm.get("finalizers")
            and (not self._graceful(rt) or nm.get("deletionGracePeriodSeconds", 0) == 0)
        ):
            return self._commit(rt, "DELETED", new, cur)
        return self._commit(rt, "MODIFIED", new, cur)

    @staticmethod
    def _validate_pod_status(rt: ResourceType, cur: Obj, new: Obj, patching: bool) -> None:
        """As the real server: a status that does not decode is 400 for an update and 422 (naming
        the patch) for a patch; a status it refuses is 422 with its field errors."""
        name = meta(cur).get("name", "")
        try:
            errors = podstatus.validate(new, cur)
        except podstatus.StatusDecodeError as exc:
            if patching:
                raise ApiError(422, f' "" is invalid: patch: Invalid value: "...": {exc}', "Invalid") from exc
            raise ApiError(400, str(exc), "BadRequest") from exc
        if errors:
            raise invalid(rt, name, errors[0][0], errors[0][1], errors)

    def bind(self, rt: ResourceType, namespace: str | None, name: str, body: Any) -> Obj:
        """``POST pods/<name>/binding`` with the real server's semantics (BindingREST): the name
        must match, ``target.name`` is required, the Binding's ``metadata.uid`` / ``resourceVersion``
        are preconditions (409), and a pod that is being deleted or already has a ``nodeName`` is
        refused with 409 Conflict on ``pods/binding``: a binding never moves a bound pod. It sets
        ``spec.nodeName``, merges the Binding's annotations and sets ``PodScheduled=True``."""
        if rt.kind != "Pod" or rt.group != "":
            raise ApiError(404, "the server could not find the requested resource", "NotFound")
        if not isinstance(body, dict) or body.get("kind") not in (None, "Binding"):
            raise ApiError(400, f"not a Binding object: {str(body)[:200]}", "BadRequest")
        m = body.get("metadata") or {}
        if not isinstance(m, dict) or m.get("name") != name:
            raise ApiError(400, "name in URL does not match name in Binding object", "BadRequest")
        target = body.get("target") or {}
        node = target.get("name") if isinstance(target, dict) else None
        if not isinstance(node, str) or not node:
            raise invalid(rt, name, "target.name", "Required value")
        if target.get("kind") not in (None, "", "Node"):
            raise invalid(rt, name, "target.kind", f"Not found: {target.get('kind')!r}")
        cur = self.get(rt, namespace, name)
        self.check_preconditions(rt, cur, m.get("uid"), m.get("resourceVersion"), for_delete=True)
        cm = meta(cur)
        if cm.get("deletionTimestamp"):
            raise conflict("pods/binding", name, f"pod {name} is being deleted, cannot be assigned to a host")
        bound = (cur.get("spec") or {}).get("nodeName")
        if bound:
            raise conflict("pods/binding", name, f"pod {name} is already assigned to node {bound!r}".replace("'", '"'))
        new = deep_copy(cur)
        new.setdefault("spec", {})["nodeName"] = node
        ann = m.get("annotations")
        if isinstance(ann, dict) and ann:
            new["metadata"].setdefault("annotations", {}).update({str(k): str(v) for k, v in ann.items()})
        status = new.setdefault("status", {})
        conds = [c for c in status.get("conditions") or [] if isinstance(c, dict) and c.get("type") != "PodScheduled"]
        status["conditions"] = [*conds, {"type": "PodScheduled", "status": "True", "lastProbeTime": None,
                                         "lastTransitionTime": now_rfc3339()}]
        return self._commit(rt, "MODIFIED", new, cur)

    @staticmethod
    def _graceful(rt: ResourceType) -> bool:
        return rt.kind == "Pod" and rt.group == ""

    def delete(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        options: dict[str, Any] | None = None,
    ) -> Obj:
        """Delete per DeleteOptions: preconditions, grace period (pods), finalizers."""
        cur = self.get(rt, namespace, name)
        options = options or {}
        pre = options.get("preconditions") or {}
        self.check_preconditions(rt, cur, pre.get("uid"), pre.get("resourceVersion"), for_delete=True)
        cm = meta(cur)
        grace = 0
        if self._graceful(rt):
            g = options.get("gracePeriodSeconds")
            if g is None:
                g = (cur.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
            grace = max(0, int(g))
        finalizers = cm.get("finalizers") or []
        if cm.get("deletionTimestamp"):
            old_grace = int(cm.get("deletionGracePeriodSeconds") or 0)
            if grace >= old_grace:
                return cur  # an ongoing deletion is only ever shortened, never extended
        if grace == 0 and not finalizers:
            if rt.kind == "Namespace":
                self._purge_namespace(name)
            return self._commit(rt, "DELETED", cur, cur)
        new = {**cur, "metadata": dict(cm)}  # only metadata is written below
        nm = new["metadata"]
        nm["deletionTimestamp"] = now_rfc3339(grace)
        nm["deletionGracePeriodSeconds"] = grace
        if not cm.get("deletionTimestamp"):
            nm["generation"] = int(cm.get("generation") or 0) + 1
        return self._commit(rt, "MODIFIED", new, cur)

    def _purge_namespace(self, ns: str) -> None:
        """Delete a namespace's contents immediately (no Terminating phase in the dev server)."""
        for rt_key, bucket in list(self.objects.items()):
            for key, obj in sorted(bucket.items()):
                if key[0] == ns:
                    rt = self._rt_for_key(rt_key)
                    if rt is not None:
                        self._commit(rt, "DELETED", obj, obj)

    def _rt_for_key(self, key: str) -> ResourceType | None:
        for rt in self.registry.types.values():
            if rt.key == key:
                return rt
        return None

    def all_objects(self) -> Iterable[tuple[str, Obj]]:
        for key, bucket in self.objects.items():
            for obj in bucket.values():
                yield key, obj


def invalid(
    rt: ResourceType, name: str, field_path: str, detail: str, causes: list[tuple[str, str]] | None = None
) -> ApiError:
    """422 Invalid in the real server's wording (``Pod "x" is invalid: field: detail``)."""
    err = ApiError(
        422,
        f'{rt.kind} "{name}" is invalid: {field_path}: {detail}',
        "Invalid",
        name=name,
        kind=rt.kind,
        group=rt.group,
    )
    err.causes = [  # type: ignore[attr-defined]
        {"reason": "FieldValueInvalid", "message": d, "field": f}
        for f, d in (causes or [(field_path, detail)])
    ]
    return err
