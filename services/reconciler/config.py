"""Reconciler configuration, on the shared configuration path (``shared.config``): the settings
below plus the shared groups (NATS, bus names, logging, HTTP), validated before anything starts."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from typing import ClassVar

from shared.config import ConfigError, HttpSettings, KubeSettings, ServiceSettings, override, setting

__all__ = ["ConfigError", "ReconcilerConfig"]


@dataclass(frozen=True)
class ReconcilerConfig(ServiceSettings, KubeSettings):
    PROG: ClassVar[str] = "vmfence reconciler"
    DESCRIPTION: ClassVar[str] = "Decide, append, and carry out effects."

    http_host: str = override(HttpSettings, "http_host", "0.0.0.0")
    replicas: int = setting(1, "JetStream replicas of the streams it provisions: 1 or 3", choices=(1, 3))
    id: str = setting("", "this reconciler's writer id", shown_default="<hostname>-<pid>-<random>")
    data_dir: str = setting(".vmfence/reconciler", "where partition snapshots are kept")
    kube: str = setting("auto", "auto, or none for no Kubernetes (benchmarks)", choices=("auto", "none"))
    lease_ttl_s: float = setting(10.0, "seconds a partition lease lives unrenewed", flag="--lease-ttl", lo=1.0)
    max_partitions: int = setting(0, "most partitions to hold; 0 = a fair share", lo=0, hi=4096)
    ack_wait_s: float = setting(10.0, "seconds before an unacked input is redelivered", flag="--ack-wait", lo=0.5)
    max_ack_pending: int = 4096
    fetch_batch: int = 256
    effect_workers: int = 64
    snapshot_interval_s: float = setting(2.0, "seconds between partition snapshots", flag="--snapshot-interval",
                                         lo=0.05)
    image_interval_s: float = setting(
        30.0, "seconds between the partition images put on the bus for whoever takes a partition next (one is "
        "also put at each hand-over); 0 = at hand-overs only", flag="--image-interval", lo=0.0)
    host_stale_s: float = setting(15.0, "heartbeat age (s) after which a host counts as dead", flag="--host-stale",
                                  lo=1.0)
    restart_backoff_base_s: float = setting(10.0, "first VM restart delay (s)", flag="--restart-backoff", lo=0.0)
    bind_unscheduled: str = setting(
        "auto", "pods without spec.nodeName: on = vmfence places and binds them (pods/binding) before their VM, "
        "as a scheduler does; off = they wait for the scheduler's binding; auto = on against the development API "
        "server (no scheduler runs there), off against any other (a real control plane has kube-scheduler)",
        choices=("auto", "on", "off"))
    done_linger_s: float = setting(30.0, "seconds the completion of a status write that succeeded may wait "
                                   "to be logged with its pod's next entry instead of alone; 0 = logged at once "
                                   "(a crash meanwhile only makes the write again)", flag="--done-linger",
                                   lo=0.0, hi=3600.0)
    drift_interval_s: float = setting(60.0, "seconds between drift checks of the held keys against every live "
                                      "host's inventory (vmfence_drift); 0 = off", flag="--drift-interval",
                                      lo=0.0, hi=86400.0)

    def owner_id(self) -> str:
        return self.id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
