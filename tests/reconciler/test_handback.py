"""A partition that goes hands what it fetched and did not answer back to the stream at once, on a
real nats-server: the next owner gets those inputs now, not after ack_wait."""

from __future__ import annotations

import asyncio

import nats.errors
import nats.js.errors
import pytest
from nats.js import api

from services.reconciler.effects import EffectRunner
from services.reconciler.kube import NullGateway
from services.reconciler.partition import Partition
from shared.bus.connect import Bus
from shared.fence.decide import DecideEnv, HostView
from shared.fence.keys import Key
from shared.fence.schema import Observed, Spec, decode_input
from tests.reconciler.helpers import observe, wait_until

ACK_WAIT_S = 30.0  # far beyond the test: an input comes back within it only if handed back
DURABLE = "reconciler-p0"  # the partition's own consumer, which the next owner pulls from


def _env() -> DecideEnv:
    return DecideEnv(hosts=[HostView("host-a", 64, 65536)])  # a live host that never answers


async def _running(bus: Bus, objects: dict[str, tuple[str, int, Spec]]) -> tuple[Partition, asyncio.Task[None]]:
    """Partition 0 of a writer at generation 7, loaded and running, over a gateway holding ``objects``."""
    gateway = NullGateway()
    gateway.objects.update(objects)
    part = Partition(0, js=bus.js, subjects=bus.subjects, writer="writer-1",
                     effects=EffectRunner(bus.js, bus.subjects, gateway), snapshots=None, env=_env,
                     confirm=gateway.confirm, gen=7, ack_wait_s=ACK_WAIT_S)
    await part.load()
    return part, asyncio.create_task(part.run())


async def _holding(bus: Bus, key: Key) -> tuple[Partition, asyncio.Task[None]]:
    """A partition of a writer whose verification no host answers, holding ``key``'s first input
    (fetched, decided by nobody, unacked) -- as a writer does for a few seconds after a take."""
    part, task = await _running(bus, {str(key): ("uid-1", 1, Spec())})
    await observe(bus, key, "uid-1", 1)
    await wait_until(lambda: str(key) in part._held_inputs, "the input held for verification")
    return part, task


async def _stop(part: Partition, task: asyncio.Task[None]) -> None:
    """The partition's own stop: a fetch answered in the loop turn of a cancel swallows it on
    Python 3.11 (``shared.tasks``), so the run may end by returning rather than cancelled."""
    await part.stop(task, settle=False)
    assert task.done()


async def _next_owner_fetch(bus: Bus, timeout: float) -> list[Observed]:  # noqa: ASYNC109
    psub = await bus.js.pull_subscribe(bus.subjects.in_partition(0), durable=DURABLE, stream=bus.subjects.stream_in,
                                       config=api.ConsumerConfig(ack_wait=ACK_WAIT_S))
    try:
        msgs = await psub.fetch(10, timeout=timeout)
    except (nats.errors.TimeoutError, TimeoutError):
        return []
    finally:
        await psub.unsubscribe()
    return [decode_input(m.data) for m in msgs]  # type: ignore[misc]


async def test_inputs_held_when_the_partition_goes_reach_the_next_owner_at_once(bus: Bus) -> None:
    key = Key("pod", "default", "web")
    part, task = await _holding(bus, key)
    await _stop(part, task)
    assert await part.hand_back() == 1
    got = await _next_owner_fetch(bus, timeout=5)
    assert [(o.key, o.uid) for o in got] == [(str(key), "uid-1")]
    assert part._unanswered == {}


async def test_without_the_hand_back_the_next_owner_waits_out_ack_wait(bus: Bus) -> None:
    """The other side of the rule: what the test above sees is the hand-back's doing."""
    part, task = await _holding(bus, Key("pod", "default", "web"))
    await _stop(part, task)
    assert await _next_owner_fetch(bus, timeout=2) == []


async def test_answered_inputs_are_not_handed_back(bus: Bus) -> None:
    key = Key("pod", "default", "web")
    part, task = await _holding(bus, key)
    # the hold ends (NEW_KEY_HOLD_S): the held input is decided and acked
    await wait_until(lambda: str(key) not in part._held_inputs and not part._unanswered, "the held input answered")
    await _stop(part, task)
    assert await part.hand_back() == 0
    assert await _next_owner_fetch(bus, timeout=2) == []


async def test_handing_back_while_still_deciding_is_refused(bus: Bus) -> None:
    part, task = await _holding(bus, Key("pod", "default", "web"))
    try:
        with pytest.raises(AssertionError):
            await part.hand_back()
    finally:
        await _stop(part, task)


async def _fetch_waiting(bus: Bus) -> bool:
    try:
        info = await bus.js.consumer_info(bus.subjects.stream_in, DURABLE)
    except nats.js.errors.NotFoundError:  # the partition has not made its consumer yet
        return False
    return bool(info.num_waiting)


async def test_a_partition_stopped_on_purpose_hands_back_what_its_last_fetch_brings(bus: Bus) -> None:
    """A partition handed over on purpose stops deciding and lets its consumer's fetch under way
    return (``stop`` with ``settle``): an input that fetch brings is answered by no one and handed
    back at once, rather than being cut off inside a cancelled fetch (where, delivered to this
    client and never read, it would wait out ``ack_wait``, here 30 s)."""
    part, task = await _running(bus, {})
    deadline = asyncio.get_running_loop().time() + 10
    while not await _fetch_waiting(bus):  # the consumer's pull request is at the server
        assert asyncio.get_running_loop().time() < deadline, "the partition never fetched"
        await asyncio.sleep(0.02)
    stopping = asyncio.create_task(part.stop(task, settle=True))
    await asyncio.sleep(0)  # it stopped deciding; its fetch is still at the server
    await observe(bus, Key("pod", "default", "late"), "uid-9", 1)
    await stopping
    assert task.done() and not task.cancelled(), "it ended by itself, its fetch returned"
    assert await part.hand_back() == 1
    assert [o.key for o in await _next_owner_fetch(bus, timeout=2)] == ["default/late"]
