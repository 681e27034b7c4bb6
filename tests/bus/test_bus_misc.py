"""Small pieces of shared.bus: connecting, the Bus holder, retry bounds, ack-subject parsing."""

from __future__ import annotations

import time

from hypothesis import given
from hypothesis import strategies as st
from nats.js import JetStreamContext

from services.testbed.natsserver import NatsServer
from shared.bus.append import fenced_append
from shared.bus.connect import Bus
from shared.bus.provision import StreamsConfig, provision
from shared.bus.read import _reply_seqs
from shared.bus.retry import BACKOFF_MAX_S, Retry, backoff_delay
from shared.fence.keys import Key
from shared.subjects import Subjects


@given(st.integers(min_value=0, max_value=10_000))
def test_backoff_delay_bounded(attempt: int) -> None:
    d = backoff_delay(attempt)
    assert 0 < d <= BACKOFF_MAX_S


async def test_retry_respects_attempts_and_budget() -> None:
    r = Retry(max_attempts=4, budget_s=60)
    assert [await r.backoff() for _ in range(5)] == [True, True, True, False, False]
    start = time.monotonic()
    r = Retry(max_attempts=1000, budget_s=0.3)
    while await r.backoff():
        pass
    assert time.monotonic() - start < 0.3 + 0.2


@given(
    st.integers(min_value=1, max_value=2**63),
    st.integers(min_value=0, max_value=2**63),
    st.sampled_from(["v1", "v2", "v2r"]),
)
def test_reply_seqs(seq: int, pending: int, layout: str) -> None:
    if layout == "v1":
        reply = f"$JS.ACK.VMFENCE_IN.c1.1.{seq}.{pending + 1}.1700000000000000000.{pending}"
    else:
        reply = f"$JS.ACK._.ACCHASH.VMFENCE_IN.c1.1.{seq}.{pending + 1}.1700000000000000000.{pending}"
        if layout == "v2r":
            reply += ".rnd"
    assert _reply_seqs(reply) == (seq, pending + 1)  # stream and consumer sequence


async def test_bus_open_close(nats_server: NatsServer) -> None:
    b = await Bus.open(nats_server.url, name="misc", max_reconnect_attempts=3)
    try:
        assert b.subjects == Subjects()
        assert b.nc.is_connected
        await provision(b.js, b.subjects, StreamsConfig())
        seq = await fenced_append(
            b.js,
            b.subjects.log(Key("pod", "ns", "x")),
            b"1",
            expected_last_subject_seq=0,
            msg_id="x1",
            stream=b.subjects.stream_log,
        )
        assert seq == 1
    finally:
        await b.close()
    assert b.nc.is_closed
    await b.close()  # idempotent


async def test_bench_sync_append_rate(provisioned: JetStreamContext, subjects: Subjects) -> None:
    """Benchmark-style: fenced appends awaited one at a time (one key); prints the rate."""
    js = provisioned
    subj = subjects.log(Key("pod", "bench", "k"))
    n = 2000
    last = 0
    t0 = time.perf_counter()
    for i in range(n):
        last = await fenced_append(
            js, subj, b"d" * 64, expected_last_subject_seq=last, msg_id=f"b{i}", stream=subjects.stream_log
        )
    rate = n / (time.perf_counter() - t0)
    print(f"\nsync fenced_append (R1, file, one key): {rate:,.0f} appends/s")
    assert last == n
