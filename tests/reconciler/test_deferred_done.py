"""Deferred completions (services/reconciler/entries.py): the completion of a status write
that succeeded is folded at once and logged first in the key's next entry, or alone once it has
waited ``done_linger_s``; until then the log still owes the write, so a crash, a snapshot or a lost
race makes it again — never loses it, never forks the log."""

from __future__ import annotations

import msgspec
import pytest

from services.reconciler.effects import EffectRunner
from services.reconciler.kube import NullGateway
from services.reconciler.partition import Partition
from shared.bus.connect import Bus
from shared.fence.audit import audit
from shared.fence.decide import DecideEnv, HostView
from shared.fence.keys import Key
from shared.fence.schema import Commanded, CommandResult, Done, Observed, Spec, WriteDone, WriteRequested
from shared.fence.state import KeyState, decode_state, encode_state, fold_all
from tests.reconciler.helpers import log_entries, per_key

BOUND = Spec(node="vmfence-host-a")
ENV = DecideEnv(hosts=[HostView("host-a", 64, 65536)])
KEY = Key("pod", "default", "deferred")


def _partition(bus: Bus, writer: str, gateway: NullGateway, linger_s: float = 30.0) -> Partition:
    effects = EffectRunner(bus.js, bus.subjects, gateway)  # not run: effects stay queued, we answer them
    return Partition(0, js=bus.js, subjects=bus.subjects, writer=writer, effects=effects, snapshots=None,
                     env=lambda: ENV, confirm=gateway.confirm, done_linger_s=linger_s)


def _gateway() -> NullGateway:
    gateway = NullGateway()
    gateway.objects[str(KEY)] = ("uid-1", 1, BOUND)
    return gateway


def _pending_write(part: Partition) -> WriteRequested:
    """A status write the key owes."""
    writes = [e for e in part.keys[str(KEY)].state.outbox.values()
              if isinstance(e, WriteRequested) and e.write.verb == "status"]
    assert writes, "the key owes no status write: the test proves nothing"
    return writes[0]


def _ok(w: WriteRequested) -> WriteDone:
    return WriteDone(w.write.fence, w.write.id, "ok")


async def _replayed(bus: Bus) -> KeyState:
    state = KeyState(key=str(KEY))
    for e in per_key(await log_entries(bus))[str(KEY)]:
        fold_all(state, e.decisions)
        state.n = e.n
    return state


def _same(a: KeyState, b: KeyState) -> bool:
    a2, b2 = decode_state(encode_state(a)), decode_state(encode_state(b))
    a2.unverified = b2.unverified = False  # how the key was first seen, not what its log holds
    return msgspec.structs.asdict(a2) == msgspec.structs.asdict(b2)


async def _admitted(bus: Bus, part: Partition) -> None:
    """Admitted and its VM made: the result asks for the Running status (and an event)."""
    assert await part.feed(str(KEY), Observed(str(KEY), "uid-1", 1, spec=BOUND))
    (create,) = [e.command for e in part.keys[str(KEY)].state.outbox.values()
                 if isinstance(e, Commanded) and e.command.op == "create"]
    assert await part.feed(str(KEY), CommandResult(create.fence, create.id, "create", create.host, create.vm_id, "ok",
                                                   ip="10.0.0.2"))


async def test_a_completion_waits_for_the_next_entry_and_goes_first_in_it(bus: Bus) -> None:
    part = _partition(bus, "writer", _gateway())
    await _admitted(bus, part)
    before = len(await log_entries(bus))
    write = _pending_write(part)
    assert await part.feed(str(KEY), _ok(write))
    assert len(await log_entries(bus)) == before, "a lone completion was appended at once"
    slot = part.keys[str(KEY)]
    assert write.write.id not in slot.state.outbox and slot.deferred == [Done(write.write.id, "ok")]
    # the log still owes the write: replayed now, it is pending
    assert write.write.id in (await _replayed(bus)).outbox

    assert await part.feed(str(KEY), Observed(str(KEY), "uid-1", 2, spec=Spec(node="vmfence-host-a", cpus=2)))
    entries = await log_entries(bus)
    last = entries[-1][1]
    assert last.decisions[0] == Done(write.write.id, "ok"), "the deferred completion is not first"
    assert len(last.decisions) > 1 and slot.deferred is None
    assert _same(await _replayed(bus), slot.state), "the writer's state is not what its log replays to"
    report = audit(entries, final=False)
    assert report.clean, report.violations


async def test_a_completion_left_alone_past_the_linger_is_logged_alone(bus: Bus) -> None:
    part = _partition(bus, "writer", _gateway(), linger_s=30.0)
    await _admitted(bus, part)
    write = _pending_write(part)
    assert await part.feed(str(KEY), _ok(write))
    before = len(await log_entries(bus))
    assert await part.flush_deferred() == 0, "a completion younger than the linger was logged"
    assert await part.flush_deferred(older_than_s=0) == 1
    entries = await log_entries(bus)
    assert len(entries) == before + 1 and entries[-1][1].decisions == [Done(write.write.id, "ok")]
    assert not part._deferred_keys and part.keys[str(KEY)].deferred is None
    assert _same(await _replayed(bus), part.keys[str(KEY)].state)


async def test_with_no_linger_a_completion_is_logged_at_once(bus: Bus) -> None:
    part = _partition(bus, "writer", _gateway(), linger_s=0.0)
    await _admitted(bus, part)
    before = len(await log_entries(bus))
    write = _pending_write(part)
    assert await part.feed(str(KEY), _ok(write))
    entries = await log_entries(bus)
    assert len(entries) == before + 1 and entries[-1][1].decisions == [Done(write.write.id, "ok")]


@pytest.mark.parametrize("outcome", ["superseded", "gone", "failed"])
async def test_only_a_write_that_succeeded_waits(bus: Bus, outcome: str) -> None:
    part = _partition(bus, "writer", _gateway())
    await _admitted(bus, part)
    before = len(await log_entries(bus))
    write = _pending_write(part)
    assert await part.feed(str(KEY), WriteDone(write.write.fence, write.write.id, outcome))  # type: ignore[arg-type]
    assert len(await log_entries(bus)) == before + 1 and part.keys[str(KEY)].deferred is None


async def test_a_lost_race_drops_the_deferred_completion_and_owes_the_write_again(bus: Bus) -> None:
    gateway = _gateway()
    part = _partition(bus, "writer-a", gateway)
    await _admitted(bus, part)
    write = _pending_write(part)
    assert await part.feed(str(KEY), _ok(write))
    # another writer (a stale owner, a hand-over) appends to the key meanwhile
    other = _partition(bus, "writer-b", gateway)
    assert await other.feed(str(KEY), Observed(str(KEY), "uid-1", 2, spec=Spec(node="vmfence-host-a", cpus=2)))
    submitted: list[str] = []
    part.effects.submit_all = lambda key, effects: submitted.extend(  # type: ignore[method-assign]
        (getattr(e, "write", None) and e.write.id) or "" for e in effects)
    assert await part.feed(str(KEY), Observed(str(KEY), "uid-1", 3, spec=Spec(node="vmfence-host-a", cpus=3)))
    assert part.stats["lost_races"] >= 1, "no race was lost: the test proves nothing"
    entries = await log_entries(bus)
    logs = per_key(entries)[str(KEY)]
    assert [e.n for e in logs] == list(range(1, len(logs) + 1))
    assert not any(Done(write.write.id, "ok") == d for e in logs for d in e.decisions), \
        "a completion decided on a copy the log had moved past was logged"
    assert part.keys[str(KEY)].deferred is None
    assert write.write.id in part.keys[str(KEY)].state.outbox or write.write.id in submitted, \
        "the write the log still owes is neither pending nor made again"
    assert audit(entries, final=False).clean


async def test_a_snapshot_holds_what_the_log_holds_not_the_deferred_completion(bus: Bus) -> None:
    part = _partition(bus, "writer", _gateway())
    await _admitted(bus, part)
    write = _pending_write(part)
    assert await part.feed(str(KEY), _ok(write))
    part.keys[str(KEY)].dirty = True
    rows, _ = part.snapshot_rows()
    (key, seq, data), = rows
    assert key == str(KEY) and seq == part.keys[str(KEY)].last_seq
    saved = decode_state(data)
    assert write.write.id in saved.outbox, "the snapshot folded a completion its log does not hold"
    assert _same(saved, await _replayed(bus))


async def test_a_writer_that_dies_with_a_deferred_completion_leaves_the_write_to_its_successor(bus: Bus) -> None:
    """Rule 11 (the log is the outbox): the completion was never logged, so the next writer to load
    the key finds the write owed and makes it again."""
    gateway = _gateway()
    part = _partition(bus, "writer-a", gateway)
    await _admitted(bus, part)
    write = _pending_write(part)
    assert await part.feed(str(KEY), _ok(write))
    part.held = False  # writer-a dies here: nothing deferred is logged
    successor = _partition(bus, "writer-b", gateway)
    submitted: list[str] = []
    successor.effects.submit_all = lambda key, effects: submitted.extend(  # type: ignore[method-assign]
        e.write.id for e in effects if isinstance(e, WriteRequested))
    await successor.load()
    assert write.write.id in successor.keys[str(KEY)].state.outbox
    assert write.write.id in submitted, "the successor does not make the write its log still owes"
