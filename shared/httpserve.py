"""``/metrics``, ``/livez`` and ``/readyz`` for every service, on one small aiohttp server."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest


class ListenError(OSError):
    """The health and metrics endpoint could not listen (a service reports it as such, not as a
    failure to reach NATS or Kubernetes)."""


class HealthServer:
    """Serves health and metrics; ``ready`` is asked on every /readyz so it is always current."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        ready: Callable[[], bool] = lambda: True,
        registry: CollectorRegistry = REGISTRY,
    ) -> None:
        self.host, self.port = host, port
        self._ready = ready
        self._registry = registry
        self._runner: web.AppRunner | None = None

    async def _metrics(self, _: web.Request) -> web.Response:
        body = generate_latest(self._registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _livez(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _readyz(self, _: web.Request) -> web.Response:
        if self._ready():
            return web.Response(text="ok")
        return web.Response(status=503, text="not ready")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/livez", self._livez)
        app.router.add_get("/readyz", self._readyz)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        try:
            await site.start()
        except OSError as exc:  # the port is taken or the address is not ours: nothing left listening
            await self.stop()
            raise ListenError(exc.errno, f"cannot listen on {self.host}:{self.port}: {exc.strerror or exc}") from exc
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        if sockets:
            self.port = int(sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"
