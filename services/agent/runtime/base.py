"""The runtime driver interface shared by the agent and every driver (qemu, sim)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Literal, Protocol, runtime_checkable

import msgspec

VM_ID_RE = re.compile(r"^[a-z0-9-]{1,63}$")

VMState = Literal["running", "paused", "exited", "creating"]


class NetAttach(msgspec.Struct, frozen=True):
    """A VM's place on its host's pod network (services/agent/network.py): its address from the
    host's pool (a reservation of its fence in the agent's ledger), the pool's gateway and prefix,
    a MAC derived from the address, and the tap on the host's bridge ("" = no tap: the sim)."""

    ip: str
    prefix: int
    gateway: str
    mac: str
    tap: str = ""
    bridge: str = ""


class VMSpec(msgspec.Struct, frozen=True):
    vm_id: str  # [a-z0-9-]{1,63}, unique on the host
    cpus: int = 1
    memory_mib: int = 128
    image: str | None = None  # guest image dir (vmlinuz + initramfs.cpio.gz) or None = firmware-only
    vnc: bool = False  # reserve a VNC display from the driver's range
    probe_port: int | None = None  # guest TCP port forwarded to a host port for readiness probes
    labels: dict[str, str] = {}  # e.g. vmfence key/uid/epoch, stored with the VM for inventory
    net: NetAttach | None = None  # bridge networking (None: QEMU user networking, or no NIC)


class VMInfo(msgspec.Struct):
    vm_id: str
    state: VMState
    pid: int | None = None
    vnc_display: int | None = None
    probe_host_port: int | None = None
    ip: str | None = None
    labels: dict[str, str] = {}
    exit_code: int | None = None
    vnc_password: str | None = None  # the display's password (with vnc_display); never published


class SnapshotInfo(msgspec.Struct):
    vm_id: str
    path: str
    size_bytes: int
    seconds: float


class VMExitedEvent(msgspec.Struct, tag="exited"):
    vm_id: str
    exit_code: int | None
    signal: int | None


class VMGoneEvent(msgspec.Struct, tag="gone"):
    vm_id: str


RuntimeEvent = VMExitedEvent | VMGoneEvent


class Inconclusive(Exception):
    """inspect could not tell (e.g. QMP timeout); the caller retries, never trusts."""


class RuntimeFailure(Exception):
    """An operation failed; the message says why."""


def check_vm_id(vm_id: str) -> None:
    if not isinstance(vm_id, str) or not VM_ID_RE.match(vm_id):
        raise RuntimeFailure(f"invalid vm_id {vm_id!r}: must match [a-z0-9-]{{1,63}}")


def check_spec(spec: VMSpec) -> None:
    check_vm_id(spec.vm_id)
    if spec.cpus < 1 or spec.cpus > 64:
        raise RuntimeFailure(f"{spec.vm_id}: cpus={spec.cpus} out of range 1..64")
    if spec.memory_mib < 16 or spec.memory_mib > 65536:
        raise RuntimeFailure(f"{spec.vm_id}: memory_mib={spec.memory_mib} out of range 16..65536")
    if spec.probe_port is not None and not 1 <= spec.probe_port <= 65535:
        raise RuntimeFailure(f"{spec.vm_id}: probe_port={spec.probe_port} out of range")


@runtime_checkable
class RuntimeDriver(Protocol):
    name: str

    async def open(self) -> None:
        """Rediscover VMs left running by a previous agent process."""

    async def create(self, spec: VMSpec) -> VMInfo:
        """Create and start; idempotent by vm_id (an existing VM is returned as is)."""

    async def start(self, vm_id: str) -> VMInfo:
        """(Re)start an exited VM from its existing disk."""

    async def stop(self, vm_id: str) -> None: ...

    async def remove(self, vm_id: str) -> None:
        """Kill and delete its files; idempotent (unknown -> no error)."""

    async def inspect(self, vm_id: str) -> VMInfo | None:
        """None = the runtime does not know it; raises Inconclusive if unsure."""

    async def list_labelled(self, name: str, value: str) -> list[VMInfo]:
        """The VMs whose label ``name`` is ``value`` (a survey asks for one key's), sorted by vm id,
        at a cost per such VM where the runtime can, not per VM of the host. It need not notice
        other VMs' departures (``list`` and the inventory do)."""

    async def list(self) -> list[VMInfo]: ...

    async def snapshot(self, vm_id: str, dest: str) -> SnapshotInfo:
        """Hibernate: pause, migrate to file dest, remove the VM."""

    async def restore(self, spec: VMSpec, src: str) -> VMInfo:
        """Wake: start with incoming migration from src."""

    async def probe(self, vm_id: str) -> bool:
        """Readiness: guest TCP port if probe_port, else run state running."""

    def events(self) -> AsyncIterator[RuntimeEvent]: ...

    async def close(self) -> None:
        """Release connections; never kills VMs."""


class EventSubscription:
    """An async iterator of runtime events; registered with the hub as soon as it is created,
    so nothing published after ``driver.events()`` returns is missed."""

    def __init__(self, hub: EventHub) -> None:
        self._hub = hub
        self._queue: asyncio.Queue[RuntimeEvent | None] = asyncio.Queue()
        hub._queues.append(self._queue)
        self._closed = False

    def __aiter__(self) -> EventSubscription:
        return self

    async def __anext__(self) -> RuntimeEvent:
        if self._closed:
            raise StopAsyncIteration
        ev = await self._queue.get()
        if ev is None:
            self.aclose_now()
            raise StopAsyncIteration
        return ev

    def aclose_now(self) -> None:
        self._closed = True
        if self._queue in self._hub._queues:
            self._hub._queues.remove(self._queue)

    async def aclose(self) -> None:
        self.aclose_now()


class EventHub:
    """Fan-out of runtime events to every subscriber of events()."""

    def __init__(self) -> None:
        self._queues: list[asyncio.Queue[RuntimeEvent | None]] = []
        self.history: list[RuntimeEvent] = []

    def publish(self, event: RuntimeEvent) -> None:
        self.history.append(event)
        for q in list(self._queues):
            q.put_nowait(event)

    def close(self) -> None:
        for q in list(self._queues):
            q.put_nowait(None)

    def subscribe(self) -> EventSubscription:
        return EventSubscription(self)
