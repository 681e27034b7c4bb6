"""fenced_append (rule 1): the expected-last-subject-sequence fence on a standalone server."""

from __future__ import annotations

import asyncio
import random

import pytest
from nats.js import JetStreamContext

from shared.bus.append import LostRace, fenced_append, publish_input
from shared.bus.connect import connect
from shared.bus.deadletter import dead_letter
from shared.bus.read import last_on_subject, read_subject
from shared.bus.wire import H_MSG_ID
from shared.fence.keys import Key
from shared.subjects import Subjects

LOG = "VMFENCE_LOG"


def subject_for(s: Subjects, name: str) -> str:
    return s.log(Key("pod", "ns", name))


async def test_sequential_appends(provisioned: JetStreamContext, subjects: Subjects) -> None:
    js = provisioned
    subj = subject_for(subjects, "web.1")  # dotted pod name
    assert await last_on_subject(js, LOG, subj) is None
    seqs = []
    last = 0
    for i in range(20):
        last = await fenced_append(
            js, subj, f"e{i}".encode(), expected_last_subject_seq=last, msg_id=f"w:{i}", stream=LOG
        )
        seqs.append(last)
    assert seqs == sorted(seqs) and len(set(seqs)) == 20
    entries = [m async for m in read_subject(js, LOG, subj)]
    assert [m.data for m in entries] == [f"e{i}".encode() for i in range(20)]
    assert [m.seq for m in entries] == seqs
    top = await last_on_subject(js, LOG, subj)
    assert top is not None and top.seq == seqs[-1] and top.headers[H_MSG_ID] == "w:19"
    # read_subject resumes after a sequence
    tail = [m.seq async for m in read_subject(js, LOG, subj, after_seq=seqs[9])]
    assert tail == seqs[10:]


async def test_zero_means_empty_subject(provisioned: JetStreamContext, subjects: Subjects) -> None:
    js = provisioned
    subj = subject_for(subjects, "a")
    first = await fenced_append(js, subj, b"1", expected_last_subject_seq=0, msg_id="a1", stream=LOG)
    with pytest.raises(LostRace) as info:
        await fenced_append(js, subj, b"2", expected_last_subject_seq=0, msg_id="a2", stream=LOG)
    assert info.value.expected == 0 and info.value.actual_last_seq == first
    # Another subject's history does not matter: its own subject is empty.
    other = subject_for(subjects, "b")
    assert await fenced_append(js, other, b"1", expected_last_subject_seq=0, msg_id="b1", stream=LOG) > first


async def test_stale_expected_seq_loses(provisioned: JetStreamContext, subjects: Subjects) -> None:
    js = provisioned
    subj = subject_for(subjects, "stale")
    s1 = await fenced_append(js, subj, b"1", expected_last_subject_seq=0, msg_id="m1", stream=LOG)
    s2 = await fenced_append(js, subj, b"2", expected_last_subject_seq=s1, msg_id="m2", stream=LOG)
    with pytest.raises(LostRace) as info:
        await fenced_append(js, subj, b"3", expected_last_subject_seq=s1, msg_id="m3", stream=LOG)
    assert info.value.subject == subj
    assert info.value.actual_last_seq == s2
    assert [m.seq async for m in read_subject(js, LOG, subj)] == [s1, s2]


async def test_benign_retry_returns_original(provisioned: JetStreamContext, subjects: Subjects) -> None:
    """An append whose ack was lost is re-sent unchanged: same seq back, nothing duplicated."""
    js = provisioned
    subj = subject_for(subjects, "retry")
    s1 = await fenced_append(js, subj, b"1", expected_last_subject_seq=0, msg_id="r1", stream=LOG)
    s2 = await fenced_append(js, subj, b"2", expected_last_subject_seq=s1, msg_id="r2", stream=LOG)
    again = await fenced_append(js, subj, b"2", expected_last_subject_seq=s1, msg_id="r2", stream=LOG)
    assert again == s2
    # r1 is no longer on top: its retry cannot be told from a lost race, so it must not pass.
    with pytest.raises(LostRace):
        await fenced_append(js, subj, b"1", expected_last_subject_seq=0, msg_id="r1", stream=LOG)
    assert [m.data async for m in read_subject(js, LOG, subj)] == [b"1", b"2"]


async def test_old_retry_under_newer_entry_is_lost_race(
    provisioned: JetStreamContext, subjects: Subjects
) -> None:
    js = provisioned
    subj = subject_for(subjects, "old")
    s1 = await fenced_append(js, subj, b"1", expected_last_subject_seq=0, msg_id="o1", stream=LOG)
    await fenced_append(js, subj, b"2", expected_last_subject_seq=s1, msg_id="o2", stream=LOG)
    # A different entry written against the stale expected seq 0: 10071, and the top is not ours.
    with pytest.raises(LostRace):
        await fenced_append(js, subj, b"1", expected_last_subject_seq=0, msg_id="o1-other", stream=LOG)


async def test_concurrent_writers_exactly_one_wins(nats_url: str, subjects: Subjects) -> None:
    """Many rounds of 2-4 writers on separate connections racing on one expected sequence."""
    from shared.bus.provision import StreamsConfig, provision

    clients = [await connect(nats_url, name=f"w{i}", max_reconnect_attempts=2) for i in range(4)]
    try:
        jss = [nc.jetstream() for nc in clients]
        await provision(jss[0], subjects, StreamsConfig())
        rng = random.Random(20240601)
        subj = subject_for(subjects, "contended")
        expected = 0
        winners_log: list[int] = []

        async def attempt(i: int, round_no: int, exp: int) -> int | None:
            for _ in range(rng.randrange(3)):
                await asyncio.sleep(0)  # vary the interleaving, not a synchronisation
            try:
                return await fenced_append(
                    jss[i],
                    subj,
                    f"{round_no}:{i}".encode(),
                    expected_last_subject_seq=exp,
                    msg_id=f"{round_no}:{i}",
                    stream=LOG,
                )
            except LostRace:
                return None

        for round_no in range(150):
            writers = rng.sample(range(4), rng.randint(2, 4))
            results = await asyncio.gather(*(attempt(i, round_no, expected) for i in writers))
            won = [r for r in results if r is not None]
            assert len(won) == 1, f"round {round_no}: {results}"
            expected = won[0]
            winners_log.append(expected)
        entries = [m async for m in read_subject(jss[0], LOG, subj)]
        assert [m.seq for m in entries] == winners_log
        assert [int(m.data.split(b":")[0]) for m in entries] == list(range(150))
    finally:
        for nc in clients:
            await nc.close()


async def test_rule1_writers_never_fork(nats_url: str, subjects: Subjects) -> None:
    """Two writers that both think they own the key: lost race → re-read → retry. No fork."""
    from shared.bus.provision import StreamsConfig, provision

    clients = [await connect(nats_url, name=f"o{i}", max_reconnect_attempts=2) for i in range(2)]
    try:
        jss = [nc.jetstream() for nc in clients]
        await provision(jss[0], subjects, StreamsConfig())
        subj = subject_for(subjects, "forky")
        per_writer = 60

        async def writer(i: int) -> int:
            js = jss[i]
            lost = 0
            top = await last_on_subject(js, LOG, subj)
            last = top.seq if top else 0
            n = 0
            while n < per_writer:
                try:
                    last = await fenced_append(
                        js,
                        subj,
                        f"{i}:{n}:{last}".encode(),
                        expected_last_subject_seq=last,
                        msg_id=f"{i}:{n}",
                        stream=LOG,
                    )
                    n += 1
                except LostRace:
                    lost += 1
                    async for m in read_subject(js, LOG, subj, after_seq=last):
                        last = m.seq
            return lost

        losses = await asyncio.gather(writer(0), writer(1))
        entries = [m async for m in read_subject(jss[0], LOG, subj)]
        assert len(entries) == 2 * per_writer
        prev = 0
        for m in entries:
            _, _, parent = m.data.split(b":")
            assert int(parent) == prev, "entry was not appended on top of its predecessor"
            prev = m.seq
        print(f"\nlost races re-read and retried: {losses}")
    finally:
        for nc in clients:
            await nc.close()


async def test_publish_input_dedupes(provisioned: JetStreamContext, subjects: Subjects) -> None:
    js = provisioned
    subj = subjects.observation(Key("pod", "ns", "p"))
    a = await publish_input(js, subj, b"obs", msg_id="uid-1:10")
    b = await publish_input(js, subj, b"obs", msg_id="uid-1:10")
    c = await publish_input(js, subj, b"obs2", msg_id="uid-1:11")
    assert a == b and c > a
    info = await js.stream_info(subjects.stream_in)
    assert info.state.messages == 2


async def test_dead_letter(provisioned: JetStreamContext, subjects: Subjects) -> None:
    js = provisioned
    await dead_letter(
        js,
        subjects,
        source="reconciler",
        reason="undecodable\npayload",
        subject="vmfence.in.1.pod.a.b",
        data=b"\x00garbage",
        headers={"X-Trace": "t1", "Nats-Msg-Id": "dropped"},
    )
    msg = await js.get_last_msg(subjects.stream_dlq, subjects.dlq("reconciler"))
    assert msg.data == b"\x00garbage"
    assert msg.headers is not None
    assert msg.headers["Vmfence-Reason"] == "undecodable payload"
    assert msg.headers["Vmfence-Original-Subject"] == "vmfence.in.1.pod.a.b"
    assert msg.headers["X-Trace"] == "t1"
    assert "Nats-Msg-Id" not in msg.headers
