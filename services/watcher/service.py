"""``vmfence watcher``: configuration, health/metrics server, signals; the work is in ``watch``.

Configuration is the shared path (``shared.config``: NATS and its credentials, prefix, partitions,
``--log-format``/``--log-level``, ``--http-host``/``--http-port``) plus the settings below; each flag
has a ``VMFENCE_*`` variable (``vmfence watcher --help`` lists them), all validated before anything
connects (a bad value → one line on stderr, exit 2).

``/readyz`` answers 200 once pods and VirtualMachines have been listed successfully.
SIGTERM/SIGINT stop the watches and exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from dataclasses import dataclass
from typing import ClassVar

from kubernetes_asyncio import client

from shared.bus.connect import Bus, NatsAuthError
from shared.bus.wire import META_PARTITIONS
from shared.config import EXIT_CONFIG, ConfigError, KubeSettings, ServiceSettings, config_error, load, setting, start
from shared.httpserve import HealthServer
from shared.kubeclient import load_api_client
from shared.tasks import run_main

from .watch import WATCH_TIMEOUT_S, Watcher

log = logging.getLogger("services.watcher")

__all__ = ["ConfigError", "WatcherConfig", "main", "parse", "serve"]


@dataclass(frozen=True)
class WatcherConfig(ServiceSettings, KubeSettings):
    PROG: ClassVar[str] = "vmfence watcher"
    DESCRIPTION: ClassVar[str] = "List/watch pods and VirtualMachines into VMFENCE_IN."

    namespace: str | None = setting(None, "watch one namespace (default: all)",
                                    pattern=r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", want="a namespace name")
    watch_timeout_s: int = setting(WATCH_TIMEOUT_S, "seconds one watch request lasts before it is renewed",
                                   flag="--watch-timeout", lo=1, hi=3600)


def parse(argv: list[str] | None = None) -> WatcherConfig:
    return load(WatcherConfig, argv)


async def _api_client(kubeconfig: str | None) -> client.ApiClient:
    return await load_api_client(kubeconfig)


async def _check_partitions(bus: Bus) -> None:
    """The IN stream's recorded partition count must match ours (a mismatch is a migration)."""
    try:
        info = await bus.js.stream_info(bus.subjects.stream_in)
    except Exception as exc:  # no permission or not provisioned yet: the reconciler owns that
        log.warning("cannot check %s partitions: %r", bus.subjects.stream_in, exc)
        return
    recorded = (info.config.metadata or {}).get(META_PARTITIONS)
    if recorded is not None and recorded != str(bus.subjects.partitions):
        raise ConfigError(
            f"VMFENCE_PARTITIONS={bus.subjects.partitions} but stream {bus.subjects.stream_in} "
            f"was provisioned with {recorded} partitions"
        )


async def serve(cfg: WatcherConfig, stop: asyncio.Event | None = None) -> None:
    """Run until SIGTERM/SIGINT (or ``stop`` is set)."""
    api = await _api_client(cfg.kubeconfig)
    bus: Bus | None = None
    health: HealthServer | None = None
    try:
        bus = await Bus.open(cfg.nats_url, name="vmfence-watcher", subjects=cfg.subjects, auth=cfg.nats_auth)
        await _check_partitions(bus)
        watcher = Watcher(api, bus.js, cfg.subjects, namespace=cfg.namespace, watch_timeout_s=cfg.watch_timeout_s)
        health = HealthServer(host=cfg.http_host, port=cfg.http_port, ready=watcher.is_ready)
        await health.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, watcher.stop)
        if stop is not None:
            asyncio.get_running_loop().create_task(stop.wait()).add_done_callback(lambda _t: watcher.stop())
        log.info("watcher started (namespace=%s, http=%s)", cfg.namespace or "*", health.url)
        await watcher.run()
        log.info("watcher stopped")
    finally:
        with contextlib.suppress(Exception):
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
        if health is not None:
            await health.stop()
        if bus is not None:
            await bus.close()
        await api.close()


def main(argv: list[str] | None = None) -> int:
    cfg = start(WatcherConfig, argv)
    if cfg is None:
        return EXIT_CONFIG
    try:
        run_main(serve(cfg))
    except ConfigError as exc:
        return config_error(cfg.PROG, exc)
    except NatsAuthError as exc:
        print(f"{cfg.PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
