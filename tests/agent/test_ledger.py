"""Ledger-level rules: reservations belong to (vm_id, uid, epoch); tombstones and results persist."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.agent.ledger import Ledger, ReservationConflict, VMRow
from shared.fence.agentfence import fence_verdict
from shared.fence.schema import CommandResult, Fence, Spec

from .conftest import fence


@contextlib.asynccontextmanager
async def reopened(ledger: Ledger) -> AsyncIterator[Ledger]:
    """Close ``ledger`` and open its file again: what an agent's restart reads back."""
    await ledger.close()
    again = Ledger(ledger.path)
    await again.open()
    try:
        yield again
    finally:
        await again.close()


async def test_reservations_are_freed_only_by_their_owner(tmp_path: Path) -> None:
    ledger = Ledger(str(tmp_path / "l.sqlite3"))
    await ledger.open()
    try:
        old, new = fence(1), fence(2)
        await ledger.reserve("vnc", "12", "vm-a", old)
        await ledger.reserve("vnc", "12", "vm-a", old)  # idempotent for the owner
        with pytest.raises(ReservationConflict):
            await ledger.reserve("vnc", "12", "vm-b", new)  # someone else cannot claim it
        with pytest.raises(ReservationConflict):
            await ledger.release("vnc", "12", "vm-a", new)  # a newer fence is not the owner
        with pytest.raises(ReservationConflict):
            await ledger.release("vnc", "12", "vm-b", old)  # nor is another VM of the same fence
        assert await ledger.reservation_owner("vnc", "12") == ("vm-a", old.uid, old.epoch)
        assert await ledger.release("vnc", "12", "vm-a", old) is True
        assert await ledger.release("vnc", "12", "vm-a", old) is False  # already free
        await ledger.reserve("vnc", "12", "vm-b", new)  # free again: anyone may take it
        # burying a VM releases only what its owner holds on it; snapshots outlive the VM
        await ledger.reserve("port", "20000", "vm-b", new)
        await ledger.reserve("snapshot", "/s/vm-b.snap", "vm-b", new)
        await ledger.bury("vm-b", "removed", old)  # not the owner: nothing released
        assert len(await ledger.reservations("vm-b")) == 3
        await ledger.bury("vm-b", "removed", new)
        assert [r.kind for r in await ledger.reservations("vm-b")] == ["snapshot"]
    finally:
        await ledger.close()


async def test_ledger_survives_reopen(tmp_path: Path) -> None:
    path = str(tmp_path / "l.sqlite3")
    ledger = Ledger(path)
    await ledger.open()
    f = fence(3)
    await ledger.put_vm(VMRow(vm_id="vm-c", fence=f, state="creating", spec=Spec(cpus=2)))
    res = CommandResult(fence=f, command_id="c1", op="remove", host="h", vm_id="vm-d", outcome="ok")
    await ledger.record(res, bury=("removed", f))
    await ledger.close()
    again = Ledger(path)
    await again.open()
    try:
        row = again.vm("vm-c")
        assert row is not None and row.fence == f and row.state == "creating" and row.spec.cpus == 2
        assert await again.result("c1") == res
        tomb = again.tombstone("vm-d")
        assert tomb is not None and tomb.reason == "removed"
    finally:
        await again.close()


async def test_a_write_whose_caller_is_cancelled_lands_in_the_file_and_the_mirror(tmp_path: Path) -> None:
    """A transaction runs whole on the ledger's thread once asked for: cancelling the caller must not
    leave the file committed and the mirror without the row (the agent would then not know a VM it
    recorded)."""
    path = str(tmp_path / "l.sqlite3")
    ledger = Ledger(path)
    await ledger.open()
    f = fence(2)
    write = asyncio.create_task(ledger.put_vm(VMRow(vm_id="vm-x", fence=f, state="creating", spec=Spec())))
    await asyncio.sleep(0)  # the task ran to its wait on the ledger's thread
    write.cancel()
    with pytest.raises(asyncio.CancelledError):
        await write
    row = ledger.vm("vm-x")
    assert row is not None and row.fence == f
    async with reopened(ledger) as again:
        assert again.vm("vm-x") == row


async def test_crossing_mark_raises_keep_the_higher_epoch_in_the_mirror_and_the_file(tmp_path: Path) -> None:
    path = str(tmp_path / "l.sqlite3")
    ledger = Ledger(path)
    await ledger.open()
    key = "pod/default/a"
    await asyncio.gather(ledger.raise_key_mark(key, 5, "u5"), ledger.raise_key_mark(key, 3, "u3"))
    assert (ledger.key_mark(key), ledger.key_mark_uid(key)) == (5, "u5")
    async with reopened(ledger) as again:
        assert (again.key_mark(key), again.key_mark_uid(key)) == (5, "u5")


async def test_the_rows_of_one_key_follow_every_write_and_a_reopen(tmp_path: Path) -> None:
    """``vms_of`` (a survey's ledger half) is an index beside the mirror: it must see what ``vms``
    sees, after puts, records, burials, forgets and a reopen."""
    path = str(tmp_path / "l.sqlite3")
    ledger = Ledger(path)
    await ledger.open()
    a, b = fence(1), Fence("pod/default/b", "ub", 1)

    def by_key(led: Ledger, key: str) -> list[VMRow]:
        assert led.vms_of(key) == [r for r in led.vms() if r.fence.key == key]
        return led.vms_of(key)

    await ledger.put_vm(VMRow(vm_id="a-2", fence=a, state="creating", spec=Spec()))
    await ledger.put_vm(VMRow(vm_id="a-1", fence=a, state="creating", spec=Spec()))
    await ledger.record(CommandResult(fence=b, command_id="cb", op="create", host="h", vm_id="b-1", outcome="ok"),
                        put=VMRow(vm_id="b-1", fence=b, state="running", spec=Spec()))
    assert [r.vm_id for r in by_key(ledger, a.key)] == ["a-1", "a-2"]
    await ledger.record(CommandResult(fence=a, command_id="ca", op="remove", host="h", vm_id="a-2", outcome="ok"),
                        bury=("removed", a))
    await ledger.forget_vm("b-1")
    assert [r.vm_id for r in by_key(ledger, a.key)] == ["a-1"] and by_key(ledger, b.key) == []
    async with reopened(ledger) as again:
        assert [r.vm_id for r in by_key(again, a.key)] == ["a-1"] and by_key(again, b.key) == []


async def test_writes_asked_for_together_commit_together_and_one_bad_write_fails_alone(tmp_path: Path) -> None:
    """Group commit: writes queued while the ledger's thread is busy share one COMMIT (one fsync),
    yet each is all-or-nothing: a write that raises (here a reservation its VM does not hold) gets
    its own error and the others still land, in the file and the mirror."""
    path = str(tmp_path / "l.sqlite3")
    ledger = Ledger(path)
    await ledger.open()
    f = fence(1)
    await ledger.reserve("vnc", "5901", "vm-0", f)
    before = ledger.commits
    gate = threading.Event()
    busy = asyncio.ensure_future(ledger.run(lambda db: gate.wait(10)))  # the thread is in an fsync, say
    writes = [asyncio.ensure_future(ledger.put_vm(VMRow(vm_id=f"vm-{i}", fence=f, state="creating", spec=Spec())))
              for i in range(1, 40)]
    bad = asyncio.ensure_future(ledger.release("vnc", "5901", "vm-other", f))
    await asyncio.sleep(0)  # every write above has been queued behind the busy thread
    gate.set()
    assert await busy
    out = await asyncio.gather(*writes, bad, return_exceptions=True)
    assert isinstance(out[-1], ReservationConflict)
    assert all(isinstance(r, VMRow) for r in out[:-1])
    assert ledger.commits - before < len(writes), "no write shared a commit"
    assert [r.vm_id for r in ledger.vms()] == sorted(f"vm-{i}" for i in range(1, 40))
    async with reopened(ledger) as again:
        assert [r.vm_id for r in again.vms()] == sorted(f"vm-{i}" for i in range(1, 40))
        assert await again.reservation_owner("vnc", "5901") == ("vm-0", f.uid, f.epoch)


async def test_a_write_asked_for_while_a_batch_commits_gets_a_batch_of_its_own(tmp_path: Path) -> None:
    """Writes share a thread hop: only the first of a batch submits a drain. One asked for while
    the thread is inside a batch must still be drained (not wait for the next write to come)."""
    ledger = Ledger(str(tmp_path / "l.sqlite3"))
    await ledger.open()
    inside, gate = threading.Event(), threading.Event()

    def slow(db: object) -> bool:
        inside.set()
        return gate.wait(10)

    first = asyncio.ensure_future(ledger._write(slow))
    await asyncio.to_thread(inside.wait, 10)  # the thread is committing the first batch
    f = fence(1)
    second = asyncio.ensure_future(ledger.put_vm(VMRow(vm_id="vm-1", fence=f, state="creating", spec=Spec())))
    await asyncio.sleep(0)
    gate.set()
    assert await asyncio.wait_for(first, 10)
    row = await asyncio.wait_for(second, 10)
    assert row.vm_id == "vm-1" and [r.vm_id for r in ledger.vms()] == ["vm-1"]
    await ledger.close()


def test_fence_verdicts() -> None:
    owner = fence(2)
    assert fence_verdict("start", owner, owner) is None
    assert fence_verdict("start", fence(1), owner) is not None  # older: refused
    assert fence_verdict("remove", fence(1), owner) is not None
    assert fence_verdict("remove", owner, owner) is None  # the owner's own cleanup
    assert fence_verdict("adopt", fence(3), owner) is None  # adopt carries a newer fence
    assert fence_verdict("create", fence(3), owner) is not None  # only adopt moves ownership
    assert fence_verdict("start", fence(2, uid="other"), owner) is not None
    assert fence_verdict("remove", fence(3, key="other/key"), owner) is not None
    assert fence_verdict("create", fence(1), None) is None
