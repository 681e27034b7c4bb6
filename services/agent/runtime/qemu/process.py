"""Spawn and QMP: one QEMU process per VM, started in its own session (it outlives the agent), its
QMP socket bound by the driver and handed over as a listening fd, and the mechanics of its end
(reap, kill, terminate). What an exit *means* (events, the record) is the driver's."""

# QEMU must not be an asyncio subprocess (asyncio kills its children when their transport is
# closed), so it is fork/exec'd from the loop; record and pidfile reads are sub-millisecond. Hence
# ruff: noqa: ASYNC109, ASYNC220

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from qemu.qmp import QMPClient
from qemu.qmp.protocol import Runstate

from ..base import Inconclusive, RuntimeFailure, VMSpec, VMState
from .disks import overlay
from .files import (
    FILE_MODE,
    image_files,
    is_our_qemu,
    open_private,
    private_file,
    short_path,
    tail,
    write_atomic,
)

log = logging.getLogger("vmfence.agent.runtime.qemu")


class Record(msgspec.Struct):
    """spec.json: what open() needs to rediscover a VM and start() needs to relaunch it."""

    spec: VMSpec
    accel: str = "tcg"
    vnc_display: int | None = None
    vnc_owner: str | None = None
    vnc_password: str | None = None  # set over QMP at every launch: QEMU keeps it in memory only
    probe_host_port: int | None = None
    exit_code: int | None = None
    exit_signal: int | None = None
    stopped: bool = False
    created_at: float = 0.0



def read_record(vm_dir: str) -> Record | None:
    try:
        with open(os.path.join(vm_dir, "spec.json"), "rb") as f:
            return msgspec.json.decode(f.read(), type=Record)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except msgspec.DecodeError as e:
        log.warning("unreadable spec.json in %s: %s", vm_dir, e)
        return None



def rotate_console(serial: str) -> None:
    """The boot before this one keeps its console as ``serial.log.previous`` (``kubectl logs --previous``)."""
    with contextlib.suppress(FileNotFoundError):
        if os.path.getsize(serial) > 0:
            os.replace(serial, serial + ".previous")


def free_tcp_port() -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
    finally:
        s.close()



async def console_pty(qemu: Qemu, vm: VM) -> str | None:
    """The pty of the VM's serial console (QMP query-chardev), made the agent user's alone."""
    try:
        devices = await qemu.qmp(vm, "query-chardev")
    except (RuntimeFailure, Inconclusive):
        return None
    for dev in devices or []:
        name = str(dev.get("filename", ""))
        if dev.get("label") == "ser0" and name.startswith("pty:"):
            path = name[4:]
            with contextlib.suppress(OSError):
                os.chmod(path, FILE_MODE)  # a pty is group tty writable by default: the guest's root shell
            return path
    return None


@dataclass(eq=False)
class VM:
    vm_id: str
    dir: str
    record: Record
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


STATUS_MAP: dict[str, VMState] = {
    "running": "running",
    "inmigrate": "creating",
    "prelaunch": "creating",
    "shutdown": "exited",
}



class Qemu:
    """Starts QEMU for a VM and talks QMP to it; holds only configuration, the VM holds its state."""

    def __init__(
        self,
        *,
        binary: str,
        machine: str,
        qmp_timeout: float,
        start_timeout: float,
        stop_timeout: float,
        kernel_append: str,
        tcg_tb_size_mib: int,
        nic_model: str,
        vnc_listen: str = "127.0.0.1",
        user_network: bool = True,
    ) -> None:
        self.qemu_binary = binary
        self.machine = machine
        self.qmp_timeout = qmp_timeout
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.kernel_append = kernel_append
        self.tcg_tb_size_mib = tcg_tb_size_mib
        self.nic_model = nic_model
        self.vnc_listen = vnc_listen
        self.user_network = user_network  # a VM without a NetAttach gets QEMU user networking (else no NIC)

    @staticmethod
    def save_record(vm: VM) -> None:
        """spec.json, written atomically: what open() and start() read back."""
        write_atomic(os.path.join(vm.dir, "spec.json"), msgspec.json.encode(vm.record))

    def command_line(self, vm: VM, accel: str, incoming: bool, qmp_fd: int = 3) -> list[str]:
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
            # the serial console: a pty (vmfence console attaches to it) whose every byte is also
            # logged to serial.log (kubectl logs), whether or not anybody is attached
            "-chardev", f"pty,id=ser0,logfile={os.path.join(d, 'serial.log')}",
            "-serial", "chardev:ser0",
            "-debugcon", f"file:{os.path.join(d, 'firmware.log')}",
            "-global", "isa-debugcon.iobase=0x402",
            "-drive", f"file={overlay(d)},format=qcow2,if=virtio,id=disk0",
        ]  # fmt: skip
        if spec.net is not None:
            # bridge networking: the VM's own tap (made by the driver before launch), its MAC from its
            # address; the guest image reads its address from the kernel command line
            netdev = (f"tap,id=net0,ifname={spec.net.tap},script=no,downscript=no" if spec.net.tap
                      else "user,id=net0,restrict=on")
            args += ["-netdev", netdev, "-device", f"{self.nic_model},netdev=net0,mac={spec.net.mac},romfile="]
        elif self.user_network and (spec.image is not None or spec.probe_port is not None):
            netdev = "user,id=net0"
            if spec.probe_port is not None and vm.record.probe_host_port is not None:
                netdev += f",hostfwd=tcp:127.0.0.1:{vm.record.probe_host_port}-:{spec.probe_port}"
            args += ["-netdev", netdev, "-device", f"{self.nic_model},netdev=net0,romfile="]
        if spec.vnc and vm.record.vnc_display is not None:
            # password=on: nobody gets in until launch sets the VM's password over QMP
            host = f"[{self.vnc_listen}]" if ":" in self.vnc_listen else self.vnc_listen
            args += ["-vnc", f"{host}:{vm.record.vnc_display},password=on"]
        if spec.image is not None:
            files = image_files(spec.image)
            if files is None:
                raise RuntimeFailure(f"{spec.vm_id}: image {spec.image} has no vmlinuz + initramfs.cpio.gz")
            append = self.kernel_append
            if spec.net is not None:
                append += f" vmfence.ip={spec.net.ip}/{spec.net.prefix} vmfence.gw={spec.net.gateway}"
            args += ["-kernel", files[0], "-initrd", files[1], "-append", append]
        if incoming:
            args += ["-incoming", "defer"]
        return args

    async def launch(self, vm: VM, accel: str, *, incoming: bool = False) -> None:
        """Start vm's QEMU and attach QMP; on return vm.state is running (or creating if incoming).
        A host port the guest's probe port is forwarded to can be taken meanwhile: up to 3 tries."""
        vm.record.accel = accel
        for attempt in range(3):
            if vm.spec.probe_port is not None and vm.spec.net is None and (
                    vm.record.probe_host_port is None or attempt > 0):
                vm.record.probe_host_port = free_tcp_port()
            vm.record.exit_code = vm.record.exit_signal = None
            vm.record.stopped = False
            self.save_record(vm)
            try:
                await self._spawn(vm, accel, incoming)
                return
            except RuntimeFailure as e:
                if "host forwarding" in str(e) and attempt < 2:
                    continue
                raise

    async def _spawn(self, vm: VM, accel: str, incoming: bool) -> None:
        sock_path = os.path.join(vm.dir, "qmp.sock")
        for stale in (sock_path, os.path.join(vm.dir, "qemu.pid")):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)
        rotate_console(os.path.join(vm.dir, "serial.log"))
        for log_file in ("serial.log", "firmware.log"):  # QEMU opens them and keeps their mode
            private_file(os.path.join(vm.dir, log_file))
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with short_path(sock_path) as p:
                listener.bind(p)
                os.chmod(p, FILE_MODE)  # the monitor is the VM: the agent user's alone
            listener.listen(4)
            fd = listener.fileno()
            args = self.command_line(vm, accel, incoming, qmp_fd=fd)
            with os.fdopen(open_private(os.path.join(vm.dir, "qemu.log"), os.O_WRONLY | os.O_APPEND), "ab") as errlog:
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
            await asyncio.wait_for(self.connect(vm), self.start_timeout)
            if vm.spec.vnc and vm.record.vnc_display is not None:
                if not vm.record.vnc_password:
                    raise RuntimeFailure(f"{vm.vm_id}: VNC display without a password")
                await self.qmp(vm, "change-vnc-password", {"password": vm.record.vnc_password})
            if not incoming:
                await self._wait_status(vm, ("running",), self.start_timeout)
                vm.state = "running"
        except (RuntimeFailure, Inconclusive, OSError, TimeoutError) as e:
            rc = await self.reap(vm, 1.0)
            if rc is None:
                self.kill(vm)
                rc = await self.reap(vm, 2.0)
            if vm.qmp is not None:
                with contextlib.suppress(Exception):
                    await vm.qmp.disconnect()
                vm.qmp = None
            vm.state, vm.pid, vm.proc = "exited", None, None
            msg = tail(os.path.join(vm.dir, "qemu.log"))
            raise RuntimeFailure(f"{vm.vm_id}: qemu failed to start (rc={rc}): {msg or e}") from e

    async def connect(self, vm: VM) -> None:
        qmp = QMPClient(f"vmfence-{vm.vm_id}")
        qmp.logger.setLevel(logging.CRITICAL)
        with short_path(os.path.join(vm.dir, "qmp.sock")) as p:
            try:
                await asyncio.wait_for(qmp.connect(p), self.qmp_timeout)
            except TimeoutError as e:
                with contextlib.suppress(Exception):
                    await qmp.disconnect()
                raise Inconclusive(f"{vm.vm_id}: QMP connect timed out") from e
            except Exception as e:
                raise RuntimeFailure(f"{vm.vm_id}: QMP connect failed: {e}") from e
        vm.qmp = qmp

    async def qmp(self, vm: VM, cmd: str, args: dict[str, Any] | None = None) -> Any:
        qmp = vm.qmp
        if qmp is None or qmp.runstate != Runstate.RUNNING:
            raise RuntimeFailure(f"{vm.vm_id}: no QMP connection")
        try:
            return await asyncio.wait_for(qmp.execute(cmd, args), self.qmp_timeout)
        except TimeoutError as e:
            raise Inconclusive(f"{vm.vm_id}: QMP {cmd} timed out after {self.qmp_timeout}s") from e
        except Exception as e:
            raise RuntimeFailure(f"{vm.vm_id}: QMP {cmd} failed: {e}") from e

    async def query_state(self, vm: VM) -> VMState:
        st = await self.qmp(vm, "query-status")
        return STATUS_MAP.get(st["status"], "paused")

    async def _wait_status(self, vm: VM, want: tuple[str, ...], timeout: float) -> str:
        deadline = time.monotonic() + timeout
        delay = 0.005
        while True:
            st = (await self.qmp(vm, "query-status"))["status"]
            if st in want:
                return str(st)
            if time.monotonic() > deadline:
                raise RuntimeFailure(f"{vm.vm_id}: status {st!r}, wanted {want} within {timeout}s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)

    # ------------------------------------------------------------------ exit detection
    def alive(self, vm: VM) -> bool:
        if vm.proc is not None:
            return vm.proc.poll() is None
        return vm.pid is not None and is_our_qemu(vm.pid, vm.dir)

    async def reap(self, vm: VM, timeout: float) -> int | None:
        """Wait up to timeout for vm's process to end; its returncode if it is our child."""
        deadline = time.monotonic() + timeout
        delay = 0.002
        while self.alive(vm):
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
        return vm.proc.returncode if vm.proc is not None else None

    def kill(self, vm: VM) -> None:
        if vm.proc is not None:
            if vm.proc.poll() is None:
                vm.proc.kill()
        elif vm.pid is not None and is_our_qemu(vm.pid, vm.dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(vm.pid, signal.SIGKILL)

    async def detach(self, vm: VM) -> None:
        if vm.watcher is not None:
            vm.watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await vm.watcher
            vm.watcher = None
        if vm.qmp is not None:
            with contextlib.suppress(Exception):
                await vm.qmp.disconnect()
            vm.qmp = None

    async def terminate(self, vm: VM) -> int | None:
        """Make vm's QEMU exit (QMP quit, then SIGKILL); no VMExitedEvent (expected exit)."""
        vm.expected_exit = True
        if self.alive(vm) and vm.qmp is not None:
            with contextlib.suppress(RuntimeFailure, Inconclusive):
                await self.qmp(vm, "quit")
        rc = await self.reap(vm, self.stop_timeout)
        if self.alive(vm):
            self.kill(vm)
            rc = await self.reap(vm, self.stop_timeout)
        if self.alive(vm):
            raise RuntimeFailure(f"{vm.vm_id}: pid {vm.pid} survived SIGKILL")
        await self.detach(vm)
        return rc
