"""The host's half of partition verification (PartitionVerify): once a partition's writer of
generation g has verified a host, nothing an older writer of that partition sent may make, wake,
hibernate, adopt or look at a VM there -- it is answered ``inconclusive`` and not stored, so the
newer writer's own copy of the command still runs -- while removes (cleanup) still run. The floor
survives an agent restart, and the answer names exactly the partition's keys with a VM here."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.agent.config import AgentConfig
from services.agent.service import Agent
from shared.bus.read import read_stream
from shared.fence.keys import partition_of
from shared.fence.schema import (
    H_KIND,
    VERIFY_KIND,
    Command,
    CommandResult,
    PartitionVerified,
    PartitionVerify,
    decode_input,
    decode_verified,
    encode,
)
from shared.subjects import Subjects

from .conftest import HOST, WAIT_S, Reports, command, fence, send, sim_driver


def _key_in(p: int, avoid: str = "") -> str:
    """A key of partition ``p`` (16 partitions, the agent's default)."""
    return next(k for i in range(10_000) if partition_of(k := f"default/pod-{i}", 16) == p and k != avoid)


@pytest.fixture
async def answers(nc: Client) -> AsyncIterator[asyncio.Queue[PartitionVerified]]:
    got: asyncio.Queue[PartitionVerified] = asyncio.Queue()

    async def on_msg(msg: Msg) -> None:
        got.put_nowait(decode_verified(msg.data))

    sub = await nc.subscribe("vmfence.in.*.agent.*.partition", cb=on_msg)
    await nc.flush()
    yield got
    await sub.unsubscribe()


async def _verify(nc: Client, answers: asyncio.Queue[PartitionVerified], p: int, gen: int) -> PartitionVerified:
    ask = PartitionVerify(p, gen, HOST, "writer-test")
    await nc.jetstream().publish(Subjects().command(HOST), encode(ask), timeout=5.0,
                                 headers={H_KIND: VERIFY_KIND, "Nats-Msg-Id": f"verify-{p}-{gen}"})
    async with asyncio.timeout(WAIT_S):
        return await answers.get()


async def _result(nc: Client, reports: Reports, cmd: Command, msg_id: str | None = None) -> CommandResult:
    """The answer to this sending of ``cmd`` (a resend under a new Msg-Id gets an answer of its own)."""
    before = len(reports.of(CommandResult, command_id=cmd.id))
    await send(nc, cmd, msg_id=msg_id)
    await reports.wait(lambda _: len(reports.of(CommandResult, command_id=cmd.id)) > before)
    r: CommandResult = reports.of(CommandResult, command_id=cmd.id)[before]
    return r


async def _stored_results(nc: Client, command_id: str) -> list[CommandResult]:
    """The results of ``command_id`` the inputs stream *stored* (a core subscription also sees
    publishes the stream's dedupe dropped)."""
    subjects = Subjects()
    out = []
    async for m in read_stream(nc.jetstream(), subjects.stream_in, f"{subjects.prefix}.in.*.agent.{HOST}.>"):
        if m.subject.endswith(".partition"):
            continue  # a PartitionVerified, no input of a key
        inp = decode_input(m.data)
        if isinstance(inp, CommandResult) and inp.command_id == command_id:
            out.append(inp)
    return out


async def test_what_an_older_writer_sent_is_refused_once_a_newer_one_verified_the_host(
    nc: Client, reports: Reports, answers: asyncio.Queue[PartitionVerified], make_config: Callable[..., AgentConfig]
) -> None:
    cfg = make_config()
    driver = sim_driver(cfg)
    key = _key_in(3)
    f = fence(1, key=key)
    async with Agent(cfg, driver=driver):
        answer = await _verify(nc, answers, 3, 5)
        assert (answer.partition, answer.gen, answer.floor, answer.host, answer.keys) == (3, 5, 5, HOST, [])
        old = msgspec.structs.replace(command("create", "vm-old", f), gen=4)
        r = await _result(nc, reports, old)
        assert r.outcome == "inconclusive" and r.error is not None and "generation 4" in r.error, r
        assert driver.all_vms() == [], "a command of the older writer made a VM"
        # not stored: the newer writer's copy of the same command (same id) is carried out
        new = msgspec.structs.replace(old, gen=5)
        r = await _result(nc, reports, new, msg_id="resend-5")
        assert r.outcome == "ok", r
        assert sorted(driver.all_vms()) == ["vm-old"]
        # and the stream stored both answers: the refusal did not take the Msg-Id the real result
        # is published under (its dedupe would drop that result, and the key would wait for ever)
        assert [x.outcome for x in await _stored_results(nc, old.id)] == ["inconclusive", "ok"]
        # a key of another partition is not held to partition 3's floor
        other = command("create", "vm-other", fence(1, key=_key_in(4)))
        assert (await _result(nc, reports, other)).outcome == "ok"
        # the older writer's cleanup still runs
        remove = msgspec.structs.replace(command("remove", "vm-old", f), gen=4)
        assert (await _result(nc, reports, remove)).outcome == "ok"
        assert sorted(driver.all_vms()) == ["vm-other"]
    # the floor is durable: a restarted agent still refuses the older writer
    async with Agent(cfg, driver=sim_driver(cfg)):
        late = msgspec.structs.replace(command("create", "vm-late", f), gen=4)
        r = await _result(nc, reports, late)
        assert r.outcome == "inconclusive", r
        # and a verify of an older generation never lowers it
        assert (await _verify(nc, answers, 3, 2)).floor == 5


async def test_a_verify_names_the_keys_of_its_partition_with_a_vm_here(
    nc: Client, reports: Reports, answers: asyncio.Queue[PartitionVerified], make_config: Callable[..., AgentConfig]
) -> None:
    cfg = make_config()
    mine, also, elsewhere = _key_in(7), _key_in(7, avoid=_key_in(7)), _key_in(8)
    async with Agent(cfg, driver=sim_driver(cfg)):
        for i, key in enumerate((mine, also, elsewhere)):
            assert (await _result(nc, reports, command("create", f"vm-{i}", fence(1, key=key)))).outcome == "ok"
        assert (await _result(nc, reports, command("remove", "vm-1", fence(1, key=also)))).outcome == "ok"
        answer = await _verify(nc, answers, 7, 3)
        assert answer.keys == [mine] and not answer.truncated


async def test_a_malformed_verify_is_dead_lettered_and_raises_nothing(
    nc: Client, reports: Reports, answers: asyncio.Queue[PartitionVerified], make_config: Callable[..., AgentConfig]
) -> None:
    cfg = make_config()
    key = _key_in(2)
    async with Agent(cfg, driver=sim_driver(cfg)) as agent:
        js = nc.jetstream()
        for i, bad in enumerate((b"{", encode(PartitionVerify(2, 9, "other-host", "w")),
                                 encode(PartitionVerify(99, 9, HOST, "w")), encode(PartitionVerify(2, 0, HOST, "w")))):
            await js.publish(Subjects().command(HOST), bad, headers={H_KIND: VERIFY_KIND, "Nats-Msg-Id": f"bad-{i}"})
        cmd = msgspec.structs.replace(command("create", "vm-1", fence(1, key=key)), gen=1)
        assert (await _result(nc, reports, cmd)).outcome == "ok"  # handed out after the bad ones
        assert agent.ledger.floor(2) == 0
        assert answers.empty()
