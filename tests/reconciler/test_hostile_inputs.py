"""Hostile inputs on a real nats-server: each one is dead-lettered (or logged as Skipped) with its
reason and counted, and the partition goes on with the next key (issue 10, findings 4, 6 and 7)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest
from nats.aio.msg import Msg

from services.reconciler import metrics
from services.reconciler.effects import EffectRunner
from services.reconciler.kube import NullGateway
from services.reconciler.partition import Partition
from services.testbed.natsserver import NatsServer
from shared.bus.connect import Bus
from shared.bus.provision import StreamsConfig, provision
from shared.bus.read import read_stream
from shared.fence.decide import DecideEnv, HostView
from shared.fence.keys import Key
from shared.fence.schema import (
    Commanded,
    CommandResult,
    EvictionRequested,
    Fence,
    Observed,
    Rebuilt,
    Skipped,
    Spec,
    VMGone,
    encode,
)
from shared.subjects import Subjects
from tests.reconciler.helpers import log_entries, observe, wait_until

ENV = DecideEnv(hosts=[HostView("host-a", 64, 65536)])


@pytest.fixture
async def bus(nats_server: NatsServer) -> AsyncIterator[Bus]:
    b = await Bus.open(nats_server.url, name="test", subjects=Subjects(partitions=1))
    await provision(b.js, b.subjects, StreamsConfig(partitions=1))
    yield b
    await b.close()


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
    gateway.objects[str(hostile)] = ("uid-h", 1, Spec())
    gateway.objects[str(probe)] = ("uid-p", 1, Spec())
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
        part.held = False
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


ENV2 = DecideEnv(hosts=[HostView("host-a", 64, 65536), HostView("host-b", 64, 65536)])


async def _bound_key(bus: Bus, gateway: NullGateway, key: Key) -> tuple[Partition, str, str]:
    """A partition on two hosts with ``key`` admitted and its VM bound (fed in-process)."""
    gateway.objects[str(key)] = ("uid-1", 1, Spec())
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
    gateway.objects[str(probe)] = ("uid-p", 1, Spec())
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
        part.held = False
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


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
