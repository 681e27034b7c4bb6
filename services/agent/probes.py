"""Readiness probes: one loop per running VM, each carrying the fence it was started under.

A probe result is published only if it changed *and* the probe's fence is still the VM's owner in
the ledger, checked right before publishing — so a probe that started before an adopt moved the VM
to a newer incarnation never reports for the superseded one (the seed provider's bug: a late probe
writing the successor's readiness).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from services.agent.ledger import Ledger
from services.agent.logs import fence_fields
from services.agent.runtime import Inconclusive, RuntimeDriver, RuntimeFailure
from shared.fence.schema import Fence, ProbeChanged
from shared.tasks import cancel_and_wait

log = logging.getLogger("vmfence.agent.probes")

PROBED_STATES = ("running", "paused")

Publish = Callable[[ProbeChanged], Awaitable[None]]


class Prober:
    """Supervises per-VM probe loops inside its own TaskGroup (no ownerless tasks)."""

    def __init__(self, ledger: Ledger, driver: RuntimeDriver, host: str, publish: Publish, *,
                 interval: float, timeout: float) -> None:
        self.ledger = ledger
        self.driver = driver
        self.host = host
        self.publish = publish
        self.interval = interval
        self.timeout = timeout
        self._kick = asyncio.Event()
        self._tasks: dict[str, asyncio.Task[None]] = {}  # the one current loop per VM (a replaced one ends itself)
        self._touched: set[str] = set()
        self._probed: dict[str, tuple[Fence, bool]] = {}  # vm_id -> its last readiness, and the fence

    def readiness(self, vm_id: str, fence: Fence) -> bool | None:
        """The readiness last probed for ``vm_id`` under ``fence`` while it runs (inventories repeat
        it: a ProbeChanged may have been decided before the VM's binding, reordered by a redelivery)."""
        got = self._probed.get(vm_id)
        return got[1] if got is not None and got[0] == fence else None

    def kick(self, vm_id: str | None = None) -> None:
        """The ledger changed for ``vm_id`` (a command finished): start/stop its loop now, not at
        the next full sweep. Only that VM is looked at, so a bring-up of N VMs costs O(N)."""
        if vm_id is not None:
            self._touched.add(vm_id)
        self._kick.set()

    def restart(self, vm_id: str) -> None:
        """The VM was (re)started: probe it afresh, so its readiness is reported again even if an
        exit and restart both fell between two probes (the reconciler forgot readiness at the exit)."""
        task = self._tasks.pop(vm_id, None)
        if task is not None:
            task.cancel()
        self.kick(vm_id)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        async with asyncio.TaskGroup() as tg:
            try:
                next_sweep = 0.0
                while True:
                    if loop.time() >= next_sweep:
                        self._sync(tg)
                        next_sweep = loop.time() + self.interval
                    else:
                        for vm_id in self._touched:
                            self._sync_one(tg, vm_id)
                    self._touched.clear()
                    self._kick.clear()
                    try:
                        await asyncio.wait_for(self._kick.wait(), max(0.0, next_sweep - loop.time()))
                    except TimeoutError:
                        pass
            finally:  # each ended for sure: a TaskGroup cancels only once, and waits for all
                await cancel_and_wait(list(self._tasks.values()), what="probe loop")

    def _sync_one(self, tg: asyncio.TaskGroup, vm_id: str) -> None:
        row = self.ledger.vm(vm_id)
        task = self._tasks.get(vm_id)
        wanted = row is not None and row.state in PROBED_STATES
        if task is not None and (task.done() or not wanted):
            task.cancel()
            del self._tasks[vm_id]
            task = None
        if wanted and task is None:
            self._tasks[vm_id] = tg.create_task(self._loop(vm_id), name=f"probe-{vm_id}")

    def _sync(self, tg: asyncio.TaskGroup) -> None:
        want = {r.vm_id for r in self.ledger.vms() if r.state in PROBED_STATES}
        for vm_id, task in list(self._tasks.items()):
            if task.done() or vm_id not in want:
                task.cancel()
                del self._tasks[vm_id]
        for vm_id in want - self._tasks.keys():
            self._tasks[vm_id] = tg.create_task(self._loop(vm_id), name=f"probe-{vm_id}")

    async def _loop(self, vm_id: str) -> None:
        """Probe until the VM stops being probed or this loop is replaced. A replaced loop was
        cancelled, but on Python 3.11 a cancel racing a publish's answer can be swallowed (see
        shared.tasks): it then ends here, rather than probe on beside its successor."""
        last: dict[Fence, bool] = {}
        while self._tasks.get(vm_id) is asyncio.current_task():
            row = self.ledger.vm(vm_id)
            if row is None or row.state not in PROBED_STATES:
                self._probed.pop(vm_id, None)  # a VM not probed has no readiness to repeat
                return
            fence = row.fence  # the fence this probe runs under
            try:
                ready = await asyncio.wait_for(self.driver.probe(vm_id), self.timeout)
            except (RuntimeFailure, Inconclusive, TimeoutError) as e:
                log.debug("probe failed: %s", e, extra=fence_fields(fence, vm_id))
                ready = False
            # right before publishing: is this probe's fence still the owner?
            if self.ledger.owner(vm_id) != fence:
                log.info("probe result dropped: its fence was superseded",
                         extra=fence_fields(fence, vm_id, event="probe_superseded"))
            elif last.get(fence) != ready:
                self._probed[vm_id] = (fence, ready)
                try:
                    await self.publish(ProbeChanged(fence=fence, host=self.host, vm_id=vm_id, ready=ready))
                    last[fence] = ready
                except Exception as e:  # the next round retries
                    log.warning("probe change not published: %r", e, extra=fence_fields(fence, vm_id))
            await asyncio.sleep(self.interval)
