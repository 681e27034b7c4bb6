"""The qemu driver against real QEMU processes (TCG unless a test says otherwise)."""

# Tests read small local files, poll with bounded sleeps and run qemu directly on purpose:
# ruff: noqa: ASYNC109, ASYNC110, ASYNC220, ASYNC221, ASYNC240

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from qemu.qmp import QMPClient

from services.agent.runtime import (
    DisplayPool,
    ReservationError,
    RuntimeDriver,
    RuntimeEvent,
    VMExitedEvent,
    VMGoneEvent,
    VMSpec,
    make_driver,
)
from services.agent.runtime.base import EventSubscription
from services.agent.runtime.qemu import QemuDriver

from .conftest import QEMU, guest_image, kill_leftovers, needs_qemu

pytestmark = [pytest.mark.qemu, needs_qemu]

LABELS = {"vmfence.io/key": "default/web", "vmfence.io/uid": "uid-1", "vmfence.io/epoch": "3"}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


async def wait_dead(pid: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while alive(pid):
        assert time.monotonic() < deadline, f"pid {pid} still alive"
        await asyncio.sleep(0.02)


async def next_event(ev: EventSubscription, timeout: float = 5.0) -> RuntimeEvent:
    return await asyncio.wait_for(ev.__anext__(), timeout)


async def bare_qemu_to_running(tmp: Path) -> float:
    """A bare qemu-system-x86_64 (same machine/memory, TCG) started until QMP says running."""
    sock = tmp / "bare.sock"
    sock.unlink(missing_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [QEMU or "qemu-system-x86_64", "-machine", "q35", "-accel", "tcg,tb-size=64", "-nodefaults",
         "-no-user-config", "-display", "none", "-m", "128", "-qmp", f"unix:{sock},server=on,wait=off"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        qmp = QMPClient("bare")
        while True:
            try:
                await qmp.connect(str(sock))
                break
            except Exception:
                await asyncio.sleep(0.002)
        while (await qmp.execute("query-status"))["status"] != "running":  # type: ignore[index]
            await asyncio.sleep(0.002)
        dt = time.perf_counter() - t0
        with contextlib.suppress(Exception):  # QEMU may hang up before or after answering quit
            await qmp.execute("quit")
        with contextlib.suppress(Exception):
            await qmp.disconnect()
        return dt
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


async def test_create_inspect_list_remove(qdriver: QemuDriver) -> None:
    assert isinstance(qdriver, RuntimeDriver)
    a = await qdriver.create(VMSpec(vm_id="vm-a", labels=LABELS))
    b = await qdriver.create(VMSpec(vm_id="vm-b", cpus=2, memory_mib=64))
    assert a.state == b.state == "running"
    assert a.pid and b.pid and alive(a.pid) and alive(b.pid)
    assert a.labels == LABELS
    vm_dir = Path(qdriver.vm_dir("vm-a"))
    for f in ("disk.qcow2", "qmp.sock", "qemu.pid", "serial.log", "spec.json"):
        assert (vm_dir / f).exists(), f
    assert int((vm_dir / "qemu.pid").read_text()) == a.pid
    # idempotent by vm_id: the same VM, not a second one
    again = await qdriver.create(VMSpec(vm_id="vm-a", labels=LABELS))
    assert again.pid == a.pid
    info = await qdriver.inspect("vm-a")
    assert info is not None and info.state == "running" and info.labels == LABELS
    assert {(v.vm_id, v.state) for v in await qdriver.list()} == {("vm-a", "running"), ("vm-b", "running")}
    assert await qdriver.probe("vm-a")
    await qdriver.stop("vm-b")
    await wait_dead(b.pid)
    info = await qdriver.inspect("vm-b")
    assert info is not None and info.state == "exited"
    assert not await qdriver.probe("vm-b")
    await qdriver.remove("vm-a")
    await wait_dead(a.pid)
    assert not vm_dir.exists()
    assert await qdriver.inspect("vm-a") is None
    await qdriver.remove("vm-a")  # idempotent
    await qdriver.remove("no-such-vm")
    await qdriver.remove("vm-b")
    assert await qdriver.list() == []


async def test_create_latency_vs_bare_qemu(qdriver: QemuDriver, tmp_path: Path) -> None:
    await qdriver.resolve_accel()
    await qdriver.create(VMSpec(vm_id="warmup"))  # creates the blank base image once
    bare, created = [], []
    for i in range(5):
        bare.append(await bare_qemu_to_running(tmp_path))
        t0 = time.perf_counter()
        await qdriver.create(VMSpec(vm_id=f"lat-{i}"))
        created.append(time.perf_counter() - t0)
    b, c = statistics.median(bare), statistics.median(created)
    print(f"\nbare qemu -> QMP running: median {b * 1000:.1f} ms; driver create: median {c * 1000:.1f} ms "
          f"({c / b:.2f}x)")  # fmt: skip
    assert c <= 3 * b + 0.02, (bare, created)
    for i in range(5):
        await qdriver.remove(f"lat-{i}")
    await qdriver.remove("warmup")


async def test_sigkill_gives_exited_event_then_start_relaunches(qdriver: QemuDriver) -> None:
    ev = qdriver.events()
    info = await qdriver.create(VMSpec(vm_id="crashy", labels=LABELS))
    assert info.pid is not None
    disk = Path(qdriver.vm_dir("crashy")) / "disk.qcow2"
    ino = disk.stat().st_ino
    os.kill(info.pid, signal.SIGKILL)
    assert await next_event(ev) == VMExitedEvent(vm_id="crashy", exit_code=None, signal=9)
    after = await qdriver.inspect("crashy")
    assert after is not None and after.state == "exited" and after.pid is None
    assert disk.exists()  # the directory stays for a restart
    again = await qdriver.start("crashy")
    assert again.state == "running" and again.pid != info.pid and again.pid is not None
    assert disk.stat().st_ino == ino  # same overlay
    assert (await qdriver.inspect("crashy")).state == "running"  # type: ignore[union-attr]
    # its record vanishes (someone deleted the directory): the runtime no longer knows it
    shutil.rmtree(qdriver.vm_dir("crashy"))
    assert await next_event(ev) == VMGoneEvent(vm_id="crashy")  # found by the periodic reconciliation
    assert await qdriver.inspect("crashy") is None
    await wait_dead(again.pid)  # and its orphaned QEMU is not leaked


async def test_gone_detected_by_inspect_and_list(state_dir: Path) -> None:
    drv = QemuDriver(state_dir=str(state_dir), accel="tcg", reconcile_interval=0)  # no background pass
    await drv.open()
    try:
        ev = drv.events()
        a = await drv.create(VMSpec(vm_id="g1"))
        await drv.create(VMSpec(vm_id="g2"))
        os.kill(a.pid or 0, signal.SIGKILL)
        assert await next_event(ev) == VMExitedEvent(vm_id="g1", exit_code=None, signal=9)
        shutil.rmtree(drv.vm_dir("g1"))
        assert await drv.inspect("g1") is None
        assert await next_event(ev) == VMGoneEvent(vm_id="g1")
        shutil.rmtree(drv.vm_dir("g2"))
        assert await drv.list() == []
        assert await next_event(ev) == VMGoneEvent(vm_id="g2")
    finally:
        await drv.close()


async def test_second_qemu_on_the_same_overlay_fails(qdriver: QemuDriver) -> None:
    info = await qdriver.create(VMSpec(vm_id="locked"))
    disk = os.path.join(qdriver.vm_dir("locked"), "disk.qcow2")
    res = subprocess.run(
        [QEMU or "qemu-system-x86_64", "-machine", "q35", "-accel", "tcg", "-nodefaults", "-display", "none",
         "-m", "64", "-drive", f"file={disk},format=qcow2,if=virtio"],
        capture_output=True, timeout=20, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert res.returncode != 0
    assert b"lock" in res.stderr, res.stderr
    assert (await qdriver.inspect("locked")).state == "running"  # type: ignore[union-attr]
    assert info.pid is not None and alive(info.pid)


async def test_hibernate_and_wake_firmware_only(qdriver: QemuDriver, tmp_path: Path) -> None:
    spec = VMSpec(vm_id="sleepy", vnc=True, labels=LABELS)
    info = await qdriver.create(spec)
    ev = qdriver.events()
    snap = await qdriver.snapshot("sleepy", str(tmp_path / "snaps" / "sleepy.mig"))
    assert snap.vm_id == "sleepy" and snap.size_bytes > 0 and Path(snap.path).exists()
    print(f"\nhibernate (firmware-only, 128 MiB): {snap.seconds * 1000:.0f} ms, {snap.size_bytes} bytes")
    await wait_dead(info.pid or 0)
    assert await qdriver.inspect("sleepy") is None  # hibernated: no VM, only the snapshot
    assert qdriver.displays.owner_of(info.vnc_display or 0) is None
    t0 = time.perf_counter()
    woke = await qdriver.restore(spec, snap.path)
    print(f"wake (firmware-only): {(time.perf_counter() - t0) * 1000:.0f} ms")
    assert woke.vm_id == "sleepy" and woke.state == "running" and woke.pid != info.pid
    assert woke.labels == LABELS
    i2 = await qdriver.inspect("sleepy")
    assert i2 is not None and i2.state == "running"
    assert await qdriver.probe("sleepy")
    # restore is idempotent for a running VM
    assert (await qdriver.restore(spec, snap.path)).pid == woke.pid
    await asyncio.sleep(0.3)
    assert ev._queue.empty()  # hibernation is not a crash: no VMExitedEvent


async def test_vnc_displays_not_double_booked_and_owned(state_dir: Path) -> None:
    pool = DisplayPool(range(40, 43))
    # something else on the host already uses display 41's port: it must be skipped
    blocker = socket.socket()
    try:
        blocker.bind(("127.0.0.1", 5900 + 41))
        blocker.listen()
    except OSError:
        blocker.close()
        pytest.skip("port 5941 busy")
    drv = QemuDriver(state_dir=str(state_dir), accel="tcg", display_pool=pool, reconcile_interval=0)
    await drv.open()
    try:
        specs = [VMSpec(vm_id=f"v{i}", vnc=True, labels={"vmfence.io/uid": f"u{i}", "vmfence.io/epoch": "1"})
                 for i in range(2)]  # fmt: skip
        infos = [await drv.create(s) for s in specs]
        assert [i.vnc_display for i in infos] == [40, 42]
        for i in infos:  # QEMU really serves VNC there
            r, w = await asyncio.open_connection("127.0.0.1", 5900 + (i.vnc_display or 0))
            assert (await asyncio.wait_for(r.read(3), 5)) == b"RFB"
            w.close()
        with pytest.raises(Exception, match="no free VNC display"):
            await drv.create(VMSpec(vm_id="v9", vnc=True))
        assert not os.path.exists(drv.vm_dir("v9"))  # a failed create leaves nothing behind
        with pytest.raises(ReservationError):
            pool.release(40, "v0/u-successor/2")  # not the owner
        assert pool.owner_of(40) == "v0/u0/1"
        await drv.remove("v0")
        assert pool.owner_of(40) is None
        assert (await drv.create(VMSpec(vm_id="v3", vnc=True))).vnc_display == 40
    finally:
        blocker.close()
        await drv.close()


async def test_open_rediscovers_and_close_never_kills(state_dir: Path) -> None:
    first = make_driver("qemu", state_dir=str(state_dir), accel="tcg", reconcile_interval=0.2)
    await first.open()
    a = await first.create(VMSpec(vm_id="keep-a", vnc=True, labels=LABELS))
    b = await first.create(VMSpec(vm_id="keep-b"))
    await first.stop("keep-b")
    await first.close()
    assert a.pid is not None and alive(a.pid)  # the agent went away; the VM did not

    second = QemuDriver(state_dir=str(state_dir), accel="tcg", reconcile_interval=0.2)
    ev = second.events()
    await second.open()
    try:
        found = {v.vm_id: v for v in await second.list()}
        assert found["keep-a"].state == "running" and found["keep-a"].pid == a.pid
        assert found["keep-a"].labels == LABELS and found["keep-a"].vnc_display == a.vnc_display
        assert found["keep-b"].state == "exited"
        assert second.displays.owner_of(a.vnc_display or 0) == "keep-a/uid-1/3"
        info = await second.inspect("keep-a")  # over a fresh QMP connection
        assert info is not None and info.state == "running"
        assert (await second.create(VMSpec(vm_id="keep-a"))).pid == a.pid  # still idempotent
        # not our child any more: exit is noticed from QMP EOF + /proc, the signal is unknown
        os.kill(a.pid, signal.SIGKILL)
        assert await next_event(ev) == VMExitedEvent(vm_id="keep-a", exit_code=None, signal=None)
        restarted = await second.start("keep-b")
        assert restarted.state == "running" and b.pid != restarted.pid
    finally:
        await second.remove("keep-a")
        await second.remove("keep-b")
        await second.close()


async def test_accel_auto_picks_a_working_accelerator(state_dir: Path) -> None:
    drv = QemuDriver(state_dir=str(state_dir), accel="auto", probe_kernel=False, reconcile_interval=0)
    await drv.open()
    try:
        accel = await drv.resolve_accel()
        print(f"\naccel=auto (boot-sector probe only) picked {accel}: {drv.accel_reason}")
        assert accel in ("kvm", "tcg")
        assert (state_dir / "accel.json").exists()
        await drv.create(VMSpec(vm_id="fw"))
        # the firmware makes progress under the chosen accelerator
        fw = Path(drv.vm_dir("fw")) / "firmware.log"
        deadline = time.monotonic() + 10
        while b"Booting from" not in (fw.read_bytes() if fw.exists() else b""):
            assert time.monotonic() < deadline, fw.read_bytes()
            await asyncio.sleep(0.05)
        await drv.remove("fw")
    finally:
        await drv.close()
    again = QemuDriver(state_dir=str(state_dir), accel="auto", probe_kernel=False)
    assert await again.resolve_accel() == accel
    assert again.accel_reason.startswith("cached")


def http_get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return r.read().decode().strip()


async def wait_probe(drv: QemuDriver, vm_id: str, timeout: float) -> float:
    t0 = time.monotonic()
    while not await drv.probe(vm_id):
        assert time.monotonic() - t0 < timeout, Path(drv.serial_log(vm_id)).read_text(errors="replace")
        await asyncio.sleep(0.2)
    return time.monotonic() - t0


@pytest.mark.skipif(guest_image() is None, reason="guest image not built (make guest-image)")
async def test_guest_memory_survives_hibernate_and_wake(state_dir: Path, tmp_path: Path) -> None:
    image = guest_image()
    # accel=auto with the real guest kernel: on hosts where KVM hangs after the kernel starts, tcg
    drv = QemuDriver(state_dir=str(state_dir), accel="auto", probe_image=image, reconcile_interval=0.5)
    await drv.open()
    try:
        t0 = time.monotonic()
        accel = await drv.resolve_accel()
        print(f"\naccel=auto (with guest kernel) picked {accel} in {time.monotonic() - t0:.1f}s: "
              f"{drv.accel_reason}")  # fmt: skip
        spec = VMSpec(vm_id="guest", memory_mib=192, image=image, probe_port=8080, labels=LABELS)
        t0 = time.monotonic()
        info = await drv.create(spec)
        assert info.ip is None and info.probe_host_port  # user networking: no address worth reporting
        await wait_probe(drv, "guest", 60)
        boot = time.monotonic() - t0
        serial = Path(drv.serial_log("guest")).read_text(errors="replace")
        assert "VMFENCE-READY" in serial
        token = http_get(info.probe_host_port, "/token")
        assert token and token in serial
        print(f"guest boot to ready probe: {boot:.1f}s")
        snap = await drv.snapshot("guest", str(tmp_path / "guest.mig"))
        print(f"hibernate (guest, 192 MiB): {snap.seconds:.2f}s, {snap.size_bytes} bytes")
        assert await drv.inspect("guest") is None
        t0 = time.monotonic()
        woke = await drv.restore(spec, snap.path)
        ready = await wait_probe(drv, "guest", 30)
        print(f"wake to ready probe: {time.monotonic() - t0:.2f}s (probe {ready:.2f}s)")
        assert woke.probe_host_port
        # the token only ever existed in guest RAM (a tmpfs written at boot): same memory
        assert http_get(woke.probe_host_port, "/token") == token
        # and no second boot happened: the new serial log has no boot banner
        assert "VMFENCE-READY" not in Path(drv.serial_log("guest")).read_text(errors="replace")
        await drv.remove("guest")
    finally:
        await drv.close()
        kill_leftovers(state_dir)
