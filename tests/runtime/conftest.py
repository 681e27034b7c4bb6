"""Fixtures for the runtime driver tests. Every QEMU a test starts is killed by pidfile at the end."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from services.agent.runtime.qemu import REPO_GUEST_IMAGE, QemuDriver

QEMU = shutil.which("qemu-system-x86_64")
QEMU_IMG = shutil.which("qemu-img")
needs_qemu = pytest.mark.skipif(
    QEMU is None or QEMU_IMG is None, reason="qemu-system-x86_64 / qemu-img not installed"
)


def guest_image() -> str | None:
    cand = os.environ.get("VMFENCE_GUEST_IMAGE") or str(REPO_GUEST_IMAGE)
    if os.path.isfile(os.path.join(cand, "vmlinuz")) and os.path.isfile(
        os.path.join(cand, "initramfs.cpio.gz")
    ):
        return cand
    return None


def kill_leftovers(state_dir: str | Path) -> list[int]:
    """SIGKILL every QEMU whose pidfile is under state_dir (only if /proc confirms it is that QEMU)."""
    killed = []
    for pidfile in glob.glob(os.path.join(str(state_dir), "**", "qemu.pid"), recursive=True):
        try:
            pid = int(Path(pidfile).read_text().strip())
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if pidfile.encode() in cmd:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    return killed


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "state"
    d.mkdir()
    yield d
    kill_leftovers(d)


@pytest.fixture
async def qdriver(state_dir: Path) -> AsyncIterator[QemuDriver]:
    drv = QemuDriver(state_dir=str(state_dir), accel="tcg", reconcile_interval=0.2)
    await drv.open()
    yield drv
    await drv.close()
