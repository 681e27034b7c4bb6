"""A reconciler whose JetStream answers are lost while it starts waits for them (not ready, no exit)
and becomes ready when they come back; SIGTERM during that wait ends it cleanly."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlparse

import pytest

from services.reconciler.config import ReconcilerConfig
from services.reconciler.kube import NullGateway
from services.reconciler.service import Reconciler, StoppedDuringStartup
from services.testbed.chaos.busfaults import CALM, BusProxy, Weather
from services.testbed.natsserver import NatsServer
from shared.bus import retry as bus_retry

LOST = Weather(api_response_lost=1.0, publish_response_lost=1.0)


@pytest.fixture
async def proxy(nats_server: NatsServer) -> AsyncIterator[BusProxy]:
    u = urlparse(nats_server.url)
    p = BusProxy("reconciler", (u.hostname or "127.0.0.1", u.port or 4222))
    await p.start()
    yield p
    await p.stop()


def _reconciler(url: str, tmp_path: Path) -> Reconciler:
    cfg = ReconcilerConfig(nats_url=[url], id="startup", partitions=2, data_dir=str(tmp_path), kube="none")
    return Reconciler(cfg, gateway=NullGateway(), health=False)


async def test_lost_answers_at_start_are_waited_out_not_fatal(
    proxy: BusProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bus_retry.Retry.__init__, "__defaults__", (2, 0.1))  # provisioning gives up fast
    lost = asyncio.Event()
    proxy.on_fault = lambda component, kind: lost.set() if proxy.counts["api_response_lost"] >= 2 else None
    proxy.set_weather(1, LOST)
    rec = _reconciler(proxy.url, tmp_path)
    run = asyncio.create_task(rec.run())
    await asyncio.wait_for(lost.wait(), 60)  # provisioning has failed at least once by now
    assert not run.done() and not rec.ready.is_set()
    proxy.set_weather(1, CALM)
    await asyncio.wait_for(rec.ready.wait(), 60)
    rec.stop()
    await asyncio.wait_for(run, 30)


async def test_sigterm_while_waiting_for_jetstream_ends_the_reconciler(proxy: BusProxy, tmp_path: Path) -> None:
    lost = asyncio.Event()
    proxy.on_fault = lambda component, kind: lost.set()
    proxy.set_weather(2, LOST)
    rec = _reconciler(proxy.url, tmp_path)
    run = asyncio.create_task(rec.run())
    await asyncio.wait_for(lost.wait(), 60)
    rec.stop()
    with pytest.raises(StoppedDuringStartup):
        await asyncio.wait_for(run, 5)  # at once: not after the step's request timeouts
