"""read_stream (bulk replay/export) and read_subject: every message once, in order, bounded."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest
from nats.js import JetStreamContext

from shared.bus import read as bus_read
from shared.bus.read import read_stream, read_subject
from shared.subjects import Subjects

IN = "VMFENCE_IN"
PIPELINE = 1000  # publish_async futures awaited per chunk (each bounded by a timeout)
ACK_TIMEOUT_S = 10.0


async def fill(js: JetStreamContext, subjects: list[str], n: int, size: int = 32) -> None:
    """Bulk-load n messages round-robin over subjects; pipelined, every ack awaited with a timeout."""
    payload = b"p" * size
    pending: list[asyncio.Future[Any]] = []
    for i in range(n):
        pending.append(await js.publish_async(subjects[i % len(subjects)], payload))
        if len(pending) >= PIPELINE:
            await asyncio.wait_for(asyncio.gather(*pending), ACK_TIMEOUT_S)
            pending.clear()
    if pending:
        await asyncio.wait_for(asyncio.gather(*pending), ACK_TIMEOUT_S)


async def test_empty_stream(provisioned: JetStreamContext) -> None:
    assert [m async for m in read_stream(provisioned, IN)] == []


async def test_every_message_once_in_order(provisioned: JetStreamContext, subjects: Subjects) -> None:
    js = provisioned
    subs = [f"vmfence.in.{p}.pod.ns.n{p}" for p in range(4)]
    await fill(js, subs, 5000)
    got = [m async for m in read_stream(js, IN, batch=256)]
    assert [m.seq for m in got] == list(range(1, 5001))
    assert [m.subject for m in got[:4]] == subs
    # filtered: only partition 2, still in order, ends at its last match
    part = [m async for m in read_stream(js, IN, subjects.in_partition(2))]
    assert [m.seq for m in part] == list(range(3, 5001, 4))
    # windowed
    win = [m.seq async for m in read_stream(js, IN, start_seq=100, until_seq=199)]
    assert win == list(range(100, 200))
    # no match
    assert [m async for m in read_stream(js, IN, "vmfence.in.15.>")] == []


async def test_stops_at_last_seq_of_call_time(provisioned: JetStreamContext) -> None:
    js = provisioned
    await fill(js, ["vmfence.in.0.pod.a.b"], 300)
    seen = 0
    async for m in read_stream(js, IN, batch=64):
        if seen == 0:
            await fill(js, ["vmfence.in.0.pod.a.b"], 100)  # appended while reading: not included
        seen += 1
        assert m.seq <= 300
    assert seen == 300


async def test_early_break_cleans_up_consumer(provisioned: JetStreamContext) -> None:
    js = provisioned
    await fill(js, ["vmfence.in.0.pod.a.b"], 50)
    async with contextlib.aclosing(read_stream(js, IN)) as reader:
        async for m in reader:
            if m.seq == 10:
                break
    info = await js.stream_info(IN)
    assert info.state.consumer_count == 0
    async with contextlib.aclosing(read_stream(js, IN)) as reader:
        assert (await anext(reader)).seq == 1
    info = await js.stream_info(IN)
    assert info.state.consumer_count == 0


async def test_read_subject_matches_stream(provisioned: JetStreamContext) -> None:
    js = provisioned
    subs = ["vmfence.log.1.ns.a", "vmfence.log.1.ns.b"]
    for i in range(20):
        await js.publish(subs[i % 2], str(i).encode(), timeout=5)
    a = [m async for m in read_subject(js, "VMFENCE_LOG", subs[0])]
    assert [m.data for m in a] == [str(i).encode() for i in range(0, 20, 2)]
    via_stream = [m async for m in read_stream(js, "VMFENCE_LOG", subs[0])]
    assert [m.seq for m in via_stream] == [m.seq for m in a]
    assert [m.data for m in via_stream] == [m.data for m in a]


async def test_bench_read_stream_rate(provisioned: JetStreamContext) -> None:
    """Benchmark-style: ~50k small messages; prints rates, asserts only completeness."""
    js = provisioned
    n = 50_000
    subs = [f"vmfence.in.{p}.pod.ns.k{p}" for p in range(16)]
    t0 = time.perf_counter()
    await fill(js, subs, n)
    t1 = time.perf_counter()
    count = 0
    last = 0
    async for m in read_stream(js, IN):
        assert m.seq == last + 1
        last = m.seq
        count += 1
    t2 = time.perf_counter()
    assert count == n
    print(f"\npipelined publish: {n / (t1 - t0):,.0f} msg/s; read_stream: {n / (t2 - t1):,.0f} msg/s")


async def test_tail_removed_while_reading(
    provisioned: JetStreamContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Messages deleted after the call started are skipped and the read still ends."""
    monkeypatch.setattr(bus_read, "READ_TIMEOUT_S", 0.5)  # short pull expiry: any 408 path runs fast
    js = provisioned
    await fill(js, ["vmfence.in.0.pod.a.b"], 100)
    got = []
    async with contextlib.aclosing(read_stream(js, IN, batch=8)) as reader:
        async for m in reader:
            if m.seq == 1:
                for seq in range(60, 101):
                    await js.delete_msg(IN, seq)
            got.append(m.seq)
    print(f"\nread {len(got)} after deleting the tail")
    assert got[:50] == list(range(1, 51))
    assert set(got) <= set(range(1, 101)) and len(got) == len(set(got)) and got == sorted(got)
