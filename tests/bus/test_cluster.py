"""R3 streams on a 3-node loopback cluster: fenced appends survive a SIGKILLed stream leader."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client

from services.testbed.natsserver import NatsCluster, start_cluster
from shared.bus.append import LostRace, fenced_append
from shared.bus.connect import connect
from shared.bus.provision import StreamsConfig, provision
from shared.bus.read import read_stream, read_subject
from shared.bus.wire import H_EXPECTED_LAST_SUBJECT_SEQ, H_MSG_ID
from shared.fence.keys import Key
from shared.subjects import Subjects

LOG = "VMFENCE_LOG"
PHASE_TIMEOUT_S = 30.0  # each phase of the fault run must make progress within this
APPEND_TIMEOUT_S = 2.0
H_PARENT = "Vmfence-Parent"


@pytest.fixture
async def cluster(nats_binary: str) -> AsyncIterator[NatsCluster]:
    c = await start_cluster(3)
    try:
        yield c
    finally:
        await c.stop()


@pytest.fixture
async def clients(cluster: NatsCluster) -> AsyncIterator[list[Client]]:
    # Each client lists every node (in a different order) so it fails over on its own.
    urls = cluster.urls
    ncs = [await connect(urls[i:] + urls[:i], name=f"w{i}") for i in range(3)]
    await provision(ncs[0].jetstream(), Subjects(), StreamsConfig(replicas=3))
    try:
        yield ncs
    finally:
        for nc in ncs:
            await nc.close()


async def test_duplicate_ack_path(clients: list[Client]) -> None:
    """On R3 a re-sent append (same Msg-Id, same expected seq) is acked duplicate=True."""
    js = clients[0].jetstream()
    subj = Subjects().log(Key("pod", "ns", "dup"))
    s1 = await fenced_append(js, subj, b"1", expected_last_subject_seq=0, msg_id="d1", stream=LOG)
    hdrs = {H_EXPECTED_LAST_SUBJECT_SEQ: "0", H_MSG_ID: "d1"}
    raw = await js.publish(subj, b"1", timeout=5, headers=hdrs)
    assert raw.duplicate is True and raw.seq == s1
    again = await fenced_append(js, subj, b"1", expected_last_subject_seq=0, msg_id="d1", stream=LOG)
    assert again == s1
    assert [m.seq async for m in read_subject(js, LOG, subj)] == [s1]


async def test_r3_concurrent_writers_exactly_one_wins(clients: list[Client]) -> None:
    """Same-subject proposals in flight get 10164 on R3; retried, they resolve to one winner."""
    jss = [nc.jetstream() for nc in clients]
    subj = Subjects().log(Key("pod", "ns", "contended"))
    expected = 0
    for round_no in range(60):

        async def attempt(i: int, exp: int, r: int = round_no) -> int | None:
            try:
                return await fenced_append(
                    jss[i], subj, b"x", expected_last_subject_seq=exp, msg_id=f"{r}:{i}", stream=LOG
                )
            except LostRace:
                return None

        results = await asyncio.gather(*(attempt(i, expected) for i in range(3)))
        won = [r for r in results if r is not None]
        assert len(won) == 1, f"round {round_no}: {results}"
        expected = won[0]
    assert len([m async for m in read_subject(jss[0], LOG, subj)]) == 60


async def test_appends_survive_leader_kill_and_restart(cluster: NatsCluster, clients: list[Client]) -> None:
    subjects = Subjects()
    keys = [Key("pod", "ns", f"k{i}") for i in range(6)]
    per_key = 150
    done = 0
    phases = {name: asyncio.Event() for name in ("started", "killed_progress", "restarted_progress")}
    marks: dict[str, int] = {}

    def progress() -> None:
        nonlocal done
        done += 1
        if done >= 60:
            phases["started"].set()
        if "killed" in marks and done >= marks["killed"] + 60:
            phases["killed_progress"].set()
        if "restarted" in marks and done >= marks["restarted"] + 60:
            phases["restarted_progress"].set()

    async def writer(idx: int, key: Key) -> None:
        js = clients[idx % len(clients)].jetstream()
        subj = subjects.log(key)
        last = 0
        for i in range(per_key):
            last = await fenced_append(
                js,
                subj,
                str(i).encode(),
                expected_last_subject_seq=last,
                msg_id=f"{key}:{i}",
                stream=LOG,
                timeout=APPEND_TIMEOUT_S,
                headers={H_PARENT: str(last)},
            )
            progress()

    async def chaos() -> None:
        await asyncio.wait_for(phases["started"].wait(), PHASE_TIMEOUT_S)
        info = await clients[0].jetstream().stream_info(LOG)
        assert info.cluster is not None and info.cluster.leader
        victim = next(n for n in cluster.nodes if n.name == info.cluster.leader)
        victim.kill()
        marks["killed"] = done
        await asyncio.wait_for(phases["killed_progress"].wait(), PHASE_TIMEOUT_S)
        await victim.restart()
        marks["restarted"] = done
        await asyncio.wait_for(phases["restarted_progress"].wait(), PHASE_TIMEOUT_S)

    await asyncio.wait_for(
        asyncio.gather(chaos(), *(writer(i, k) for i, k in enumerate(keys))), 3 * PHASE_TIMEOUT_S
    )
    assert done == len(keys) * per_key
    assert marks["killed"] < done and marks["restarted"] < done

    js = clients[0].jetstream()
    for key in keys:
        entries = [m async for m in read_subject(js, LOG, subjects.log(key))]
        # every append landed exactly once, in order
        assert [m.data for m in entries] == [str(i).encode() for i in range(per_key)]
        assert [m.headers[H_MSG_ID] for m in entries] == [f"{key}:{i}" for i in range(per_key)]
        # contiguous per-subject chain: each entry was appended on top of the previous one
        parents = [int(m.headers[H_PARENT]) for m in entries]
        assert parents == [0] + [m.seq for m in entries[:-1]]
    # The bulk reader sees the same log: every entry once, in stream order.
    everything = [m async for m in read_stream(js, LOG, subjects.log_all)]
    assert len(everything) == len(keys) * per_key
    assert [m.seq for m in everything] == sorted(m.seq for m in everything)
    assert len({(m.subject, m.data) for m in everything}) == len(everything)
