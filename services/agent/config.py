"""Agent configuration: command-line flags over ``VMFENCE_*`` environment over defaults.

Everything is validated before the agent touches NATS, the ledger or a VM, so a bad value stops the
service with one clear line on stderr and exit code 2 (``ConfigError``), never a traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from shared.fence.keys import DEFAULT_PARTITIONS
from shared.subjects import DEFAULT_PREFIX

HOST_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")  # one subject token, durable and KV key
PREFIX_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
SIM_FAULT_RE = re.compile(r"^(delay|fail|crash_after|inconclusive):([a-z*]+)(?::([0-9.]+))?$")


class ConfigError(Exception):
    """A configuration value is invalid; the message is the one line the operator sees."""


@dataclass(frozen=True)
class AgentConfig:
    """Everything one agent process needs. Intervals and bounds are in seconds/counts."""

    nats_url: str = "nats://127.0.0.1:4222"
    host: str = "localhost"
    runtime: str = "sim"  # qemu | sim
    data_dir: str = ".vmfence/agent"
    snapshot_dir: str = ""  # default: <data_dir>/snapshots
    accel: str = "auto"  # qemu: auto | kvm | tcg
    vnc_range: range | None = range(10, 110)  # displays (port 5900+N); None = no VNC
    http_host: str = "0.0.0.0"
    http_port: int = 9102  # 0 = ephemeral
    prefix: str = DEFAULT_PREFIX
    partitions: int = DEFAULT_PARTITIONS
    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)
    memory_mib: int = 4096
    image_dir: str = ""  # relative Spec.image names resolve under it
    inventory_interval: float = 60.0
    heartbeat_interval: float = 5.0
    probe_interval: float = 2.0
    probe_timeout: float = 5.0
    max_concurrency: int = 16  # commands executing at once (across VMs)
    ack_wait: float = 60.0
    max_ack_pending: int = 256
    fetch_timeout: float = 1.0
    shutdown_timeout: float = 20.0  # in-flight commands after SIGTERM
    op_timeout: float = 300.0  # one driver operation
    connect_timeout: float = 30.0  # each network step of startup (NATS connect, consumer, KV)
    provision: bool = False  # create/update streams and buckets at start (dev stacks)
    cleanup_on_stop: bool = False  # remove this agent's VMs on stop (throw-away local stack only)
    sim_seed: int = 0
    sim_faults: tuple[str, ...] = ()  # test hooks, e.g. "delay:create:30" (sim runtime only)
    log_level: str = "INFO"

    @property
    def snapshots(self) -> str:
        return self.snapshot_dir or os.path.join(self.data_dir, "snapshots")

    @property
    def runtime_dir(self) -> str:
        return os.path.join(self.data_dir, "runtime")

    @property
    def images(self) -> str:
        return self.image_dir or os.path.join(self.data_dir, "images")

    def validate(self) -> AgentConfig:
        """Raise ConfigError (one line) for the first invalid value; return self when fine."""
        if not self.nats_url.strip():
            raise ConfigError("nats url must not be empty (VMFENCE_NATS_URL / --nats-url)")
        for url in self.nats_url.split(","):
            if not re.match(r"^(nats|tls|ws|wss)://[^\s/]+$", url.strip()):
                raise ConfigError(f"invalid nats url {url!r}: want nats://host:port")
        if not HOST_RE.match(self.host):
            raise ConfigError(f"invalid host {self.host!r}: want [A-Za-z0-9_-], 1-63 chars")
        if self.runtime not in ("qemu", "sim"):
            raise ConfigError(f"invalid runtime {self.runtime!r}: want qemu or sim")
        if self.accel not in ("auto", "kvm", "tcg"):
            raise ConfigError(f"invalid accel {self.accel!r}: want auto, kvm or tcg")
        if not PREFIX_RE.match(self.prefix):
            raise ConfigError(f"invalid prefix {self.prefix!r}: want [a-z][a-z0-9_-]*, no dots")
        if not 1 <= self.partitions <= 4096:
            raise ConfigError(f"invalid partitions {self.partitions}: want 1..4096")
        if not 0 <= self.http_port <= 65535:
            raise ConfigError(f"invalid http port {self.http_port}: want 0..65535")
        if self.cpus < 1 or self.memory_mib < 16:
            raise ConfigError(f"invalid capacity cpus={self.cpus} memory_mib={self.memory_mib}")
        for name in ("inventory_interval", "heartbeat_interval", "probe_interval", "probe_timeout",
                     "ack_wait", "fetch_timeout", "shutdown_timeout", "op_timeout", "connect_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"invalid {name.replace('_', '-')} {getattr(self, name)}: must be > 0")
        if self.max_concurrency < 1 or self.max_ack_pending < self.max_concurrency:
            raise ConfigError("max-concurrency must be >= 1 and max-ack-pending >= max-concurrency")
        if self.sim_faults and self.runtime != "sim":
            raise ConfigError("--sim-fault needs --runtime sim")
        for f in self.sim_faults:
            if not SIM_FAULT_RE.match(f):
                raise ConfigError(f"invalid sim fault {f!r}: want kind:op[:seconds]")
        for label, path in (("data dir", self.data_dir), ("snapshot dir", self.snapshots)):
            try:
                os.makedirs(path, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"{label} {path!r} is not usable: {e.strerror}") from None
            if not os.access(path, os.W_OK | os.X_OK):
                raise ConfigError(f"{label} {path!r} is not writable")
        return self


def parse_range(text: str) -> range | None:
    """``10-109`` (inclusive) or ``none``/empty → no VNC."""
    t = text.strip().lower()
    if t in ("", "none", "off"):
        return None
    m = re.match(r"^(\d+)-(\d+)$", t)
    if not m:
        raise ConfigError(f"invalid vnc range {text!r}: want FIRST-LAST (e.g. 10-109) or none")
    lo, hi = int(m.group(1)), int(m.group(2))
    if not 0 <= lo <= hi <= 59635:  # 5900 + display must be a TCP port
        raise ConfigError(f"invalid vnc range {text!r}: want 0 <= FIRST <= LAST <= 59635")
    return range(lo, hi + 1)


def _default_host() -> str:
    name = socket.gethostname().split(".", 1)[0]
    safe = re.sub(r"[^A-Za-z0-9_-]", "-", name)[:63].strip("-_")
    return safe or "localhost"


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (ConfigError) instead of usage + exit."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


_ENV: dict[str, str] = {
    "nats_url": "VMFENCE_NATS_URL",
    "host": "VMFENCE_HOST",
    "runtime": "VMFENCE_RUNTIME",
    "data_dir": "VMFENCE_DATA_DIR",
    "snapshot_dir": "VMFENCE_SNAPSHOT_DIR",
    "accel": "VMFENCE_ACCEL",
    "vnc_range": "VMFENCE_VNC_RANGE",
    "http_port": "VMFENCE_HTTP_PORT",
    "prefix": "VMFENCE_PREFIX",
    "partitions": "VMFENCE_PARTITIONS",
    "cpus": "VMFENCE_CPUS",
    "memory_mib": "VMFENCE_MEMORY_MIB",
    "image_dir": "VMFENCE_IMAGE_DIR",
    "inventory_interval": "VMFENCE_INVENTORY_INTERVAL",
    "heartbeat_interval": "VMFENCE_HEARTBEAT_INTERVAL",
    "probe_interval": "VMFENCE_PROBE_INTERVAL",
    "ack_wait": "VMFENCE_ACK_WAIT",
    "log_level": "VMFENCE_LOG_LEVEL",
}

_INT = {"http_port", "partitions", "cpus", "memory_mib", "max_concurrency", "max_ack_pending", "sim_seed"}
_FLOAT = {"inventory_interval", "heartbeat_interval", "probe_interval", "probe_timeout", "ack_wait",
          "fetch_timeout", "shutdown_timeout", "op_timeout", "connect_timeout"}


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="vmfence agent", description="vmfence per-host agent (the only place VMs are touched)")
    a = p.add_argument
    a("--nats-url", "--nats", dest="nats_url", help="NATS server URL(s), comma separated [VMFENCE_NATS_URL]")
    a("--host", help="this host's name (one subject token) [VMFENCE_HOST, default: hostname]")
    a("--runtime", help="qemu | sim [VMFENCE_RUNTIME, default sim]")
    a("--data-dir", help="ledger and runtime state [VMFENCE_DATA_DIR, default .vmfence/agent]")
    a("--snapshot-dir", help="hibernation snapshots [VMFENCE_SNAPSHOT_DIR, default <data-dir>/snapshots]")
    a("--accel", help="qemu accelerator auto | kvm | tcg [VMFENCE_ACCEL]")
    a("--vnc-range", help="VNC displays FIRST-LAST or none [VMFENCE_VNC_RANGE, default 10-109]")
    a("--http-host", help="bind address of /metrics, /livez, /readyz [default 0.0.0.0]")
    a("--http-port", help="port of /metrics, /livez, /readyz; 0 = ephemeral [VMFENCE_HTTP_PORT]")
    a("--prefix", help="subject/stream prefix [VMFENCE_PREFIX, default vmfence]")
    a("--partitions", help="partition count of the deployment [VMFENCE_PARTITIONS, default 16]")
    a("--cpus", help="CPU capacity reported in the heartbeat [VMFENCE_CPUS]")
    a("--memory-mib", help="memory capacity reported in the heartbeat [VMFENCE_MEMORY_MIB]")
    a("--image-dir", help="where relative guest image names resolve [VMFENCE_IMAGE_DIR]")
    a("--inventory-interval", help="seconds between inventory rounds [default 60]")
    a("--heartbeat-interval", help="seconds between heartbeats [default 5]")
    a("--probe-interval", help="seconds between readiness probes per VM [default 2]")
    a("--probe-timeout", help="seconds one probe may take [default 5]")
    a("--max-concurrency", help="commands executing at once [default 16]")
    a("--ack-wait", help="seconds before an unacked command is redelivered [default 60]")
    a("--max-ack-pending", help="unacked commands outstanding [default 256]")
    a("--shutdown-timeout", help="seconds to finish in-flight commands on SIGTERM [default 20]")
    a("--op-timeout", help="seconds one runtime operation may take [default 300]")
    a("--connect-timeout", help="seconds each startup network step may take [default 30]")
    a("--provision", action="store_true", default=None, help="create/update streams and buckets")
    a("--cleanup-on-stop", action="store_true", default=None,
      help="remove this agent's VMs on stop (throw-away local stacks only)")
    a("--sim-seed", help="sim runtime random seed")
    a("--sim-fault", action="append", dest="sim_faults", metavar="KIND:OP[:SECONDS]",
      help="sim fault injection for tests, e.g. delay:create:30 (repeatable)")
    a("--log-level", help="DEBUG | INFO | WARNING | ERROR [VMFENCE_LOG_LEVEL]")
    return p


def _convert(name: str, raw: str, source: str) -> Any:
    try:
        if name in _INT:
            return int(raw)
        if name in _FLOAT:
            return float(raw)
    except ValueError:
        raise ConfigError(f"invalid {source} {raw!r}: want a number") from None
    if name == "vnc_range":
        return parse_range(raw)
    return raw


def load_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> AgentConfig:
    """Flags beat environment beat defaults; raises ConfigError with one line on any bad value."""
    env = os.environ if env is None else env
    ns = build_parser().parse_args(list(argv) if argv is not None else None)
    values: dict[str, Any] = {}
    for name, var in _ENV.items():
        if env.get(var) not in (None, ""):
            values[name] = _convert(name, str(env[var]), var)
    for name, raw in vars(ns).items():
        if raw is None:
            continue
        if name in ("provision", "cleanup_on_stop"):
            values[name] = bool(raw)
        elif name == "sim_faults":
            values[name] = tuple(raw)
        else:
            values[name] = _convert(name, str(raw), "--" + name.replace("_", "-"))
    values.setdefault("host", _default_host())
    if "log_level" in values:
        values["log_level"] = str(values["log_level"]).upper()
        if values["log_level"] not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"invalid log level {values['log_level']!r}")
    return AgentConfig(**values).validate()
