"""Migration to and from a file: hibernate = stop the CPUs and migrate RAM + device state into the
snapshot store, wake = a new QEMU started with ``-incoming defer`` loads it and resumes (rule 10).
The disk overlay travels beside the memory file as ``<snapshot>.disk.qcow2``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import time

from ..base import RuntimeFailure
from .files import tail
from .process import VM, Qemu


def snapshot_disk(snapshot: str) -> str:
    """Where a snapshot's disk overlay is kept."""
    return f"{snapshot}.disk.qcow2"


class Migration:
    """Moves a VM's state out to a file and back in, over its QMP connection."""

    def __init__(self, qemu: Qemu, *, timeout: float) -> None:
        self.qemu = qemu
        self.timeout = timeout

    async def save(self, vm: VM, part: str) -> None:
        """Stop the CPUs and migrate into ``part``; on any failure the VM runs on and ``part`` is gone."""
        await self.qemu.qmp(vm, "stop")
        try:
            await self.qemu.qmp(vm, "migrate", {"uri": f"exec:cat > {shlex.quote(part)}"})
            await self._wait_out(vm)
        except BaseException:
            with contextlib.suppress(Exception):
                await self.qemu.qmp(vm, "cont")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(part)
            raise

    async def load(self, vm: VM, src: str) -> None:
        """Feed ``src`` to a QEMU launched with ``incoming``; on return the VM runs."""
        await self.qemu.qmp(vm, "migrate-incoming", {"uri": f"exec:cat {shlex.quote(src)}"})
        await self._wait_in(vm)

    async def _wait_out(self, vm: VM) -> None:
        deadline = time.monotonic() + self.timeout
        delay = 0.005
        while True:
            info = await self.qemu.qmp(vm, "query-migrate")
            status = info.get("status")
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                raise RuntimeFailure(f"{vm.vm_id}: migration {status}: {info.get('error-desc', '')}")
            if time.monotonic() > deadline:
                raise RuntimeFailure(f"{vm.vm_id}: migration not done after {self.timeout}s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)

    async def _wait_in(self, vm: VM) -> None:
        deadline = time.monotonic() + self.timeout
        delay = 0.005
        while True:
            st = (await self.qemu.qmp(vm, "query-status"))["status"]
            if st == "running":
                vm.state = "running"
                return
            if st != "inmigrate":
                mig = await self.qemu.qmp(vm, "query-migrate")
                mstatus = mig.get("status")
                if mstatus in ("failed", "cancelled"):
                    why = mig.get("error-desc", "")
                    raise RuntimeFailure(f"{vm.vm_id}: incoming migration {mstatus}: {why}")
                if mstatus == "completed" and st in ("paused", "postmigrate", "prelaunch"):
                    await self.qemu.qmp(vm, "cont")
            if not self.qemu.alive(vm):
                raise RuntimeFailure(f"{vm.vm_id}: qemu exited during incoming migration: "
                                     f"{tail(os.path.join(vm.dir, 'qemu.log'))}")
            if time.monotonic() > deadline:
                raise RuntimeFailure(f"{vm.vm_id}: incoming migration not done after {self.timeout}s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)
