"""The client-boundary fault proxy against a real nats-server, and what the bus does about its faults:
a read that loses deliveries still yields every message once; a publish whose answer is lost is
retried and deduplicated; a lost ack is redelivered; a replay after the dedupe window is stored again."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator
from urllib.parse import urlparse

import pytest
from nats.js import JetStreamContext

from services.testbed.chaos.busfaults import BusProxy, Weather
from services.testbed.natsserver import NatsServer
from shared.bus import read as bus_read
from shared.bus import retry as bus_retry
from shared.bus.append import publish_input
from shared.bus.connect import Bus
from shared.bus.provision import StreamsConfig, provision
from shared.bus.read import read_stream
from shared.fence.keys import Key
from shared.subjects import Subjects

IN = "VMFENCE_IN"
FAULTED: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)  # fault kind -> it happened


@pytest.fixture
async def proxy(nats_server: NatsServer) -> AsyncIterator[BusProxy]:
    u = urlparse(nats_server.url)
    p = BusProxy("test", (u.hostname or "127.0.0.1", u.port or 4222))
    p.on_fault = lambda component, kind: FAULTED[kind].set()
    FAULTED.clear()
    await p.start()
    yield p
    await p.stop()


@pytest.fixture
async def through(proxy: BusProxy) -> AsyncIterator[Bus]:
    b = await Bus.open(proxy.url, name="through-proxy", subjects=Subjects())
    await provision(b.js, b.subjects, StreamsConfig(duplicate_window_s=1.0))
    yield b
    await b.close()


async def _fill(js: JetStreamContext, subjects: Subjects, n: int) -> None:
    for i in range(n):
        await js.publish(subjects.observation(Key("pod", "default", f"p{i % 7}")), str(i).encode())


async def test_a_read_that_loses_deliveries_still_yields_every_message_once_in_order(
    proxy: BusProxy, through: Bus
) -> None:
    await _fill(through.js, through.subjects, 300)
    proxy.set_weather(1, Weather(delivery_lost=0.05))
    got = [m.seq async for m in read_stream(through.js, IN, batch=32)]
    assert proxy.counts["delivery_lost"] > 0, "nothing was dropped; the test proves nothing"
    assert got == list(range(1, 301))


async def test_a_read_whose_last_deliveries_are_lost_still_ends_with_every_message(
    proxy: BusProxy, through: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lost delivery is seen as a gap in consumer sequences only when a later one arrives. The
    last ones of a read have none after them: their pull request expires unfilled, and the
    consumer's own count of deliveries shows they were sent (it hung, re-pulling forever)."""
    await _fill(through.js, through.subjects, 12)
    monkeypatch.setattr(bus_read, "READ_TIMEOUT_S", 0.5)  # pull expiries come sooner
    monkeypatch.setattr(bus_retry.Retry.__init__, "__defaults__", (200, 60.0))
    proxy.set_weather(3, Weather(delivery_lost=0.5))
    got = [m.seq async for m in read_stream(through.js, IN, batch=4)]
    assert got == list(range(1, 13))
    assert proxy.counts["delivery_lost"] > 0


async def test_a_long_read_that_loses_deliveries_late_still_yields_every_message(
    proxy: BusProxy, through: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gap-restart budget is per stretch without progress, not per read: a replay that runs
    longer than one budget and then meets a gap reads on."""
    await _fill(through.js, through.subjects, 200)
    monkeypatch.setattr(bus_retry.Retry.__init__, "__defaults__", (60, 0.2))
    proxy.set_weather(4, Weather(delivery_lost=0.03))
    got = []
    async for m in read_stream(through.js, IN, batch=16):
        got.append(m.seq)
        await asyncio.sleep(0.003)  # a slow reader: the read outlasts the budget
    assert proxy.counts["delivery_lost"] > 0, "nothing was dropped; the test proves nothing"
    assert got == list(range(1, 201))


async def test_a_publish_whose_answer_is_lost_is_retried_and_stored_once(proxy: BusProxy, through: Bus) -> None:
    key = Key("pod", "default", "lost-answer")
    proxy.set_weather(2, Weather(publish_response_lost=1.0))
    subject = through.subjects.observation(key)
    task = asyncio.create_task(publish_input(through.js, subject, b"x", msg_id="obs-1", timeout=0.25))
    await asyncio.wait_for(FAULTED["publish_response_lost"].wait(), 10)
    proxy.set_weather(2, Weather())  # the retry's answer gets through
    await asyncio.wait_for(task, 30)
    stored = [m async for m in read_stream(through.js, IN, through.subjects.observation(key))]
    assert len(stored) == 1


async def test_a_publish_replayed_after_the_dedupe_window_is_stored_again(proxy: BusProxy, through: Bus) -> None:
    key = Key("pod", "default", "replayed")
    proxy.set_weather(3, Weather(publish_replayed=1.0, replay_after_s=(1.5, 1.5)))
    await publish_input(through.js, through.subjects.observation(key), b"x", msg_id="obs-2")
    proxy.set_weather(3, Weather())
    await asyncio.wait_for(FAULTED["publish_replayed"].wait(), 10)
    await through.nc.flush()
    stored = [m async for m in read_stream(through.js, IN, through.subjects.observation(key))]
    assert [m.headers.get("Nats-Msg-Id") for m in stored] == ["obs-2", "obs-2"]


async def test_a_cut_refuses_the_component_then_lets_it_back(proxy: BusProxy, through: Bus) -> None:
    proxy.cut(1.0)
    assert proxy.counts["bus_cut"] == 1
    key = Key("pod", "default", "after-cut")
    subject = through.subjects.observation(key)
    await asyncio.wait_for(publish_input(through.js, subject, b"y", msg_id="obs-3", timeout=1.0), 30)
    stored = [m async for m in read_stream(through.js, IN, through.subjects.observation(key))]
    assert len(stored) == 1
