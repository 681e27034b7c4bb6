"""Hostile inputs on a real nats-server: each one is dead-lettered (or logged as Skipped) with its
reason and counted, and the partition goes on with the next key (issue 10, findings 4, 6 and 7)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest
from nats.aio.msg import Msg

from services.reconciler.effects import EffectRunner
from services.reconciler.kube import NullGateway
from services.reconciler.partition import Partition
from services.testbed.natsserver import NatsServer
from shared.bus.connect import Bus
from shared.bus.provision import StreamsConfig, provision
from shared.bus.read import read_stream
from shared.fence.decide import DecideEnv, HostView
from shared.fence.keys import Key
from shared.fence.schema import Observed, Spec, encode
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
