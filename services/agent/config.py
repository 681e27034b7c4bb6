"""Agent configuration, on the shared configuration path (``shared.config``): every setting is
declared once below or in the shared groups (NATS, bus names, logging, HTTP). Everything is
validated before the agent touches NATS, the ledger or a VM: a bad value stops it with one line on
stderr and exit code 2.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from dataclasses import dataclass
from typing import Any, ClassVar

from shared.config import ConfigError, HttpSettings, ServiceSettings, override, setting

__all__ = ["AgentConfig", "ConfigError", "parse_range"]

HOST_RE = r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}"  # one subject token, durable and KV key
SIM_FAULT_RE = r"(delay|fail|crash_after|inconclusive):([a-z*]+)(:[0-9.]+)?"
VNC_BASE_PORT = 5900  # display N listens on TCP 5900 + N (QEMU's -vnc :N)
MAX_PORT = 65535
OLD_VNC_ENV = "VMFENCE_VNC_RANGE"  # display numbers once, mistaken for ports by deployments


def parse_range(text: str) -> range | None:
    """``5910-6009``: the VNC *TCP ports* (inclusive), as a firewall or a port mapping names them;
    the displays are ``port - 5900``. ``none``/empty → no VNC."""
    t = text.strip().lower()
    if t in ("", "none", "off"):
        return None
    m = re.fullmatch(r"(\d+)-(\d+)", t)
    if not m or not VNC_BASE_PORT <= int(m.group(1)) <= int(m.group(2)) <= MAX_PORT:
        raise ValueError(f"is not a range of VNC ports: want FIRST-LAST with {VNC_BASE_PORT} <= FIRST <= LAST <= "
                         f"{MAX_PORT} (TCP ports; display = port - {VNC_BASE_PORT}), or none")
    return range(int(m.group(1)) - VNC_BASE_PORT, int(m.group(2)) - VNC_BASE_PORT + 1)


def parse_listen(text: str) -> str:
    """An IP address VNC listens on (default loopback)."""
    try:
        return str(ipaddress.ip_address(text.strip().strip("[]")))
    except ValueError:
        raise ValueError("is not an IP address") from None


def parse_cidr_text(text: str) -> str:
    """An IPv4 subnet (network bits only), or empty."""
    if not text.strip():
        return ""
    net = ipaddress.IPv4Network(text.strip(), strict=False)
    if str(net) != text.strip():
        raise ValueError(f"is not a subnet's own address (did you mean {net}?)")
    if not 8 <= net.prefixlen <= 29:
        raise ValueError("needs a prefix between /8 and /29")
    return str(net)


def parse_optional_ip(text: str) -> str:
    return parse_listen(text) if text.strip() else ""


MIN_MEMORY_MIB = 16  # the smallest capacity a host offers (a VM's own minimum)
_FALLBACK_MEMORY_MIB = 4096  # a host whose /proc/meminfo cannot be read (not Linux)


def host_cpus() -> int:
    """The CPUs this process may run on (a cgroup or taskset limit counts, as for a kubelet)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def host_memory_mib(meminfo: str = "/proc/meminfo") -> int:
    """MemTotal of ``meminfo`` in MiB (kB there are KiB); a fallback when it cannot be read."""
    try:
        with open(meminfo, encoding="ascii", errors="replace") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name == "MemTotal":
                    fields = rest.split()
                    if fields and fields[0].isdigit() and len(fields[0]) <= 15:
                        return max(MIN_MEMORY_MIB, int(fields[0]) // 1024)
    except OSError:
        pass
    return _FALLBACK_MEMORY_MIB


def _default_host() -> str:
    name = socket.gethostname().split(".", 1)[0]
    safe = re.sub(r"[^A-Za-z0-9_-]", "-", name)[:63].strip("-_")
    return safe or "localhost"


def _seconds(default: float, what: str) -> Any:
    """An interval or timeout setting: seconds, more than zero."""
    return setting(default, what, lo=1e-3)


@dataclass(frozen=True)
class AgentConfig(ServiceSettings):
    """Everything one agent process needs. Intervals and bounds are in seconds/counts."""

    PROG: ClassVar[str] = "vmfence agent"
    DESCRIPTION: ClassVar[str] = "vmfence per-host agent (the only place VMs are touched)"

    http_host: str = override(HttpSettings, "http_host", "0.0.0.0")
    http_port: int = override(HttpSettings, "http_port", 9102)
    host: str = setting(help="this host's name (one subject token)", factory=_default_host, pattern=HOST_RE,
                        want="[A-Za-z0-9_-], 1-63 characters", shown_default="the hostname")
    runtime: str = setting("sim", "VM runtime: qemu or sim", choices=("qemu", "sim"))
    data_dir: str = setting(".vmfence/agent", "ledger and runtime state")
    snapshot_dir: str = setting("", "hibernation snapshots", shown_default="<data-dir>/snapshots")
    accel: str = setting("auto", "qemu accelerator: auto, kvm or tcg", choices=("auto", "kvm", "tcg"))
    vnc_range: range | None = setting(
        range(10, 110), "VNC TCP ports FIRST-LAST (display = port - 5900), or none", flag="--vnc-ports",
        aliases=("--vnc-range",), parse=parse_range, metavar="FIRST-LAST", shown_default="5910-6009",
    )
    vnc_listen: str = setting("127.0.0.1", "address VNC displays listen on (each VM's has its own password)",
                              parse=parse_listen, metavar="ADDRESS")
    network: str = setting("bridge", "pod networking: bridge (a bridge, an address pool and a tap per VM; the sim "
                           "allocates addresses only), user (QEMU user networking: no address is reported) or none",
                           choices=("bridge", "user", "none"))
    pod_cidr: str = setting("", "this host's pod subnet, e.g. 10.240.7.0/24 (its first address is the bridge's)",
                            parse=parse_cidr_text, metavar="CIDR",
                            shown_default="a free /24 of --pod-cidr-pool, kept in <data-dir>/network.json")
    pod_cidr_pool: str = setting("10.240.0.0/16", "where a host without --pod-cidr leases its /24",
                                 parse=parse_cidr_text, metavar="CIDR")
    host_ip: str = setting("", "this host's address in its heartbeat (the Node's InternalIP, pods' hostIP)",
                           parse=parse_optional_ip, metavar="ADDRESS",
                           shown_default="the pod network's gateway (bridge networking), else none")
    cpus: int = setting(0, "CPUs offered to VMs (heartbeat, the Node's allocatable); 0 = this host's own "
                        "(sched_getaffinity) minus --reserve-cpus (a sim host may overcommit far beyond)",
                        lo=0, hi=1_000_000,
                        shown_default="0: the host's CPUs minus --reserve-cpus")
    memory_mib: int = setting(0, "memory (MiB) offered to VMs; 0 = MemTotal of /proc/meminfo minus --reserve-memory",
                              lo=0, shown_default="0: the host's memory minus --reserve-memory")
    reserve_cpus: int = setting(0, "CPUs kept for the host itself when --cpus is 0 (the Node's capacity minus "
                                "its allocatable)", lo=0, hi=1_000_000)
    reserve_memory_mib: int = setting(512, "memory (MiB) kept for the host itself when --memory-mib is 0",
                                      flag="--reserve-memory", lo=0)
    image_dir: str = setting("", "where relative guest image names resolve", shown_default="<data-dir>/images")
    inventory_interval: float = _seconds(60.0, "seconds between inventory rounds")
    inventory_rate: float = setting(
        100.0, "a round's VMs reported per second at most (a host's whole round at once queued every pod's "
        "input behind it at the reconcilers; a host with more VMs than this times --inventory-interval has "
        "its rounds back to back); 0 = unpaced", lo=0.0)
    heartbeat_interval: float = _seconds(5.0, "seconds between heartbeats")
    probe_interval: float = _seconds(2.0, "seconds between readiness probes per VM")
    probe_timeout: float = _seconds(5.0, "seconds one probe may take")
    max_concurrency: int = setting(16, "commands executing at once (across VMs)", lo=1)
    # what a crashed agent's in-flight commands wait before its restart gets them again (a command
    # still running tells the server so every third of it, so this bounds no op's length)
    ack_wait: float = _seconds(15.0, "seconds before an unacked command is redelivered")
    max_ack_pending: int = setting(256, "unacked commands outstanding (at least --max-concurrency)", lo=1)
    fetch_timeout: float = _seconds(1.0, "seconds one fetch of commands waits")
    shutdown_timeout: float = _seconds(20.0, "seconds to finish in-flight commands on SIGTERM")
    op_timeout: float = _seconds(300.0, "seconds one runtime operation may take")
    command_attempts: int = setting(
        8, "deliveries of a command that keeps failing before it is answered failed (backoff doubles each)",
        lo=1, hi=100,
    )
    retry_base: float = _seconds(1.0, "seconds before the first redelivery of a command that failed")
    retry_max: float = _seconds(60.0, "longest wait between redeliveries of a failing command")
    connect_timeout: float = _seconds(30.0, "seconds each startup network step may take (NATS connect, consumer, KV)")
    kubelet_port: int = setting(10250, "port of the kubelet endpoint kubectl logs reaches through the API server "
                                "(HTTPS; served when --kubelet-tls-cert, --kubelet-tls-key and --kubelet-client-ca "
                                "are set; 0 = any free port)", lo=0, hi=65535)
    kubelet_listen: str = setting("", "address the kubelet endpoint listens on", parse=parse_optional_ip,
                                  metavar="ADDRESS", shown_default="this host's address (--host-ip), else 127.0.0.1")
    kubelet_tls_cert: str = setting("", "the kubelet endpoint's serving certificate (PEM)", metavar="FILE")
    kubelet_tls_key: str = setting("", "its private key (PEM)", metavar="FILE")
    kubelet_client_ca: str = setting("", "CA whose client certificates the kubelet endpoint accepts (the API "
                                     "server's kubelet client)", metavar="FILE")
    kubelet_client_names: str = setting("kube-apiserver-kubelet-client", "comma-separated certificate common "
                                        "names the kubelet endpoint accepts (empty: any the CA signed)")
    console_client_names: str = setting("vmfence-console", "comma-separated certificate common names that may "
                                        "attach to a VM's serial console (vmfence console) on the kubelet endpoint")
    collect_interval: float = _seconds(60.0, "seconds between collector passes (unowned snapshots, VM "
                                             "directories, addresses, taps)")
    collect_grace: float = setting(600.0, "seconds an unowned snapshot or VM directory is left before it is "
                                          "collected", lo=0.0)
    provision: bool = setting(False, "create/update streams and buckets at start (development stacks)")
    cleanup_on_stop: bool = setting(False, "remove this agent's VMs on stop (throw-away local stacks only)")
    sim_seed: int = setting(0, "sim runtime random seed")
    sim_faults: tuple[str, ...] = setting(
        (), "sim fault injection for tests, e.g. delay:create:30 (repeatable; sim runtime only)",
        flag="--sim-fault", repeat=True, metavar="KIND:OP[:SECONDS]", pattern=SIM_FAULT_RE, want="kind:op[:seconds]",
    )

    def __post_init__(self) -> None:
        """0 for --cpus / --memory-mib: derived from the host (the heartbeat sends these numbers)."""
        super().__post_init__()
        if self.cpus == 0:
            object.__setattr__(self, "cpus", max(1, host_cpus() - self.reserve_cpus))
        if self.memory_mib == 0:
            object.__setattr__(self, "memory_mib", max(MIN_MEMORY_MIB, host_memory_mib() - self.reserve_memory_mib))

    @property
    def snapshots(self) -> str:
        return self.snapshot_dir or os.path.join(self.data_dir, "snapshots")

    @property
    def runtime_dir(self) -> str:
        return os.path.join(self.data_dir, "runtime")

    @property
    def images(self) -> str:
        return self.image_dir or os.path.join(self.data_dir, "images")

    def check(self) -> None:
        super().check()
        if self.max_ack_pending < self.max_concurrency:
            raise ConfigError("--max-ack-pending must be at least --max-concurrency")
        if OLD_VNC_ENV in os.environ:
            raise ConfigError(f"{OLD_VNC_ENV} is not read any more (it took display numbers): set VMFENCE_VNC_PORTS "
                              f"to the VNC TCP ports FIRST-LAST, e.g. 5910-5929, or none")
        if self.retry_max < self.retry_base:
            raise ConfigError("--retry-max must be at least --retry-base")
        tls = (self.kubelet_tls_cert, self.kubelet_tls_key, self.kubelet_client_ca)
        if any(tls) and not all(tls):
            raise ConfigError("--kubelet-tls-cert, --kubelet-tls-key and --kubelet-client-ca go together")
        for path in tls:
            if path and not os.path.isfile(path):
                raise ConfigError(f"kubelet TLS file {path!r} does not exist")
        if self.sim_faults and self.runtime != "sim":
            raise ConfigError("--sim-fault needs --runtime sim")
        for label, path in (("data dir", self.data_dir), ("snapshot dir", self.snapshots)):
            try:
                os.makedirs(path, mode=0o700, exist_ok=True)  # created: the agent user's alone
            except OSError as e:
                raise ConfigError(f"{label} {path!r} is not usable: {e.strerror}") from None
            if not os.access(path, os.W_OK | os.X_OK):
                raise ConfigError(f"{label} {path!r} is not writable")

