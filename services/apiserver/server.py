"""vmfence development Kubernetes API server (aiohttp).

THIS IS A DEVELOPMENT SERVER, NOT A PRODUCTION KUBERNETES API. It exists so that vmfence (and
its tests and demo) run without a cluster. It speaks the real REST + watch protocol that
kubernetes-asyncio and kubectl use: discovery, namespaces, pods (+status, eviction, binding), nodes,
leases, events, the VirtualMachine CRD and CustomResourceDefinitions; one global
resourceVersion; 409 on stale or UID-mismatched writes and on DeleteOptions preconditions;
deletionTimestamp with grace periods and finalizers; label/field selectors; watches with
bookmarks and 410 Expired for versions older than the event window; optional SQLite
persistence; and fault injection (see :mod:`services.apiserver.faults`). There is no
authentication, authorization, admission, scheduling, garbage collection or protobuf.

It imports nothing from the rest of vmfence on purpose: it stands in for a foreign system.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sqlite3
import sys
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import yaml
from aiohttp import web

from . import jsontree, openapi, tables
from .errors import ApiError
from .faults import Faults
from .podlogs import KubeletClient, PodLogs
from .resources import Registry, ResourceType
from .selectors import field_selector, label_selector
from .store import Obj, Store, Watcher

SERVER_VERSION = {
    "major": "1",
    "minor": "35",
    "gitVersion": "v1.35.0-vmfence-dev",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2025-01-01T00:00:00Z",
    "goVersion": "go1.24.0",
    "compiler": "gc",
    "platform": "linux/amd64",
}
WRITE_VERBS = frozenset({"create", "update", "patch", "delete"})
# events already queued for a watch go out in one write, up to this many (a write per event was a
# fifth of the server's CPU in the fleet bench)
WATCH_BATCH = 256


@dataclass
class ApiServerConfig:
    """Listening address, optional SQLite file, watch event window and bookmark period."""

    host: str = "127.0.0.1"
    port: int = 0
    db_path: str | None = None
    watch_window: int = 1000
    bookmark_interval_s: float = 5.0
    # pods/log is proxied to the node's kubelet endpoint with this client certificate; the kubelet
    # CA checks the agents' serving certificates (services/apiserver/podlogs.py)
    kubelet_client_cert: str | None = None
    kubelet_client_key: str | None = None
    kubelet_ca: str | None = None


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=jsontree.encode(data),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def _error_response(err: ApiError) -> web.Response:
    body = err.status()
    causes = getattr(err, "causes", None)
    if causes:
        body.setdefault("details", {})["causes"] = causes
    headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s is not None else None
    return _json(body, err.code, headers)


@dataclass
class _Target:
    """A parsed resource URL."""

    rt: ResourceType
    namespace: str | None
    name: str | None
    sub: str | None

    @property
    def fault_names(self) -> tuple[str, ...]:
        suffix = f"/{self.sub}" if self.sub else ""
        names = [f"{self.rt.plural}{suffix}"]
        if self.rt.group:
            names.append(f"{self.rt.plural}.{self.rt.group}{suffix}")
        return tuple(names)


class _Handlers:
    """HTTP handlers bound to one store."""

    def __init__(self, store: Store, faults: Faults, config: ApiServerConfig) -> None:
        self.store = store
        self.faults = faults
        self.config = config
        self.registry: Registry = store.registry

    # --- discovery ------------------------------------------------------------------------
    async def version(self, _request: web.Request) -> web.Response:
        return _json(SERVER_VERSION)

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def api_versions(self, request: web.Request) -> web.Response:
        return _json(
            {
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": request.host}],
            }
        )

    def _group_doc(self, group: str, versions: list[str]) -> dict[str, Any]:
        gvs = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return {"name": group, "versions": gvs, "preferredVersion": gvs[0]}

    async def api_groups(self, _request: web.Request) -> web.Response:
        groups = [self._group_doc(g, vs) for g, vs in sorted(self.registry.group_versions().items()) if g]
        return _json({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})

    async def api_group(self, request: web.Request) -> web.Response:
        group = request.match_info["group"]
        versions = self.registry.group_versions().get(group)
        if not versions:
            raise ApiError(404, "the server could not find the requested resource", "NotFound")
        return _json({"kind": "APIGroup", "apiVersion": "v1", **self._group_doc(group, versions)})

    async def resource_list(self, request: web.Request) -> web.Response:
        group = request.match_info.get("group", "")
        version = request.match_info.get("version", "v1")
        if version not in self.registry.group_versions().get(group, []):
            raise ApiError(404, "the server could not find the requested resource", "NotFound")
        resources: list[dict[str, Any]] = []
        for rt in self.registry.in_group_version(group, version):
            resources.extend(rt.discovery())
        return _json(
            {
                "kind": "APIResourceList",
                "apiVersion": "v1",
                "groupVersion": f"{group}/{version}" if group else version,
                "resources": resources,
            }
        )

    async def not_found(self, _request: web.Request) -> web.Response:
        raise ApiError(404, "the server could not find the requested resource", "NotFound")

    async def openapi_root(self, _request: web.Request) -> web.Response:
        return _json(openapi.root(self.registry))

    async def openapi_gv(self, request: web.Request) -> web.Response:
        parts = request.match_info["tail"].split("/")
        doc = None
        if len(parts) == 2 and parts[0] == "api":
            doc = openapi.group_version(self.registry, "", parts[1])
        elif len(parts) == 3 and parts[0] == "apis":
            doc = openapi.group_version(self.registry, parts[1], parts[2])
        if doc is None:
            raise ApiError(404, "the server could not find the requested resource", "NotFound")
        return _json(doc)

    # --- faults over HTTP -----------------------------------------------------------------
    async def faults_get(self, _request: web.Request) -> web.Response:
        return _json(self.faults.snapshot())

    async def faults_post(self, request: web.Request) -> web.Response:
        try:
            body = await request.json() if request.can_read_body else {}
            return _json(self.faults.apply(body))
        except (ValueError, KeyError, TypeError) as exc:
            raise ApiError(400, f"bad fault command: {exc}", "BadRequest") from exc

    # --- resources ------------------------------------------------------------------------
    def _parse(self, group: str, version: str, tail: str) -> _Target:
        segs = tail.split("/") if tail else []
        if any(s == "" for s in segs):
            raise ApiError(404, "the server could not find the requested resource", "NotFound")
        namespace: str | None = None
        if len(segs) >= 3 and segs[0] == "namespaces":
            cand = self.registry.lookup(group, version, segs[2])
            if group or (cand is not None and cand.namespaced):
                namespace, segs = segs[1], segs[2:]
        if not segs or len(segs) > 3:
            raise ApiError(404, "the server could not find the requested resource", "NotFound")
        rt = self.registry.lookup(group, version, segs[0])
        if rt is None or (namespace is not None and not rt.namespaced):
            raise ApiError(404, "the server could not find the requested resource", "NotFound")
        name = segs[1] if len(segs) > 1 else None
        sub = segs[2] if len(segs) > 2 else None
        if rt.namespaced and name is not None and namespace is None:
            raise ApiError(404, "the server could not find the requested resource", "NotFound")
        if sub is not None and sub not in rt.subresources:
            raise ApiError(404, "the server could not find the requested resource", "NotFound")
        return _Target(rt, namespace, name, sub)

    @staticmethod
    def _verb(request: web.Request, target: _Target) -> str:
        m = request.method
        if m == "GET":
            if target.name is None:
                return "watch" if request.query.get("watch", "") in ("1", "true", "True") else "list"
            return "get"
        if m == "POST":
            return "create"
        if m == "PUT":
            return "update"
        if m == "PATCH":
            return "patch"
        if m == "DELETE":
            return "delete" if target.name is not None else "deletecollection"
        raise ApiError(405, f"method {m} not allowed", "MethodNotAllowed")

    async def core(self, request: web.Request) -> web.StreamResponse:
        return await self._resource(request, "", "v1", request.match_info["tail"])

    async def grouped(self, request: web.Request) -> web.StreamResponse:
        mi = request.match_info
        return await self._resource(request, mi["group"], mi["version"], mi["tail"])

    async def _resource(
        self, request: web.Request, group: str, version: str, tail: str
    ) -> web.StreamResponse:
        target = self._parse(group, version, tail)
        verb = self._verb(request, target)
        if request.query.get("dryRun"):
            raise ApiError(400, "dryRun is not supported by the vmfence development server", "BadRequest")
        fault_verb = "delete" if verb == "deletecollection" else verb
        self.faults.count(fault_verb, target.fault_names)
        delay_ms = self.faults.latency_ms(fault_verb, target.fault_names)
        if delay_ms > 0:
            await asyncio.sleep(delay_ms / 1000.0)
        rule = self.faults.take_error(fault_verb, target.fault_names)
        if rule is not None:
            raise ApiError(
                rule.code,
                rule.message or f"injected fault: {rule.code} for {verb} {target.fault_names[0]}",
                retry_after_s=1 if rule.code == 429 else None,
                name=target.name,
                kind=target.rt.plural,
                group=target.rt.group,
            )
        if verb == "watch":
            return await self._watch(request, target)
        handler: Callable[[web.Request, _Target], Awaitable[tuple[int, Any]]] = getattr(self, f"_do_{verb}")
        status, body = await handler(request, target)
        if verb in WRITE_VERBS or verb == "deletecollection":
            lost = self.faults.take_lost_response(fault_verb, target.fault_names)
            if lost is not None:
                if lost.mode == "close" and request.transport is not None:
                    request.transport.close()
                    return web.Response(status=500)
                raise ApiError(500, "injected fault: the write was applied but its response was lost")
        return _json(body, status)

    def _predicate(self, request: web.Request) -> Callable[[Obj], bool]:
        lsel = label_selector(request.query.get("labelSelector"))
        fsel = field_selector(request.query.get("fieldSelector"))
        return lambda o: lsel(o) and fsel(o)

    @staticmethod
    def _cached(request: web.Request) -> bool:
        """resourceVersion=0 reads may be served from the (possibly lagging) watch cache."""
        return request.query.get("resourceVersion") == "0"

    async def _body(self, request: web.Request) -> Any:
        if not request.can_read_body:
            return None
        ctype = request.content_type
        if "protobuf" in ctype or "cbor" in ctype:
            raise ApiError(
                415,
                f"the vmfence development server only accepts JSON bodies, not {ctype}",
                "UnsupportedMediaType",
            )
        raw = await request.read()
        if not raw.strip():
            return None
        try:
            if ctype in ("application/yaml", "application/apply-patch+yaml"):
                return jsontree.from_yaml_value(yaml.safe_load(raw))
            return jsontree.decode(raw)
        except (ValueError, TypeError, RecursionError, yaml.YAMLError) as exc:
            # msgspec.DecodeError is a ValueError; too deep a nesting is a RecursionError
            raise ApiError(400, f"invalid request body: {exc}", "BadRequest") from exc

    async def _do_get(self, request: web.Request, t: _Target) -> tuple[int, Any]:
        assert t.name is not None
        obj = self.store.get(t.rt, t.namespace, t.name, cached=self._cached(request))
        if tables.wants_table(request.headers.get("Accept", "")):
            return 200, tables.table(t.rt, [obj], obj["metadata"].get("resourceVersion", ""))
        return 200, obj

    async def _do_list(self, request: web.Request, t: _Target) -> tuple[int, Any]:
        items, rv = self.store.list(t.rt, t.namespace, self._predicate(request), cached=self._cached(request))
        if tables.wants_table(request.headers.get("Accept", "")):
            return 200, tables.table(t.rt, items, str(rv), self.store)
        return 200, {
            "kind": f"{t.rt.kind}List",
            "apiVersion": t.rt.api_version,
            "metadata": {"resourceVersion": str(rv)},
            "items": items,
        }

    async def _do_create(self, request: web.Request, t: _Target) -> tuple[int, Any]:
        body = await self._body(request)
        if t.sub == "eviction":
            assert t.name is not None
            return self._evict(t, body)
        if t.sub == "binding":
            assert t.name is not None
            self.store.bind(t.rt, t.namespace, t.name, body)
            return 201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
        if t.name is not None:
            raise ApiError(405, "POST is only allowed on collections", "MethodNotAllowed")
        if t.rt.namespaced and t.namespace is None:
            raise ApiError(404, "the server could not find the requested resource", "NotFound")
        return 201, self.store.create(t.rt, t.namespace, body)

    def _evict(self, t: _Target, body: Any) -> tuple[int, Any]:
        assert t.name is not None
        self.store.get(t.rt, t.namespace, t.name)  # 404 first, as the real server does
        if not isinstance(body, dict) or body.get("kind") not in (None, "Eviction"):
            raise ApiError(400, "eviction body must be a policy/v1 Eviction", "BadRequest")
        name = (body.get("metadata") or {}).get("name")
        if name not in (None, t.name):
            raise ApiError(400, f"name in URL does not match name in Eviction object ({name})", "BadRequest")
        self.store.delete(t.rt, t.namespace, t.name, body.get("deleteOptions") or {})
        return 201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}

    async def _do_update(self, request: web.Request, t: _Target) -> tuple[int, Any]:
        if t.name is None:
            raise ApiError(405, "PUT is only allowed on named objects", "MethodNotAllowed")
        return 200, self.store.update(t.rt, t.namespace, t.name, await self._body(request), t.sub)

    async def _do_patch(self, request: web.Request, t: _Target) -> tuple[int, Any]:
        if t.name is None:
            raise ApiError(405, "PATCH is only allowed on named objects", "MethodNotAllowed")
        ctype = request.headers.get("Content-Type", "")
        if ctype.startswith("application/apply-patch"):
            raise ApiError(
                415,
                "server-side apply is not supported by the vmfence development server",
                "UnsupportedMediaType",
            )
        body = await self._body(request)
        return 200, self.store.patch(t.rt, t.namespace, t.name, ctype, body, t.sub)

    def _delete_options(self, request: web.Request, body: Any) -> dict[str, Any]:
        opts: dict[str, Any] = dict(body) if isinstance(body, dict) else {}
        if "gracePeriodSeconds" in request.query:
            try:
                opts["gracePeriodSeconds"] = int(request.query["gracePeriodSeconds"])
            except ValueError as exc:
                raise ApiError(400, "gracePeriodSeconds must be an integer", "BadRequest") from exc
        return opts

    async def _do_delete(self, request: web.Request, t: _Target) -> tuple[int, Any]:
        assert t.name is not None
        if t.sub is not None:
            raise ApiError(405, "DELETE is not allowed on subresources", "MethodNotAllowed")
        opts = self._delete_options(request, await self._body(request))
        return 200, self.store.delete(t.rt, t.namespace, t.name, opts)

    async def _do_deletecollection(self, request: web.Request, t: _Target) -> tuple[int, Any]:
        opts = self._delete_options(request, await self._body(request))
        items, _rv = self.store.list(t.rt, t.namespace, self._predicate(request))
        out = []
        for item in items:
            m = item["metadata"]
            with contextlib.suppress(ApiError):
                out.append(self.store.delete(t.rt, m.get("namespace"), m["name"], opts))
        return 200, {
            "kind": f"{t.rt.kind}List",
            "apiVersion": t.rt.api_version,
            "metadata": {"resourceVersion": str(self.store.rv)},
            "items": out,
        }

    # --- watch ----------------------------------------------------------------------------
    async def _watch(self, request: web.Request, t: _Target) -> web.StreamResponse:
        table = tables.wants_table(request.headers.get("Accept", ""))
        timeout_s: float | None = None
        if request.query.get("timeoutSeconds"):
            try:
                timeout_s = float(request.query["timeoutSeconds"])
            except ValueError as exc:
                raise ApiError(400, "timeoutSeconds must be a number", "BadRequest") from exc
        bookmarks = request.query.get("allowWatchBookmarks") in ("1", "true", "True")
        send_initial = request.query.get("sendInitialEvents") in ("1", "true", "True")
        rv_param = None if send_initial else request.query.get("resourceVersion")
        cache = self.store.cache
        resp = web.StreamResponse(status=200, headers={"Cache-Control": "no-cache, private"})
        resp.content_type = "application/json"
        try:
            watcher, initial = cache.subscribe(t.rt.key, t.namespace, self._predicate(request), rv_param)
        except ApiError as err:
            if err.code != 410:
                raise
            await resp.prepare(request)
            await resp.write(_line({"type": "ERROR", "object": err.status()}))
            return resp
        try:
            await resp.prepare(request)
            await self._stream(
                resp, t, watcher, initial, timeout_s, bookmarks, table, send_initial and bookmarks
            )
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            cache.unsubscribe(watcher)
        return resp

    async def _stream(
        self,
        resp: web.StreamResponse,
        t: _Target,
        watcher: Watcher,
        initial: list[tuple[str, Obj]],
        timeout_s: float | None,
        bookmarks: bool,
        table: bool,
        initial_end_bookmark: bool = False,
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s if timeout_s else None
        interval = self.config.bookmark_interval_s
        next_bookmark = loop.time() + interval if bookmarks else None
        sent = 0
        first_table = True

        def line(etype: str, obj: Obj) -> bytes:
            nonlocal first_table
            if table:
                obj = tables.table(
                    t.rt,
                    [obj],
                    obj["metadata"].get("resourceVersion", ""),
                    self.store,
                    with_columns=first_table,
                )
                first_table = False
            return _line({"type": etype, "object": obj})

        async def send(events: list[tuple[str, Obj]]) -> bool:
            """Write ``events`` as one chunk (one write per batch, not per event); False once the
            fault that drops a watch after N events has ended this one."""
            nonlocal sent
            every = self.faults.drop_watch_every
            if every:
                events = events[: max(0, every - sent)]
            if events:
                await resp.write(b"".join(line(etype, obj) for etype, obj in events))
            sent += len(events)
            return not (every and sent >= every)

        for i in range(0, len(initial), WATCH_BATCH):
            if not await send(initial[i : i + WATCH_BATCH]):
                return
        if initial_end_bookmark:
            # watch-list (sendInitialEvents=true): tell the client the initial state is complete
            rv = max(self.store.cache.rv, watcher.min_rv)
            end = {
                "kind": t.rt.kind,
                "apiVersion": t.rt.api_version,
                "metadata": {
                    "resourceVersion": str(rv),
                    "annotations": {"k8s.io/initial-events-end": "true"},
                },
            }
            await resp.write(_line({"type": "BOOKMARK", "object": end}))
        while not watcher.closed or not watcher.queue.empty():
            now = loop.time()
            waits = [x - now for x in (deadline, next_bookmark) if x is not None]
            wait = max(0.0, min(waits)) if waits else None
            try:
                item = await asyncio.wait_for(watcher.queue.get(), wait)
            except TimeoutError:
                now = loop.time()
                if deadline is not None and now >= deadline:
                    return
                if next_bookmark is not None and now >= next_bookmark:
                    rv = max(self.store.cache.rv, watcher.min_rv)
                    bookmark = {
                        "kind": t.rt.kind,
                        "apiVersion": t.rt.api_version,
                        "metadata": {"resourceVersion": str(rv)},
                    }
                    await resp.write(_line({"type": "BOOKMARK", "object": bookmark}))
                    next_bookmark = now + interval
                continue
            if item is None:
                return
            batch, closing = [item], False
            while len(batch) < WATCH_BATCH and not watcher.queue.empty():
                more = watcher.queue.get_nowait()
                if more is None:
                    closing = True
                    break
                batch.append(more)
            if not await send(batch) or closing:
                return


def _line(event: dict[str, Any]) -> bytes:
    return jsontree.encode(event) + b"\n"


@web.middleware
async def _errors_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Turn every failure into a Kubernetes Status body."""
    try:
        return await handler(request)
    except ApiError as err:
        return _error_response(err)
    except web.HTTPException as exc:
        if exc.status == 404:
            return _error_response(ApiError(404, "the server could not find the requested resource"))
        if exc.status == 405:
            return _error_response(ApiError(405, f"method {request.method} not allowed"))
        raise
    except Exception as exc:  # a dev server answers InternalError rather than dropping the connection
        return _error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))


def make_app(store: Store, faults: Faults, config: ApiServerConfig) -> web.Application:
    """The aiohttp application for a store (exposed so tests can mount it elsewhere)."""
    h = _Handlers(store, faults, config)
    app = web.Application(middlewares=[_errors_middleware], client_max_size=16 * 1024 * 1024)
    r = app.router
    r.add_get("/version", h.version)
    r.add_get("/version/", h.version)  # kubernetes clients' VersionApi asks with the slash (the real server answers)
    for path in ("/livez", "/readyz", "/healthz"):
        r.add_get(path, h.health)
    r.add_get("/_dev/faults", h.faults_get)
    r.add_post("/_dev/faults", h.faults_post)
    r.add_get("/api", h.api_versions)
    r.add_get("/api/", h.api_versions)
    r.add_get("/api/v1", h.resource_list)
    r.add_get("/api/v1/", h.resource_list)
    PodLogs(store, KubeletClient(config.kubelet_client_cert, config.kubelet_client_key, config.kubelet_ca)).register(r)
    r.add_route("*", "/api/v1/{tail:.+}", h.core)
    r.add_get("/apis", h.api_groups)
    r.add_get("/apis/", h.api_groups)
    r.add_get("/apis/{group}", h.api_group)
    r.add_get("/apis/{group}/{version}", h.resource_list)
    r.add_route("*", "/apis/{group}/{version}/{tail:.+}", h.grouped)
    r.add_get("/openapi/v3", h.openapi_root)
    r.add_get("/openapi/v3/{tail:.+}", h.openapi_gv)
    r.add_get("/openapi/{tail:.*}", h.not_found)
    return app


class ApiServer:
    """A running development API server; ``faults`` switches fault injection in-process."""

    def __init__(self, config: ApiServerConfig | None = None) -> None:
        self.config = config or ApiServerConfig()
        self.faults = Faults()
        self.store: Store | None = None
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        """Open the store (loading SQLite if configured) and start listening."""
        self.store = Store(Registry.builtin(), self.faults, self.config.watch_window, self.config.db_path)
        self.faults._on_stale_change = self.store.cache.pump
        self.faults._on_drop_watches = self.store.cache.close_all
        app = make_app(self.store, self.faults, self.config)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        try:
            await site.start()
        except OSError:
            await self._runner.cleanup()
            self.store.close()
            raise
        server = site._server
        assert server is not None
        port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        host = self.config.host if ":" not in self.config.host else f"[{self.config.host}]"
        self.url = f"http://{host}:{port}"

    async def stop(self) -> None:
        """Close watch streams (so handlers finish), stop listening, close the database."""
        if self.store is not None:
            self.store.cache.close_all()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.store is not None:
            self.store.close()

    async def __aenter__(self) -> ApiServer:
        await self.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.stop()


async def start_apiserver(config: ApiServerConfig | None = None) -> ApiServer:
    """Create and start a server; the caller owns ``await server.stop()``."""
    server = ApiServer(config)
    await server.start()
    return server


def write_kubeconfig(url: str, path: str, context: str = "vmfence-dev") -> str:
    """Write a plain-http, no-auth kubeconfig for ``url``; returns ``path``."""
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": context, "cluster": {"server": url}}],
        "users": [{"name": context, "user": {}}],
        "contexts": [
            {"name": context, "context": {"cluster": context, "user": context, "namespace": "default"}}
        ],
        "current-context": context,
        "preferences": {},
    }
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as fh:
        yaml.safe_dump(doc, fh, sort_keys=False)
    return path


class _ConfigError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one clear line, exit 2
        raise _ConfigError(message)


def _env(name: str) -> str | None:
    value = os.environ.get(f"VMFENCE_APISERVER_{name}")
    return value if value else None


def _parse_config(argv: list[str] | None) -> tuple[ApiServerConfig, str | None]:
    p = _Parser(
        prog="vmfence apiserver", description="Development Kubernetes API server (not for production)."
    )
    p.add_argument("--host", default=_env("HOST") or "127.0.0.1")
    p.add_argument("--port", default=_env("PORT") or "6443")
    p.add_argument("--db", default=_env("DB"), help="SQLite file for persistence (default: in-memory)")
    p.add_argument("--kubeconfig-out", default=_env("KUBECONFIG_OUT"), help="write a kubeconfig here")
    p.add_argument("--watch-window", default=_env("WATCH_WINDOW") or "1000")
    p.add_argument("--bookmark-interval", default=_env("BOOKMARK_INTERVAL") or "5")
    a = p.parse_args(argv)
    try:
        port = int(a.port)
    except ValueError as exc:
        raise _ConfigError(f"port must be an integer, got {a.port!r}") from exc
    if not 0 <= port <= 65535:
        raise _ConfigError(f"port must be within 0..65535, got {port}")
    try:
        window = int(a.watch_window)
        bookmark = float(a.bookmark_interval)
    except ValueError as exc:
        raise _ConfigError(f"watch window / bookmark interval must be numbers: {exc}") from exc
    if window < 1 or bookmark <= 0:
        raise _ConfigError("watch window must be >= 1 and bookmark interval > 0")
    if a.db and not os.path.isdir(os.path.dirname(os.path.abspath(a.db))):
        raise _ConfigError(f"directory of --db {a.db!r} does not exist")
    cfg = ApiServerConfig(a.host, port, a.db, window, bookmark)
    return cfg, a.kubeconfig_out


async def _serve(config: ApiServerConfig, kubeconfig_out: str | None) -> None:
    server = ApiServer(config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        if kubeconfig_out:
            write_kubeconfig(server.url, kubeconfig_out)
        print(f"vmfence development apiserver listening on {server.url}", flush=True)
        await stop.wait()
    finally:
        await server.stop()


def _run(coro: Coroutine[Any, Any, None]) -> None:
    """On uvloop where it is installed (the server's CPU per request halves), else asyncio."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)


def main(argv: list[str] | None = None) -> int:
    """``vmfence apiserver``: serve until SIGTERM/SIGINT; configuration errors exit 2."""
    try:
        config, kubeconfig_out = _parse_config(argv)
    except _ConfigError as exc:
        print(f"vmfence apiserver: error: {exc}", file=sys.stderr)
        return 2
    try:
        _run(_serve(config, kubeconfig_out))
    except OSError as exc:
        print(
            f"vmfence apiserver: error: cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr
        )
        return 2
    except sqlite3.Error as exc:
        print(f"vmfence apiserver: error: database {config.db_path!r}: {exc}", file=sys.stderr)
        return 2
    return 0
