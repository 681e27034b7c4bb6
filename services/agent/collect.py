"""The agent's collector (issue 12 §4): what no ledger record owns any more is deleted, after a grace
period; nothing of a live incarnation is ever touched.

One pass (``Collector.collect``), run every ``--collect-interval`` seconds:

- **snapshot files** in the snapshot store (``<vm>.snap`` with its ``.disk.qcow2`` and partial
  files) that no ``snapshot`` reservation holds, untouched for ``--collect-grace`` seconds. A
  snapshot is held from before its hibernation writes a byte until the wake that restores it took (or
  the hibernated VM's removal): an unheld snapshot can never be taken again, so the grace only
  guards against other writers of a shared store.
- **VM directories** of the runtime (qemu) whose vm_id the ledger buried (removed, lost,
  hibernated) or that have no readable record, when no command works on the vm_id, the runtime runs
  nothing under it, and it is older than the grace period. A directory with a record and no
  tombstone (a ledger lost or replaced) is never collected: the inventory reports it and the
  reconciler adopts or removes it (rule 8).
- **addresses** (``ip`` reservations) whose vm_id has no ledger row and no hibernated tombstone
  (an agent that died between reserving and recording its intent), once the runtime confirms it has
  no VM under that id: released for their owner.
- **taps** this agent made (their alias says so) that no ledger VM uses.

Every check is made under the vm_id's lock (the executor's), so a command on the VM waits for the
collector or the collector skips the VM; sizes and counts go to the agent's metrics.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.agent.executor import SNAPSHOT_SUFFIXES, Executor, delete_snapshot_files
from services.agent.ledger import ADDRESS_KIND, Ledger
from services.agent.metrics import AgentMetrics
from services.agent.network import tap_name
from services.agent.runtime import Inconclusive, RuntimeFailure
from services.agent.runtime.netlink import delete_link
from shared.fence.schema import Fence

log = logging.getLogger("vmfence.agent.collect")

SNAPSHOT_EXT = ".snap"


@dataclass
class Collected:
    """What one pass found and freed."""

    snapshots: int = 0
    snapshot_bytes: int = 0
    vm_dirs: int = 0
    addresses: int = 0
    taps: int = 0
    held_snapshots: int = 0
    held_snapshot_bytes: int = 0
    kept: list[str] = field(default_factory=list)  # what was spared and why (diagnostics)


def snapshot_base(name: str) -> str | None:
    """``x.snap`` for every file of that snapshot (``x.snap``, ``x.snap.disk.qcow2``, ``x.snap.part``...)."""
    for suffix in sorted(SNAPSHOT_SUFFIXES, key=len, reverse=True):
        tail = SNAPSHOT_EXT + suffix
        if name.endswith(tail) and len(name) > len(tail):
            return name[: len(name) - len(suffix)] if suffix else name
    return None


def _scan_snapshots(snapshot_dir: str) -> dict[str, tuple[int, float]]:
    """Snapshot base path -> (bytes of all its files, newest mtime)."""
    out: dict[str, tuple[int, float]] = {}
    try:
        names = os.listdir(snapshot_dir)
    except FileNotFoundError:
        return out
    for name in names:
        base = snapshot_base(name)
        if base is None:
            continue
        try:
            st = os.stat(os.path.join(snapshot_dir, name))
        except FileNotFoundError:
            continue
        path = os.path.join(snapshot_dir, base)
        size, mtime = out.get(path, (0, 0.0))
        out[path] = (size + st.st_size, max(mtime, st.st_mtime))
    return out


@dataclass
class Collector:
    executor: Executor
    metrics: AgentMetrics
    grace_s: float = 600.0
    clock: Callable[[], float] = time.time

    @property
    def ledger(self) -> Ledger:
        return self.executor.ledger

    async def collect(self) -> Collected:
        out = Collected()
        await self._snapshots(out)
        await self._vm_dirs(out)
        await self._addresses(out)
        await self._taps(out)
        m = self.metrics
        m.snapshots.set(out.held_snapshots)
        m.snapshot_bytes.set(out.held_snapshot_bytes)
        for kind, n in (("snapshot", out.snapshots), ("vm_dir", out.vm_dirs), ("address", out.addresses),
                        ("tap", out.taps)):
            if n:
                m.collected.labels(kind=kind).inc(n)
        if out.snapshot_bytes:
            m.collected_bytes.inc(out.snapshot_bytes)
        held = await self.ledger.held(ADDRESS_KIND)
        net = self.executor.network
        m.addresses.labels(state="held").set(len(held))
        if net is not None and net.pool is not None:
            m.addresses.labels(state="free").set(max(0, net.pool.size - len(held)))
        if out.snapshots or out.vm_dirs or out.addresses or out.taps:
            log.info("collected %d snapshots (%d bytes), %d VM directories, %d addresses, %d taps",
                     out.snapshots, out.snapshot_bytes, out.vm_dirs, out.addresses, out.taps,
                     extra={"host": self.executor.host, "event": "collected"})
        return out

    # ------------------------------------------------------------------ snapshots
    async def _snapshots(self, out: Collected) -> None:
        snapdir = self.executor.snapshot_dir
        scanned = await asyncio.to_thread(_scan_snapshots, snapdir)
        now = self.clock()
        for path, (size, mtime) in sorted(scanned.items()):
            if await self.ledger.reservation_owner("snapshot", path) is not None:
                out.held_snapshots += 1
                out.held_snapshot_bytes += size
                continue
            if now - mtime < self.grace_s:
                out.kept.append(f"{path}: unheld, within the grace period")
                continue
            freed = await asyncio.to_thread(delete_snapshot_files, path)
            out.snapshots += 1
            out.snapshot_bytes += freed
            log.info("snapshot %s collected (%d bytes, no reservation)", path, freed,
                     extra={"host": self.executor.host, "event": "snapshot_collected"})

    # ------------------------------------------------------------------ VM directories
    async def _vm_dirs(self, out: Collected) -> None:
        ex = self.executor
        vms_dir = getattr(ex.driver, "vms_dir", None)
        if not isinstance(vms_dir, str) or not await asyncio.to_thread(os.path.isdir, vms_dir):
            return
        now = self.clock()
        for vm_id in sorted(await asyncio.to_thread(os.listdir, vms_dir)):
            if ex.ledger.vm(vm_id) is not None or ex.locks.busy(vm_id):
                continue
            async with ex.locks.hold(vm_id):
                if ex.ledger.vm(vm_id) is not None:
                    continue  # a command made it meanwhile
                d = os.path.join(vms_dir, vm_id)
                tomb = ex.ledger.tombstone(vm_id)
                has_record = await asyncio.to_thread(os.path.isfile, os.path.join(d, "spec.json"))
                if tomb is None and has_record:
                    out.kept.append(f"{vm_id}: a record the ledger does not know (reported, never collected)")
                    continue
                try:
                    mtime = os.stat(d).st_mtime
                except FileNotFoundError:
                    continue
                if now - mtime < self.grace_s:
                    continue
                try:
                    info = await ex.timed(ex.driver.inspect(vm_id))
                except (Inconclusive, RuntimeFailure, TimeoutError):
                    continue
                if info is not None and info.state in ("running", "paused", "creating"):
                    out.kept.append(f"{vm_id}: buried but the runtime runs it")
                    continue
                try:
                    await ex.timed(ex.driver.remove(vm_id))
                except (RuntimeFailure, TimeoutError) as e:
                    log.warning("VM directory %s not collected: %s", vm_id, e, extra={"vm_id": vm_id})
                    continue
                out.vm_dirs += 1

    # ------------------------------------------------------------------ addresses
    async def _addresses(self, out: Collected) -> None:
        ex = self.executor
        if ex.network is None:
            return
        rows = await ex.ledger.reserved_since(ADDRESS_KIND)
        now = self.clock()
        for ip, vm_id, uid, epoch, at in rows:
            if ex.ledger.vm(vm_id) is not None or ex.locks.busy(vm_id) or now - at < self.grace_s:
                continue
            tomb = ex.ledger.tombstone(vm_id)
            if tomb is not None and tomb.reason == "hibernated":
                continue  # kept with its snapshot until the wake or the removal
            async with ex.locks.hold(vm_id):
                if ex.ledger.vm(vm_id) is not None:
                    continue
                try:
                    info = await ex.timed(ex.driver.inspect(vm_id))
                except (Inconclusive, RuntimeFailure, TimeoutError):
                    continue
                if info is not None:
                    continue  # the runtime has a VM under it: never taken from it
                owner = Fence(tomb.fence.key if tomb else "", uid, epoch)
                if await ex.ledger.release(ADDRESS_KIND, ip, vm_id, owner):
                    out.addresses += 1
                    log.info("address %s of %s released (no VM has it)", ip, vm_id, extra={"vm_id": vm_id})

    # ------------------------------------------------------------------ taps
    async def _taps(self, out: Collected) -> None:
        ex = self.executor
        net = ex.network
        if net is None or not net.taps:
            return
        # listed before the VMs are looked at: a tap is made only after its VM's intent row, so a
        # tap seen here whose row is not in the ledger afterwards has no VM coming for it
        ours = await net.stray_taps(())
        used = {tap_name(net.bridge, r.vm_id) for r in ex.ledger.vms()}
        running = {tap_name(net.bridge, i.vm_id) for i in await ex.timed(ex.driver.list())}
        for name in ours:
            if name not in used and name not in running and await delete_link(name, net.bridge):
                out.taps += 1
