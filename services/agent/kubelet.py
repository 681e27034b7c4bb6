"""The kubelet endpoints ``kubectl logs`` needs, served by the agent (issue 12 §3).

``GET /containerLogs/<namespace>/<pod>/<container>`` over HTTPS on ``--kubelet-port`` (advertised
in the heartbeat, written to the Node's ``status.daemonEndpoints.kubeletEndpoint.Port``), answered
from the pod's VM's serial console (the qemu driver's ``serial.log``, the sim's console file):

- ``follow``: the console as it grows, until the VM's console is replaced (a restart), the VM
  leaves this host, or the client goes; ``tailLines``, ``limitBytes``; ``previous``: the console of
  the boot before the last restart (``serial.log.previous``);
- ``timestamps`` and ``sinceSeconds``/``sinceTime``: a serial console records no times, so the agent
  samples every console's size once a second (``ConsoleClock``) and a line is dated by the sample
  that first saw it (to the second; lines already there when the agent first looked get that time).

Only a client certificate signed by ``--kubelet-client-ca`` is accepted (TLS ``CERT_REQUIRED``), and
of those only the names in ``--kubelet-client-names`` (default ``kube-apiserver-kubelet-client``, the
API server's kubelet client): the agent still holds no Kubernetes credentials. A VM is the pod's one
container, so any container name answers with it. ``exec``, ``attach``, ``portForward`` and ``run``
answer 501 with a message naming ``vmfence console``, never a bare 404.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import datetime
import logging
import os
import ssl
import time
import tty
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

from services.agent.ledger import TRANSIENT_STATES, Ledger, VMRow
from services.agent.runtime import RuntimeDriver

log = logging.getLogger("vmfence.agent.kubelet")

DEFAULT_CLIENT_NAMES = ("kube-apiserver-kubelet-client",)
DEFAULT_CONSOLE_NAMES = ("vmfence-console",)
CONSOLE_READ = 4096
CLOCK_INTERVAL_S = 1.0
CLOCK_SAMPLES = 4096  # per VM; older samples are merged (their lines keep the older time)
FOLLOW_POLL_S = 0.2
MAX_READ_BYTES = 16 * 1024 * 1024  # the newest part of a console a request reads
NOT_SUPPORTED = (
    "vmfence runs this pod as a virtual machine: {what} is not supported. Use `vmfence console {ns}/{pod}` "
    "for the VM's serial console (kubectl logs works: it reads the same console)."
)


@dataclass(frozen=True)
class KubeletTls:
    cert: str
    key: str
    client_ca: str
    client_names: tuple[str, ...] = DEFAULT_CLIENT_NAMES
    console_names: tuple[str, ...] = DEFAULT_CONSOLE_NAMES  # who may attach to a VM's serial console

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.client_ca)
        ctx.load_cert_chain(self.cert, self.key)
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


@dataclass
class ConsoleClock:
    """When each part of a console was first seen: samples of ``(size, time)`` per console path."""

    clock: Callable[[], float] = time.time
    _samples: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)

    def sample(self, path: str) -> None:
        try:
            size = os.path.getsize(path)
        except OSError:
            return
        sizes, times = self._samples.setdefault(path, ([], []))
        if sizes and size < sizes[-1]:  # replaced (a restart rotated it): a new console
            sizes.clear()
            times.clear()
        if not sizes or size > sizes[-1]:
            sizes.append(size)
            times.append(self.clock())
            if len(sizes) > CLOCK_SAMPLES:  # merge the two oldest: their bytes take the later time
                del sizes[0]
                del times[0]

    def time_of(self, path: str, offset: int) -> float:
        """The time of the first sample that saw byte ``offset`` (now, if none has yet)."""
        sizes, times = self._samples.get(path, ([], []))
        i = bisect.bisect_right(sizes, offset)
        return times[i] if i < len(times) else self.clock()

    def forget(self, keep: set[str]) -> None:
        for p in list(self._samples):
            if p not in keep:
                del self._samples[p]


def rfc3339(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_since_time(text: str) -> float:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@dataclass(frozen=True)
class LogQuery:
    follow: bool = False
    tail_lines: int | None = None
    limit_bytes: int | None = None
    since: float | None = None  # a wall-clock time
    timestamps: bool = False
    previous: bool = False

    @staticmethod
    def parse(q: dict[str, str], now: float) -> LogQuery:
        def flag(name: str) -> bool:
            return q.get(name, "false").lower() in ("true", "1")

        def count(name: str) -> int | None:
            if name not in q:
                return None
            try:
                v = int(q[name])
            except ValueError:
                raise web.HTTPBadRequest(text=f"{name}: {q[name]!r} is not an integer") from None
            if v < 0:
                raise web.HTTPBadRequest(text=f"{name} must not be negative")
            return v

        since = None
        if "sinceSeconds" in q:
            s = count("sinceSeconds")
            since = now - (s or 0)
        elif "sinceTime" in q:
            try:
                since = parse_since_time(q["sinceTime"])
            except ValueError:
                raise web.HTTPBadRequest(text=f"sinceTime: {q['sinceTime']!r} is not an RFC 3339 time") from None
        return LogQuery(follow=flag("follow"), tail_lines=count("tailLines"), limit_bytes=count("limitBytes"),
                        since=since, timestamps=flag("timestamps"), previous=flag("previous"))


def _read_tail(path: str) -> tuple[bytes, int]:
    """The newest MAX_READ_BYTES of the file and the offset they start at."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        start = max(0, size - MAX_READ_BYTES)
        f.seek(start)
        return f.read(), start


def _read_from(path: str, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


def render(data: bytes, start: int, q: LogQuery, when: Callable[[int], float]) -> bytes:
    """The lines of ``data`` (which begins at file offset ``start``) a query selects, as sent."""
    lines: list[tuple[int, bytes]] = []
    off = start
    for line in data.splitlines(keepends=True):
        lines.append((off, line))
        off += len(line)
    if q.since is not None:
        lines = [(o, ln) for o, ln in lines if when(o) >= q.since]
    if q.tail_lines is not None:
        lines = lines[-q.tail_lines:] if q.tail_lines else []
    out = b"".join((rfc3339(when(o)).encode() + b" " if q.timestamps else b"") + ln for o, ln in lines)
    if q.limit_bytes is not None:
        out = out[: q.limit_bytes]
    return out


class KubeletServer:
    """The agent's kubelet endpoint: see the module docstring."""

    def __init__(self, ledger: Ledger, driver: RuntimeDriver, host: str, tls: KubeletTls, *,
                 listen: str, port: int, clock: ConsoleClock | None = None) -> None:
        self.ledger = ledger
        self.driver = driver
        self.host = host
        self.tls = tls
        self.listen = listen
        self.port = port
        self.clock = clock or ConsoleClock()
        self._runner: web.AppRunner | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> int:
        app = web.Application(middlewares=[self._authorize])
        app.router.add_get("/containerLogs/{ns}/{pod}/{container}", self.container_logs)
        app.router.add_get("/console/{ns}/{pod}", self.console)
        for what in ("exec", "attach", "portForward", "run"):
            app.router.add_route("*", f"/{what}/{{ns}}/{{pod}}{{tail:(/.*)?}}", self._not_supported(what))
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.listen, self.port, ssl_context=self.tls.server_context())
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        if sockets:
            self.port = sockets[0].getsockname()[1]
        log.info("kubelet endpoint on %s:%d (HTTPS, client certificates of %s)", self.listen, self.port,
                 ", ".join(self.tls.client_names) or "any name", extra={"host": self.host, "event": "kubelet"})
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def run_clock(self) -> None:
        """Sample every console's size once a second (see ConsoleClock)."""
        while True:
            paths = set()
            for row in self.ledger.vms():
                p = self._console(row.vm_id)
                if p is not None:
                    paths.add(p)
                    self.clock.sample(p)
            self.clock.forget(paths)
            await asyncio.sleep(CLOCK_INTERVAL_S)

    # ------------------------------------------------------------------ authentication
    @web.middleware
    async def _authorize(self, request: web.Request, handler: Callable[..., object]) -> web.StreamResponse:
        cert = request.transport.get_extra_info("peercert") if request.transport else None
        names = {v for rdn in (cert or {}).get("subject", ()) for k, v in rdn if k == "commonName"}
        allowed = self.tls.console_names if request.path.startswith("/console/") else self.tls.client_names
        if not cert or (allowed and not names & set(allowed)):
            log.warning("kubelet request refused: client %s is not one of %s", sorted(names) or "unknown",
                        allowed, extra={"host": self.host, "event": "kubelet_refused"})
            return web.Response(status=403, text="Forbidden: this client certificate may not use the kubelet API\n")
        result = await handler(request)  # type: ignore[misc]
        assert isinstance(result, web.StreamResponse)
        return result

    # ------------------------------------------------------------------ logs
    def _console(self, vm_id: str) -> str | None:
        fn = getattr(self.driver, "serial_log", None)
        return fn(vm_id) if callable(fn) else None

    def _vm_of(self, ns: str, pod: str) -> VMRow | None:
        key = f"{ns}/{pod}"
        rows = [r for r in self.ledger.vms() if r.fence.key == key and r.state not in ("removing", "hibernating")]
        if not rows:
            return None
        return max(rows, key=lambda r: (r.fence.epoch, r.state not in TRANSIENT_STATES, r.created_at))

    async def container_logs(self, request: web.Request) -> web.StreamResponse:
        ns, pod = request.match_info["ns"], request.match_info["pod"]
        q = LogQuery.parse(dict(request.query), time.time())
        row = self._vm_of(ns, pod)
        path = self._console(row.vm_id) if row is not None else None
        if row is None or path is None:
            raise web.HTTPNotFound(text=f"no VM of pod {ns}/{pod} on host {self.host}\n")
        if q.previous:
            path += ".previous"
        try:
            data, start = await asyncio.to_thread(_read_tail, path)
        except FileNotFoundError:
            if q.previous:
                raise web.HTTPBadRequest(text=f"previous terminated container of pod {ns}/{pod} not found: the "
                                              f"VM {row.vm_id} has not restarted\n") from None
            data, start = b"", 0
        self.clock.sample(path)
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        await resp.write(render(data, start, q, lambda o: self.clock.time_of(path, o)))
        if q.follow and not q.previous:
            with contextlib.suppress(ConnectionResetError, asyncio.CancelledError):
                await self._follow(resp, row.vm_id, path, start + len(data), q)
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof()
        return resp

    async def _follow(self, resp: web.StreamResponse, vm_id: str, path: str, offset: int, q: LogQuery) -> None:
        """New console bytes as they come, until the console is replaced or the VM leaves this host."""
        try:
            ino = os.stat(path).st_ino
        except FileNotFoundError:
            ino = None
        partial = b""
        while True:
            await asyncio.sleep(FOLLOW_POLL_S)
            if self.ledger.vm(vm_id) is None:
                return  # removed, hibernated or lost
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            if ino is not None and (st.st_ino != ino or st.st_size < offset):
                return  # a restart rotated it: a new container, as a kubelet's follow ends
            ino = st.st_ino
            if st.st_size <= offset:
                continue
            chunk = await asyncio.to_thread(_read_from, path, offset, min(st.st_size - offset, MAX_READ_BYTES))
            offset += len(chunk)
            self.clock.sample(path)
            if q.timestamps:  # whole lines only, stamped now (they have just appeared)
                buf = partial + chunk
                cut = buf.rfind(b"\n") + 1
                partial = buf[cut:]
                stamp = rfc3339(time.time()).encode() + b" "
                out = b"".join(stamp + ln for ln in buf[:cut].splitlines(keepends=True))
            else:
                out = chunk
            if out:
                await resp.write(out)

    # ------------------------------------------------------------------ the serial console
    async def console(self, request: web.Request) -> web.StreamResponse:
        """A websocket to the VM's serial console: binary messages each way, until either side ends
        (the client detaches, the VM stops)."""
        ns, pod = request.match_info["ns"], request.match_info["pod"]
        row = self._vm_of(ns, pod)
        fn = getattr(self.driver, "console", None)
        pty = await fn(row.vm_id) if row is not None and callable(fn) else None
        if row is None or pty is None:
            raise web.HTTPNotFound(text=f"no running VM of pod {ns}/{pod} with a serial console on host {self.host}\n")
        ws = web.WebSocketResponse(heartbeat=30.0)
        await ws.prepare(request)
        fd = os.open(pty, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK)
        tty.setraw(fd)
        loop = asyncio.get_running_loop()
        out: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=256)

        def readable() -> None:
            try:
                data = os.read(fd, CONSOLE_READ)
            except BlockingIOError:
                return
            except OSError:
                data = b""  # EIO: QEMU closed its side
            if not data:
                loop.remove_reader(fd)
            with contextlib.suppress(asyncio.QueueFull):  # a client that does not read loses output
                out.put_nowait(data or None)

        async def to_client() -> None:
            while (data := await out.get()) is not None:
                await ws.send_bytes(data)

        async def to_vm() -> None:
            async for msg in ws:
                if msg.type in (web.WSMsgType.BINARY, web.WSMsgType.TEXT):
                    data = msg.data if isinstance(msg.data, bytes) else str(msg.data).encode()
                    with contextlib.suppress(BlockingIOError):
                        os.write(fd, data)

        fields = {"key": row.fence.key, "uid": row.fence.uid, "epoch": row.fence.epoch, "vm_id": row.vm_id}
        log.info("console attached", extra={**fields, "event": "console_attached"})
        loop.add_reader(fd, readable)
        try:
            tasks = [asyncio.ensure_future(to_client()), asyncio.ensure_future(to_vm())]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            loop.remove_reader(fd)
            os.close(fd)
            await ws.close()
            log.info("console detached", extra={**fields, "event": "console_detached"})
        return ws

    # ------------------------------------------------------------------ what a VM cannot do
    def _not_supported(self, what: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handler(request: web.Request) -> web.Response:
            ns, pod = request.match_info["ns"], request.match_info["pod"]
            # an upgrade (exec's SPDY or websocket) that is refused must end the connection, or an
            # API server proxying it waits for the stream it asked for
            return web.Response(status=501, text=NOT_SUPPORTED.format(what=what, ns=ns, pod=pod) + "\n",
                                headers={"Connection": "close"})

        return handler
