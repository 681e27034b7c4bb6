"""The ``qemu`` runtime driver: every VM is a real QEMU process driven over QMP (qemu.qmp).

Layout under ``state_dir``::

    base/blank.qcow2            blank base disk, created once, overlaid by every VM
    accel.json                  cached result of the accel=auto probe
    vms/<vm_id>/spec.json       the VM's record (spec + runtime assignments); open() rediscovers from it
    vms/<vm_id>/disk.qcow2      qcow2 overlay (qemu-img create -f qcow2 -b <base> -F qcow2)
    vms/<vm_id>/qmp.sock        QMP socket (bound by the driver, handed to QEMU as a listening fd)
    vms/<vm_id>/qemu.pid        QEMU's pidfile (QEMU holds a lock on it while it runs)
    vms/<vm_id>/serial.log      guest serial console
    vms/<vm_id>/firmware.log    SeaBIOS output (debugcon port 0x402)
    vms/<vm_id>/qemu.log        QEMU's stderr

QEMU runs in its own session (``start_new_session``) so it outlives the agent; ``close()`` only
drops connections. Exit detection: the QMP connection's EOF (then ``waitpid`` when the VM is our
child, or a /proc pid check when it was rediscovered) plus a periodic reconciliation that also
notices VM directories that vanished (-> VMGoneEvent).
"""

# The driver does small, local file operations (spec.json, pidfiles, /proc) and fork/exec's QEMU
# directly from the event loop: each is sub-millisecond, and QEMU must not be an asyncio
# subprocess (asyncio kills its children when their transport is closed). Hence:
# ruff: noqa: ASYNC109, ASYNC220, ASYNC230, ASYNC240

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec
from qemu.qmp import QMPClient
from qemu.qmp.protocol import Runstate

from .base import (
    EventHub,
    EventSubscription,
    Inconclusive,
    RuntimeFailure,
    SnapshotInfo,
    VMExitedEvent,
    VMGoneEvent,
    VMInfo,
    VMSpec,
    VMState,
    check_spec,
    check_vm_id,
)
from .pool import DisplayPool, vnc_owner

log = logging.getLogger("vmfence.agent.runtime.qemu")

GUEST_IP = "10.0.2.15"
REPO_GUEST_IMAGE = Path(__file__).resolve().parents[3] / "build" / "guest"

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


# ---------------------------------------------------------------------------------------------
# small helpers (synchronous; cheap file operations)
# ---------------------------------------------------------------------------------------------



def _kill_pidfile(path: str) -> None:
    """SIGKILL the process a pidfile names, if it is still a QEMU (pids are reused)."""
    try:
        with open(path) as f:
            pid = int(f.read().strip())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"qemu" not in f.read():
                return
        os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError):
        pass

class _Record(msgspec.Struct):
    """spec.json: what open() needs to rediscover a VM and start() needs to relaunch it."""

    spec: VMSpec
    accel: str = "tcg"
    vnc_display: int | None = None
    vnc_owner: str | None = None
    probe_host_port: int | None = None
    exit_code: int | None = None
    exit_signal: int | None = None
    stopped: bool = False
    created_at: float = 0.0


def _write_json_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _read_record(vm_dir: str) -> _Record | None:
    try:
        with open(os.path.join(vm_dir, "spec.json"), "rb") as f:
            return msgspec.json.decode(f.read(), type=_Record)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except msgspec.DecodeError as e:
        log.warning("unreadable spec.json in %s: %s", vm_dir, e)
        return None


def _read_pidfile(vm_dir: str) -> int | None:
    try:
        with open(os.path.join(vm_dir, "qemu.pid")) as f:
            return int(f.read().strip() or "0") or None
    except (FileNotFoundError, ValueError, NotADirectoryError):
        return None


def _proc_state(pid: int) -> str | None:
    """The /proc state letter of pid, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat[stat.rindex(")") + 2 :].split(" ", 1)[0]


def _is_our_qemu(pid: int, vm_dir: str) -> bool:
    """pid is alive (not a zombie) and is the QEMU of vm_dir (guards against pid reuse)."""
    st = _proc_state(pid)
    if st is None or st in ("Z", "X"):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return False
    return os.path.join(vm_dir, "qemu.pid").encode() in cmd


def _tail(path: str, n: int = 800) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""


@contextlib.contextmanager
def _short_path(path: str) -> Iterator[str]:
    """AF_UNIX paths are limited to 108 bytes: reach long ones through /proc/self/fd/<dirfd>."""
    if len(os.fsencode(path)) < 100:
        yield path
        return
    fd = os.open(os.path.dirname(path), os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{os.path.basename(path)}"
    finally:
        os.close(fd)


def _free_tcp_port() -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
    finally:
        s.close()


def _kvm_usable() -> str | None:
    """None if /dev/kvm can be opened read-write, else why not."""
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        return f"/dev/kvm: {e.strerror}"
    os.close(fd)
    return None


def _image_files(image: str) -> tuple[str, str] | None:
    k, i = os.path.join(image, "vmlinuz"), os.path.join(image, "initramfs.cpio.gz")
    if os.path.isfile(k) and os.path.isfile(i):
        return k, i
    return None


def _file_contains(path: str, needles: tuple[bytes, ...]) -> bool:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return False
    return any(n in data for n in needles)


# ---------------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _VM:
    vm_id: str
    dir: str
    record: _Record
    state: VMState = "creating"
    pid: int | None = None
    proc: subprocess.Popen[bytes] | None = None
    qmp: QMPClient | None = None
    watcher: asyncio.Task[None] | None = None
    expected_exit: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def spec(self) -> VMSpec:
        return self.record.spec


_STATUS_MAP: dict[str, VMState] = {
    "running": "running",
    "inmigrate": "creating",
    "prelaunch": "creating",
    "shutdown": "exited",
}


class QemuDriver:
    """Runs each VM as its own QEMU process. See the module docstring for the on-disk layout."""

    name = "qemu"

    def __init__(
        self,
        *,
        state_dir: str,
        accel: Literal["auto", "kvm", "tcg"] = "auto",
        machine: str = "q35",
        qemu_binary: str = "qemu-system-x86_64",
        qemu_img: str = "qemu-img",
        vnc_displays: range = range(10, 110),
        display_pool: DisplayPool | None = None,
        reconcile_interval: float = 2.0,
        qmp_timeout: float = 5.0,
        start_timeout: float = 15.0,
        stop_timeout: float = 5.0,
        migrate_timeout: float = 120.0,
        probe_image: str | None = None,
        probe_kernel: bool = True,
        kernel_probe_timeout: float = 8.0,
        probe_request: bytes = b"GET / HTTP/1.0\r\n\r\n",
        probe_timeout: float = 2.0,
        kernel_append: str = "console=ttyS0 quiet",
        tcg_tb_size_mib: int = 64,
        nic_model: str = "virtio-net-pci",
        base_disk_mib: int = 64,
    ) -> None:
        if accel not in ("auto", "kvm", "tcg"):
            raise ValueError(f"accel must be auto, kvm or tcg, not {accel!r}")
        self.state_dir = os.path.abspath(state_dir)
        self.vms_dir = os.path.join(self.state_dir, "vms")
        self.accel_requested = accel
        self.machine = machine
        self.qemu_binary = shutil.which(qemu_binary) or qemu_binary
        self.qemu_img = shutil.which(qemu_img) or qemu_img
        self.displays = display_pool if display_pool is not None else DisplayPool(vnc_displays)
        self.reconcile_interval = reconcile_interval
        self.qmp_timeout = qmp_timeout
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.migrate_timeout = migrate_timeout
        self.probe_image = probe_image
        self.probe_kernel = probe_kernel
        self.kernel_probe_timeout = kernel_probe_timeout
        self.probe_request = probe_request
        self.probe_timeout = probe_timeout
        self.kernel_append = kernel_append
        self.tcg_tb_size_mib = tcg_tb_size_mib
        self.nic_model = nic_model
        self.base_disk_mib = base_disk_mib
        self.accel: str | None = None  # resolved accel ("kvm" | "tcg")
        self.accel_reason: str = ""
        self._vms: dict[str, _VM] = {}
        self._hub = EventHub()
        self._reconciler: asyncio.Task[None] | None = None
        self._accel_lock = asyncio.Lock()
        self._base_lock = asyncio.Lock()
        self._create_locks: dict[str, asyncio.Lock] = {}
        self._closed = False

    # ------------------------------------------------------------------ paths
    def _vm_dir(self, vm_id: str) -> str:
        return os.path.join(self.vms_dir, vm_id)

    @property
    def base_image(self) -> str:
        return os.path.join(self.state_dir, "base", "blank.qcow2")

    # ------------------------------------------------------------------ lifecycle
    async def open(self) -> None:
        """Rediscover VMs from state_dir/vms/*/spec.json: live ones are reattached over QMP,
        dead ones are listed as exited (their directory stays, start() relaunches them)."""
        os.makedirs(self.vms_dir, exist_ok=True)
        self._closed = False
        for vm_id in sorted(os.listdir(self.vms_dir)):
            if vm_id in self._vms:
                continue
            try:
                check_vm_id(vm_id)
            except RuntimeFailure:
                continue
            await self._adopt(vm_id)
        if self.reconcile_interval > 0 and self._reconciler is None:
            self._reconciler = asyncio.create_task(self._reconcile_loop(), name="qemu-reconcile")

    async def _adopt(self, vm_id: str) -> _VM | None:
        vm_dir = self._vm_dir(vm_id)
        rec = _read_record(vm_dir)
        if rec is None:
            return None
        vm = _VM(vm_id=vm_id, dir=vm_dir, record=rec, state="exited")
        self._vms[vm_id] = vm
        if rec.vnc_display is not None and rec.vnc_owner:
            try:
                self.displays.claim(rec.vnc_display, rec.vnc_owner)
            except RuntimeFailure as e:
                log.warning("%s: cannot re-claim VNC display %s: %s", vm_id, rec.vnc_display, e)
        pid = _read_pidfile(vm_dir)
        if pid is not None and _is_our_qemu(pid, vm_dir):
            vm.pid = pid
            try:
                await self._connect_qmp(vm)
                vm.state = await self._query_state(vm)
            except (RuntimeFailure, Inconclusive, OSError) as e:
                log.warning("%s: rediscovered pid %s but QMP failed: %s", vm_id, pid, e)
                vm.state = "running" if _is_our_qemu(pid, vm_dir) else "exited"
            if vm.qmp is not None:
                vm.watcher = asyncio.create_task(self._watch(vm, vm.qmp), name=f"qemu-watch-{vm_id}")
        else:
            vm.state = "exited"
        return vm

    async def close(self) -> None:
        """Drop QMP connections and background tasks. Never kills a VM."""
        self._closed = True
        if self._reconciler is not None:
            self._reconciler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reconciler
            self._reconciler = None
        for vm in list(self._vms.values()):
            await self._detach(vm)
        self._vms.clear()
        self._hub.close()

    async def _detach(self, vm: _VM) -> None:
        if vm.watcher is not None:
            vm.watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await vm.watcher
            vm.watcher = None
        if vm.qmp is not None:
            with contextlib.suppress(Exception):
                await vm.qmp.disconnect()
            vm.qmp = None

    def events(self) -> EventSubscription:
        return self._hub.subscribe()

    # ------------------------------------------------------------------ accel
    async def resolve_accel(self) -> str:
        """The accelerator this driver uses; for accel=auto, probe once (cached in state_dir)."""
        if self.accel is not None:
            return self.accel
        async with self._accel_lock:
            if self.accel is not None:
                return self.accel
            if self.accel_requested != "auto":
                self.accel, self.accel_reason = self.accel_requested, "configured"
                return self.accel
            self.accel, self.accel_reason = await self._probe_accel()
            log.info("accel=auto picked %s (%s)", self.accel, self.accel_reason)
            return self.accel

    def _probe_kernel(self) -> tuple[str, str] | None:
        if not self.probe_kernel:
            return None
        for cand in (self.probe_image, os.environ.get("VMFENCE_GUEST_IMAGE"), str(REPO_GUEST_IMAGE)):
            if cand and (files := _image_files(cand)):
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
        _write_json_atomic(
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
        _kill_pidfile(os.path.join(pdir, "probe.pid"))  # a probe left by an agent that died mid-probe
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
                if _file_contains(out_file, needles):
                    return True
                if proc.poll() is not None:
                    return _file_contains(out_file, needles)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.1)
            return False
        finally:
            if proc.poll() is None:
                proc.kill()
            await asyncio.to_thread(proc.wait)

    # ------------------------------------------------------------------ disks
    async def _run(self, *args: str) -> str:
        p = await asyncio.create_subprocess_exec(
            *args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        out, _ = await p.communicate()
        text = out.decode(errors="replace").strip()
        if p.returncode != 0:
            raise RuntimeFailure(f"{os.path.basename(args[0])} failed ({p.returncode}): {text}")
        return text

    async def _ensure_base(self) -> str:
        base = self.base_image
        if os.path.exists(base):
            return base
        async with self._base_lock:
            if not os.path.exists(base):
                os.makedirs(os.path.dirname(base), exist_ok=True)
                tmp = f"{base}.{os.getpid()}.tmp"
                await self._run(self.qemu_img, "create", "-q", "-f", "qcow2", tmp, f"{self.base_disk_mib}M")
                os.replace(tmp, base)
        return base

    async def _create_overlay(self, vm_dir: str) -> None:
        base = await self._ensure_base()
        disk = os.path.join(vm_dir, "disk.qcow2")
        await self._run(self.qemu_img, "create", "-q", "-f", "qcow2", "-b", base, "-F", "qcow2", disk)

    # ------------------------------------------------------------------ launching
    def _qemu_args(self, vm: _VM, accel: str, incoming: bool, qmp_fd: int = 3) -> list[str]:
        spec, d = vm.spec, vm.dir
        accel_opt = f"tcg,tb-size={self.tcg_tb_size_mib}" if accel == "tcg" else accel
        args = [
            self.qemu_binary,
            "-name", f"vmfence-{spec.vm_id},process=vmfence-{spec.vm_id}",
            "-machine", self.machine,
            "-accel", accel_opt,
            "-nodefaults", "-no-user-config", "-display", "none",
            "-m", str(spec.memory_mib),
            "-smp", str(spec.cpus),
            "-chardev", f"socket,id=qmp0,fd={qmp_fd},server=on,wait=off",
            "-mon", "chardev=qmp0,mode=control",
            "-pidfile", os.path.join(d, "qemu.pid"),
            "-serial", f"file:{os.path.join(d, 'serial.log')}",
            "-debugcon", f"file:{os.path.join(d, 'firmware.log')}",
            "-global", "isa-debugcon.iobase=0x402",
            "-drive", f"file={os.path.join(d, 'disk.qcow2')},format=qcow2,if=virtio,id=disk0",
        ]  # fmt: skip
        if spec.image is not None or spec.probe_port is not None:
            netdev = "user,id=net0"
            if spec.probe_port is not None and vm.record.probe_host_port is not None:
                netdev += f",hostfwd=tcp:127.0.0.1:{vm.record.probe_host_port}-:{spec.probe_port}"
            args += ["-netdev", netdev, "-device", f"{self.nic_model},netdev=net0,romfile="]
        if spec.vnc and vm.record.vnc_display is not None:
            args += ["-vnc", f"127.0.0.1:{vm.record.vnc_display}"]
        if spec.image is not None:
            files = _image_files(spec.image)
            if files is None:
                raise RuntimeFailure(f"{spec.vm_id}: image {spec.image} has no vmlinuz + initramfs.cpio.gz")
            args += ["-kernel", files[0], "-initrd", files[1], "-append", self.kernel_append]
        if incoming:
            args += ["-incoming", "defer"]
        return args

    async def _launch(self, vm: _VM, *, incoming: bool = False) -> None:
        """Start vm's QEMU and attach QMP; on return vm.state is running (or creating if incoming)."""
        accel = await self.resolve_accel()
        vm.record.accel = accel
        for attempt in range(3):
            if vm.spec.probe_port is not None and (vm.record.probe_host_port is None or attempt > 0):
                vm.record.probe_host_port = _free_tcp_port()
            vm.record.exit_code = vm.record.exit_signal = None
            vm.record.stopped = False
            _write_json_atomic(os.path.join(vm.dir, "spec.json"), msgspec.json.encode(vm.record))
            try:
                await self._spawn(vm, accel, incoming)
                return
            except RuntimeFailure as e:
                if "host forwarding" in str(e) and attempt < 2:
                    continue
                raise

    async def _spawn(self, vm: _VM, accel: str, incoming: bool) -> None:
        sock_path = os.path.join(vm.dir, "qmp.sock")
        for stale in (sock_path, os.path.join(vm.dir, "qemu.pid")):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with _short_path(sock_path) as p:
                listener.bind(p)
            listener.listen(4)
            fd = listener.fileno()
            args = self._qemu_args(vm, accel, incoming, qmp_fd=fd)
            with open(os.path.join(vm.dir, "qemu.log"), "ab") as errlog:
                proc = subprocess.Popen(
                    args,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=errlog,
                    cwd=vm.dir,
                    start_new_session=True,
                    pass_fds=(fd,),
                )
        finally:
            listener.close()
        vm.proc, vm.pid, vm.expected_exit = proc, proc.pid, False
        vm.state = "creating"
        try:
            await asyncio.wait_for(self._connect_qmp(vm), self.start_timeout)
            if not incoming:
                await self._wait_status(vm, ("running",), self.start_timeout)
                vm.state = "running"
        except (RuntimeFailure, Inconclusive, OSError, TimeoutError) as e:
            rc = await self._reap(vm, 1.0)
            if rc is None:
                self._kill(vm)
                rc = await self._reap(vm, 2.0)
            if vm.qmp is not None:
                with contextlib.suppress(Exception):
                    await vm.qmp.disconnect()
                vm.qmp = None
            vm.state, vm.pid, vm.proc = "exited", None, None
            msg = _tail(os.path.join(vm.dir, "qemu.log"))
            raise RuntimeFailure(f"{vm.vm_id}: qemu failed to start (rc={rc}): {msg or e}") from e
        assert vm.qmp is not None
        vm.watcher = asyncio.create_task(self._watch(vm, vm.qmp), name=f"qemu-watch-{vm.vm_id}")

    async def _connect_qmp(self, vm: _VM) -> None:
        qmp = QMPClient(f"vmfence-{vm.vm_id}")
        qmp.logger.setLevel(logging.CRITICAL)
        with _short_path(os.path.join(vm.dir, "qmp.sock")) as p:
            try:
                await asyncio.wait_for(qmp.connect(p), self.qmp_timeout)
            except TimeoutError as e:
                with contextlib.suppress(Exception):
                    await qmp.disconnect()
                raise Inconclusive(f"{vm.vm_id}: QMP connect timed out") from e
            except Exception as e:
                raise RuntimeFailure(f"{vm.vm_id}: QMP connect failed: {e}") from e
        vm.qmp = qmp

    async def _qmp(self, vm: _VM, cmd: str, args: dict[str, Any] | None = None) -> Any:
        qmp = vm.qmp
        if qmp is None or qmp.runstate != Runstate.RUNNING:
            raise RuntimeFailure(f"{vm.vm_id}: no QMP connection")
        try:
            return await asyncio.wait_for(qmp.execute(cmd, args), self.qmp_timeout)
        except TimeoutError as e:
            raise Inconclusive(f"{vm.vm_id}: QMP {cmd} timed out after {self.qmp_timeout}s") from e
        except Exception as e:
            raise RuntimeFailure(f"{vm.vm_id}: QMP {cmd} failed: {e}") from e

    async def _query_state(self, vm: _VM) -> VMState:
        st = await self._qmp(vm, "query-status")
        return _STATUS_MAP.get(st["status"], "paused")

    async def _wait_status(self, vm: _VM, want: tuple[str, ...], timeout: float) -> str:
        deadline = time.monotonic() + timeout
        delay = 0.005
        while True:
            st = (await self._qmp(vm, "query-status"))["status"]
            if st in want:
                return str(st)
            if time.monotonic() > deadline:
                raise RuntimeFailure(f"{vm.vm_id}: status {st!r}, wanted {want} within {timeout}s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)

    # ------------------------------------------------------------------ exit detection
    def _alive(self, vm: _VM) -> bool:
        if vm.proc is not None:
            return vm.proc.poll() is None
        return vm.pid is not None and _is_our_qemu(vm.pid, vm.dir)

    async def _reap(self, vm: _VM, timeout: float) -> int | None:
        """Wait up to timeout for vm's process to end; its returncode if it is our child."""
        deadline = time.monotonic() + timeout
        delay = 0.002
        while self._alive(vm):
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
        return vm.proc.returncode if vm.proc is not None else None

    def _kill(self, vm: _VM) -> None:
        if vm.proc is not None:
            if vm.proc.poll() is None:
                vm.proc.kill()
        elif vm.pid is not None and _is_our_qemu(vm.pid, vm.dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(vm.pid, signal.SIGKILL)

    async def _watch(self, vm: _VM, qmp: QMPClient) -> None:
        """Wait for the QMP connection to end, then find out whether the process ended."""
        try:
            while qmp.runstate == Runstate.RUNNING:
                await qmp.runstate_changed()
        except asyncio.CancelledError:
            raise
        except Exception:  # pragma: no cover - defensive
            log.exception("%s: QMP watcher failed", vm.vm_id)
        if vm.qmp is not qmp:
            return
        with contextlib.suppress(Exception):
            await qmp.disconnect()
        vm.qmp = None
        vm.watcher = None
        rc = await self._reap(vm, 5.0)
        if self._alive(vm):
            # QMP went away but QEMU did not: leave the pid check to the reconciler.
            log.warning("%s: QMP connection lost but pid %s is alive", vm.vm_id, vm.pid)
            return
        self._mark_exited(vm, rc)

    def _mark_exited(self, vm: _VM, rc: int | None) -> None:
        if vm.state == "exited" and vm.pid is None:
            return
        code, sig = (None, -rc) if rc is not None and rc < 0 else (rc, None)
        vm.state, vm.pid, vm.proc = "exited", None, None
        vm.record.exit_code, vm.record.exit_signal = code, sig
        vm.record.stopped = vm.expected_exit
        if os.path.isdir(vm.dir):
            with contextlib.suppress(OSError):
                _write_json_atomic(os.path.join(vm.dir, "spec.json"), msgspec.json.encode(vm.record))
        if not vm.expected_exit and not self._closed:
            self._hub.publish(VMExitedEvent(vm_id=vm.vm_id, exit_code=code, signal=sig))

    async def _gone(self, vm: _VM) -> None:
        """vm's directory vanished: the runtime no longer knows it."""
        if self._vms.get(vm.vm_id) is not vm:
            return
        del self._vms[vm.vm_id]
        await self._detach(vm)
        if self._alive(vm):
            self._kill(vm)  # a QEMU whose record is gone would be a leak
            await self._reap(vm, 2.0)
        if vm.record.vnc_display is not None and vm.record.vnc_owner:
            with contextlib.suppress(RuntimeFailure):
                self.displays.release(vm.record.vnc_display, vm.record.vnc_owner)
        if not self._closed:
            self._hub.publish(VMGoneEvent(vm_id=vm.vm_id))

    async def reconcile(self) -> None:
        """One pass: vanished directories -> VMGoneEvent; dead processes -> VMExitedEvent."""
        for vm in list(self._vms.values()):
            if vm.lock.locked():
                continue
            if not os.path.isfile(os.path.join(vm.dir, "spec.json")):
                await self._gone(vm)
            elif vm.state in ("running", "paused") and not self._alive(vm):
                rc = vm.proc.returncode if vm.proc is not None else None
                await self._detach(vm)
                self._mark_exited(vm, rc)

    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(self.reconcile_interval)
            try:
                await self.reconcile()
            except Exception:  # pragma: no cover - keep reconciling
                log.exception("qemu reconcile failed")

    # ------------------------------------------------------------------ info
    def _info(self, vm: _VM) -> VMInfo:
        running = vm.state in ("running", "paused", "creating")
        return VMInfo(
            vm_id=vm.vm_id,
            state=vm.state,
            pid=vm.pid if running else None,
            vnc_display=vm.record.vnc_display,
            probe_host_port=vm.record.probe_host_port,
            ip=GUEST_IP if vm.spec.image is not None else None,
            labels=dict(vm.spec.labels),
            exit_code=vm.record.exit_code if vm.state == "exited" else None,
        )

    async def _known(self, vm_id: str) -> _VM | None:
        """The VM record, after checking its directory still exists (VMGoneEvent if not)."""
        vm = self._vms.get(vm_id)
        if vm is None:
            if os.path.isfile(os.path.join(self._vm_dir(vm_id), "spec.json")):
                return await self._adopt(vm_id)
            return None
        if not os.path.isfile(os.path.join(vm.dir, "spec.json")):
            await self._gone(vm)
            return None
        return vm

    async def inspect(self, vm_id: str) -> VMInfo | None:
        check_vm_id(vm_id)
        vm = await self._known(vm_id)
        if vm is None:
            return None
        if vm.state in ("running", "paused") and not vm.lock.locked():
            if not self._alive(vm):
                await self._detach(vm)
                self._mark_exited(vm, vm.proc.returncode if vm.proc else None)
            elif vm.qmp is None:
                raise Inconclusive(f"{vm_id}: process alive but no QMP connection")
            else:
                try:
                    state = await self._query_state(vm)
                except RuntimeFailure as e:
                    if self._alive(vm):
                        raise Inconclusive(str(e)) from e
                    await self._detach(vm)
                    self._mark_exited(vm, vm.proc.returncode if vm.proc else None)
                else:
                    if state != "exited":
                        vm.state = state
        return self._info(vm)

    async def list(self) -> list[VMInfo]:
        await self.reconcile()
        return [self._info(vm) for _, vm in sorted(self._vms.items())]

    # ------------------------------------------------------------------ operations
    def _create_lock(self, vm_id: str) -> asyncio.Lock:
        return self._create_locks.setdefault(vm_id, asyncio.Lock())

    async def create(self, spec: VMSpec) -> VMInfo:
        check_spec(spec)
        async with self._create_lock(spec.vm_id):
            vm = await self._known(spec.vm_id)
            if vm is not None:
                return self._info(vm)
            vm_dir = self._vm_dir(spec.vm_id)
            os.makedirs(self.vms_dir, exist_ok=True)
            try:
                os.mkdir(vm_dir)
            except FileExistsError:
                shutil.rmtree(vm_dir, ignore_errors=True)  # a partial create without spec.json
                os.mkdir(vm_dir)
            rec = _Record(spec=spec, created_at=time.time())
            vm = _VM(vm_id=spec.vm_id, dir=vm_dir, record=rec)
            async with vm.lock:
                try:
                    await self._create_overlay(vm_dir)
                    self._reserve_display(vm)
                    self._vms[spec.vm_id] = vm
                    await self._launch(vm)
                except BaseException:
                    self._vms.pop(spec.vm_id, None)
                    self._release_display(vm)
                    shutil.rmtree(vm_dir, ignore_errors=True)
                    raise
            return self._info(vm)

    def _reserve_display(self, vm: _VM) -> None:
        if vm.spec.vnc and vm.record.vnc_display is None:
            owner = vnc_owner(vm.spec)
            vm.record.vnc_display = self.displays.reserve(owner)
            vm.record.vnc_owner = owner

    def _release_display(self, vm: _VM) -> None:
        if vm.record.vnc_display is not None and vm.record.vnc_owner:
            with contextlib.suppress(RuntimeFailure):
                self.displays.release(vm.record.vnc_display, vm.record.vnc_owner)

    async def start(self, vm_id: str) -> VMInfo:
        check_vm_id(vm_id)
        vm = await self._known(vm_id)
        if vm is None:
            raise RuntimeFailure(f"start {vm_id}: no such VM")
        async with vm.lock:
            if vm.state != "exited" and self._alive(vm):
                return self._info(vm)
            await self._detach(vm)
            if not os.path.exists(os.path.join(vm.dir, "disk.qcow2")):
                raise RuntimeFailure(f"start {vm_id}: its disk is missing")
            await self._launch(vm)
            return self._info(vm)

    async def _terminate(self, vm: _VM) -> int | None:
        """Make vm's QEMU exit (QMP quit, then SIGKILL); no VMExitedEvent (expected exit)."""
        vm.expected_exit = True
        if self._alive(vm) and vm.qmp is not None:
            with contextlib.suppress(RuntimeFailure, Inconclusive):
                await self._qmp(vm, "quit")
        rc = await self._reap(vm, self.stop_timeout)
        if self._alive(vm):
            self._kill(vm)
            rc = await self._reap(vm, self.stop_timeout)
        if self._alive(vm):
            raise RuntimeFailure(f"{vm.vm_id}: pid {vm.pid} survived SIGKILL")
        await self._detach(vm)
        return rc

    async def stop(self, vm_id: str) -> None:
        check_vm_id(vm_id)
        vm = await self._known(vm_id)
        if vm is None:
            raise RuntimeFailure(f"stop {vm_id}: no such VM")
        async with vm.lock:
            if vm.state == "exited" and not self._alive(vm):
                return
            rc = await self._terminate(vm)
            self._mark_exited(vm, rc)

    async def remove(self, vm_id: str) -> None:
        check_vm_id(vm_id)
        vm = self._vms.get(vm_id)
        vm_dir = self._vm_dir(vm_id)
        if vm is None:
            if not os.path.exists(vm_dir):
                return
            vm = await self._adopt(vm_id)
            if vm is None:  # a directory without a record: kill by pidfile, delete
                pid = _read_pidfile(vm_dir)
                if pid is not None and _is_our_qemu(pid, vm_dir):
                    os.kill(pid, signal.SIGKILL)
                shutil.rmtree(vm_dir, ignore_errors=True)
                return
        async with vm.lock:
            await self._terminate(vm)
            self._mark_exited(vm, None)
            self._vms.pop(vm_id, None)
            self._release_display(vm)
            await asyncio.to_thread(shutil.rmtree, vm_dir, True)

    async def snapshot(self, vm_id: str, dest: str) -> SnapshotInfo:
        """Hibernate: stop the CPUs, migrate RAM + device state to ``dest``, copy the disk overlay
        to ``dest + '.disk.qcow2'``, quit QEMU and remove the VM (dir, record, display)."""
        check_vm_id(vm_id)
        vm = await self._known(vm_id)
        if vm is None:
            raise RuntimeFailure(f"snapshot {vm_id}: no such VM")
        dest = os.path.abspath(dest)
        async with vm.lock:
            if vm.state == "exited" or not self._alive(vm):
                raise RuntimeFailure(f"snapshot {vm_id}: VM is not running")
            t0 = time.monotonic()
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            part = f"{dest}.part"
            await self._qmp(vm, "stop")
            try:
                await self._qmp(vm, "migrate", {"uri": f"exec:cat > {shlex.quote(part)}"})
                await self._wait_migration(vm)
            except BaseException:
                with contextlib.suppress(Exception):
                    await self._qmp(vm, "cont")
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(part)
                raise
            await self._terminate(vm)
            self._mark_exited(vm, None)
            os.replace(part, dest)
            disk = f"{dest}.disk.qcow2"
            await asyncio.to_thread(shutil.copyfile, os.path.join(vm.dir, "disk.qcow2"), disk)
            self._vms.pop(vm_id, None)
            self._release_display(vm)
            await asyncio.to_thread(shutil.rmtree, vm.dir, True)
            size = os.path.getsize(dest) + os.path.getsize(disk)
            return SnapshotInfo(vm_id=vm_id, path=dest, size_bytes=size, seconds=time.monotonic() - t0)

    async def _wait_migration(self, vm: _VM) -> None:
        deadline = time.monotonic() + self.migrate_timeout
        delay = 0.005
        while True:
            info = await self._qmp(vm, "query-migrate")
            status = info.get("status")
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                raise RuntimeFailure(f"{vm.vm_id}: migration {status}: {info.get('error-desc', '')}")
            if time.monotonic() > deadline:
                raise RuntimeFailure(f"{vm.vm_id}: migration not done after {self.migrate_timeout}s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)

    async def restore(self, spec: VMSpec, src: str) -> VMInfo:
        """Wake: a new QEMU with ``-incoming defer`` loads ``src`` (and its disk overlay
        ``src + '.disk.qcow2'`` if present) and resumes. Idempotent: a running VM is returned."""
        check_spec(spec)
        src = os.path.abspath(src)
        if not os.path.isfile(src):
            raise RuntimeFailure(f"restore {spec.vm_id}: no snapshot at {src}")
        async with self._create_lock(spec.vm_id):
            vm = await self._known(spec.vm_id)
            if vm is not None:
                if vm.state != "exited" and self._alive(vm):
                    return self._info(vm)
                await self.remove(spec.vm_id)
            vm_dir = self._vm_dir(spec.vm_id)
            shutil.rmtree(vm_dir, ignore_errors=True)
            os.makedirs(vm_dir)
            vm = _VM(vm_id=spec.vm_id, dir=vm_dir, record=_Record(spec=spec, created_at=time.time()))
            async with vm.lock:
                try:
                    disk = f"{src}.disk.qcow2"
                    if os.path.isfile(disk):
                        await asyncio.to_thread(shutil.copyfile, disk, os.path.join(vm_dir, "disk.qcow2"))
                    else:
                        await self._create_overlay(vm_dir)
                    self._reserve_display(vm)
                    self._vms[spec.vm_id] = vm
                    await self._launch(vm, incoming=True)
                    await self._qmp(vm, "migrate-incoming", {"uri": f"exec:cat {shlex.quote(src)}"})
                    await self._wait_incoming(vm)
                except BaseException:
                    vm.expected_exit = True
                    if self._alive(vm):
                        self._kill(vm)
                        await self._reap(vm, 2.0)
                    await self._detach(vm)
                    self._vms.pop(spec.vm_id, None)
                    self._release_display(vm)
                    shutil.rmtree(vm_dir, ignore_errors=True)
                    raise
            return self._info(vm)

    async def _wait_incoming(self, vm: _VM) -> None:
        deadline = time.monotonic() + self.migrate_timeout
        delay = 0.005
        while True:
            st = (await self._qmp(vm, "query-status"))["status"]
            if st == "running":
                vm.state = "running"
                return
            if st != "inmigrate":
                mig = await self._qmp(vm, "query-migrate")
                mstatus = mig.get("status")
                if mstatus in ("failed", "cancelled"):
                    why = mig.get("error-desc", "")
                    raise RuntimeFailure(f"{vm.vm_id}: incoming migration {mstatus}: {why}")
                if mstatus == "completed" and st in ("paused", "postmigrate", "prelaunch"):
                    await self._qmp(vm, "cont")
            if not self._alive(vm):
                raise RuntimeFailure(f"{vm.vm_id}: qemu exited during incoming migration: "
                                     f"{_tail(os.path.join(vm.dir, 'qemu.log'))}")
            if time.monotonic() > deadline:
                raise RuntimeFailure(f"{vm.vm_id}: incoming migration not done after {self.migrate_timeout}s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)

    async def probe(self, vm_id: str) -> bool:
        """Readiness. With probe_port: connect to the forwarded host port, send probe_request and
        require at least one byte back (QEMU user networking accepts host-side connections even
        when nothing listens in the guest, so a bare connect proves nothing). Without probe_port:
        QMP status is running."""
        check_vm_id(vm_id)
        vm = await self._known(vm_id)
        if vm is None or vm.state == "exited" or not self._alive(vm):
            return False
        if vm.spec.probe_port is None or vm.record.probe_host_port is None:
            try:
                return await self._query_state(vm) == "running"
            except (RuntimeFailure, Inconclusive):
                return False
        return await tcp_probe("127.0.0.1", vm.record.probe_host_port, self.probe_request, self.probe_timeout)

    # ------------------------------------------------------------------ test/diagnostic helpers
    def vm_dir(self, vm_id: str) -> str:
        return self._vm_dir(vm_id)

    def serial_log(self, vm_id: str) -> str:
        return os.path.join(self._vm_dir(vm_id), "serial.log")


async def tcp_probe(host: str, port: int, request: bytes, timeout: float) -> bool:
    writer: asyncio.StreamWriter | None = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        if request:
            writer.write(request)
            await writer.drain()
        data = await asyncio.wait_for(reader.read(1), timeout)
        return bool(data)
    except (OSError, TimeoutError):
        return False
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


__all__ = ["QemuDriver", "tcp_probe"]
