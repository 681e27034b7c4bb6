"""Disks: one blank qcow2 base (made once) and a qcow2 overlay per VM on top of it. QEMU's image
locking makes a second process on the same overlay fail, which is what keeps one VM one VM."""

# Existence checks of local files are sub-millisecond: hence
# ruff: noqa: ASYNC240

from __future__ import annotations

import asyncio
import os
import subprocess

from ..base import RuntimeFailure
from .files import FILE_MODE, copy_private, private_dir

OVERLAY = "disk.qcow2"


def overlay(vm_dir: str) -> str:
    """The VM's disk overlay."""
    return os.path.join(vm_dir, OVERLAY)


async def run_tool(*args: str) -> str:
    """Run a short-lived tool (qemu-img) to its end; its output, or RuntimeFailure saying why not."""
    p = await asyncio.create_subprocess_exec(
        *args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    out, _ = await p.communicate()
    text = out.decode(errors="replace").strip()
    if p.returncode != 0:
        raise RuntimeFailure(f"{os.path.basename(args[0])} failed ({p.returncode}): {text}")
    return text


class Disks:
    """The base image under ``state_dir/base`` and the overlays in VM directories."""

    def __init__(self, *, state_dir: str, qemu_img: str, base_disk_mib: int) -> None:
        self.state_dir = state_dir
        self.qemu_img = qemu_img
        self.base_disk_mib = base_disk_mib
        self._base_lock = asyncio.Lock()

    @property
    def base_image(self) -> str:
        return os.path.join(self.state_dir, "base", "blank.qcow2")

    async def _ensure_base(self) -> str:
        base = self.base_image
        if os.path.exists(base):
            return base
        async with self._base_lock:
            if not os.path.exists(base):
                private_dir(os.path.dirname(base))
                tmp = f"{base}.{os.getpid()}.tmp"
                await run_tool(self.qemu_img, "create", "-q", "-f", "qcow2", tmp, f"{self.base_disk_mib}M")
                os.chmod(tmp, FILE_MODE)
                os.replace(tmp, base)
        return base

    async def create_overlay(self, vm_dir: str) -> None:
        base = await self._ensure_base()
        await run_tool(self.qemu_img, "create", "-q", "-f", "qcow2", "-b", base, "-F", "qcow2", overlay(vm_dir))
        os.chmod(overlay(vm_dir), FILE_MODE)  # the guest's disk (in a 0700 directory from the start)

    @staticmethod
    async def save(vm_dir: str, dest: str) -> None:
        """Copy the VM's overlay to ``dest`` (a hibernation keeps its disk beside its memory)."""
        await asyncio.to_thread(copy_private, overlay(vm_dir), dest)

    async def restore(self, vm_dir: str, saved: str) -> None:
        """The VM's overlay from ``saved`` if there is one, else a fresh overlay."""
        if os.path.isfile(saved):
            await asyncio.to_thread(copy_private, saved, overlay(vm_dir))
        else:
            await self.create_overlay(vm_dir)
