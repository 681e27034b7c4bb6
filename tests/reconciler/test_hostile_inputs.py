"""Hostile inputs on a real nats-server: each one is dead-lettered (or logged as Skipped) with its
reason and counted, and the partition goes on with the next key (issue 10, findings 4, 6 and 7)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from nats.aio.msg import Msg

import services.reconciler.entries as entries_module
from services.reconciler import metrics
from services.reconciler.effects import EffectRunner
from services.reconciler.kube import NullGateway
from services.reconciler.partition import Partition
from shared.bus.connect import Bus
from shared.bus.read import read_stream
from shared.fence.decide import DecideEnv, HostView
from shared.fence.keys import Key
from shared.fence.schema import (
    MAX_COMMAND_BYTES,
    MAX_INPUT_BYTES,
    Command,
    Commanded,
    CommandResult,
    EvictionRequested,
    Fence,
    Input,
    Inventoried,
    Observed,
    Rebuilt,
    Skipped,
    Spec,
    VMGone,
    WriteRequested,
    encode,
)
from shared.subjects import Subjects
from shared.tasks import cancel_and_wait
from tests.reconciler.helpers import log_entries, observe, wait_until

# bound to its node (spec.nodeName), as a scheduled pod is: its VM is made right after admission
BOUND = Spec(node="vmfence-host-a")
ENV = DecideEnv(hosts=[HostView("host-a", 64, 65536)])



def _partition(bus: Bus, gateway: NullGateway) -> Partition:
    effects = EffectRunner(bus.js, bus.subjects, gateway)
    return Partition(
        0, js=bus.js, subjects=bus.subjects, writer="writer", effects=effects, snapshots=None,
        env=lambda: ENV, confirm=gateway.confirm,
    )


async def _dead(bus: Bus) -> list[Msg]:
    return [m async for m in read_stream(bus.js, bus.subjects.stream_dlq)]


async def test_an_input_of_an_unknown_schema_version_is_dead_lettered_and_the_partition_goes_on(bus: Bus) -> None:
    gateway = NullGateway()
    hostile, probe = Key("pod", "default", "from.the.future"), Key("pod", "default", "probe")
    gateway.objects[str(hostile)] = ("uid-h", 1, BOUND)
    gateway.objects[str(probe)] = ("uid-p", 1, BOUND)
    part = _partition(bus, gateway)
    task = asyncio.create_task(part.run())
    try:
        future = msgspec.structs.replace(Observed(str(hostile), "uid-h", 1), v=2)
        await bus.js.publish(bus.subjects.observation(hostile), encode(future))
        await observe(bus, probe, "uid-p", 1)
        await wait_until(lambda: str(probe) in part.keys and part.keys[str(probe)].state.cur is not None,
                         "the next key's admission")
        await wait_until(lambda: part.stats["dead_lettered"] >= 1, "the dead letter")
        (dead,) = await _dead(bus)
        reason = dead.headers.get("Vmfence-Reason", "") if dead.headers else ""
        assert reason.startswith("unknown input version") and "schema version 2" in reason, reason
        assert dead.data == encode(future), "nothing is lost: the original bytes are kept"
        assert part.stats["dead_lettered:unknown input version"] == 1
        assert {e.key for _, e in await log_entries(bus)} == {str(probe)}, "the v=2 input was decided"
    finally:
        await part.stop(task, settle=False)  # cancel_and_wait: Python 3.11 can swallow one cancel


ENV2 = DecideEnv(hosts=[HostView("host-a", 64, 65536), HostView("host-b", 64, 65536)])


async def _bound_key(bus: Bus, gateway: NullGateway, key: Key) -> tuple[Partition, str, str]:
    """A partition on two hosts with ``key`` admitted and its VM bound (fed in-process)."""
    gateway.objects[str(key)] = ("uid-1", 1, BOUND)
    effects = EffectRunner(bus.js, bus.subjects, gateway)
    part = Partition(0, js=bus.js, subjects=bus.subjects, writer="writer", effects=effects, snapshots=None,
                     env=lambda: ENV2, confirm=gateway.confirm)
    assert await part.feed(str(key), Observed(str(key), "uid-1", 1))
    (create,) = [e.command for e in part.keys[str(key)].state.outbox.values()
                 if isinstance(e, Commanded) and e.command.op == "create"]
    ok = CommandResult(create.fence, create.id, "create", create.host, create.vm_id, "ok")
    assert await part.feed(str(key), ok)
    cur = part.keys[str(key)].state.cur
    assert cur is not None and cur.bound
    return part, create.vm_id, create.host


async def test_a_report_on_another_hosts_subject_is_dead_lettered_and_a_hostile_epoch_is_skipped(bus: Bus) -> None:
    gateway = NullGateway()
    key, probe = Key("pod", "default", "victim"), Key("pod", "default", "probe")
    gateway.objects[str(probe)] = ("uid-p", 1, BOUND)
    part, vm, host = await _bound_key(bus, gateway, key)
    other = "host-b" if host == "host-a" else "host-a"
    fence = Fence(str(key), "uid-1", 1)
    skipped = metrics.POD_LIFECYCLE.labels("input", "skipped", "epoch_out_of_bounds")
    before = skipped._value.get()
    task = asyncio.create_task(part.run())
    try:
        # the other host's agent claims, on its own subject, that this host's VM is gone
        await bus.js.publish(bus.subjects.host_report(key, other), encode(VMGone(fence, host, vm)))
        # this host's agent (on its own subject) reports the VM gone under an epoch no log gave
        wedge = VMGone(Fence(str(key), "uid-1", 2**64 - 1), host, vm)
        await bus.js.publish(bus.subjects.host_report(key, host), encode(wedge))
        await observe(bus, probe, "uid-p", 1)
        await wait_until(lambda: str(probe) in part.keys and part.keys[str(probe)].state.cur is not None,
                         "the next key's admission")
        await wait_until(lambda: part.keys[str(key)].state.n >= 3, "the hostile epoch's entry")
        await wait_until(lambda: part.stats["dead_lettered"] >= 1, "the forged report's dead letter")
        (dead,) = await _dead(bus)
        reason = dead.headers.get("Vmfence-Reason", "") if dead.headers else ""
        assert reason.startswith("wrong sender") and repr(other) in reason, reason
        decisions = [d for _, e in await log_entries(bus) if e.key == str(key) for d in e.decisions]
        assert [d.reason for d in decisions if isinstance(d, Skipped)] == ["epoch_out_of_bounds"]
        assert not any(isinstance(d, EvictionRequested | Rebuilt) for d in decisions)
        state = part.keys[str(key)].state
        assert state.epoch == 1 and state.cur is not None and state.cur.bound and not state.cur.evicting
        assert skipped._value.get() == before + 1, "the skip is counted"
    finally:
        await part.stop(task, settle=False)  # cancel_and_wait: Python 3.11 can swallow one cancel


def test_a_host_report_subject_names_its_key_and_its_sender() -> None:
    subjects = Subjects(partitions=16)
    for key in (Key("pod", "default", "web.v1"), Key("vm", "ns", "a.b")):
        for host in ("host-a", "rack1.host.b"):
            subject = subjects.host_report(key, host)
            assert subjects.key_of_in_subject(subject) == key
            assert subjects.sender_of_in_subject(subject) == host
            assert subject.startswith(f"vmfence.in.{subjects.partition(key)}.agent.")
        assert subjects.sender_of_in_subject(subjects.report(key)) is None, "the old subject still reads"
        assert subjects.key_of_in_subject(subjects.report(key)) == key
        assert subjects.sender_of_in_subject(subjects.observation(key)) is None
    assert subjects.host_reports("rack1.host.b") == "vmfence.in.*.agent.rack1%2Ehost%2Eb.>"


async def _until_admitted(part: Partition, key: Key) -> None:
    await wait_until(lambda: str(key) in part.keys and part.keys[str(key)].state.cur is not None,
                     f"the admission of {key}")


async def test_a_read_too_large_to_log_gets_a_warning_and_the_key_goes_on(bus: Bus) -> None:
    gateway = NullGateway()
    huge, probe = Key("pod", "default", "huge"), Key("pod", "default", "probe")
    gateway.objects[str(huge)] = ("uid-h", 1, Spec(image="x" * 600_000))  # the object's read is huge
    gateway.objects[str(probe)] = ("uid-p", 1, BOUND)
    part = _partition(bus, gateway)
    task = asyncio.create_task(part.run())
    try:
        await observe(bus, huge, "uid-h", 1)
        await _until_admitted(part, huge)
        await observe(bus, probe, "uid-p", 1)
        await _until_admitted(part, probe)
        cur = part.keys[str(huge)].state.cur
        assert cur is not None and cur.invalid is not None and cur.phase == "Failed"
        # what the pod is told (the effects that write it are the log's outbox)
        writes = [d.write for _, e in await log_entries(bus) if e.key == str(huge) for d in e.decisions
                  if isinstance(d, WriteRequested)]
        warnings = [w for w in writes if w.verb == "event" and w.event_type == "Warning"]
        assert warnings and warnings[0].event_reason == "InvalidSpec"
        assert "above the bound" in (warnings[0].message or "")
        assert any(w.verb == "status" and w.status is not None and w.status.invalid for w in writes)
        assert part.stats["dead_lettered"] == 0 and part.stats["too_large"] == 0
    finally:
        await part.stop(task, settle=False)  # cancel_and_wait: Python 3.11 can swallow one cancel


async def test_an_input_above_the_bound_is_dead_lettered_truncated_and_the_partition_goes_on(bus: Bus) -> None:
    gateway = NullGateway()
    big, probe = Key("pod", "default", "big"), Key("pod", "default", "probe")
    gateway.objects[str(probe)] = ("uid-p", 1, BOUND)
    part = _partition(bus, gateway)
    task = asyncio.create_task(part.run())
    try:
        data = encode(Observed(str(big), "uid-b", 1, spec=Spec(image="y" * (MAX_INPUT_BYTES + 10))))
        await bus.js.publish(bus.subjects.observation(big), data)
        await observe(bus, probe, "uid-p", 1)
        await _until_admitted(part, probe)
        await wait_until(lambda: part.stats["dead_lettered"] >= 1, "the dead letter")
        (dead,) = await _dead(bus)
        headers = dead.headers or {}
        assert headers.get("Vmfence-Reason", "").startswith("input too large")
        assert headers.get("Vmfence-Truncated") == str(len(data)) and dead.data == data[:MAX_INPUT_BYTES]
        assert str(big) not in part.keys or part.keys[str(big)].state.n == 0
    finally:
        await part.stop(task, settle=False)  # cancel_and_wait: Python 3.11 can swallow one cancel


async def test_an_entry_above_the_bound_is_dead_lettered_never_redelivered(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(entries_module, "MAX_ENTRY_BYTES", 4096)
    gateway = NullGateway()
    key, probe = Key("pod", "default", "many.vms"), Key("pod", "default", "probe")
    gateway.objects[str(probe)] = ("uid-p", 1, BOUND)
    part = _partition(bus, gateway)
    task = asyncio.create_task(part.run())
    try:
        # an agent reports a VM of an incarnation nobody knows, under a name long enough that the
        # entry recording it (Discovered, a read request) passes the (lowered) entry bound
        stray = Inventoried(Fence(str(key), "uid-x", 0), "host-a", "v" * 5000, "running")
        await bus.js.publish(bus.subjects.host_report(key, "host-a"), encode(stray))
        await observe(bus, probe, "uid-p", 1)
        await _until_admitted(part, probe)
        await wait_until(lambda: part.stats["dead_lettered"] >= 1, "the dead letter")
        (dead,) = await _dead(bus)
        assert (dead.headers or {}).get("Vmfence-Reason", "").startswith("entry too large")
        assert part.stats["too_large"] == 1
        assert str(key) not in {e.key for _, e in await log_entries(bus)}
        info = await bus.js.consumer_info(bus.subjects.stream_in, "reconciler-p0")
        assert info.num_ack_pending == 0 and info.num_redelivered == 0, "acked, never redelivered"
    finally:
        await part.stop(task, settle=False)  # cancel_and_wait: Python 3.11 can swallow one cancel


async def test_a_command_above_the_bound_is_never_sent_and_ends_as_a_failed_result(bus: Bus) -> None:
    outcomes: list[tuple[str, Input]] = []

    async def feed(key: str, inp: Input) -> bool:
        outcomes.append((key, inp))
        return True

    runner = EffectRunner(bus.js, bus.subjects, NullGateway(), workers=1, feed=feed)
    key = "default/big.cmd"
    cmd = Command("c-1", "create", Fence(key, "uid-1", 1), "host-a", "vm-1",
                  spec=Spec(image="z" * (MAX_COMMAND_BYTES + 1)))
    task = asyncio.create_task(runner.run())
    try:
        runner.submit(key, Commanded(cmd))
        await wait_until(lambda: bool(outcomes), "the command's outcome")
        ((to, result),) = outcomes
        assert to == key and isinstance(result, CommandResult)
        assert (result.command_id, result.outcome) == ("c-1", "failed")
        assert result.error is not None and result.error.startswith("command too large")
        sent = [m async for m in read_stream(bus.js, bus.subjects.stream_cmd)]
        assert sent == [], "a command the agent could never receive is not published"
    finally:
        assert not await cancel_and_wait([task], what="effect runner")


async def _bind(part: Partition, gateway: NullGateway, key: Key, uid: str) -> Command:
    """Admit ``key`` and bind its VM, fed in-process; returns its create."""
    gateway.objects[str(key)] = (uid, 1, BOUND)
    assert await part.feed(str(key), Observed(str(key), uid, 1))
    (create,) = [e.command for e in part.keys[str(key)].state.outbox.values()
                 if isinstance(e, Commanded) and e.command.op == "create"]
    assert await part.feed(str(key), CommandResult(create.fence, create.id, "create", create.host, create.vm_id, "ok"))
    return create


def _inspects(part: Partition, key: Key) -> list[Command]:
    return [e.command for e in part.keys[str(key)].state.outbox.values()
            if isinstance(e, Commanded) and e.command.op == "inspect"]


async def test_a_complete_round_that_lacks_a_bound_vm_asks_for_an_inspect_then_evicts(bus: Bus) -> None:
    gateway = NullGateway()
    effects = EffectRunner(bus.js, bus.subjects, gateway)
    part = Partition(0, js=bus.js, subjects=bus.subjects, writer="writer", effects=effects, snapshots=None,
                     env=lambda: ENV, confirm=gateway.confirm)
    kept, vanished = Key("pod", "default", "kept"), Key("pod", "default", "vanished")
    a, b = await _bind(part, gateway, kept, "uid-k"), await _bind(part, gateway, vanished, "uid-v")
    assert a.host == b.host == "host-a"

    async def item(create: Command, round_id: str) -> None:
        inv = Inventoried(create.fence, "host-a", create.vm_id, "running", round=round_id)
        await bus.js.publish(bus.subjects.host_report(Key.parse(create.fence.key), "host-a"), encode(inv))

    task = asyncio.create_task(part.run())
    try:
        await item(a, "host-a-b1-1")
        await item(b, "host-a-b1-1")
        await item(a, "host-a-b1-2")  # round 2 names only one of the two (a forged remove took the other)
        await item(a, "host-a-b1-3")  # round 3 begins: round 2 is complete
        await wait_until(lambda: bool(_inspects(part, vanished)), "the inspect of the VM round 2 lacked")
        assert _inspects(part, kept) == [], "a VM every round named is not inspected"
        state = part.keys[str(vanished)].state
        assert state.cur is not None and state.cur.bound, "absence alone evicts nothing"
        (inspect,) = _inspects(part, vanished)
        assert (inspect.vm_id, inspect.host) == (b.vm_id, "host-a")
        gone = CommandResult(inspect.fence, inspect.id, "inspect", "host-a", inspect.vm_id, "not_found")
        await bus.js.publish(bus.subjects.host_report(vanished, "host-a"), encode(gone))
        await wait_until(lambda: part.keys[str(vanished)].state.cur is not None
                         and part.keys[str(vanished)].state.cur.evicting, "the eviction")
        decisions = [d for _, e in await log_entries(bus) if e.key == str(vanished) for d in e.decisions]
        assert any(isinstance(d, EvictionRequested) for d in decisions)
        assert part.stats["absent"] == 1
    finally:
        await part.stop(task, settle=False)  # cancel_and_wait: Python 3.11 can swallow one cancel


async def test_a_bound_vm_no_round_named_for_long_is_inspected(bus: Bus) -> None:
    gateway = NullGateway()
    effects = EffectRunner(bus.js, bus.subjects, gateway)
    part = Partition(0, js=bus.js, subjects=bus.subjects, writer="writer", effects=effects, snapshots=None,
                     env=lambda: ENV, confirm=gateway.confirm, inventory_stale_s=0.0)
    alone = Key("pod", "default", "alone")  # the only VM of its host in this partition: no round completes
    create = await _bind(part, gateway, alone, "uid-a")
    assert await part.sweep_inventory({"host-b"}) == 0, "a host that is not live is not asked"
    assert await part.sweep_inventory({"host-a"}) == 1
    (inspect,) = _inspects(part, alone)
    assert (inspect.vm_id, inspect.host, inspect.fence) == (create.vm_id, "host-a", create.fence)
    await part.sweep_inventory({"host-a"})
    assert len(_inspects(part, alone)) == 1, "one inspect at a time"
