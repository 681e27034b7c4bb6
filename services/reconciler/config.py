"""Reconciler configuration: flags and ``VMFENCE_*`` environment, validated before anything starts."""

from __future__ import annotations

import argparse
import os
import socket
import uuid
from dataclasses import dataclass, field

from shared.fence.keys import DEFAULT_PARTITIONS
from shared.subjects import DEFAULT_PREFIX


class ConfigError(Exception):
    """One clear line for the operator; the service exits 2 with it."""


@dataclass(frozen=True)
class ReconcilerConfig:
    nats_url: list[str] = field(default_factory=lambda: ["nats://127.0.0.1:4222"])
    nats_user: str | None = None
    nats_password: str | None = None
    nats_creds: str | None = None
    prefix: str = DEFAULT_PREFIX
    partitions: int = DEFAULT_PARTITIONS
    replicas: int = 1
    id: str = ""
    data_dir: str = ".vmfence/reconciler"
    kubeconfig: str | None = None
    kube: str = "auto"  # auto | none: "none" means no Kubernetes (benchmarks)
    http_host: str = "127.0.0.1"
    http_port: int = 9180
    log_format: str = "json"
    lease_ttl_s: float = 10.0
    max_partitions: int = 0  # 0 = take as many as are free
    ack_wait_s: float = 10.0
    max_ack_pending: int = 4096
    fetch_batch: int = 256
    effect_workers: int = 64
    snapshot_interval_s: float = 2.0
    host_stale_s: float = 15.0
    restart_backoff_base_s: float = 10.0

    def owner_id(self) -> str:
        return self.id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"VMFENCE_{name}", default)


def _int(name: str, value: str, lo: int, hi: int) -> int:
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None
    if not lo <= n <= hi:
        raise ConfigError(f"{name}={n} is out of range {lo}..{hi}")
    return n


def _float(name: str, value: str, lo: float) -> float:
    try:
        x = float(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a number") from None
    if x < lo:
        raise ConfigError(f"{name}={x} must be at least {lo}")
    return x


def parse(argv: list[str] | None = None) -> ReconcilerConfig:
    p = argparse.ArgumentParser(prog="vmfence reconciler", description="Decide, append, and carry out effects.")
    p.add_argument("--nats", default=_env("NATS_URL", "nats://127.0.0.1:4222"), help="NATS URL(s), comma-separated")
    p.add_argument("--nats-user", default=_env("NATS_USER"))
    p.add_argument("--nats-password", default=_env("NATS_PASSWORD"))
    p.add_argument("--nats-creds", default=_env("NATS_CREDS"))
    p.add_argument("--prefix", default=_env("PREFIX", DEFAULT_PREFIX))
    p.add_argument("--partitions", default=_env("PARTITIONS", str(DEFAULT_PARTITIONS)))
    p.add_argument("--replicas", default=_env("REPLICAS", "1"))
    p.add_argument("--id", default=_env("ID", ""))
    p.add_argument("--data-dir", default=_env("DATA_DIR", ".vmfence/reconciler"))
    p.add_argument("--kubeconfig", default=_env("KUBECONFIG"))
    p.add_argument("--kube", default=_env("KUBE", "auto"), help="auto | none (no Kubernetes)")
    p.add_argument("--http-host", default=_env("HTTP_HOST", "0.0.0.0"))
    p.add_argument("--http-port", default=_env("HTTP_PORT", "9180"))
    p.add_argument("--log-format", default=_env("LOG_FORMAT", "json"))
    p.add_argument("--lease-ttl", default=_env("LEASE_TTL", "10"))
    p.add_argument("--max-partitions", default=_env("MAX_PARTITIONS", "0"))
    p.add_argument("--snapshot-interval", default=_env("SNAPSHOT_INTERVAL", "2"))
    p.add_argument("--host-stale", default=_env("HOST_STALE", "15"), help="heartbeat age (s) for a dead host")
    p.add_argument("--restart-backoff", default=_env("RESTART_BACKOFF", "10"), help="first VM restart delay (s)")
    p.add_argument("--ack-wait", default=_env("ACK_WAIT", "10"), help="seconds before an unacked input is redelivered")
    a = p.parse_args(argv)
    prefix = a.prefix
    if not prefix or not prefix.replace("_", "").replace("-", "").isalnum():
        raise ConfigError(f"VMFENCE_PREFIX={prefix!r} must be letters, digits, '-' or '_'")
    if a.log_format not in ("json", "text"):
        raise ConfigError(f"VMFENCE_LOG_FORMAT={a.log_format!r} must be json or text")
    if a.kube not in ("auto", "none"):
        raise ConfigError(f"VMFENCE_KUBE={a.kube!r} must be auto or none")
    if a.kubeconfig and not os.path.isfile(a.kubeconfig):
        raise ConfigError(f"VMFENCE_KUBECONFIG={a.kubeconfig!r} does not exist")
    replicas = _int("VMFENCE_REPLICAS", a.replicas, 1, 5)
    if replicas not in (1, 3):
        raise ConfigError(f"VMFENCE_REPLICAS={replicas} must be 1 or 3")
    urls = [u.strip() for u in a.nats.split(",") if u.strip()]
    if not urls or not all(u.startswith(("nats://", "tls://", "ws://", "wss://")) for u in urls):
        raise ConfigError(f"VMFENCE_NATS_URL={a.nats!r} must be nats:// URL(s)")
    return ReconcilerConfig(
        nats_url=urls,
        nats_user=a.nats_user,
        nats_password=a.nats_password,
        nats_creds=a.nats_creds,
        prefix=prefix,
        partitions=_int("VMFENCE_PARTITIONS", a.partitions, 1, 4096),
        replicas=replicas,
        id=a.id,
        data_dir=a.data_dir,
        kubeconfig=a.kubeconfig,
        kube=a.kube,
        http_host=a.http_host,
        http_port=_int("VMFENCE_HTTP_PORT", a.http_port, 0, 65535),
        log_format=a.log_format,
        lease_ttl_s=_float("VMFENCE_LEASE_TTL", a.lease_ttl, 1.0),
        max_partitions=_int("VMFENCE_MAX_PARTITIONS", a.max_partitions, 0, 4096),
        snapshot_interval_s=_float("VMFENCE_SNAPSHOT_INTERVAL", a.snapshot_interval, 0.05),
        restart_backoff_base_s=_float("VMFENCE_RESTART_BACKOFF", a.restart_backoff, 0.0),
        host_stale_s=_float("VMFENCE_HOST_STALE", a.host_stale, 1.0),
        ack_wait_s=_float("VMFENCE_ACK_WAIT", a.ack_wait, 0.5),
    )
