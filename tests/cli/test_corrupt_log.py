"""A stored entry that does not decode (bit rot, a bad restore, a forged append) is a violation the
audit names at its position — not a traceback — and the entries after it are still audited."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from services.testbed.natsserver import NatsServer
from shared.bus.connect import Bus
from shared.fence.keys import Key
from shared.subjects import Subjects
from tests.cli.test_replay import _make_log, vmfence


async def test_an_undecodable_entry_is_a_violation_and_reading_goes_on(nats_server: NatsServer,
                                                                        tmp_path: Path) -> None:
    await _make_log(nats_server.url, tmp_path)
    subjects = Subjects()
    bus = await Bus.open(nats_server.url, name="test", subjects=subjects)
    try:
        ack = await bus.js.publish(subjects.log(Key("pod", "shop", "cart.0")), b"\x00not an entry",
                                   stream=subjects.stream_log)
    finally:
        await bus.close()
    out = await asyncio.to_thread(vmfence, "replay", "--nats-url", nats_server.url, "--json", "--not-final")
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    report = json.loads(out.stdout)
    bad = [v for v in report["violations"] if v["rule"] == "undecodable_entry"]
    assert len(bad) == 1 and bad[0]["seq"] == ack.seq and bad[0]["key"] == "shop/cart.0"
    assert report["entries"] == ack.seq  # every entry read, the broken one counted
    decode = {c["name"]: c for c in report["invariants"]}["entries_decode"]
    assert decode["violations"] == 1 and decode["positions"] == report["entries"]
    listed = await asyncio.to_thread(vmfence, "decisions", "--nats-url", nats_server.url, "--key", "shop/cart.0")
    assert listed.returncode == 0 and "Traceback" not in listed.stderr
    assert any(line.split()[:1] == [str(ack.seq)] and "UNDECODABLE" in line for line in listed.stdout.splitlines())
