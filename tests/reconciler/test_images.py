"""Partition images (services/reconciler/images.py): a reconciler that takes partitions another one
handed over loads that one's image instead of the log since its own snapshot, on a real nats-server;
an image that is not one to use is ignored as a whole, and the log is read instead."""

from __future__ import annotations

import asyncio
import zlib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from services.reconciler.config import ReconcilerConfig
from services.reconciler.images import (
    ImageRefused,
    ImageStore,
    PartitionImage,
    decode_image,
    encode_image,
)
from services.reconciler.kube import NullGateway
from services.reconciler.service import Reconciler
from services.testbed.natsserver import NatsServer
from shared.bus.connect import Bus
from shared.fence.keys import Key
from shared.fence.schema import Spec
from shared.fence.state import KeyState, encode_state
from shared.subjects import Subjects
from tests.reconciler.helpers import log_entries, observe, per_key, wait_until

P = 2
KEYS = [Key("pod", "default", f"web-{i}") for i in range(24)]


def _reconciler(server: NatsServer, tmp_path: Path, name: str) -> Reconciler:
    cfg = ReconcilerConfig(nats_url=[server.url], partitions=P, id=name, data_dir=str(tmp_path / name),
                           kube="none", http_port=0, image_interval_s=0.0)
    gateway = NullGateway()
    for i, key in enumerate(KEYS):
        gateway.objects[str(key)] = (f"uid-{i}", 1, Spec())
    return Reconciler(cfg, gateway=gateway, health=False)


def _keys_with_entries(rec: Reconciler) -> int:
    return sum(1 for part in rec.partitions.values() for slot in part.keys.values() if slot.peek().n >= 1)


async def _handed_over(server: NatsServer, tmp_path: Path, *, between: Any = None) -> Reconciler:
    """``KEYS`` observed and logged by one reconciler, which then stops (a hand-over); ``between``
    runs on the bus after it stopped; the second reconciler returned holds every partition."""
    first = _reconciler(server, tmp_path, "rec-a")
    bus = await Bus.open([server.url], name="test-images", subjects=Subjects(partitions=P))
    try:
        async with asyncio.TaskGroup() as tg:
            run = tg.create_task(first.run())
            await asyncio.wait_for(first.ready.wait(), 30)
            await wait_until(lambda: len(first.partitions) == P, "the first reconciler holding every partition")
            for i, key in enumerate(KEYS):
                await observe(bus, key, f"uid-{i}", 1)
            await wait_until(lambda: _keys_with_entries(first) == len(KEYS), "every key logged")
            first.stop()
            await run
        if between is not None:
            await between(bus)
    finally:
        await bus.close()
    second = _reconciler(server, tmp_path, "rec-b")  # a data dir of its own: no snapshot of these
    return second


async def _loaded(rec: Reconciler, check: Any) -> None:
    async with asyncio.TaskGroup() as tg:
        tg.create_task(rec.run())
        await asyncio.wait_for(rec.ready.wait(), 30)
        await wait_until(lambda: len(rec.partitions) == P, "the second reconciler holding every partition")
        try:
            await check(rec)
        finally:
            rec.stop()


async def _entries_per_key(server: NatsServer) -> dict[str, int]:
    bus = await Bus.open([server.url], name="test-images-read", subjects=Subjects(partitions=P))
    try:
        return {key: len(entries) for key, entries in per_key(await log_entries(bus)).items()}
    finally:
        await bus.close()


async def test_the_next_owner_loads_the_image_not_the_log(nats_server: NatsServer, tmp_path: Path) -> None:
    second = await _handed_over(nats_server, tmp_path)
    logged = await _entries_per_key(nats_server)

    async def check(rec: Reconciler) -> None:
        for part in rec.partitions.values():
            assert part.stats["from_image"] == 1, f"partition {part.p} was not loaded from its image"
            assert part.stats["caught_up"] == 0, f"partition {part.p} read {part.stats['caught_up']} entries"
        held = {key: slot.peek().n for part in rec.partitions.values() for key, slot in part.keys.items()}
        assert held == logged, "the image's rows are not the log's"

    await _loaded(second, check)


async def test_a_snapshot_written_after_a_load_from_an_image_holds_every_row(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """A snapshot saves the rows that changed; rows loaded from an image changed nowhere in its
    file. After a take from an image the next flush writes them all, so a restart from that
    snapshot (its watermark as high as the image's, so the image is not used) knows every key."""
    second = await _handed_over(nats_server, tmp_path)
    logged = await _entries_per_key(nats_server)

    async def from_image(rec: Reconciler) -> None:
        assert all(part.stats["from_image"] == 1 for part in rec.partitions.values())

    await _loaded(second, from_image)  # stops cleanly: its snapshot flushed, its image put again

    async def from_snapshot(rec: Reconciler) -> None:
        assert all(part.stats["from_image"] == 0 for part in rec.partitions.values())
        held = {key: slot.peek().n for part in rec.partitions.values() for key, slot in part.keys.items()}
        assert held == logged, "keys loaded from the image were missing from the snapshot"

    await _loaded(_reconciler(nats_server, tmp_path, "rec-b"), from_snapshot)


async def test_an_image_that_is_not_one_is_ignored_and_the_log_read(nats_server: NatsServer, tmp_path: Path) -> None:
    subjects = Subjects(partitions=P)

    async def forge(bus: Bus) -> None:
        await bus.js.publish(subjects.image(0), b"not an image at all")

    second = await _handed_over(nats_server, tmp_path, between=forge)
    logged = await _entries_per_key(nats_server)
    in_zero = sum(n for key, n in logged.items() if subjects.partition(key) == 0)

    async def check(rec: Reconciler) -> None:
        forged, kept = rec.partitions[0], rec.partitions[1]
        assert forged.stats["from_image"] == 0 and forged.stats["caught_up"] == in_zero
        assert kept.stats["from_image"] == 1
        held = {key: slot.peek().n for part in rec.partitions.values() for key, slot in part.keys.items()}
        assert held == logged

    await _loaded(second, check)


# --------------------------------------------------------------------------- what is refused
SUBJECTS = Subjects(partitions=P)
KEY = "default/web-0"
KEY_P = SUBJECTS.partition(KEY)


def _image(**changes: Any) -> PartitionImage:
    fields: dict[str, Any] = {"stream": "s1", "partition": KEY_P, "watermark": 9, "writer": "w",
                              "rows": [(KEY, 5, encode_state(KeyState(key=KEY)))]}
    return PartitionImage(**(fields | changes))


def _rows(data: bytes) -> tuple[int, dict[str, tuple[KeyState, int]]]:
    store = ImageStore(None, SUBJECTS, stream_identity="s1", writer="w")  # type: ignore[arg-type]
    return store._rows(KEY_P, decode_image(data))


def test_an_image_reads_back_as_it_was_put() -> None:
    watermark, rows = _rows(encode_image(_image()))
    assert watermark == 9 and rows[KEY][1] == 5 and rows[KEY][0].key == KEY


other_key = next(k for k in (f"default/web-{i}" for i in range(100)) if SUBJECTS.partition(k) != KEY_P)


@pytest.mark.parametrize(("data", "why"), [
    (b"garbage", "not compressed"),
    (encode_image(_image())[:-4], "truncated"),
    (zlib.compress(b"\x00" * 4096), "undecodable"),
    (encode_image(_image(v=2)), "schema 2"),
    (encode_image(_image(stream="s0")), "another stream"),
    (encode_image(_image(partition=KEY_P + 1)), "of partition"),
    (encode_image(_image(rows=[(other_key, 5, encode_state(KeyState(key=other_key)))])), "not in partition"),
    (encode_image(_image(rows=[(KEY, 5, encode_state(KeyState(key="default/else")))])), "another key's"),
    (encode_image(_image(rows=[(KEY, 5, b"\xc1")])), "row"),
    (encode_image(_image(rows=[("no-slash", 5, b"")])), "row"),
], ids=["garbage", "truncated", "not-msgpack", "newer-schema", "other-stream", "other-partition",
        "row-of-another-partition", "row-of-another-key", "undecodable-state", "not-a-key"])
def test_what_is_not_an_image_to_use_is_refused(data: bytes, why: str) -> None:
    with pytest.raises(ImageRefused, match=why):
        _rows(data)


def test_an_image_larger_than_the_bound_decompressed_is_refused_unread() -> None:
    data = encode_image(_image(writer="w" * 10_000))
    assert len(data) < 1_000
    with pytest.raises(ImageRefused, match="larger than"):
        decode_image(data, max_bytes=5_000)
    assert msgspec.msgpack.decode(zlib.decompress(data))["writer"] == "w" * 10_000
