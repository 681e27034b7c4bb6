"""``vmfence watcher``: configuration, health/metrics server, signals; the work is in ``watch``.

Configuration by flags, each defaulting to a ``VMFENCE_*`` environment variable, all validated
before anything connects (a bad value → one line on stderr, exit 2):

=========================  ===========================  ==========================================
flag                       environment                  meaning
=========================  ===========================  ==========================================
``--nats``                 ``VMFENCE_NATS_URL``         NATS URL(s), comma-separated
``--nats-user``/...        ``VMFENCE_NATS_USER``,       NATS credentials (optional)
                           ``_PASSWORD``, ``_CREDS``
``--kubeconfig``           ``VMFENCE_KUBECONFIG``       kubeconfig file; absent → in-cluster
``--prefix``               ``VMFENCE_PREFIX``           subject/stream prefix (default vmfence)
``--partitions``           ``VMFENCE_PARTITIONS``       partition count P (default 16)
``--namespace``            ``VMFENCE_NAMESPACE``        watch one namespace (default: all)
``--http-host``            ``VMFENCE_HTTP_HOST``        /metrics /livez /readyz address
``--http-port``            ``VMFENCE_HTTP_PORT``        ... and port (default 9180, 0 = any)
``--log-format``           ``VMFENCE_LOG_FORMAT``       json | text
=========================  ===========================  ==========================================

``/readyz`` answers 200 once pods and VirtualMachines have been listed successfully.
SIGTERM/SIGINT stop the watches and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import signal
import sys
from dataclasses import dataclass, field

from kubernetes_asyncio import client, config

from shared.bus.connect import Bus
from shared.bus.wire import META_PARTITIONS
from shared.fence.keys import DEFAULT_PARTITIONS
from shared.httpserve import HealthServer
from shared.logs import setup_logging
from shared.subjects import DEFAULT_PREFIX, Subjects

from .watch import WATCH_TIMEOUT_S, Watcher

log = logging.getLogger("services.watcher")

DEFAULT_HTTP_PORT = 9180
_PREFIX = re.compile(r"^[A-Za-z0-9_-]+$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class ConfigError(Exception):
    """One clear line for the operator; main() exits 2 with it."""


@dataclass(frozen=True)
class WatcherConfig:
    nats_url: list[str] = field(default_factory=lambda: ["nats://127.0.0.1:4222"])
    nats_user: str | None = None
    nats_password: str | None = None
    nats_creds: str | None = None
    kubeconfig: str | None = None
    prefix: str = DEFAULT_PREFIX
    partitions: int = DEFAULT_PARTITIONS
    namespace: str | None = None
    http_host: str = "127.0.0.1"
    http_port: int = DEFAULT_HTTP_PORT
    log_format: str = "json"
    watch_timeout_s: int = WATCH_TIMEOUT_S

    @property
    def subjects(self) -> Subjects:
        return Subjects(prefix=self.prefix, partitions=self.partitions)


def _env(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(f"VMFENCE_{name}")
    return value if value not in (None, "") else default


def _int(name: str, value: str, lo: int, hi: int) -> int:
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None
    if not lo <= n <= hi:
        raise ConfigError(f"{name}={n} is out of range {lo}..{hi}")
    return n


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def parse(argv: list[str] | None = None) -> WatcherConfig:
    p = _Parser(prog="vmfence watcher", description="List/watch pods and VirtualMachines into VMFENCE_IN.")
    p.add_argument("--nats", default=_env("NATS_URL", "nats://127.0.0.1:4222"), help="NATS URL(s), comma-separated")
    p.add_argument("--nats-user", default=_env("NATS_USER"))
    p.add_argument("--nats-password", default=_env("NATS_PASSWORD"))
    p.add_argument("--nats-creds", default=_env("NATS_CREDS"))
    p.add_argument("--kubeconfig", default=_env("KUBECONFIG"), help="kubeconfig file (absent: in-cluster)")
    p.add_argument("--prefix", default=_env("PREFIX", DEFAULT_PREFIX))
    p.add_argument("--partitions", default=_env("PARTITIONS", str(DEFAULT_PARTITIONS)))
    p.add_argument("--namespace", default=_env("NAMESPACE"), help="watch one namespace (default: all)")
    p.add_argument("--http-host", default=_env("HTTP_HOST", "127.0.0.1"))
    p.add_argument("--http-port", default=_env("HTTP_PORT", str(DEFAULT_HTTP_PORT)))
    p.add_argument("--log-format", default=_env("LOG_FORMAT", "json"))
    p.add_argument("--watch-timeout", default=_env("WATCH_TIMEOUT_S", str(WATCH_TIMEOUT_S)))
    a = p.parse_args(argv)
    urls = [u.strip() for u in str(a.nats).split(",") if u.strip()]
    if not urls or any("://" not in u for u in urls):
        raise ConfigError(f"VMFENCE_NATS_URL={a.nats!r} is not a comma-separated list of nats:// URLs")
    if not _PREFIX.fullmatch(a.prefix or ""):
        raise ConfigError(f"VMFENCE_PREFIX={a.prefix!r} must be letters, digits, '-' or '_' (no dots)")
    if a.kubeconfig and not os.path.isfile(a.kubeconfig):
        raise ConfigError(f"VMFENCE_KUBECONFIG={a.kubeconfig!r} is not a readable file")
    if a.namespace and not _DNS_LABEL.fullmatch(a.namespace):
        raise ConfigError(f"VMFENCE_NAMESPACE={a.namespace!r} is not a namespace name")
    if a.log_format not in ("json", "text"):
        raise ConfigError(f"VMFENCE_LOG_FORMAT={a.log_format!r} must be json or text")
    return WatcherConfig(
        nats_url=urls,
        nats_user=a.nats_user,
        nats_password=a.nats_password,
        nats_creds=a.nats_creds,
        kubeconfig=a.kubeconfig,
        prefix=a.prefix,
        partitions=_int("VMFENCE_PARTITIONS", a.partitions, 1, 4096),
        namespace=a.namespace or None,
        http_host=a.http_host,
        http_port=_int("VMFENCE_HTTP_PORT", a.http_port, 0, 65535),
        log_format=a.log_format,
        watch_timeout_s=_int("VMFENCE_WATCH_TIMEOUT_S", a.watch_timeout, 1, 3600),
    )


async def _api_client(kubeconfig: str | None) -> client.ApiClient:
    cfg = client.Configuration()
    if kubeconfig:
        await config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    else:
        config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    return client.ApiClient(configuration=cfg)


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
        bus = await Bus.open(
            cfg.nats_url,
            name="vmfence-watcher",
            subjects=cfg.subjects,
            user=cfg.nats_user,
            password=cfg.nats_password,
            creds=cfg.nats_creds,
        )
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
    try:
        cfg = parse(argv)
    except ConfigError as exc:
        print(f"vmfence watcher: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg.log_format)
    try:
        asyncio.run(serve(cfg))
    except ConfigError as exc:
        print(f"vmfence watcher: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
