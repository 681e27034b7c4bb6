"""A stored log entry that does not decode (bit rot, a bad restore, a forged append by an identity
that may write the log) quarantines its key, and only its key: the reconciler stays up and ready,
every other key of the partition is still decided, the broken key decides nothing (rule 12), its
inputs are dead-lettered with the reason, and the metrics count it (issue 10)."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import msgspec
import pytest
from prometheus_client import REGISTRY

from services.reconciler.config import ReconcilerConfig
from services.reconciler.kube import NullGateway
from services.reconciler.partition import Partition
from services.reconciler.service import Reconciler
from services.testbed.natsserver import NatsServer
from shared.bus.connect import Bus
from shared.bus.read import StoredMsg, read_stream
from shared.fence.keys import Key
from shared.fence.schema import Admitted, Commanded, LogEntry, Spec, decode_entry, encode
from tests.reconciler.helpers import heartbeat, observe, wait_until


def _reconciler(url: str, data_dir: Path, gateway: NullGateway) -> Reconciler:
    cfg = ReconcilerConfig(nats_url=[url], id="rec-q", partitions=1, data_dir=str(data_dir), kube="none",
                           http_port=0, lease_ttl_s=3.0)
    return Reconciler(cfg, gateway=gateway, health=False)


def _undecodable() -> float:
    return REGISTRY.get_sample_value("vmfence_log_undecodable_total") or 0.0


def _quarantined_gauge() -> float | None:
    return REGISTRY.get_sample_value("vmfence_quarantined_keys", {"partition": "0"})


async def _dead(bus: Bus) -> list[StoredMsg]:
    return [m async for m in read_stream(bus.js, bus.subjects.stream_dlq)]


def _decided(part: Partition, key: Key) -> bool:
    slot = part.keys.get(str(key))
    return slot is not None and slot.state.cur is not None and slot.state.cur.host != ""


async def _entries(bus: Bus) -> list[tuple[int, LogEntry]]:
    """The log's entries that decode (the test's garbage left out)."""
    out = []
    async for m in read_stream(bus.js, bus.subjects.stream_log, bus.subjects.log_all):
        try:
            out.append((m.seq, decode_entry(m.data)))
        except msgspec.DecodeError:
            pass
    return out


async def _garbage(bus: Bus, key: Key, data: bytes) -> int:
    """Append a message to ``key``'s log subject as an unrestricted identity; its stream sequence."""
    ack = await bus.js.publish(bus.subjects.log(key), data, stream=bus.subjects.stream_log)
    return ack.seq


async def test_an_undecodable_log_entry_quarantines_only_its_key_before_and_after_the_load(
    bus: Bus, nats_server: NatsServer, tmp_path: Path
) -> None:
    await heartbeat(bus, "host-a")
    gateway = NullGateway()
    broken, forged, probe, later = (Key("pod", "default", n) for n in ("broken", "forged", "probe", "later"))
    for i, k in enumerate((broken, forged, probe, later)):
        gateway.objects[str(k)] = (f"uid-{i}", 1, Spec())
    undecodable_before = _undecodable()

    # a first reconciler decides two keys, then stops (its snapshot is kept in data_dir)
    first = _reconciler(nats_server.url, tmp_path, gateway)
    async with asyncio.TaskGroup() as tg:
        run = tg.create_task(first.run())
        await asyncio.wait_for(first.ready.wait(), 30)
        await observe(bus, broken, "uid-0", 1)
        await observe(bus, forged, "uid-1", 1)
        await wait_until(lambda: _decided(first.partitions[0], broken) and _decided(first.partitions[0], forged),
                         "the first two keys placed")
        first.stop()
        await run

    # before the next load: bytes that are no entry, and a valid entry of another key on forged's subject
    bad_seq = await _garbage(bus, broken, b"\x00\xffbit rot")
    other = LogEntry(str(probe), 1, [], input="forged", writer="intruder")
    await _garbage(bus, forged, encode(other))

    second = _reconciler(nats_server.url, tmp_path, gateway)
    writes_before = len(gateway.last_writes)
    async with asyncio.TaskGroup() as tg:
        run = tg.create_task(second.run())
        await asyncio.wait_for(second.ready.wait(), 30)  # the load did not crash the process
        part = second.partitions[0]
        assert set(part.quarantined) == {str(broken), str(forged)}
        assert part.quarantined[str(broken)].seq == bad_seq
        assert str(broken) not in part.keys and second.effects is not None and second.effects.halted(str(broken))
        assert _undecodable() == undecodable_before + 2, "each undecodable entry is counted once"
        assert _quarantined_gauge() == 2

        # every other key goes on; the quarantined keys' inputs are dead-lettered with the reason
        await observe(bus, broken, "uid-0", 2)
        await observe(bus, probe, "uid-2", 1)
        await wait_until(lambda: _decided(part, probe), "the probe key placed")
        await wait_until(lambda: part.stats["dead_lettered"] >= 1, "the quarantined key's dead letter")
        (dead,) = await _dead(bus)
        reason = (dead.headers or {}).get("Vmfence-Reason", "")
        assert reason.startswith("quarantined key") and f"stream sequence {bad_seq}" in reason, reason

        # after the load: a forged append to a key this reconciler holds and has decided
        await observe(bus, later, "uid-3", 1)
        await wait_until(lambda: _decided(part, later), "the later key placed")
        later_seq = await _garbage(bus, later, b'{"key": "default/later", "n": "not a number"}')
        await wait_until(lambda: str(later) in part.quarantined, "the later key's quarantine by the log tail")
        assert part.quarantined[str(later)].seq == later_seq
        assert _quarantined_gauge() == 3 and _undecodable() == undecodable_before + 3
        assert second.ready.is_set() and part.held, "still up, still holding the partition"
        await observe(bus, later, "uid-3", 2)
        await wait_until(lambda: part.stats["dead_lettered"] >= 2, "the later key's dead letter")

        # the broken keys decided nothing and wrote nothing to Kubernetes after their bad entry
        entries = await _entries(bus)
        after = [(seq, e.key) for seq, e in entries if seq > bad_seq and e.writer == second.writer]
        assert {k for _, k in after} >= {str(probe)}
        assert not [k for seq, k in after if k in (str(broken), str(forged))]
        assert not [k for seq, k in after if k == str(later) and seq > later_seq]
        written = [str(k) for k, _ in list(gateway.last_writes)[writes_before:]]
        assert str(broken) not in written and str(forged) not in written
        probe_decisions = [type(d) for _, e in entries if e.key == str(probe) for d in e.decisions]
        assert Admitted in probe_decisions and Commanded in probe_decisions, "admitted and its VM commanded"

        # an operator removes the bad entry: the next re-check loads the key again
        await bus.js.delete_msg(bus.subjects.stream_log, later_seq)
        assert await part.recheck_quarantined() == [str(later)]
        assert str(later) in part.keys and part.keys[str(later)].state.cur is not None
        assert not second.effects.halted(str(later)) and _quarantined_gauge() == 2

        second.stop()
        await run
    # the gauge reads every partition object of this process: other tests' partitions (held, never
    # stopped: they had no lease) report partition 0 until they are collected
    gc.collect()
    assert not part.held
    assert _quarantined_gauge() is None, "a partition no longer held reports nothing"


def test_a_garbage_entry_is_no_entry_of_any_key() -> None:
    """What ``Partition._entry`` refuses, without a bus."""
    from services.reconciler.partition import Undecodable
    from shared.subjects import Subjects

    class _Bare(Partition):
        def __init__(self) -> None:
            self.subjects = Subjects(partitions=1)

    part, key = _Bare(), Key("pod", "default", "web.v1")
    subject = part.subjects.log(key)
    ok = encode(LogEntry(str(key), 1, []))
    assert part._entry(1, subject, ok).key == str(key)
    for data, why in (
        (b"\xff", "does not decode"),
        (encode(LogEntry("default/other", 1, [])), "an entry of key"),
        (msgspec.json.encode({"key": str(key), "n": 1, "decisions": [], "v": 99}), "schema version 99"),
    ):
        with pytest.raises(Undecodable) as info:
            part._entry(7, subject, data)
        assert info.value.key == str(key) and info.value.seq == 7 and why in info.value.reason
    # a subject no key's reader reads (a key of another partition under this one's prefix) is nobody's
    with pytest.raises(Undecodable) as info:
        part._entry(8, "vmfence.log.0.x", b"\xff")
    assert info.value.key == ""
