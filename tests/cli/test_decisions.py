"""`vmfence decisions` and the async iterator behind it: filters by key and namespace, JSON lines,
and following the log live."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

from services.testbed.natsserver import NatsServer
from shared.bus.connect import Bus
from shared.bus.logstream import Filter, follow_log
from shared.subjects import Subjects
from tests.cli.test_replay import _make_log, vmfence


async def test_decisions_filters_and_follow(nats_server: NatsServer, tmp_path: Path) -> None:
    await _make_log(nats_server.url, tmp_path)
    out = await asyncio.to_thread(vmfence, "decisions", "--nats", nats_server.url, "--key", "shop/cart.3", "--json")
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert records and {r["entry"]["key"] for r in records} == {"shop/cart.3"}
    assert [r["entry"]["n"] for r in records] == list(range(1, len(records) + 1))
    out = await asyncio.to_thread(vmfence, "decisions", "--nats", nats_server.url, "--namespace", "nope", "--json")
    assert out.returncode == 0 and out.stdout == ""
    # following: stored entries from the start, in order, for every key of the namespace
    bus = await Bus.open(nats_server.url, name="test", subjects=Subjects())
    seen: list[str] = []
    async with contextlib.aclosing(follow_log(bus.js, bus.subjects, Filter(namespace="shop"), start_seq=1)) as live:
        async for rec in live:
            seen.append(rec.entry.key)
            if len(seen) >= 8:
                break
    assert set(seen) <= {f"shop/cart.{i}" for i in range(8)} and len(seen) == 8
    await bus.close()
