"""Which accelerator QEMU gets: ``kvm`` or ``tcg`` as configured, or for ``auto`` a probe (once,
cached in ``state_dir/accel.json`` per QEMU version and guest kernel) that runs real guests under
KVM, because nested KVM has been seen to hang guests that firmware-only checks let through."""

# The probe fork/exec's QEMU directly from the event loop (see driver.py for why) and reads small
# local files: hence
# ruff: noqa: ASYNC109, ASYNC220, ASYNC230

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

import msgspec

from ..base import RuntimeFailure
from .files import file_contains, image_files, kill_pidfile, write_atomic

log = logging.getLogger("vmfence.agent.runtime.qemu")

REPO_GUEST_IMAGE = Path(__file__).resolve().parents[4] / "build" / "guest"

# A 512-byte boot sector (see accel_probe_bootsector.S in the docstring of _BOOT_SECTOR_SRC):
# real mode -> protected mode -> long mode with 2 MiB identity pages over 1 GiB, writes and reads
# back every 4 KiB page from 2 to 48 MiB, printing R P L W K on the debugcon port 0x402.
_BOOT_SECTOR_HEX = (
    "fa31c08ed88ed0bc007cba0204b052ee0f0116207d0f20c06683c8010f22c0ea247c080066b810008ed88ec08ed0"
    "66ba0204b050eebf0010000031c0b9000c0000f3abc7050010000003200000c7050020000003300000bf00300000"
    "b883000000b9000200008907c7470400000000050000200083c7084975ecb8001000000f22d80f20e083c8200f22"
    "e0b9800000c00f320d000100000f300f20c00d000000800f22c0eaab7c0000180066ba0204b04cee48c7c7000020"
    "0048893f4881c7001000004881ff0000000372edb057ee48c7c70000200048393f75194881c7001000004881ff00"
    "00000372ebb04beeb00aeef4ebfdb058eeebf88db426000000000000000000000000ffff0000009acf00ffff0000"
    "0092cf00ffff0000009aaf001f00007d"
)
_BOOT_SECTOR_OK = b"RPLWK"


def _boot_sector() -> bytes:
    code = bytes.fromhex(_BOOT_SECTOR_HEX)
    return code + b"\0" * (510 - len(code)) + b"\x55\xaa"


def _kvm_usable() -> str | None:
    """None if /dev/kvm can be opened read-write, else why not."""
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        return f"/dev/kvm: {e.strerror}"
    os.close(fd)
    return None


class AccelProbe:
    """Resolves the accelerator once per driver; ``accel``/``reason`` say what it picked and why."""

    def __init__(
        self,
        *,
        state_dir: str,
        requested: str,
        qemu_binary: str,
        machine: str,
        probe_image: str | None,
        probe_kernel: bool,
        kernel_probe_timeout: float,
    ) -> None:
        self.state_dir = state_dir
        self.requested = requested
        self.qemu_binary = qemu_binary
        self.machine = machine
        self.probe_image = probe_image
        self.probe_kernel = probe_kernel
        self.kernel_probe_timeout = kernel_probe_timeout
        self.accel: str | None = None  # resolved accel ("kvm" | "tcg")
        self.reason: str = ""
        self._lock = asyncio.Lock()

    async def resolve(self) -> str:
        """The accelerator to use; for accel=auto, probe once (cached in state_dir)."""
        if self.accel is not None:
            return self.accel
        async with self._lock:
            if self.accel is not None:
                return self.accel
            if self.requested != "auto":
                self.accel, self.reason = self.requested, "configured"
                return self.accel
            self.accel, self.reason = await self._probe_accel()
            log.info("accel=auto picked %s (%s)", self.accel, self.reason)
            return self.accel

    def _probe_kernel(self) -> tuple[str, str] | None:
        if not self.probe_kernel:
            return None
        for cand in (self.probe_image, os.environ.get("VMFENCE_GUEST_IMAGE"), str(REPO_GUEST_IMAGE)):
            if cand and (files := image_files(cand)):
                return files
        return None

    async def _probe_accel(self) -> tuple[str, str]:
        cache = os.path.join(self.state_dir, "accel.json")
        kernel = self._probe_kernel()
        version = await self._qemu_version()
        try:
            with open(cache, "rb") as f:
                cached = msgspec.json.decode(f.read())
            if (
                cached.get("qemu") == version
                and cached.get("kernel") == (kernel[0] if kernel else None)
                and cached.get("accel") in ("kvm", "tcg")
            ):
                return cached["accel"], f"cached: {cached.get('reason', '')}"
        except (FileNotFoundError, msgspec.DecodeError, AttributeError):
            pass
        t0 = time.monotonic()
        accel, reason = await self._probe_kvm(kernel)
        reason = f"{reason} ({time.monotonic() - t0:.2f}s)"
        os.makedirs(self.state_dir, exist_ok=True)
        write_atomic(
            cache,
            msgspec.json.encode(
                {"accel": accel, "reason": reason, "qemu": version, "kernel": kernel[0] if kernel else None}
            ),
        )
        return accel, reason

    async def _qemu_version(self) -> str:
        try:
            p = await asyncio.create_subprocess_exec(
                self.qemu_binary, "--version", stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
            )
            out, _ = await p.communicate()
            return out.decode(errors="replace").splitlines()[0] if out else "unknown"
        except OSError as e:
            raise RuntimeFailure(f"cannot run {self.qemu_binary}: {e}") from e

    async def _probe_kvm(self, kernel: tuple[str, str] | None) -> tuple[str, str]:
        why = _kvm_usable()
        if why is not None:
            return "tcg", f"kvm unusable: {why}"
        pdir = os.path.join(self.state_dir, "accel-probe")
        kill_pidfile(os.path.join(pdir, "probe.pid"))  # a probe left by an agent that died mid-probe
        shutil.rmtree(pdir, ignore_errors=True)
        os.makedirs(pdir)
        img = os.path.join(pdir, "boot.img")
        with open(img, "wb") as f:
            f.write(_boot_sector())
        # Stage 1: the boot sector must get through real -> protected -> long mode and touch memory.
        dbg = os.path.join(pdir, "debugcon.log")
        ok = await self._run_probe_vm(
            [
                "-machine", "pc,accel=kvm", "-m", "64",
                "-drive", f"file={img},format=raw,if=ide",
                "-debugcon", f"file:{dbg}", "-global", "isa-debugcon.iobase=0x402",
            ],
            dbg, (_BOOT_SECTOR_OK,), 5.0,
        )  # fmt: skip
        if not ok:
            return "tcg", "kvm probe: boot sector did not reach long mode"
        if kernel is None:
            return "kvm", "kvm probe: boot sector reached long mode (no guest kernel to try)"
        # Stage 2: a real Linux kernel must reach userspace (guests have been seen to hang right
        # after the kernel starts under nested KVM while firmware runs fine).
        ser = os.path.join(pdir, "serial.log")
        ok = await self._run_probe_vm(
            [
                "-machine", f"{self.machine},accel=kvm", "-m", "256",
                "-kernel", kernel[0], "-initrd", kernel[1],
                "-append", "console=ttyS0 earlyprintk=serial,ttyS0 panic=-1",
                "-serial", f"file:{ser}", "-no-reboot",
            ],
            ser, (b"Run /init as init process", b"VMFENCE-READY"), self.kernel_probe_timeout,
        )  # fmt: skip
        if not ok:
            return "tcg", "kvm probe: guest kernel did not reach userspace under kvm"
        return "kvm", "kvm probe: boot sector and guest kernel ran under kvm"

    async def _run_probe_vm(
        self, extra: list[str], out_file: str, needles: tuple[bytes, ...], timeout: float
    ) -> bool:
        pidfile = os.path.join(os.path.dirname(out_file), "probe.pid")
        args = [
            self.qemu_binary, "-nodefaults", "-no-user-config", "-display", "none", "-pidfile", pidfile, *extra
        ]
        with open(f"{out_file}.stderr", "wb") as err:
            proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                start_new_session=True,
            )  # fmt: skip
        try:
            deadline = time.monotonic() + timeout
            delay = 0.01
            while time.monotonic() < deadline:
                if file_contains(out_file, needles):
                    return True
                if proc.poll() is not None:
                    return file_contains(out_file, needles)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.1)
            return False
        finally:
            if proc.poll() is None:
                proc.kill()
            await asyncio.to_thread(proc.wait)
