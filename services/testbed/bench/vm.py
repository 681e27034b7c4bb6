"""`vmfence bench vm`: what the runtime driver adds to starting a VM, measured against a bare QEMU.

The qemu driver is used directly (no bus, no agent) so the figure is the driver's own cost: the
qcow2 overlay, the record on disk, the QMP handshake and the status poll. The baseline is a bare
``qemu-system-x86_64`` with the driver's exact -machine/-accel/-m/-smp/-nodefaults options started
by this benchmark to QMP ``running``, interleaved with the driver's creates so that load from other
processes on a shared machine hits both alike. ``--runtime sim`` gives trivial numbers: a smoke run.

``--network bridge`` (issue 12 §5) adds ``reachable``: guest VMs created through the driver on a pod
network bridge of their own (services/agent/network.py), create-to-running and create-to-reachable
(the first TCP answer from the guest's address) p50/p95, each VM followed by a bare QEMU booting the
same guest on the same tap with the same address, measured the same way.
"""

# The benchmark fork/execs QEMU and reads /proc from the event loop, as the driver does.
# ruff: noqa: ASYNC220, ASYNC230

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from qemu.qmp import QMPClient

from services.agent.runtime import RuntimeDriver, VMSpec, make_driver

ROOT = Path(__file__).resolve().parents[3]  # the repository (this file is services/testbed/<pkg>/)
GUEST_IMAGE = ROOT / "build" / "guest"
GUEST_READY = b"VMFENCE-READY"
GUEST_BOOT_TIMEOUT_S = 120.0
# accel=auto probes KVM by booting a guest (~10 s when nested KVM fails); the driver caches the
# answer in its state dir, which here is a temp dir: keep the cache across runs.
ACCEL_CACHE = ROOT / ".vmfence" / "bench" / "qemu-accel.json"
MEMORY_MIB = 128


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); the p95 of a few samples is their maximum."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))
    return s[k]


def rss_mib(pids: list[int]) -> float:
    """Sum of the processes' resident set sizes (VmRSS from /proc), in MiB."""
    total_kib = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total_kib += int(line.split()[1])
                        break
        except OSError:
            continue
    return total_kib / 1024


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


# ------------------------------------------------------------------------------- bare QEMU


class RawQemu:
    """A bare QEMU with the driver's machine options and nothing else (no disk, no serial,
    no pidfile), driven over a QMP socket handed to it as a listening fd, as the driver does."""

    def __init__(self, binary: str, machine: str, accel_opt: str, workdir: str, name: str,
                 extra: list[str] | None = None, memory_mib: int = MEMORY_MIB) -> None:
        self.args = [
            binary, "-machine", machine, "-accel", accel_opt,
            "-nodefaults", "-no-user-config", "-display", "none",
            "-m", str(memory_mib), "-smp", "1", *(extra or []),
        ]  # fmt: skip
        self.dir = os.path.join(workdir, name)
        self.proc: subprocess.Popen[bytes] | None = None
        self.qmp: QMPClient | None = None

    async def start(self) -> float:
        """Seconds from fork to QMP query-status == running."""
        os.makedirs(self.dir, exist_ok=True)
        sock_path = os.path.join(self.dir, "qmp.sock")
        t0 = time.perf_counter()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(sock_path)
            listener.listen(4)
            fd = listener.fileno()
            args = [*self.args, "-chardev", f"socket,id=qmp0,fd={fd},server=on,wait=off",
                    "-mon", "chardev=qmp0,mode=control"]
            with open(os.path.join(self.dir, "qemu.log"), "ab") as err:
                self.proc = subprocess.Popen(
                    args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                    start_new_session=True, pass_fds=(fd,),
                )  # fmt: skip
        finally:
            listener.close()
        qmp = QMPClient("bench-raw")
        qmp.logger.setLevel(logging.CRITICAL)
        await asyncio.wait_for(qmp.connect(sock_path), 15)
        self.qmp = qmp
        delay = 0.005
        while (await qmp.execute("query-status"))["status"] != "running":
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)
        return time.perf_counter() - t0

    async def stop(self) -> None:
        # disconnect first, then SIGTERM: a QMP `quit` makes qemu.qmp's reader hit EOF and log
        # an unretrieved exception
        if self.qmp is not None:
            with contextlib.suppress(Exception):
                await self.qmp.disconnect()
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
            try:
                await asyncio.to_thread(self.proc.wait, 3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)
        shutil.rmtree(self.dir, ignore_errors=True)


# ------------------------------------------------------------------------------- guest boot


async def _wait_serial(path: str, needle: bytes, timeout: float) -> bool:  # noqa: ASYNC109
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(path, "rb") as f:
                if needle in f.read():
                    return True
        except FileNotFoundError:
            pass
        await asyncio.sleep(0.02)
    return False


async def _guest_boots(driver: Any, n: int) -> list[float]:
    """create() to "VMFENCE-READY" on the guest's serial console, for n guest VMs in turn."""
    out: list[float] = []
    for i in range(n):
        vm_id = f"bench-guest-{i}"
        t0 = time.perf_counter()
        await driver.create(VMSpec(vm_id=vm_id, memory_mib=256, image=str(GUEST_IMAGE)))
        try:
            ok = await _wait_serial(driver.serial_log(vm_id), GUEST_READY, GUEST_BOOT_TIMEOUT_S)
            if ok:
                out.append(time.perf_counter() - t0)
        finally:
            await driver.remove(vm_id)
    return out


def guest_image_present() -> bool:
    return (GUEST_IMAGE / "vmlinuz").is_file() and (GUEST_IMAGE / "initramfs.cpio.gz").is_file()


# ------------------------------------------------------------------------------- reachability


NET_GUEST_MIB = 160
NET_PORT = 8080  # the guest image's HTTP server
REACH_POLL_S = 0.05
REACH_ATTEMPT_S = 0.25  # one connect (an address nobody has yet does not answer ARP)


async def _first_answer(ip: str, timeout: float) -> float | None:  # noqa: ASYNC109
    """perf_counter() of the first TCP answer (a connect, a request, a byte back) from ip:8080."""
    from services.agent.runtime.qemu import tcp_probe

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await tcp_probe(ip, NET_PORT, b"GET / HTTP/1.0\r\n\r\n", REACH_ATTEMPT_S):
            return time.perf_counter()
        await asyncio.sleep(REACH_POLL_S)
    return None


async def _reachability(driver: Any, net: Any, n: int, raw: Any) -> dict[str, Any]:
    """n guest VMs through the driver on the host's bridge, each followed by a bare QEMU booting
    the same guest on the same tap with the same address and MAC: create-to-running (the driver's
    create returned / QMP running) and create-to-reachable (the first TCP answer from the guest's
    address), per VM."""
    from services.agent.runtime.netlink import delete_tap, ensure_tap

    out: dict[str, list[float]] = {"running": [], "reachable": [], "raw_running": [], "raw_reachable": []}
    image = str(GUEST_IMAGE)
    for i in range(n):
        vm_id = f"bench-net-{i}"
        ip = list(net.pool.addresses())[i]
        att = net.attach(vm_id, ip)
        t0 = time.perf_counter()
        await driver.create(VMSpec(vm_id=vm_id, memory_mib=NET_GUEST_MIB, image=image, probe_port=NET_PORT, net=att))
        out["running"].append(time.perf_counter() - t0)
        try:
            at = await _first_answer(ip, GUEST_BOOT_TIMEOUT_S)
            if at is not None:
                out["reachable"].append(at - t0)
        finally:
            await driver.remove(vm_id)  # its tap goes with it
        await ensure_tap(att)
        append = f"console=ttyS0 quiet vmfence.ip={ip}/{att.prefix} vmfence.gw={att.gateway}"
        rq = raw(f"raw-net-{i}", [
            "-kernel", os.path.join(image, "vmlinuz"), "-initrd", os.path.join(image, "initramfs.cpio.gz"),
            "-append", append, "-netdev", f"tap,id=net0,ifname={att.tap},script=no,downscript=no",
            "-device", f"virtio-net-pci,netdev=net0,mac={att.mac},romfile=",
        ])
        try:
            t0 = time.perf_counter()
            out["raw_running"].append(await rq.start())
            at = await _first_answer(ip, GUEST_BOOT_TIMEOUT_S)
            if at is not None:
                out["raw_reachable"].append(at - t0)
        finally:
            await rq.stop()
            await delete_tap(att)
    return out


def _reach_figures(r: dict[str, list[float]], n: int) -> dict[str, Any]:
    def p(vals: list[float], q: float) -> float | None:
        return _r(statistics.median(vals) if q == 50 else pct(vals, q)) if vals else None

    return {
        "vms": n,
        "reached": len(r["reachable"]),
        "create_to_running_p50_s": p(r["running"], 50),
        "create_to_running_p95_s": p(r["running"], 95),
        "create_to_reachable_p50_s": p(r["reachable"], 50),
        "create_to_reachable_p95_s": p(r["reachable"], 95),
        "raw_qemu_running_p50_s": p(r["raw_running"], 50),
        "raw_qemu_running_p95_s": p(r["raw_running"], 95),
        "raw_qemu_reachable_p50_s": p(r["raw_reachable"], 50),
        "raw_qemu_reachable_p95_s": p(r["raw_reachable"], 95),
        "guest_memory_mib": NET_GUEST_MIB,
    }


# ------------------------------------------------------------------------------- the bench


async def _lifecycle(
    driver: RuntimeDriver, count: int, tmp: str, raw: Any | None
) -> dict[str, Any]:
    """create count VMs (interleaved with bare QEMU starts when raw is given), measure RSS, then
    hibernate and wake each, then remove all."""
    creates: list[float] = []
    raws: list[float] = []
    raw_vms: list[RawQemu] = []
    ids = [f"bench-vm-{i}" for i in range(count)]
    try:
        for i, vm_id in enumerate(ids):
            if raw is not None:
                rq = raw(f"raw-{i}")
                raw_vms.append(rq)
                raws.append(await rq.start())
            t0 = time.perf_counter()
            await driver.create(VMSpec(vm_id=vm_id, memory_mib=MEMORY_MIB))
            creates.append(time.perf_counter() - t0)
        infos = [await driver.inspect(v) for v in ids]
        pids = [i.pid for i in infos if i is not None and i.pid is not None]
        rss = rss_mib(pids) / count if pids else 0.0
        raw_rss = (
            rss_mib([r.proc.pid for r in raw_vms if r.proc is not None]) / len(raw_vms) if raw_vms else None
        )
        for rq in raw_vms:
            await rq.stop()
        raw_vms.clear()
        hibernates: list[float] = []
        wakes: list[float] = []
        snap_sizes: list[int] = []
        for vm_id in ids:
            dest = os.path.join(tmp, "snapshots", f"{vm_id}.snap")
            t0 = time.perf_counter()
            snap = await driver.snapshot(vm_id, dest)
            hibernates.append(time.perf_counter() - t0)
            snap_sizes.append(snap.size_bytes)
            t0 = time.perf_counter()
            await driver.restore(VMSpec(vm_id=vm_id, memory_mib=MEMORY_MIB), dest)
            wakes.append(time.perf_counter() - t0)
    finally:
        for rq in raw_vms:
            await rq.stop()
        for vm_id in ids:
            with contextlib.suppress(Exception):
                await driver.remove(vm_id)
    return {
        "creates": creates, "raws": raws, "rss": rss, "raw_rss": raw_rss,
        "hibernates": hibernates, "wakes": wakes, "snap_sizes": snap_sizes, "pids": pids,
    }


async def run_vm_bench(runtime: str, count: int, *, guest_boots: int = 3, network: str = "user") -> dict[str, Any]:
    """The `bench vm` result: driver create latency beside a bare QEMU, hibernate/wake, RSS; with
    ``network="bridge"`` (qemu) also create-to-reachable on the pod network beside a bare QEMU on
    the same tap (``guest_boots`` guest VMs)."""
    if count < 1:
        raise ValueError("count must be at least 1")
    if network not in ("user", "bridge"):
        raise ValueError(f"unknown network {network!r} (user or bridge)")
    tmp = tempfile.mkdtemp(prefix="vmfence-benchvm-")
    try:
        if runtime == "sim":
            return {**await _run_sim(count, tmp), "network": network}
        if runtime == "qemu":
            return await _run_qemu(count, tmp, guest_boots, network)
        raise ValueError(f"unknown runtime {runtime!r} (qemu or sim)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


async def _run_sim(count: int, tmp: str) -> dict[str, Any]:
    driver = make_driver("sim", state_dir=os.path.join(tmp, "sim"))
    await driver.open()
    try:
        r = await _lifecycle(driver, count, tmp, None)
    finally:
        await driver.close()
    return {
        "bench": "vm",
        "runtime": "sim",
        "accel": "sim",
        "count": count,
        "create_p50_s": _r(statistics.median(r["creates"]), 6),
        "create_p95_s": _r(pct(r["creates"], 95), 6),
        "raw_qemu_start_p50_s": None,
        "create_ratio_to_raw": None,
        "guest_image": guest_image_present(),
        "guest_boot_p50_s": None,
        "hibernate_p50_s": _r(statistics.median(r["hibernates"]), 6),
        "wake_p50_s": _r(statistics.median(r["wakes"]), 6),
        "rss_per_vm_mib": 0.0,
        "note": "sim runtime: in-process records, no QEMU; a smoke run of the benchmark itself",
    }


async def _run_qemu(count: int, tmp: str, guest_boots: int, network: str = "user") -> dict[str, Any]:
    from services.agent.network import HostNetwork
    from services.agent.runtime.qemu import QemuDriver

    if shutil.which("qemu-system-x86_64") is None or shutil.which("qemu-img") is None:
        raise RuntimeError("qemu-system-x86_64 / qemu-img not installed")
    state_dir = os.path.join(tmp, "qemu")
    os.makedirs(state_dir)
    with contextlib.suppress(OSError):
        shutil.copyfile(ACCEL_CACHE, os.path.join(state_dir, "accel.json"))
    driver = make_driver("qemu", state_dir=state_dir, accel="auto", reconcile_interval=0)
    assert isinstance(driver, QemuDriver)
    await driver.open()
    try:
        t0 = time.perf_counter()
        accel = await driver.resolve_accel()
        accel_probe_s = time.perf_counter() - t0
        with contextlib.suppress(OSError):
            ACCEL_CACHE.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(os.path.join(state_dir, "accel.json"), ACCEL_CACHE)
        accel_opt = f"tcg,tb-size={driver.tcg_tb_size_mib}" if accel == "tcg" else accel
        rawdir = os.path.join(tmp, "raw")

        def raw(name: str, extra: list[str] | None = None) -> RawQemu:
            memory = NET_GUEST_MIB if extra else MEMORY_MIB
            return RawQemu(driver.qemu_binary, driver.machine, accel_opt, rawdir, name, extra, memory)

        # warm-up (not counted): the base image, page cache for the QEMU binary and firmware
        t0 = time.perf_counter()
        await driver.create(VMSpec(vm_id="bench-warmup", memory_mib=MEMORY_MIB))
        first_create = time.perf_counter() - t0
        await driver.remove("bench-warmup")
        warm = raw("raw-warmup")
        await warm.start()
        await warm.stop()

        r = await _lifecycle(driver, count, tmp, raw)
        boots: list[float] = []
        has_guest = guest_image_present()
        if has_guest and guest_boots > 0:
            boots = await _guest_boots(driver, guest_boots)
        reach: dict[str, Any] | None = None
        if network == "bridge":
            if not has_guest:
                raise RuntimeError("--network bridge measures reachability of the guest image: make guest-image")
            net = HostNetwork("bridge", tmp, "bench")
            await net.open()
            try:
                reach = _reach_figures(await _reachability(driver, net, max(1, guest_boots), raw), max(1, guest_boots))
            finally:
                await net.teardown()
                net.close()
    finally:
        await driver.close()
    create_p50 = statistics.median(r["creates"])
    raw_p50 = statistics.median(r["raws"])
    load1 = os.getloadavg()[0]
    return {
        "bench": "vm",
        "runtime": "qemu",
        "accel": accel,
        "accel_reason": driver.accel_reason,
        "accel_probe_s": round(accel_probe_s, 3),
        "count": count,
        "first_create_s": round(first_create, 4),
        "create_p50_s": _r(create_p50),
        "create_p95_s": _r(pct(r["creates"], 95)),
        "raw_qemu_start_p50_s": _r(raw_p50),
        "raw_qemu_start_p95_s": _r(pct(r["raws"], 95)),
        "create_ratio_to_raw": _r(create_p50 / raw_p50, 3),
        "create_overhead_p50_s": _r(create_p50 - raw_p50),
        "guest_image": has_guest,
        "guest_boot_p50_s": _r(statistics.median(boots)) if boots else None,
        "guest_boots": len(boots),
        "hibernate_p50_s": _r(statistics.median(r["hibernates"])),
        "wake_p50_s": _r(statistics.median(r["wakes"])),
        "snapshot_bytes_p50": int(statistics.median(r["snap_sizes"])),
        "rss_per_vm_mib": round(r["rss"], 2),
        "raw_rss_per_vm_mib": _r(r["raw_rss"], 2),
        "memory_mib": MEMORY_MIB,
        "loadavg_1m_end": round(load1, 2),
        "cpus": os.cpu_count(),
        "network": network,
        **({"reachable": reach} if reach is not None else {}),
    }
