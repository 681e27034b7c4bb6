"""Two reconcilers share the partitions: one that joins below its share runs short lease rounds
while the membership settles (so what the other hands back is taken at once, not at its next
round), and neither polls so once each holds its share. On a real nats-server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats.errors
import pytest

from services.reconciler.config import ReconcilerConfig
from services.reconciler.kube import NullGateway
from services.reconciler.service import SETTLING_ROUND_S, Reconciler
from services.testbed.natsserver import NatsServer
from tests.reconciler.helpers import wait_until

P = 4
LEASE_TTL_S = 3.0  # rounds a second apart: the hand-over happens within the test


def _reconciler(server: NatsServer, tmp_path: Path, name: str) -> Reconciler:
    cfg = ReconcilerConfig(nats_url=[server.url], partitions=P, id=name, data_dir=str(tmp_path / name),
                           kube="none", http_port=0, lease_ttl_s=LEASE_TTL_S)
    return Reconciler(cfg, gateway=NullGateway(), health=False)


async def test_a_joining_reconciler_settles_in_short_rounds_then_stops(nats_server: NatsServer, tmp_path: Path) -> None:
    first, second = _reconciler(nats_server, tmp_path, "rec-a"), _reconciler(nats_server, tmp_path, "rec-b")
    async with asyncio.TaskGroup() as tg:
        tg.create_task(first.run())
        await asyncio.wait_for(first.ready.wait(), 30)
        await wait_until(lambda: len(first.partitions) == P, "the first reconciler holding every partition")
        tg.create_task(second.run())
        await asyncio.wait_for(second.ready.wait(), 30)
        # its first round saw two members and nothing free (unless the first handed back in
        # between, a few milliseconds of a second): below its share, in short rounds
        now = asyncio.get_running_loop().time()
        if len(second.partitions) < P // 2:
            assert second._short_until > now, "below its share, it waits a whole round for what is handed back"
        assert SETTLING_ROUND_S < LEASE_TTL_S / 3
        await wait_until(lambda: len(first.partitions) == len(second.partitions) == P // 2, "an even share", 15)
        await wait_until(lambda: first._short_until == second._short_until == 0.0,
                         "both back to rounds a third of the TTL apart", 5)
        first.stop()
        second.stop()


async def test_what_a_stopping_reconciler_hands_back_is_taken_at_once_not_at_the_next_round(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """A reconciler stopped on purpose releases its leases and leaves; the other, at its share and
    in rounds a third of the TTL apart, sees the deletions on the leases bucket and takes every
    partition at once. With rounds 10 s apart here, the next round would be far too late."""
    ttl_s = 30.0
    cfgs = [ReconcilerConfig(nats_url=[nats_server.url], partitions=P, id=name, data_dir=str(tmp_path / name),
                             kube="none", http_port=0, lease_ttl_s=ttl_s) for name in ("rec-a", "rec-b")]
    first, second = (Reconciler(cfg, gateway=NullGateway(), health=False) for cfg in cfgs)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(first.run())
        await asyncio.wait_for(first.ready.wait(), 30)
        second_run = tg.create_task(second.run())
        await asyncio.wait_for(second.ready.wait(), 30)
        # the first hands half back at its next round: the joiner takes it in its short rounds
        await wait_until(lambda: len(first.partitions) == len(second.partitions) == P // 2, "an even share", 25)
        await wait_until(lambda: first._short_until == 0.0, "the first back to rounds ttl/3 apart", 5)
        second.stop()
        await second_run
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await wait_until(lambda: len(first.partitions) == P, "the first holding every partition", 5)
        assert loop.time() - t0 < ttl_s / 3 / 2, "taken at the next round, not when they were handed back"
        first.stop()


async def test_a_partition_whose_load_fails_is_handed_back_and_taken_again(
    nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Partitions are loaded side by side; one whose load the bus fails is not kept (a lease held
    with no partition running would be renewed forever while its inputs wait): its lease goes back,
    the others load on, and a later round takes it."""
    from services.reconciler.partition import Partition

    load = Partition.load
    failed: list[int] = []

    async def flaky(self: Partition) -> None:
        if self.p == 1 and not failed:
            failed.append(self.p)
            raise nats.errors.TimeoutError
        await load(self)

    monkeypatch.setattr(Partition, "load", flaky)
    rec = _reconciler(nats_server, tmp_path, "rec-a")
    async with asyncio.TaskGroup() as tg:
        tg.create_task(rec.run())
        await asyncio.wait_for(rec.ready.wait(), 30)
        assert failed == [1]
        await wait_until(lambda: set(rec._tasks) == set(range(P)) == set(rec.partitions),
                         "every partition running, the one that failed too", 10)
        rec.stop()
