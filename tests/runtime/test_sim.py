from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from services.agent.runtime import (
    Inconclusive,
    RuntimeDriver,
    RuntimeFailure,
    VMExitedEvent,
    VMGoneEvent,
    VMSpec,
    make_driver,
)
from services.agent.runtime.sim import AgentCrash, SimDriver

LABELS = {"vmfence.io/key": "ns/p", "vmfence.io/uid": "u1", "vmfence.io/epoch": "1"}


async def scenario(seed: int, tmp: Path) -> tuple[list[object], list[object], list[str]]:
    d = SimDriver(seed=seed)
    d.faults.fail("create", probability=0.5, times=None)
    d.faults.inconclusive(probability=0.3, times=None)
    ev = d.events()
    out: list[object] = []
    for i in range(30):
        try:
            out.append(await d.create(VMSpec(vm_id=f"vm-{i}", labels=LABELS)))
        except RuntimeFailure as e:
            out.append(str(e))
        try:
            out.append(await d.inspect(f"vm-{i}"))
        except Inconclusive as e:
            out.append(str(e))
    for vm_id in d.running_vms()[:3]:
        d.crash_vm(vm_id)
    snap = await d.snapshot(d.running_vms()[0], str(tmp / f"s{seed}.snap"))
    out.append((snap.vm_id, snap.size_bytes))
    await d.close()
    events = [e async for e in ev]
    return out, events, [f"{h.op}:{h.vm_id}:{h.outcome}" for h in d.history]


async def test_deterministic_per_seed(tmp_path: Path) -> None:
    a = await scenario(7, tmp_path)
    b = await scenario(7, tmp_path)
    c = await scenario(8, tmp_path)
    assert a == b
    assert a[2] != c[2]


async def test_interface_and_oracle(tmp_path: Path) -> None:
    d = make_driver("sim", state_dir=str(tmp_path), seed=1)
    assert isinstance(d, RuntimeDriver)
    assert isinstance(d, SimDriver)
    await d.open()
    info = await d.create(VMSpec(vm_id="a", vnc=True, probe_port=8080, labels=LABELS))
    again = await d.create(VMSpec(vm_id="a", labels=LABELS))
    assert info == again  # idempotent by vm_id
    assert info.state == "running" and info.vnc_display == 10 and info.probe_host_port is not None
    assert await d.probe("a")
    await d.stop("a")
    assert (await d.inspect("a")).state == "exited"  # type: ignore[union-attr]
    assert not await d.probe("a")
    assert (await d.start("a")).state == "running"
    assert d.running_vms() == ["a"]
    await d.remove("a")
    await d.remove("a")  # idempotent
    await d.remove("never-existed")
    assert await d.inspect("a") is None
    assert d.running_vms() == []
    ops = [(h.op, h.vm_id, h.labels.get("vmfence.io/uid")) for h in d.history]
    assert ops[0] == ("create", "a", "u1")
    assert [o for o, _, _ in ops] == [
        "create", "create", "probe", "stop", "inspect", "probe", "start", "remove", "remove",
        "remove", "inspect",
    ]  # fmt: skip


async def test_fail_and_delay_faults() -> None:
    d = SimDriver(seed=0)
    d.faults.fail("create", times=2, message="boom")
    for _ in range(2):
        with pytest.raises(RuntimeFailure, match="boom"):
            await d.create(VMSpec(vm_id="x"))
    assert d.running_vms() == []  # a failed op has no effect
    await d.create(VMSpec(vm_id="x"))
    assert d.running_vms() == ["x"]
    d.faults.delay("stop", 0.2, vm_id="x")
    t0 = time.monotonic()
    await d.stop("x")
    assert time.monotonic() - t0 >= 0.2
    # only the chosen VM is affected
    d.faults.fail("start", vm_id="y", times=None)
    await d.start("x")
    await d.create(VMSpec(vm_id="y"))
    await d.stop("y")
    with pytest.raises(RuntimeFailure):
        await d.start("y")
    outcomes = [(h.op, h.vm_id, h.outcome) for h in d.history if h.outcome != "ok"]
    assert outcomes == [("create", "x", "failed"), ("create", "x", "failed"), ("start", "y", "failed")]


async def test_crash_vm_emits_exited_and_start_relaunches() -> None:
    d = SimDriver(seed=3)
    ev = d.events()
    first = await d.create(VMSpec(vm_id="c"))
    d.crash_vm("c")
    e = await asyncio.wait_for(ev.__anext__(), 1)
    assert e == VMExitedEvent(vm_id="c", exit_code=None, signal=9)
    info = await d.inspect("c")
    assert info is not None and info.state == "exited"
    assert d.running_vms() == []
    again = await d.start("c")
    assert again.state == "running" and again.pid != first.pid


async def test_lose_vm_inspect_none_and_gone_event() -> None:
    d = SimDriver(seed=4)
    ev = d.events()
    await d.create(VMSpec(vm_id="l", vnc=True))
    d.lose_vm("l")
    assert d.running_vms() == []
    assert await d.inspect("l") is None
    e = await asyncio.wait_for(ev.__anext__(), 1)
    assert e == VMGoneEvent(vm_id="l")
    assert await d.inspect("l") is None  # gone is reported once
    await d.reconcile()
    assert d.emitted == [VMGoneEvent(vm_id="l")]
    # its display went back to the pool
    assert (await d.create(VMSpec(vm_id="m", vnc=True))).vnc_display == 10


async def test_inconclusive_inspect() -> None:
    d = SimDriver(seed=5)
    await d.create(VMSpec(vm_id="i"))
    d.faults.inconclusive(vm_id="i", times=2)
    for _ in range(2):
        with pytest.raises(Inconclusive):
            await d.inspect("i")
    assert (await d.inspect("i")).state == "running"  # type: ignore[union-attr]


async def test_crash_after_effect_then_restart_sees_the_vm(tmp_path: Path) -> None:
    d = SimDriver(state_dir=str(tmp_path), seed=6)
    await d.open()
    d.faults.crash_after("create")
    with pytest.raises(AgentCrash):
        await d.create(VMSpec(vm_id="k", labels=LABELS))
    assert d.running_vms() == ["k"]  # the effect happened although the agent "died" before reporting
    # a new agent process: the sim host (JSON file) outlives it
    d2 = SimDriver(state_dir=str(tmp_path), seed=6)
    await d2.open()
    assert d2.running_vms() == ["k"]
    info = await d2.inspect("k")
    assert info is not None and info.labels == LABELS
    assert [(h.op, h.outcome) for h in d2.history] == [("create", "crashed_after"), ("inspect", "ok")]
    # a VM lost while no agent ran is noticed as gone at open()
    d2.lose_vm("k")
    d3 = SimDriver(state_dir=str(tmp_path), seed=6)
    ev = d3.events()
    await d3.open()
    assert await asyncio.wait_for(ev.__anext__(), 1) == VMGoneEvent(vm_id="k")


async def test_snapshot_restore_keeps_memory(tmp_path: Path) -> None:
    d = SimDriver(seed=9)
    await d.create(VMSpec(vm_id="h", vnc=True))
    token = d.memory_token("h")
    snap = await d.snapshot("h", str(tmp_path / "h.snap"))
    assert snap.size_bytes > 0 and (tmp_path / "h.snap").exists()
    assert await d.inspect("h") is None and d.running_vms() == []
    # a fresh driver (another host sharing the snapshot dir) can wake it from the file
    d2 = SimDriver(seed=10)
    info = await d2.restore(VMSpec(vm_id="h", vnc=True), snap.path)
    assert info.state == "running" and d2.memory_token("h") == token
    with pytest.raises(RuntimeFailure):
        await d2.restore(VMSpec(vm_id="z"), str(tmp_path / "missing.snap"))


async def test_the_host_record_is_a_journal_that_reloads_whole_and_survives_a_torn_line(tmp_path: Path) -> None:
    """An effect appends one line (the host file is not rewritten per op, which made each op cost
    O(VMs)); compaction folds the journal back; a reload sees exactly the driver's VMs and history."""
    from services.agent.runtime.sim import HOST_FILE, JOURNAL_FILE, JOURNAL_MIN_COMPACT, load_host

    d = SimDriver(state_dir=str(tmp_path), seed=7)
    await d.open()
    host_file = tmp_path / HOST_FILE
    written = host_file.stat().st_mtime_ns
    for i in range(JOURNAL_MIN_COMPACT - 10):
        await d.create(VMSpec(vm_id=f"v{i}", labels=LABELS))
    assert host_file.stat().st_mtime_ns == written, "an effect rewrote the whole host file"
    await d.remove("v0")
    await d.probe("v1")  # read-only: in the history, journaled with the next effect
    await d.remove("v2")
    rec = load_host(str(tmp_path))
    assert sorted(rec.vms) == d.all_vms()
    assert [(h.op, h.vm_id) for h in rec.history] == [(h.op, h.vm_id) for h in d.history]
    inode = host_file.stat().st_ino
    for i in range(3, JOURNAL_MIN_COMPACT - 10):  # the journal passes twice the VMs: compacted
        await d.remove(f"v{i}")
    assert host_file.stat().st_ino != inode, "the journal was never folded back into the host file"
    assert len((tmp_path / JOURNAL_FILE).read_bytes().splitlines()) < JOURNAL_MIN_COMPACT
    assert sorted(load_host(str(tmp_path)).vms) == d.all_vms()
    # an agent SIGKILLed mid-write leaves a torn last line: everything before it still counts
    await d.create(VMSpec(vm_id="last", labels=LABELS))
    _append(tmp_path / JOURNAL_FILE, b'{"vm_id":"torn","vm":{"spec"')
    d2 = SimDriver(state_dir=str(tmp_path), seed=7)
    await d2.open()
    assert d2.all_vms() == d.all_vms() and "last" in d2.all_vms() and "torn" not in d2.all_vms()
    await d2.close()


def _append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


async def test_list_labelled_is_the_filtered_list(tmp_path: Path) -> None:
    """A survey's question: the VMs of one key, in the order and shape ``list`` gives them."""
    d = SimDriver(seed=3)
    for i, key in enumerate(["ns/a", "ns/b", "ns/a", "ns/c", "ns/a"]):
        await d.create(VMSpec(vm_id=f"vm-{4 - i}", labels={**LABELS, "vmfence.io/key": key}))
    everything = await d.list()
    for key in ("ns/a", "ns/b", "ns/none"):
        assert await d.list_labelled("vmfence.io/key", key) == [
            i for i in everything if i.labels["vmfence.io/key"] == key]
    assert [i.vm_id for i in await d.list_labelled("vmfence.io/key", "ns/a")] == ["vm-0", "vm-2", "vm-4"]
    await d.close()


def text(path: Path) -> str:
    return path.read_text()


def exists(path: Path) -> bool:
    return path.exists()


async def test_a_console_is_written_when_first_asked_for_with_the_run_before(tmp_path: Path) -> None:
    """No file per boot (an inode each); ``serial_log`` writes the console and the previous run's
    from the record, and once asked for, each boot writes them at once (a follower sees it)."""
    d = SimDriver(state_dir=str(tmp_path), seed=1)
    await d.open()
    try:
        await d.create(VMSpec(vm_id="v1"))
        assert not exists(tmp_path / "console"), "a boot wrote a console nobody asked for"
        d.crash_vm("v1")
        await d.start("v1")  # the second run, its console still unread
        path = Path(d.serial_log("v1"))
        previous = Path(str(path) + ".previous")
        assert "booting v1 (pid 1000," in text(previous)
        assert text(path).startswith("sim: booting v1 (pid 1001,") and "VMFENCE-READY" in text(path)
        d.crash_vm("v1")
        await d.start("v1")  # asked for before: this boot writes at once
        assert "(pid 1001," in text(previous) and "(pid 1002," in text(path)
        await d.remove("v1")
        assert not exists(path) and not exists(previous)
    finally:
        await d.close()
