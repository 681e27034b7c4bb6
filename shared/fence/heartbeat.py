"""What an agent writes into the hosts bucket: a record on the bus beside the fence's own inputs and
decisions, read for placement and the virtual Nodes, never decided or folded."""

from __future__ import annotations

import msgspec

from shared.fence.schema import SCHEMA_VERSION


class HostHeartbeat(msgspec.Struct, frozen=True, omit_defaults=True):
    """What an agent writes into the hosts bucket (key = host name) every few seconds. Liveness is
    judged by the bucket's TTL and the KV entry's own timestamp, never by this ``at`` alone."""

    host: str
    runtime: str
    cpus_total: int
    cpus_free: int
    memory_total_mib: int
    memory_free_mib: int
    vms: int
    at: float  # the agent's wall clock, informational
    ip: str | None = None
    accel: str | None = None
    # pod networking: "bridge" (VMs have addresses of the host's pool), "user" (QEMU user networking:
    # VMs have no address reachable from outside), "none"; None from an agent before networking
    network: str | None = None
    kubelet_port: int | None = None  # the agent's kubelet endpoint (Node status.daemonEndpoints), None: not served
    # the host's own CPUs and memory before the agent's reserve (the Node's capacity; ``cpus_total``
    # and ``memory_total_mib`` are what VMs may use, its allocatable). None: an older agent (= totals)
    cpus_capacity: int | None = None
    memory_capacity_mib: int | None = None
    v: int = SCHEMA_VERSION
