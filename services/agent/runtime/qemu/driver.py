"""The ``qemu`` runtime driver: every VM is a real QEMU process driven over QMP (qemu.qmp).

The package is split by job: ``accel`` (which accelerator, probed), ``disks`` (the qcow2 base and
overlays), ``process`` (spawn and QMP), ``migration`` (hibernate and wake through a file), ``files``
(small synchronous helpers), and this module, the driver that composes them and owns what a VM's
life *means*: the records under ``state_dir``, the display reservations, exit and gone events.

Layout under ``state_dir``::

    base/blank.qcow2            blank base disk, created once, overlaid by every VM
    accel.json                  cached result of the accel=auto probe
    vms/<vm_id>/spec.json       the VM's record (spec + runtime assignments, the VNC password); open()
                                rediscovers from it
    vms/<vm_id>/disk.qcow2      qcow2 overlay (qemu-img create -f qcow2 -b <base> -F qcow2)
    vms/<vm_id>/qmp.sock        QMP socket (bound by the driver, handed to QEMU as a listening fd)
    vms/<vm_id>/qemu.pid        QEMU's pidfile (QEMU holds a lock on it while it runs)
    vms/<vm_id>/serial.log      guest serial console
    vms/<vm_id>/firmware.log    SeaBIOS output (debugcon port 0x402)
    vms/<vm_id>/qemu.log        QEMU's stderr

Every file is 0600 and every directory 0700 (snapshots in the store too): a VM's disk, RAM, console
and record are the agent user's alone; the QMP socket is the agent user's too. A VNC display
(``-vnc <vnc_listen>:<display>,password=on``) takes nobody until launch sets the VM's own password
over QMP (``change-vnc-password``); the password is kept in the record and handed to the agent in
``VMInfo.vnc_password``, which stores it with the display's reservation in its ledger.

QEMU runs in its own session (``start_new_session``) so it outlives the agent; ``close()`` only
drops connections. Exit detection: the QMP connection's EOF (then ``waitpid`` when the VM is our
child, or a /proc pid check when it was rediscovered) plus a periodic reconciliation that also
notices VM directories that vanished (-> VMGoneEvent).
"""

# The driver does small, local file operations (spec.json, pidfiles, /proc) from the event loop:
# each is sub-millisecond. Hence
# ruff: noqa: ASYNC109, ASYNC240

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import time
from typing import Literal

from qemu.qmp import QMPClient
from qemu.qmp.protocol import Runstate

from ..base import (
    EventHub,
    EventSubscription,
    Inconclusive,
    RuntimeFailure,
    SnapshotInfo,
    VMExitedEvent,
    VMGoneEvent,
    VMInfo,
    VMSpec,
    check_spec,
    check_vm_id,
)
from ..images import check_in_store
from ..netlink import delete_tap, ensure_tap
from ..pool import DEFAULT_VNC_LISTEN, DisplayPool, new_vnc_password, vnc_owner
from .accel import AccelProbe
from .disks import Disks, overlay
from .files import DIR_MODE, image_files, is_our_qemu, private_dir, private_file, read_pidfile
from .migration import Migration, snapshot_disk
from .process import VM, Qemu, Record, console_pty, read_record

log = logging.getLogger("vmfence.agent.runtime.qemu")

GUEST_IP = "10.0.2.15"


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
        vnc_listen: str = DEFAULT_VNC_LISTEN,
        image_store: str | None = None,
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
        user_network: bool = True,
    ) -> None:
        if accel not in ("auto", "kvm", "tcg"):
            raise ValueError(f"accel must be auto, kvm or tcg, not {accel!r}")
        self.state_dir = os.path.abspath(state_dir)
        self.vms_dir = os.path.join(self.state_dir, "vms")
        binary = shutil.which(qemu_binary) or qemu_binary
        self._accel = AccelProbe(
            state_dir=self.state_dir, requested=accel, qemu_binary=binary, machine=machine,
            probe_image=probe_image, probe_kernel=probe_kernel, kernel_probe_timeout=kernel_probe_timeout,
        )  # fmt: skip
        self._disks = Disks(
            state_dir=self.state_dir, qemu_img=shutil.which(qemu_img) or qemu_img, base_disk_mib=base_disk_mib
        )
        self._qemu = Qemu(
            binary=binary, machine=machine, qmp_timeout=qmp_timeout, start_timeout=start_timeout,
            stop_timeout=stop_timeout, kernel_append=kernel_append, tcg_tb_size_mib=tcg_tb_size_mib,
            nic_model=nic_model, vnc_listen=vnc_listen, user_network=user_network,
        )  # fmt: skip
        self._migration = Migration(self._qemu, timeout=migrate_timeout)
        self.vnc_listen = vnc_listen
        self.displays = display_pool if display_pool is not None else DisplayPool(vnc_displays, listen=vnc_listen)
        # set (the agent sets it): a spec's image and the files QEMU opens in it resolve inside it
        self.image_store = os.path.abspath(image_store) if image_store is not None else None
        self.reconcile_interval = reconcile_interval
        self.probe_request = probe_request
        self.probe_timeout = probe_timeout
        self._vms: dict[str, VM] = {}
        self._hub = EventHub()
        self._reconciler: asyncio.Task[None] | None = None
        self._create_locks: dict[str, asyncio.Lock] = {}
        self._closed = False

    # ------------------------------------------------------------------ configuration, as resolved
    @property
    def qemu_binary(self) -> str:
        return self._qemu.qemu_binary

    @property
    def machine(self) -> str:
        return self._qemu.machine

    @property
    def tcg_tb_size_mib(self) -> int:
        return self._qemu.tcg_tb_size_mib

    @property
    def accel(self) -> str | None:
        """The resolved accelerator ("kvm" | "tcg"), None before ``resolve_accel``."""
        return self._accel.accel

    @property
    def accel_reason(self) -> str:
        return self._accel.reason

    async def resolve_accel(self) -> str:
        """The accelerator this driver uses; for accel=auto, probe once (cached in state_dir)."""
        return await self._accel.resolve()

    # ------------------------------------------------------------------ paths
    def _vm_dir(self, vm_id: str) -> str:
        return os.path.join(self.vms_dir, vm_id)

    @property
    def base_image(self) -> str:
        return self._disks.base_image

    # ------------------------------------------------------------------ lifecycle
    async def open(self) -> None:
        """Rediscover VMs from state_dir/vms/*/spec.json: live ones are reattached over QMP,
        dead ones are listed as exited (their directory stays, start() relaunches them)."""
        private_dir(self.state_dir)
        private_dir(self.vms_dir)
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

    async def _adopt(self, vm_id: str) -> VM | None:
        vm_dir = self._vm_dir(vm_id)
        rec = read_record(vm_dir)
        if rec is None:
            return None
        vm = VM(vm_id=vm_id, dir=vm_dir, record=rec, state="exited")
        self._vms[vm_id] = vm
        if rec.vnc_display is not None and rec.vnc_owner:
            try:
                self.displays.claim(rec.vnc_display, rec.vnc_owner)
            except RuntimeFailure as e:
                log.warning("%s: cannot re-claim VNC display %s: %s", vm_id, rec.vnc_display, e)
        pid = read_pidfile(vm_dir)
        if pid is not None and is_our_qemu(pid, vm_dir):
            vm.pid = pid
            try:
                await self._qemu.connect(vm)
                vm.state = await self._qemu.query_state(vm)
            except (RuntimeFailure, Inconclusive, OSError) as e:
                log.warning("%s: rediscovered pid %s but QMP failed: %s", vm_id, pid, e)
                vm.state = "running" if is_our_qemu(pid, vm_dir) else "exited"
            self._watch_exit(vm)
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
            await self._qemu.detach(vm)
        self._vms.clear()
        self._hub.close()

    def events(self) -> EventSubscription:
        return self._hub.subscribe()

    # ------------------------------------------------------------------ launching, exit detection
    def _check_image(self, spec: VMSpec) -> None:
        """The image directory and the kernel and initramfs QEMU will open stay inside the image
        store, symlinks followed (checked before every launch: a link may change after a create)."""
        if self.image_store is None or spec.image is None:
            return
        files = image_files(spec.image) if "\0" not in spec.image else None
        check_in_store(self.image_store, spec.image, files or ())

    async def _launch(self, vm: VM, *, incoming: bool = False) -> None:
        """Start vm's QEMU (see Qemu.launch) and watch for its exit; its tap first (bridge networking)."""
        self._check_image(vm.spec)
        if vm.spec.net is not None:
            await ensure_tap(vm.spec.net)
        await self._qemu.launch(vm, await self.resolve_accel(), incoming=incoming)
        self._watch_exit(vm)

    def _watch_exit(self, vm: VM) -> None:
        if vm.qmp is not None:
            vm.watcher = asyncio.create_task(self._watch(vm, vm.qmp), name=f"qemu-watch-{vm.vm_id}")

    async def _watch(self, vm: VM, qmp: QMPClient) -> None:
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
        rc = await self._qemu.reap(vm, 5.0)
        if self._qemu.alive(vm):
            # QMP went away but QEMU did not: leave the pid check to the reconciler.
            log.warning("%s: QMP connection lost but pid %s is alive", vm.vm_id, vm.pid)
            return
        self._mark_exited(vm, rc)

    def _mark_exited(self, vm: VM, rc: int | None) -> None:
        if vm.state == "exited" and vm.pid is None:
            return
        code, sig = (None, -rc) if rc is not None and rc < 0 else (rc, None)
        vm.state, vm.pid, vm.proc = "exited", None, None
        vm.record.exit_code, vm.record.exit_signal = code, sig
        vm.record.stopped = vm.expected_exit
        if os.path.isdir(vm.dir):
            with contextlib.suppress(OSError):
                self._qemu.save_record(vm)
        if not vm.expected_exit and not self._closed:
            self._hub.publish(VMExitedEvent(vm_id=vm.vm_id, exit_code=code, signal=sig))

    async def _gone(self, vm: VM) -> None:
        """vm's directory vanished: the runtime no longer knows it."""
        if self._vms.get(vm.vm_id) is not vm:
            return
        del self._vms[vm.vm_id]
        await self._qemu.detach(vm)
        if self._qemu.alive(vm):
            self._qemu.kill(vm)  # a QEMU whose record is gone would be a leak
            await self._qemu.reap(vm, 2.0)
        self._release_display(vm)
        with contextlib.suppress(RuntimeFailure):
            await delete_tap(vm.spec.net)
        if not self._closed:
            self._hub.publish(VMGoneEvent(vm_id=vm.vm_id))

    async def reconcile(self) -> None:
        """One pass: vanished directories -> VMGoneEvent; dead processes -> VMExitedEvent."""
        for vm in list(self._vms.values()):
            if vm.lock.locked():
                continue
            if not os.path.isfile(os.path.join(vm.dir, "spec.json")):
                await self._gone(vm)
            elif vm.state in ("running", "paused") and not self._qemu.alive(vm):
                rc = vm.proc.returncode if vm.proc is not None else None
                await self._qemu.detach(vm)
                self._mark_exited(vm, rc)

    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(self.reconcile_interval)
            try:
                await self.reconcile()
            except Exception:  # pragma: no cover - keep reconciling
                log.exception("qemu reconcile failed")

    # ------------------------------------------------------------------ info
    def _info(self, vm: VM) -> VMInfo:
        running = vm.state in ("running", "paused", "creating")
        return VMInfo(
            vm_id=vm.vm_id,
            state=vm.state,
            pid=vm.pid if running else None,
            vnc_display=vm.record.vnc_display,
            vnc_password=vm.record.vnc_password if vm.record.vnc_display is not None else None,
            probe_host_port=vm.record.probe_host_port,
            # bridge networking: the pool's address; user networking has none worth reporting (QEMU's
            # 10.0.2.15 is the same inside every guest and unreachable from the host)
            ip=vm.spec.net.ip if vm.spec.net is not None else None,
            labels=dict(vm.spec.labels),
            exit_code=vm.record.exit_code if vm.state == "exited" else None,
        )

    async def _known(self, vm_id: str) -> VM | None:
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

    async def _require(self, op: str, vm_id: str) -> VM:
        """The known VM ``op`` works on, or RuntimeFailure: there is no such VM."""
        check_vm_id(vm_id)
        vm = await self._known(vm_id)
        if vm is None:
            raise RuntimeFailure(f"{op} {vm_id}: no such VM")
        return vm

    async def inspect(self, vm_id: str) -> VMInfo | None:
        check_vm_id(vm_id)
        vm = await self._known(vm_id)
        if vm is None:
            return None
        if vm.state in ("running", "paused") and not vm.lock.locked():
            if not self._qemu.alive(vm):
                await self._qemu.detach(vm)
                self._mark_exited(vm, vm.proc.returncode if vm.proc else None)
            elif vm.qmp is None:
                raise Inconclusive(f"{vm_id}: process alive but no QMP connection")
            else:
                try:
                    state = await self._qemu.query_state(vm)
                except RuntimeFailure as e:
                    if self._qemu.alive(vm):
                        raise Inconclusive(str(e)) from e
                    await self._qemu.detach(vm)
                    self._mark_exited(vm, vm.proc.returncode if vm.proc else None)
                else:
                    if state != "exited":
                        vm.state = state
        return self._info(vm)

    async def list_labelled(self, name: str, value: str) -> list[VMInfo]:
        """A host runs tens of QEMU VMs: the whole scan (which also refreshes their states), filtered."""
        return [info for info in await self.list() if info.labels.get(name) == value]

    # ------------------------------------------------------------------ operations
    def _create_lock(self, vm_id: str) -> asyncio.Lock:
        return self._create_locks.setdefault(vm_id, asyncio.Lock())

    async def list(self) -> list[VMInfo]:
        await self.reconcile()
        return [self._info(vm) for _, vm in sorted(self._vms.items())]

    async def create(self, spec: VMSpec) -> VMInfo:
        check_spec(spec)
        self._check_image(spec)  # before anything is made for it
        async with self._create_lock(spec.vm_id):
            vm = await self._known(spec.vm_id)
            if vm is not None:
                return self._info(vm)
            vm_dir = self._vm_dir(spec.vm_id)
            private_dir(self.vms_dir)
            try:
                os.mkdir(vm_dir, DIR_MODE)
            except FileExistsError:
                shutil.rmtree(vm_dir, ignore_errors=True)  # a partial create without spec.json
                os.mkdir(vm_dir, DIR_MODE)
            rec = Record(spec=spec, created_at=time.time())
            vm = VM(vm_id=spec.vm_id, dir=vm_dir, record=rec)
            async with vm.lock:
                try:
                    await self._disks.create_overlay(vm_dir)
                    self._reserve_display(vm)
                    self._vms[spec.vm_id] = vm
                    await self._launch(vm)
                except BaseException:
                    self._vms.pop(spec.vm_id, None)
                    self._release_display(vm)
                    shutil.rmtree(vm_dir, ignore_errors=True)
                    with contextlib.suppress(RuntimeFailure):
                        await delete_tap(spec.net)
                    raise
            return self._info(vm)

    def _reserve_display(self, vm: VM) -> None:
        if vm.spec.vnc and vm.record.vnc_display is None:
            owner = vnc_owner(vm.spec)
            vm.record.vnc_display = self.displays.reserve(owner)
            vm.record.vnc_owner = owner
            vm.record.vnc_password = new_vnc_password()  # the display's, for this VM alone

    def _release_display(self, vm: VM) -> None:
        if vm.record.vnc_display is not None and vm.record.vnc_owner:
            with contextlib.suppress(RuntimeFailure):
                self.displays.release(vm.record.vnc_display, vm.record.vnc_owner)

    async def start(self, vm_id: str) -> VMInfo:
        vm = await self._require("start", vm_id)
        async with vm.lock:
            if vm.state != "exited" and self._qemu.alive(vm):
                return self._info(vm)
            await self._qemu.detach(vm)
            if not os.path.exists(overlay(vm.dir)):
                raise RuntimeFailure(f"start {vm_id}: its disk is missing")
            await self._launch(vm)
            return self._info(vm)

    async def stop(self, vm_id: str) -> None:
        vm = await self._require("stop", vm_id)
        async with vm.lock:
            if vm.state == "exited" and not self._qemu.alive(vm):
                return
            rc = await self._qemu.terminate(vm)
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
                pid = read_pidfile(vm_dir)
                if pid is not None and is_our_qemu(pid, vm_dir):
                    os.kill(pid, signal.SIGKILL)
                shutil.rmtree(vm_dir, ignore_errors=True)
                return
        async with vm.lock:
            await self._qemu.terminate(vm)
            self._mark_exited(vm, None)
            self._vms.pop(vm_id, None)
            self._release_display(vm)
            await delete_tap(vm.spec.net)  # the QEMU that had it open is gone
            await asyncio.to_thread(shutil.rmtree, vm_dir, True)

    async def snapshot(self, vm_id: str, dest: str) -> SnapshotInfo:
        """Hibernate: stop the CPUs, migrate RAM + device state to ``dest``, copy the disk overlay
        to ``dest + '.disk.qcow2'``, quit QEMU and remove the VM (dir, record, display)."""
        vm = await self._require("snapshot", vm_id)
        dest = os.path.abspath(dest)
        async with vm.lock:
            if vm.state == "exited" or not self._qemu.alive(vm):
                raise RuntimeFailure(f"snapshot {vm_id}: VM is not running")
            t0 = time.monotonic()
            private_dir(os.path.dirname(dest))
            part = f"{dest}.part"
            private_file(part)  # guest RAM: the migration's ``cat >`` keeps this mode
            await self._migration.save(vm, part)
            await self._qemu.terminate(vm)
            self._mark_exited(vm, None)
            os.replace(part, dest)
            disk = snapshot_disk(dest)
            await self._disks.save(vm.dir, disk)
            self._vms.pop(vm_id, None)
            self._release_display(vm)
            await delete_tap(vm.spec.net)
            await asyncio.to_thread(shutil.rmtree, vm.dir, True)
            size = os.path.getsize(dest) + os.path.getsize(disk)
            return SnapshotInfo(vm_id=vm_id, path=dest, size_bytes=size, seconds=time.monotonic() - t0)

    async def restore(self, spec: VMSpec, src: str) -> VMInfo:
        """Wake: a new QEMU with ``-incoming defer`` loads ``src`` (and its disk overlay
        ``src + '.disk.qcow2'`` if present) and resumes. Idempotent: a running VM is returned."""
        check_spec(spec)
        self._check_image(spec)
        src = os.path.abspath(src)
        if not os.path.isfile(src):
            raise RuntimeFailure(f"restore {spec.vm_id}: no snapshot at {src}")
        async with self._create_lock(spec.vm_id):
            vm = await self._known(spec.vm_id)
            if vm is not None:
                if vm.state != "exited" and self._qemu.alive(vm):
                    return self._info(vm)
                await self.remove(spec.vm_id)
            vm_dir = self._vm_dir(spec.vm_id)
            shutil.rmtree(vm_dir, ignore_errors=True)
            private_dir(self.vms_dir)
            os.mkdir(vm_dir, DIR_MODE)
            vm = VM(vm_id=spec.vm_id, dir=vm_dir, record=Record(spec=spec, created_at=time.time()))
            async with vm.lock:
                try:
                    await self._disks.restore(vm_dir, snapshot_disk(src))
                    self._reserve_display(vm)
                    self._vms[spec.vm_id] = vm
                    await self._launch(vm, incoming=True)
                    await self._migration.load(vm, src)
                except BaseException:
                    vm.expected_exit = True
                    if self._qemu.alive(vm):
                        self._qemu.kill(vm)
                        await self._qemu.reap(vm, 2.0)
                    await self._qemu.detach(vm)
                    self._vms.pop(spec.vm_id, None)
                    self._release_display(vm)
                    shutil.rmtree(vm_dir, ignore_errors=True)
                    with contextlib.suppress(RuntimeFailure):
                        await delete_tap(spec.net)
                    raise
            return self._info(vm)

    async def probe(self, vm_id: str) -> bool:
        """Readiness. With probe_port: connect to the forwarded host port, send probe_request and
        require at least one byte back (QEMU user networking accepts host-side connections even
        when nothing listens in the guest, so a bare connect proves nothing). Without probe_port:
        QMP status is running."""
        check_vm_id(vm_id)
        vm = await self._known(vm_id)
        if vm is None or vm.state == "exited" or not self._qemu.alive(vm):
            return False
        if vm.spec.net is not None and vm.spec.probe_port is not None:
            return await tcp_probe(vm.spec.net.ip, vm.spec.probe_port, self.probe_request, self.probe_timeout)
        if vm.spec.probe_port is None or vm.record.probe_host_port is None:
            try:
                return await self._qemu.query_state(vm) == "running"
            except (RuntimeFailure, Inconclusive):
                return False
        return await tcp_probe("127.0.0.1", vm.record.probe_host_port, self.probe_request, self.probe_timeout)

    async def console(self, vm_id: str) -> str | None:
        """The pty of the running VM's serial console (None: not running, or no pty)."""
        check_vm_id(vm_id)
        vm = await self._known(vm_id)
        if vm is None or vm.state == "exited" or not self._qemu.alive(vm):
            return None
        return await console_pty(self._qemu, vm)

    # ------------------------------------------------------------------ test/diagnostic helpers
    def vm_dir(self, vm_id: str) -> str:
        return self._vm_dir(vm_id)

    def serial_log(self, vm_id: str) -> str:
        return os.path.join(self._vm_dir(vm_id), "serial.log")


async def tcp_probe(host: str, port: int, request: bytes, timeout: float) -> bool:
    """Connect, send ``request``, and require at least one byte back within ``timeout`` each."""
    opened: asyncio.StreamWriter | None = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        opened = writer
        if request:
            writer.write(request)
            await writer.drain()
        data = await asyncio.wait_for(reader.read(1), timeout)
        return bool(data)
    except (OSError, TimeoutError):
        return False
    finally:
        if opened is not None:
            opened.close()
            with contextlib.suppress(Exception):
                await opened.wait_closed()


__all__ = ["QemuDriver", "tcp_probe"]
