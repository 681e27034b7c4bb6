"""The writer's half of partition verification, on a real nats-server: a key first seen after the
load makes its first VM without a survey of its own only once every live host has answered this
writer's PartitionVerify at its generation and none named the key. A stale, forged or truncated
answer verifies nothing; a host that joins must answer before keys skip their survey again; a host
above our generation makes us take a higher one; every command sent carries the generation."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator

import msgspec
from nats.aio.msg import Msg
from nats.js import api

from services.reconciler.effects import EffectRunner
from services.reconciler.kube import NullGateway
from services.reconciler.partition import Partition
from shared.bus.connect import Bus
from shared.fence.decide import DecideEnv, HostView
from shared.fence.keys import Key
from shared.fence.schema import (
    H_KIND,
    SURVEY_VM_ID,
    VERIFY_KIND,
    Command,
    Commanded,
    CommandResult,
    Fence,
    LogEntry,
    Observed,
    PartitionVerified,
    Spec,
    decode_command,
    decode_verify,
    encode,
)
from tests.reconciler.helpers import log_entries

BOUND = Spec(node="vmfence-host-a")  # scheduled to host-a: its VM is made right after admission
GEN = 7
_durables = itertools.count()



class Fleet:
    """The live hosts, as the hosts bucket would say them."""

    def __init__(self, *names: str) -> None:
        self.names = list(names)

    def env(self) -> DecideEnv:
        return DecideEnv(hosts=[HostView(n, 64, 65536) for n in self.names])


async def _partition(bus: Bus, fleet: Fleet, gateway: NullGateway, effects: EffectRunner | None = None) -> Partition:
    part = Partition(0, js=bus.js, subjects=bus.subjects, writer="writer-1", effects=effects or
                     EffectRunner(bus.js, bus.subjects, gateway), snapshots=None, env=fleet.env,
                     confirm=gateway.confirm, gen=GEN)
    await part.load()
    return part


async def _hand(bus: Bus, part: Partition, subject: str, payload: msgspec.Struct) -> None:
    """Publish ``payload`` on ``subject`` (an input subject) and hand it to the partition as fetched."""
    psub = await bus.js.pull_subscribe(subject, durable=f"verify-test-{next(_durables)}", stream=bus.subjects.stream_in,
                                       config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.NEW))
    await bus.js.publish(subject, encode(payload))
    msgs: list[Msg] = await psub.fetch(1, timeout=5)
    await part.handle(msgs[0])
    await psub.unsubscribe()


async def _answer(bus: Bus, part: Partition, answer: PartitionVerified, *, on: str | None = None) -> None:
    """A host's answer, on the subject of host ``on`` (default: its own)."""
    await _hand(bus, part, bus.subjects.host_partition_report(0, on or answer.host), answer)


async def _queue_of(bus: Bus, host: str) -> asyncio.Queue[Msg]:
    """Every message published to ``host``'s command subject, as it is published."""
    got: asyncio.Queue[Msg] = asyncio.Queue()

    async def on_msg(msg: Msg) -> None:
        got.put_nowait(msg)

    await bus.nc.subscribe(bus.subjects.command(host), cb=on_msg)
    return got


def _ops(part: Partition, key: str) -> list[str]:
    return sorted(e.command.op for e in part.keys[key].state.outbox.values() if isinstance(e, Commanded))


async def _first_vm(part: Partition, gateway: NullGateway, key: str) -> list[str]:
    """What the key's first input commands."""
    gateway.objects[key] = ("uid-1", 1, BOUND)
    assert await part.feed(key, Observed(key, "uid-1", 1, spec=BOUND))
    return _ops(part, key)


async def test_a_new_key_skips_its_survey_only_once_every_live_host_verified_the_partition(bus: Bus) -> None:
    gateway, fleet = NullGateway(), Fleet("host-a", "host-b")
    part = await _partition(bus, fleet, gateway)
    asked = await _queue_of(bus, "host-a")
    assert await part.ask_hosts() == ["host-a", "host-b"]
    msg = await asyncio.wait_for(asked.get(), 5)
    assert (msg.headers or {}).get(H_KIND) == VERIFY_KIND
    ask = decode_verify(msg.data)
    assert (ask.partition, ask.gen, ask.host, ask.writer) == (0, GEN, "host-a", "writer-1")
    assert await part.ask_hosts() == [], "asked again within the retry period"

    assert await _first_vm(part, gateway, "default/before") == ["survey", "survey"]  # nothing verified yet
    await _answer(bus, part, PartitionVerified(0, GEN, GEN, "host-a", []))
    assert part.verified == {"host-a"} and not part.partition_verified()
    assert await _first_vm(part, gateway, "default/half") == ["survey", "survey"]  # host-b has not answered
    await _answer(bus, part, PartitionVerified(0, GEN, GEN, "host-b", ["default/named"]))
    assert part.partition_verified()
    assert await _first_vm(part, gateway, "default/after") == ["create"]
    # a key a host has a VM of (a lost tail's, maybe) still asks every host what it has
    assert await _first_vm(part, gateway, "default/named") == ["survey", "survey"]
    # a key that was first seen before verification stays unverified: its survey is out
    assert part.keys["default/before"].state.unverified


async def test_stale_forged_or_truncated_answers_verify_nothing(bus: Bus) -> None:
    gateway, fleet = NullGateway(), Fleet("host-a")
    part = await _partition(bus, fleet, gateway)
    await _answer(bus, part, PartitionVerified(0, GEN - 1, GEN - 1, "host-a", []))  # an older lease's
    await _answer(bus, part, PartitionVerified(0, GEN, GEN, "host-a", [], truncated=True))
    assert not part.partition_verified()
    dead = part.stats["dead_lettered"]
    await _answer(bus, part, PartitionVerified(0, GEN, GEN, "host-a", []), on="host-b")  # host-b speaking for a
    await _answer(bus, part, PartitionVerified(1, GEN, GEN, "host-a", []))  # another partition's
    assert part.stats["dead_lettered"] == dead + 2
    assert not part.partition_verified()
    assert await _first_vm(part, gateway, "default/web") == ["survey"]


async def test_a_host_that_joins_must_answer_before_keys_skip_their_survey_again(bus: Bus) -> None:
    gateway, fleet = NullGateway(), Fleet("host-a")
    part = await _partition(bus, fleet, gateway)
    await part.ask_hosts()
    await _answer(bus, part, PartitionVerified(0, GEN, GEN, "host-a", []))
    assert part.partition_verified()
    fleet.names.append("host-b")
    assert not part.partition_verified()
    assert await _first_vm(part, gateway, "default/joined") == ["survey", "survey"]
    assert await part.ask_hosts() == ["host-b"]
    # a host that leaves the live set answers again when it comes back
    await _answer(bus, part, PartitionVerified(0, GEN, GEN, "host-b", []))
    fleet.names.remove("host-a")
    part._asked.clear()
    await part.ask_hosts()
    fleet.names.append("host-a")
    assert not part.partition_verified()


async def test_a_host_above_our_generation_makes_us_take_a_higher_one(bus: Bus) -> None:
    gateway, fleet = NullGateway(), Fleet("host-a")
    part = await _partition(bus, fleet, gateway)
    await _answer(bus, part, PartitionVerified(0, GEN, GEN + 5, "host-a", []))
    assert part.gen == GEN + 6 and not part.partition_verified()
    assert await part.ask_hosts() == ["host-a"]


@contextlib.asynccontextmanager
async def _sending(bus: Bus, gateway: NullGateway) -> AsyncIterator[tuple[Partition, asyncio.Queue[Msg]]]:
    """A partition of one live host whose effects are carried out, and what it sends that host."""
    parts: list[Partition] = []
    effects = EffectRunner(bus.js, bus.subjects, gateway, gen=lambda p: parts[0].gen)
    parts.append(await _partition(bus, Fleet("host-a"), gateway, effects))
    sent = await _queue_of(bus, "host-a")
    runner = asyncio.create_task(effects.run())
    try:
        yield parts[0], sent
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)


async def test_every_command_carries_its_writers_generation(bus: Bus) -> None:
    gateway = NullGateway()
    async with _sending(bus, gateway) as (part, sent):
        await _first_vm(part, gateway, "default/web")
        cmd = decode_command((await asyncio.wait_for(sent.get(), 5)).data)
        assert cmd.op == "survey" and cmd.gen == GEN


async def test_a_refusal_of_an_older_writers_copy_is_never_decided_and_ours_goes_again(bus: Bus) -> None:
    """A host's refusal of a predecessor's copy of a command (same id; the stream's dedupe may have
    let it stand for ours) must not end the command in our log -- else the answer to our copy
    would find nothing to complete. Our copy goes again under a Msg-Id naming our generation."""
    gateway = NullGateway()
    async with _sending(bus, gateway) as (part, sent):
        await part.ask_hosts()
        await asyncio.wait_for(sent.get(), 5)  # the verify
        await _answer(bus, part, PartitionVerified(0, GEN, GEN, "host-a", []))
        await _first_vm(part, gateway, "default/web")
        first = await asyncio.wait_for(sent.get(), 5)
        create = decode_command(first.data)
        assert create.op == "create" and (first.headers or {})["Nats-Msg-Id"] == create.id
        refused = CommandResult(create.fence, create.id, "create", "host-a", create.vm_id, "inconclusive",
                                error="older generation", floor=GEN)
        n = part.keys["default/web"].state.n
        report = bus.subjects.host_report(Key.parse(create.fence.key), "host-a")
        await _hand(bus, part, report, refused)
        state = part.keys["default/web"].state
        assert state.n == n and create.id in state.outbox, "the refusal was decided"
        again = await asyncio.wait_for(sent.get(), 5)
        assert decode_command(again.data).id == create.id
        assert (again.headers or {})["Nats-Msg-Id"] == f"{create.id}@{GEN}"
        assert part.stats["refused_below_floor"] == 1 and part.gen == GEN
        # above our generation: we are the older writer; take a higher one and verify again. The
        # refusal is not acked: the writer it is for (a newer one, or us at the new generation)
        # gets it again -- acked here, that writer would never send its own copy
        assert await _handed_again(bus, part, report, msgspec.structs.replace(refused, floor=GEN + 3))
        assert part.gen == GEN + 4 and not part.partition_verified()
        part.held = False  # a writer whose lease is gone leaves every refusal to the next
        assert await _handed_again(bus, part, report, refused)


async def _handed_again(bus: Bus, part: Partition, subject: str, payload: msgspec.Struct) -> bool:
    """Hand ``payload`` to the partition as fetched; True if the stream then delivers it again
    (the partition did not ack it)."""
    psub = await bus.js.pull_subscribe(subject, durable=f"verify-test-{next(_durables)}", stream=bus.subjects.stream_in,
                                       config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.NEW, ack_wait=30))
    try:
        await bus.js.publish(subject, encode(payload))
        msgs: list[Msg] = await psub.fetch(1, timeout=5)
        await part.handle(msgs[0])
        try:
            again = await psub.fetch(1, timeout=5)
        except TimeoutError:
            return False
        await again[0].ack()
        return again[0].metadata.num_delivered == 2
    finally:
        await psub.unsubscribe()


async def test_a_refusal_of_a_command_we_learn_of_later_makes_our_copy_go_under_our_generation(bus: Bus) -> None:
    """A hand-over: the host refuses the predecessor's copy before we have read the entry that
    commanded it (appended after our load). When our re-read carries the command out, its copy
    must not be the command's own Msg-Id -- the stream's dedupe would let the refused copy stand
    for it and the key would wait for ever (a stack campaign's pod never got its survey)."""
    gateway = NullGateway()
    async with _sending(bus, gateway) as (part, sent):
        await part.ask_hosts()
        await asyncio.wait_for(sent.get(), 5)  # the verify
        await _answer(bus, part, PartitionVerified(0, GEN, GEN, "host-a", []))
        key = "default/late"
        fence = Fence(key, "uid-9", 1)
        cmd = Command(id="uid-9:1:survey:survey:1.1.4.x", op="survey", fence=fence, host="host-a", vm_id=SURVEY_VM_ID)
        refused = CommandResult(fence, cmd.id, "survey", "host-a", SURVEY_VM_ID, "inconclusive",
                                error="older generation", floor=GEN)
        await _hand(bus, part, bus.subjects.host_report(Key.parse(key), "host-a"), refused)
        assert part.stats["refused_below_floor"] == 1 and sent.empty()  # nothing of ours to send yet
        part.effects.submit(key, Commanded(cmd))  # as the re-read's outbox would (``_owe``)
        again = await asyncio.wait_for(sent.get(), 5)
        assert decode_command(again.data).id == cmd.id
        assert (again.headers or {})["Nats-Msg-Id"] == f"{cmd.id}@{GEN}"
        # a command no host refused still goes under its own id (a predecessor's copy stands for it)
        other = msgspec.structs.replace(cmd, id="uid-9:1:survey:survey:1.1.5.x")
        part.effects.submit(key, Commanded(other))
        assert ((await asyncio.wait_for(sent.get(), 5)).headers or {})["Nats-Msg-Id"] == other.id


def _decisions(entries: list[tuple[int, LogEntry]], key: str) -> list[str]:
    return [type(d).__name__ for _, e in entries if e.key == key for d in e.decisions]


async def _holding(bus: Bus, name: str, seconds: float) -> tuple[Partition, NullGateway, asyncio.Task[None], Key]:
    """A partition of host-a holding new keys for ``seconds``, whose key ``name`` sent a first input."""
    gateway = NullGateway()
    part = await _partition(bus, Fleet("host-a"), gateway)
    gateway.objects[f"default/{name}"] = ("uid-1", 1, BOUND)
    part.hold_new_keys(seconds)
    release = asyncio.create_task(part.release_held())
    key = Key("pod", "default", name)
    await _hand(bus, part, bus.subjects.observation(key), Observed(str(key), "uid-1", 1, spec=BOUND))
    return part, gateway, release, key


async def test_a_new_keys_inputs_wait_for_the_verification_in_order_and_make_no_survey(bus: Bus) -> None:
    """Inputs of keys first seen right after the partition is taken are held (unacked) until every
    live host has verified it; then each key's inputs are decided in arrival order, without a
    survey of every host per key."""
    part, gateway, release, key = await _holding(bus, "early", 30)
    await _hand(bus, part, bus.subjects.observation(key), Observed(str(key), "uid-1", 2, deleting=True, spec=BOUND))
    assert str(key) not in part.keys and len(part._held_inputs[str(key)]) == 2, "decided before verification"
    assert not release.done()
    # a key the log tail slotted before the hosts answered (a hand-over's foreign entry) is held too
    tail = Key("pod", "default", "tail")
    gateway.objects[str(tail)] = ("uid-2", 1, BOUND)
    part._slot(str(tail))
    await _hand(bus, part, bus.subjects.observation(tail), Observed(str(tail), "uid-2", 1, spec=BOUND))
    assert len(part._held_inputs[str(tail)]) == 1 and part.keys[str(tail)].state.n == 0
    await _answer(bus, part, PartitionVerified(0, GEN, GEN, "host-a", []))
    await asyncio.wait_for(release, 5)
    assert part._held_inputs == {} and part.stats["held_keys"] == 2
    assert _ops(part, str(tail)) == ["create"], "verified by the partition's answers: no survey"
    decided = _decisions(await log_entries(bus), str(key))
    assert "Admitted" in decided and "DeleteClaimed" in decided, decided
    assert decided.index("Admitted") < decided.index("DeleteClaimed"), f"decided out of arrival order: {decided}"
    commanded = [d.command.op for _, e in await log_entries(bus) if e.key == str(key)
                 for d in e.decisions if isinstance(d, Commanded)]
    assert "survey" not in commanded, commanded
    # once released, a key first seen is decided at once (verified: no survey)
    assert await _first_vm(part, gateway, "default/later") == ["create"]


async def test_held_keys_survey_every_host_when_the_verification_does_not_come_in_time(bus: Bus) -> None:
    part, _, release, key = await _holding(bus, "late", 0.3)
    assert str(key) not in part.keys
    await asyncio.wait_for(release, 5)  # host-a never answers
    assert _ops(part, str(key)) == ["survey"]
    assert not part._holding(), "held once per lease"


async def test_keys_first_seen_while_the_partition_was_verified_are_verified_by_its_answers(bus: Bus) -> None:
    """A hand-over's foreign log tail slots keys before the hosts have answered: once every live
    host has, those no host named and with no survey out need none (their delete would survey)."""
    gateway, fleet = NullGateway(), Fleet("host-a")
    part = await _partition(bus, fleet, gateway)
    quiet, named = part._slot("default/quiet"), part._slot("default/named")
    surveying = await _first_vm(part, gateway, "default/surveying")
    assert quiet.state.unverified and named.state.unverified and surveying == ["survey"]
    await _answer(bus, part, PartitionVerified(0, GEN, GEN, "host-a", ["default/named"]))
    assert part.partition_verified()
    assert not part.keys["default/quiet"].state.unverified, "verified by the hosts' answers"
    assert part.keys["default/named"].state.unverified, "a host has a VM of it: it surveys"
    assert part.keys["default/surveying"].state.unverified, "its survey is out: its answers verify it"
    assert part.stats["verified_early"] == 1


async def test_keys_loaded_from_the_log_are_verified_by_the_next_writers_answers(bus: Bus) -> None:
    """After a hand-over every loaded key used to survey every host at its next bring-up or delete
    (a loaded log may have lost a tail): the new writer's verification vouches for those no host
    named, as for keys first seen after it."""
    gateway, fleet = NullGateway(), Fleet("host-a")
    first = await _partition(bus, fleet, gateway)
    await _answer(bus, first, PartitionVerified(0, GEN, GEN, "host-a", []))
    assert await _first_vm(first, gateway, "default/kept") == ["create"]
    assert await _first_vm(first, gateway, "default/vm-here") == ["create"]
    first.held = False
    second = Partition(0, js=bus.js, subjects=bus.subjects, writer="writer-2", effects=EffectRunner(
        bus.js, bus.subjects, gateway), snapshots=None, env=fleet.env, confirm=gateway.confirm, gen=GEN + 1)
    await second.load()
    assert second.keys["default/kept"].state.unverified, "loaded: unverified until the hosts answer"
    await _answer(bus, second, PartitionVerified(0, GEN + 1, GEN + 1, "host-a", ["default/vm-here"]))
    assert not second.keys["default/kept"].state.unverified
    assert second.keys["default/vm-here"].state.unverified, "a host has its VM: it surveys"
