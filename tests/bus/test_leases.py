"""PartitionLease: KV create / CAS renew / CAS release, and expiry by the bucket TTL."""

from __future__ import annotations

import asyncio
import time

import nats.js.errors
import pytest
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from shared.bus.leases import LeaseLost, PartitionLease
from shared.subjects import Subjects

from .conftest import LEASE_TTL_S

EXPIRY_DEADLINE_S = LEASE_TTL_S + 8.0
POLL_S = 0.1


@pytest.fixture
async def kv(provisioned: JetStreamContext, subjects: Subjects) -> KeyValue:
    return await provisioned.key_value(subjects.kv_leases)


async def test_acquire_renew_release(kv: KeyValue) -> None:
    a = PartitionLease(kv, 3, "reconciler-a")
    b = PartitionLease(kv, 3, "reconciler-b")
    r1 = await a.acquire()
    assert r1 is not None
    holder = await a.holder()
    assert holder is not None and holder[0].owner == "reconciler-a" and holder[1] == r1
    assert holder[0].expires_hint > time.time() - 1  # informational only
    assert await b.acquire() is None
    r2 = await a.renew(r1)
    assert r2 > r1 and a.revision == r2
    assert await b.acquire() is None
    assert await a.release() is True
    assert await a.holder() is None
    rb = await b.acquire()
    assert rb is not None


async def test_stale_revision_is_lost(kv: KeyValue) -> None:
    a = PartitionLease(kv, 1, "a")
    r1 = await a.acquire()
    assert r1 is not None
    r2 = await a.renew()
    with pytest.raises(LeaseLost):
        await a.renew(r1)
    assert a.revision is None
    # A release with a stale revision touches nothing.
    assert await a.release(r1) is False
    holder = await a.holder()
    assert holder is not None and holder[1] == r2


async def test_cas_loss_between_two_holders(kv: KeyValue) -> None:
    """Someone wrote the key behind a's back: a's next renew and release both fail."""
    a = PartitionLease(kv, 2, "a")
    assert await a.acquire() is not None
    # Simulate another writer (e.g. an operator force-moving the partition).
    holder = await a.holder()
    assert holder is not None
    await kv.update("2", b'{"owner":"b","expires_hint":0}', last=holder[1])
    with pytest.raises(LeaseLost):
        await a.renew()
    assert await a.release(holder[1]) is False
    still = await a.holder()
    assert still is not None and still[0].owner == "b"


async def test_same_owner_reacquires(kv: KeyValue) -> None:
    """A restarted process with the same owner id takes its own lease back (new revision)."""
    first = PartitionLease(kv, 4, "a")
    r1 = await first.acquire()
    again = PartitionLease(kv, 4, "a")
    r2 = await again.acquire()
    assert r1 is not None and r2 is not None and r2 > r1
    with pytest.raises(LeaseLost):
        await first.renew()


async def test_racing_acquire_one_winner(kv: KeyValue) -> None:
    leases = [PartitionLease(kv, "fleet", f"owner-{i}") for i in range(6)]
    revs = await asyncio.gather(*(lease.acquire() for lease in leases))
    assert sum(r is not None for r in revs) == 1


async def wait_acquire(lease: PartitionLease, deadline_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < deadline_s:
        if await lease.acquire() is not None:
            return time.monotonic() - start
        await asyncio.sleep(POLL_S)  # waiting on a server-side TTL: nothing to subscribe to
    raise AssertionError(f"lease not acquirable within {deadline_s}s")


async def test_expiry_lets_another_owner_take_it(kv: KeyValue) -> None:
    a = PartitionLease(kv, 5, "a")
    b = PartitionLease(kv, 5, "b")
    assert await a.acquire() is not None
    assert await b.acquire() is None
    waited = await wait_acquire(b, EXPIRY_DEADLINE_S)
    print(f"lease expired and was taken over after {waited:.2f}s (ttl {LEASE_TTL_S}s)")
    with pytest.raises(LeaseLost):
        await a.renew()
    assert await a.release() is False


async def test_renewal_keeps_lease_past_ttl(kv: KeyValue) -> None:
    a = PartitionLease(kv, 6, "a")
    b = PartitionLease(kv, 6, "b")
    assert await a.acquire() is not None
    renew_every = LEASE_TTL_S / 5
    end = time.monotonic() + 2 * LEASE_TTL_S
    while time.monotonic() < end:
        await asyncio.sleep(renew_every)
        await a.renew()
        assert await b.acquire() is None
    assert await a.release() is True


class _ExpiresDuringCreate:
    """A real bucket whose first create loses the race with the bucket's max_age: nats-py's create
    found the key taken, re-read it, and the entry had expired meanwhile (KeyNotFoundError)."""

    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv
        self.raised = 0

    async def create(self, key: str, value: bytes) -> int:
        if not self.raised:
            self.raised += 1
            raise nats.js.errors.KeyNotFoundError
        return await self._kv.create(key, value)

    def __getattr__(self, name: str) -> object:
        return getattr(self._kv, name)


async def test_a_lease_that_expires_inside_create_is_taken_not_raised(kv: KeyValue) -> None:
    racing = _ExpiresDuringCreate(kv)
    lease = PartitionLease(racing, 11, "b")  # type: ignore[arg-type]
    rev = await lease.acquire()
    assert racing.raised == 1 and rev is not None and lease.revision == rev
    holder = await lease.holder()
    assert holder is not None and holder[0].owner == "b"


async def test_a_renewal_whose_answer_was_lost_does_not_keep_the_lease_from_a_release(kv: KeyValue) -> None:
    """A shutdown cancels the lease rounds, maybe after a renewal was sent and before its answer
    came: the entry still names us, at a revision this object never saw. Releasing what it holds
    releases that revision, so the partition is free now, not when the TTL expires it."""
    a = PartitionLease(kv, 9, "a")
    r1 = await a.acquire()
    assert r1 is not None
    r2 = await kv.update("9", a._value(), last=r1)  # the renewal applied; its answer never read
    assert a.revision == r1 != r2
    assert await a.release() is True
    assert await a.holder() is None
    # someone else's entry is never released that way
    b = PartitionLease(kv, 10, "b")
    rb = await b.acquire()
    assert rb is not None
    await kv.update("10", b'{"owner":"c","expires_hint":0}', last=rb)
    assert await b.release() is False
    held = await b.holder()
    assert held is not None and held[0].owner == "c"
