"""Rule 1 on a real nats-server: two writers on one partition never fork a key's log; malformed
inputs go to the dead-letter stream and do not stop the partition."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from services.reconciler.effects import EffectRunner
from services.reconciler.kube import NullGateway
from services.reconciler.partition import Partition
from services.reconciler.snapshot import SnapshotStore
from shared.bus.connect import Bus
from shared.bus.read import read_stream
from shared.fence.audit import audit
from shared.fence.decide import DecideEnv, HostView
from shared.fence.keys import Key
from shared.fence.schema import Observed, Spec, encode
from tests.reconciler.helpers import log_entries, observe, per_key, wait_until

# bound to its node (spec.nodeName), as a scheduled pod is: its VM is made right after admission
BOUND = Spec(node="vmfence-host-a")
ENV = DecideEnv(hosts=[HostView("host-a", 64, 65536)])



def _partition(bus: Bus, writer: str, gateway: NullGateway) -> Partition:
    effects = EffectRunner(bus.js, bus.subjects, gateway)
    return Partition(
        0, js=bus.js, subjects=bus.subjects, writer=writer, effects=effects, snapshots=None,
        env=lambda: ENV, confirm=gateway.confirm,
    )


async def test_two_writers_on_one_partition_never_fork_a_log(bus: Bus) -> None:
    gateway = NullGateway()
    keys = [Key("pod", "default", f"web.{i}") for i in range(12)]
    for i, k in enumerate(keys):
        gateway.objects[str(k)] = (f"uid-{i}", 1, BOUND)
    a, b = _partition(bus, "writer-a", gateway), _partition(bus, "writer-b", gateway)
    # both believe they own partition 0 (no lease at all) and decide the same inputs at once
    for round_ in range(3):
        jobs = []
        for i, k in enumerate(keys):
            obs = Observed(str(k), f"uid-{i}", 1 + round_, spec=Spec(cpus=1 + round_ % 2))
            jobs += [a.feed(str(k), obs), b.feed(str(k), obs)]
        results = await asyncio.gather(*jobs)
        assert all(results)
    races = a.stats["lost_races"] + b.stats["lost_races"]
    assert races > 0, "the two writers never raced; the test proves nothing"
    entries = await log_entries(bus)
    for key, log in per_key(entries).items():
        assert [e.n for e in log] == list(range(1, len(log) + 1)), f"forked or gapped log for {key}"
    report = audit(entries, final=False)
    assert report.clean, report.violations
    # the loser re-folded: neither writer is ahead of the log, and one of them is at its end
    logs = per_key(entries)
    for k in keys:
        na, nb = a.keys[str(k)].state.n, b.keys[str(k)].state.n
        assert max(na, nb) == len(logs[str(k)]) and min(na, nb) <= len(logs[str(k)])


async def test_malformed_input_goes_to_the_dead_letter_stream_and_the_partition_goes_on(bus: Bus) -> None:
    gateway = NullGateway()
    key = Key("pod", "default", "ok")
    gateway.objects[str(key)] = ("uid-ok", 1, BOUND)
    part = _partition(bus, "writer", gateway)
    task = asyncio.create_task(part.run())
    try:
        subject = bus.subjects.observation(key)
        await bus.js.publish(subject, b"{not json", headers={"Nats-Msg-Id": "garbage-1"})
        await bus.js.publish(subject, b'{"type":"observed","key":"other/key","uid":"x","resource_version":1}')
        await observe(bus, key, "uid-ok", 1)
        await wait_until(lambda: str(key) in part.keys and part.keys[str(key)].state.cur is not None, "admission")
        dead = [m async for m in read_stream(bus.js, bus.subjects.stream_dlq)]
        reasons = [m.headers.get("Vmfence-Reason", "") for m in dead]
        assert len(dead) == 2
        assert reasons[0].startswith("undecodable input") and "on the subject of" in reasons[1]
        assert dead[0].data == b"{not json", "nothing is lost: the original bytes are kept"
    finally:
        await part.stop(task, settle=False)  # cancel_and_wait: Python 3.11 can swallow one cancel


async def test_a_partition_whose_lease_is_gone_appends_nothing(bus: Bus) -> None:
    gateway = NullGateway()
    key = Key("pod", "default", "lease.lost")
    gateway.objects[str(key)] = ("uid-1", 1, BOUND)
    part = _partition(bus, "writer", gateway)
    part.held = False  # the lease renewal failed a moment ago
    assert await part.feed(str(key), Observed(str(key), "uid-1", 1)) is False
    assert await log_entries(bus) == []


async def test_a_lost_log_tail_on_the_stream_is_rebuilt_and_surveyed(bus: Bus) -> None:
    from shared.fence.schema import Commanded, Rebuilt

    gateway = NullGateway()
    key = Key("pod", "default", "tail.lost")
    gateway.objects[str(key)] = ("uid-1", 1, BOUND)
    part = _partition(bus, "writer", gateway)
    assert await part.feed(str(key), Observed(str(key), "uid-1", 1))  # admitted, create commanded
    assert await part.feed(str(key), Observed(str(key), "uid-1", 2, spec=Spec(cpus=2)))
    known_epoch = part.keys[str(key)].state.epoch
    # the stream loses the key's last entry (restored from an older copy)
    last = (await log_entries(bus))[-1][0]
    await bus.js.delete_msg(bus.subjects.stream_log, last)
    assert await part.feed(str(key), Observed(str(key), "uid-1", 3, spec=Spec(cpus=3)))
    entries = [e for _, e in await log_entries(bus)]
    assert [e.n for e in entries] == list(range(1, len(entries) + 1)), "contiguous after the rebuild"
    rebuilt = [d for e in entries for d in e.decisions if isinstance(d, Rebuilt)]
    assert rebuilt and rebuilt[0].epoch_floor >= known_epoch
    surveys = [d.command for e in entries for d in e.decisions if isinstance(d, Commanded) and d.command.op == "survey"]
    assert {c.host for c in surveys} == {"host-a"} and part.keys[str(key)].state.rebuilding
    assert part.keys[str(key)].state.epoch > known_epoch


def _snap_partition(bus: Bus, writer: str, gateway: NullGateway, snapshots: SnapshotStore) -> Partition:
    effects = EffectRunner(bus.js, bus.subjects, gateway)
    return Partition(
        0, js=bus.js, subjects=bus.subjects, writer=writer, effects=effects, snapshots=snapshots,
        env=lambda: ENV, confirm=gateway.confirm,
    )


async def _store(path: Path) -> SnapshotStore:
    store = SnapshotStore(str(path))
    await store.open(stream_identity="test")
    return store


async def test_a_snapshot_ahead_of_a_cut_log_never_wins_at_load(bus: Bus, tmp_path: Path) -> None:
    from shared.fence.schema import Commanded, Rebuilt

    gateway = NullGateway()
    key = Key("pod", "default", "snap.ahead")
    gateway.objects[str(key)] = ("uid-1", 1, BOUND)
    store = await _store(tmp_path / "snap.sqlite")
    first = _snap_partition(bus, "writer", gateway, store)
    await first.load()
    assert await first.feed(str(key), Observed(str(key), "uid-1", 1))
    assert await first.feed(str(key), Observed(str(key), "uid-1", 2, spec=Spec(cpus=2)))
    known = first.keys[str(key)].state
    await first.flush()  # the row holds both entries
    last = (await log_entries(bus))[-1][0]
    await bus.js.delete_msg(bus.subjects.stream_log, last)  # the log is restored from an older copy
    again = _snap_partition(bus, "writer", gateway, store)  # the writer restarts from its snapshot
    await again.load()
    entries = [e for _, e in await log_entries(bus)]
    assert [e.n for e in entries] == [1, 2]
    assert isinstance(entries[1].decisions[0], Rebuilt) and entries[1].decisions[0].epoch_floor >= known.epoch
    surveys = [d for d in entries[1].decisions if isinstance(d, Commanded) and d.command.op == "survey"]
    state = again.keys[str(key)].state
    assert surveys and state.rebuilding and state.epoch > known.epoch and state.n == 2
    await store.close()


async def test_a_snapshot_row_whose_positions_the_log_refilled_is_reread_not_trusted(bus: Bus, tmp_path: Path) -> None:
    from shared.fence.schema import Rebuilt

    gateway = NullGateway()
    key = Key("pod", "default", "snap.diverged")
    gateway.objects[str(key)] = ("uid-1", 1, BOUND)
    one, two = await _store(tmp_path / "one.sqlite"), await _store(tmp_path / "two.sqlite")
    w1 = _snap_partition(bus, "w1", gateway, one)
    await w1.load()
    assert await w1.feed(str(key), Observed(str(key), "uid-1", 1))
    assert await w1.feed(str(key), Observed(str(key), "uid-1", 2, spec=Spec(cpus=2)))
    await w1.flush()
    w2 = _snap_partition(bus, "w2", gateway, two)  # held the partition for a while: same rows
    await w2.load()
    await w2.flush()
    last = (await log_entries(bus))[-1][0]
    await bus.js.delete_msg(bus.subjects.stream_log, last)
    # w1 comes back first: rebuilds, and the key goes on (the positions w2's row knows are refilled)
    w1 = _snap_partition(bus, "w1", gateway, one)
    await w1.load()
    assert await w1.feed(str(key), Observed(str(key), "uid-1", 3, spec=Spec(cpus=3)))
    # then w2 takes the partition with its row: same n as some log entry, a different history
    w2 = _snap_partition(bus, "w2", gateway, two)
    await w2.load()
    entries = [e for _, e in await log_entries(bus)]
    assert sum(isinstance(d, Rebuilt) for e in entries for d in e.decisions) == 1, "rebuilt twice"
    assert w2.keys[str(key)].state == w1.keys[str(key)].state, "w2 trusted its diverged row"
    await one.close()
    await two.close()


async def _commands_to(bus: Bus, host: str) -> tuple[Subscription, asyncio.Queue[bytes]]:
    """What the partition sends to ``host``, as it is published."""
    sent: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_command(msg: Msg) -> None:
        sent.put_nowait(msg.data)

    return await bus.nc.subscribe(bus.subjects.command(host), cb=on_command), sent


async def test_a_no_op_input_on_a_stale_copy_is_decided_on_the_log_not_dropped(bus: Bus) -> None:
    """Rule 1 for inputs that decide nothing: they are acked without an append, so no fence checks
    them. A writer whose copy is stale (it lost its lease while cut off, then fetched again) must
    not consume the answer to a command the new owner sent: it re-reads the key and decides it."""
    from shared.fence.schema import Commanded, CommandResult, Hibernated

    gateway = NullGateway()
    key = Key("pod", "default", "stale.copy")
    gateway.objects[str(key)] = ("uid-1", 1, BOUND)
    old, new = _partition(bus, "old-owner", gateway), _partition(bus, "new-owner", gateway)
    assert await new.feed(str(key), Observed(str(key), "uid-1", 1))  # admitted, a create sent
    await old._reload(old._slot(str(key)))  # the old owner's copy stops here (then it is cut off)
    (create,) = [e.command for e in new.keys[str(key)].state.outbox.values() if isinstance(e, Commanded)]
    assert await new.feed(str(key), CommandResult(create.fence, create.id, "create", create.host, create.vm_id, "ok"))
    assert await new.feed(str(key), Observed(str(key), "uid-1", 2, spec=Spec(hibernate=True)))
    (hibernate,) = [e.command for e in new.keys[str(key)].state.outbox.values()
                    if isinstance(e, Commanded) and e.command.op == "hibernate"]
    answer = CommandResult(hibernate.fence, hibernate.id, "hibernate", hibernate.host, hibernate.vm_id, "ok",
                           snapshot="snap-1")
    await bus.js.publish(bus.subjects.report(key), encode(answer), headers={"Nats-Msg-Id": "answer-1"})
    psub = await bus.js.pull_subscribe(bus.subjects.report(key), durable="stale-copy-test",
                                       stream=bus.subjects.stream_in)
    (msg,) = await psub.fetch(1, timeout=5)
    await old.handle(msg)  # the stale owner fetched it (same epoch: nothing in it shows the copy is old)
    hibernated = [d for _, e in await log_entries(bus) for d in e.decisions if isinstance(d, Hibernated)]
    assert [h.vm_id for h in hibernated] == [create.vm_id], "the answer was dropped on a stale copy"
    assert old.stats["dropped"] == 0


async def test_an_entry_a_previous_owner_appends_after_the_load_is_taken_over_with_its_effects(bus: Bus) -> None:
    """Rule 1's other half: a previous owner that has not noticed its lease is gone can still append
    (fenced per key, so no fork), after the new owner loaded. The new owner tails its partition's
    log, re-reads that key and carries out its outbox — else a timer or command decided by the old
    owner dies with it and the key waits for an input that may never come."""
    from shared.fence.schema import decode_command

    gateway = NullGateway()
    key = Key("pod", "default", "late.append")
    gateway.objects[str(key)] = ("uid-1", 1, BOUND)
    sub, sent = await _commands_to(bus, "host-a")
    new = _partition(bus, "new-owner", gateway)
    effects, run = asyncio.create_task(new.effects.run()), asyncio.create_task(new.run())
    try:
        old = _partition(bus, "old-owner", gateway)  # its effect runner never runs: it is cut off
        assert await old.feed(str(key), Observed(str(key), "uid-1", 1))  # admitted, a create decided
        await wait_until(lambda: str(key) in new.keys and new.keys[str(key)].state.n == 1, "new owner re-read the key")
        command = decode_command(await asyncio.wait_for(sent.get(), 10))  # sent by the new owner
        assert command.op == "create" and command.fence.uid == "uid-1"
    finally:
        await sub.unsubscribe()
        new.held = False
        for t in (run, effects):
            t.cancel()
        await asyncio.gather(run, effects, return_exceptions=True)


async def test_inputs_that_wait_for_their_keys_lock_are_decided_into_one_entry(bus: Bus) -> None:
    """The key's log as a group commit: inputs that queue while the key's entry is being appended
    are decided, in order and each on the state the ones before it left, into the next entry. The
    log then holds the same decisions in the same order as one entry each, numbered without a gap,
    and the audit is clean; a lone input keeps its own entry."""
    gateway = NullGateway()
    key = Key("pod", "default", "grouped")
    gateway.objects[str(key)] = ("uid-1", 1, BOUND)
    part = _partition(bus, "writer", gateway)
    assert await part.feed(str(key), Observed(str(key), "uid-1", 1, spec=BOUND))
    slot = part.keys[str(key)]
    n = slot.state.n
    changes = [Observed(str(key), "uid-1", rv, spec=Spec(node="vmfence-host-a", cpus=rv)) for rv in (2, 3, 4)]
    async with slot.lock:  # an append of the key in flight, say
        jobs = [asyncio.ensure_future(part.feed(str(key), obs)) for obs in changes]
        await wait_until(lambda: len(slot.waiting or []) == len(changes), "the inputs queued for the lock")
    assert await asyncio.gather(*jobs) == [True, True, True]
    assert slot.state.n == n + 1 and part.stats["grouped"] == len(changes)
    entries = await log_entries(bus)
    log = per_key(entries)[str(key)]
    assert [e.n for e in log] == list(range(1, len(log) + 1))
    grouped = log[-1]
    specs = [d.spec.cpus for d in grouped.decisions if type(d).__name__ == "SpecChanged"]
    assert specs == [2, 3, 4], grouped.decisions  # rv 2, 3, 4 in order, each decided after the last
    assert slot.state.cur is not None and slot.state.cur.rv == 4
    report = audit(entries, final=False)  # its create is still out: no agent runs here
    assert report.clean, report.violations


async def test_an_append_stored_whose_answer_was_lost_has_its_effects_carried_out(
        bus: Bus, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server stored an entry but its answer never reached the writer (a leader election, a
    handler cancelled mid-append): the writer's copy lacks it, so the input comes again, its append
    loses the race to the writer's own entry, the re-read folds it, and the input decides nothing.
    The outbox that entry holds (here the new pod's survey) is then owed by nobody else — the log
    tail passes over our own entries — so the re-read must carry it out, or the pod never starts."""
    from services.reconciler import entries as entries_module
    from shared.fence.schema import decode_command

    gateway = NullGateway()
    key = Key("pod", "default", "lost.answer")
    gateway.objects[str(key)] = ("uid-1", 1, BOUND)
    sub, sent = await _commands_to(bus, "host-a")
    part = _partition(bus, "writer", gateway)
    part._loaded = True  # a key first seen after the load: it surveys the hosts before its create
    real = entries_module.fenced_append
    lost: list[int] = []

    async def answer_lost(*args: object, **kw: object) -> int:
        seq = await real(*args, **kw)  # type: ignore[arg-type]
        if not lost:
            lost.append(seq)
            raise TimeoutError("the append's answer was lost")
        return seq

    monkeypatch.setattr(entries_module, "fenced_append", answer_lost)
    effects = asyncio.create_task(part.effects.run())
    try:
        with pytest.raises(TimeoutError):
            await part.feed(str(key), Observed(str(key), "uid-1", 1))
        assert lost and part.keys[str(key)].state.n == 0, "stored, not folded"
        assert sent.empty()
        assert await part.feed(str(key), Observed(str(key), "uid-1", 1))  # the input again
        slot = part.keys[str(key)]
        assert slot.state.n == 1 and slot.last_seq == lost[0] and part.stats["lost_races"] == 1
        command = decode_command(await asyncio.wait_for(sent.get(), 10))
        assert command.op == "survey" and command.fence.uid == "uid-1"
    finally:
        await sub.unsubscribe()
        effects.cancel()
        await asyncio.gather(effects, return_exceptions=True)


async def test_a_failed_fetch_lets_the_inputs_being_handled_finish(bus: Bus, monkeypatch: pytest.MonkeyPatch) -> None:
    """The consumer restarts when a fetch fails (a leader election after a node loss); the inputs
    it already handed out must finish their appends first, not be cancelled between the server
    storing an entry and the writer folding it."""
    from types import SimpleNamespace

    import nats.js.errors

    part = _partition(bus, "writer", NullGateway())
    started, release = asyncio.Event(), asyncio.Event()
    finished: list[str] = []

    class _Electing:
        def __init__(self) -> None:
            self.fetches = 0

        async def fetch(self, batch: int, timeout: float) -> list[object]:  # noqa: ASYNC109
            self.fetches += 1
            if self.fetches == 1:
                return [SimpleNamespace(metadata=SimpleNamespace(num_pending=None), is_acked=False)]
            await started.wait()
            raise nats.js.errors.ServiceUnavailableError

        async def unsubscribe(self) -> None:
            pass

    async def pull_subscribe(*args: object, **kw: object) -> _Electing:
        return _Electing()

    async def slow_handle(msg: object) -> None:
        started.set()
        await release.wait()
        finished.append("handled")

    monkeypatch.setattr(part.js, "pull_subscribe", pull_subscribe)
    monkeypatch.setattr(part, "handle", slow_handle)
    consume = asyncio.create_task(part._consume())
    await started.wait()
    await asyncio.sleep(0)  # the failing fetch is answered while the input is still being handled
    assert not consume.done()
    release.set()
    with pytest.raises(nats.js.errors.ServiceUnavailableError):
        await asyncio.wait_for(consume, 10)
    assert finished == ["handled"], "the input in flight was cancelled by the fetch's failure"
