"""Issue 10, finding 9, with real QEMU (TCG): a VM's VNC display requires its own password, listens
where configured, and everything the driver keeps of a guest is the agent user's alone — files
0600 (record, disk overlay, serial/firmware/QEMU logs, pidfile; snapshot RAM and disk), directories
0700, the QMP socket without group/world bits. Measured under the default umask 022, where an
unguarded create gives 0644 files and 0755 directories."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from services.agent.runtime import VMSpec
from services.agent.runtime.pool import VNC_PASSWORD_CHARS, DisplayPool
from services.agent.runtime.qemu import QemuDriver

from .conftest import needs_qemu
from .rfb import OPENSSL, SEC_VNC_AUTH, security_types, vnc_login

pytestmark = [pytest.mark.qemu, needs_qemu, pytest.mark.skipif(OPENSSL is None, reason="openssl not installed")]

LABELS = {"vmfence.io/key": "default/web", "vmfence.io/uid": "uid-1", "vmfence.io/epoch": "3"}
DISPLAYS = range(70, 90)  # ports 5970-5989
VM_FILES = ("spec.json", "disk.qcow2", "serial.log", "firmware.log", "qemu.log", "qemu.pid")


def mode(path: str | Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def modes(d: str, names: tuple[str, ...]) -> dict[str, str]:
    return {n: oct(mode(os.path.join(d, n))) for n in names}


@pytest.fixture(autouse=True)
def umask_022() -> None:
    """The usual umask: what an unguarded file would get is 0644 (so the test sees the guard)."""
    old = os.umask(0o022)
    os.umask(old)
    assert old == 0o022, f"this test wants the default umask 022, the process has {old:03o}"


async def test_vnc_requires_the_vms_own_password_and_files_are_private(
    state_dir: Path, tmp_path: Path
) -> None:
    drv = QemuDriver(state_dir=str(state_dir), accel="tcg", vnc_displays=DISPLAYS, reconcile_interval=0)
    await drv.open()
    try:
        a = await drv.create(VMSpec(vm_id="vnc-a", vnc=True, labels=LABELS))
        b = await drv.create(VMSpec(vm_id="vnc-b", vnc=True, labels=LABELS))
        assert a.vnc_display is not None and b.vnc_display is not None
        assert a.vnc_password and b.vnc_password and len(a.vnc_password) == VNC_PASSWORD_CHARS
        assert a.vnc_password != b.vnc_password
        port = DisplayPool.BASE_PORT + a.vnc_display
        # the display offers VNC Authentication only (never "None"), and only its own password passes
        assert await security_types("127.0.0.1", port) == [SEC_VNC_AUTH]
        assert await vnc_login("127.0.0.1", port, a.vnc_password)
        assert not await vnc_login("127.0.0.1", port, b.vnc_password)
        assert not await vnc_login("127.0.0.1", port, "")
        pid = int(read(os.path.join(drv.vm_dir("vnc-a"), "qemu.pid")))
        cmdline = read(f"/proc/{pid}/cmdline").split(b"\0")
        assert f"127.0.0.1:{a.vnc_display},password=on".encode() in cmdline  # loopback by default

        # files 0600, directories 0700, the QMP socket the agent user's alone
        d = drv.vm_dir("vnc-a")
        assert modes(d, VM_FILES) == dict.fromkeys(VM_FILES, "0o600")
        sock = os.path.join(d, "qmp.sock")
        assert stat.S_ISSOCK(os.lstat(sock).st_mode) and mode(sock) & 0o077 == 0, oct(mode(sock))
        for directory in (state_dir, drv.vms_dir, d, os.path.dirname(drv.base_image)):
            assert mode(directory) == 0o700, (directory, oct(mode(directory)))
        assert mode(drv.base_image) == 0o600

        # a restart in place sets the same password again (QEMU keeps it in memory only)
        await drv.stop("vnc-a")
        again = await drv.start("vnc-a")
        assert again.vnc_display == a.vnc_display and again.vnc_password == a.vnc_password
        assert await vnc_login("127.0.0.1", port, a.vnc_password)
        assert not await vnc_login("127.0.0.1", port, b.vnc_password)

        # hibernate: guest RAM and disk in the store 0600, the store's new directory 0700
        store = tmp_path / "snapshots" / "host"
        dest = str(store / "vnc-a.snap")
        snap = await drv.snapshot("vnc-a", dest)
        assert mode(store) == 0o700
        assert mode(snap.path) == 0o600 and mode(f"{snap.path}.disk.qcow2") == 0o600
        # wake: a new VM, its overlay from the snapshot 0600, a display with a password again
        woken = await drv.restore(VMSpec(vm_id="vnc-c", vnc=True, labels=LABELS), snap.path)
        assert woken.vnc_display is not None and woken.vnc_password
        assert modes(drv.vm_dir("vnc-c"), VM_FILES) == dict.fromkeys(VM_FILES, "0o600")
        wport = DisplayPool.BASE_PORT + woken.vnc_display
        assert await security_types("127.0.0.1", wport) == [SEC_VNC_AUTH]
        assert await vnc_login("127.0.0.1", wport, woken.vnc_password)
        # the driver's record carries the password for relaunches, and is 0600 like every file
        assert woken.vnc_password.encode() in read(os.path.join(drv.vm_dir("vnc-c"), "spec.json"))
    finally:
        for vm in ("vnc-a", "vnc-b", "vnc-c"):
            await drv.remove(vm)
        await drv.close()


async def test_vnc_listens_on_the_configured_address(state_dir: Path) -> None:
    drv = QemuDriver(state_dir=str(state_dir), accel="tcg", vnc_displays=DISPLAYS, vnc_listen="127.0.0.2",
                     reconcile_interval=0)
    await drv.open()
    try:
        info = await drv.create(VMSpec(vm_id="vnc-l", vnc=True, labels=LABELS))
        assert info.vnc_display is not None and info.vnc_password
        port = DisplayPool.BASE_PORT + info.vnc_display
        assert await vnc_login("127.0.0.2", port, info.vnc_password)
        with pytest.raises(OSError):  # not on the other loopback address
            await security_types("127.0.0.1", port)
    finally:
        await drv.remove("vnc-l")
        await drv.close()
