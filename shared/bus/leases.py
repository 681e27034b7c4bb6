"""Partition leases in the vmfence_leases KV bucket: acquire, renew by revision CAS, release."""

from __future__ import annotations

import time

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from shared.bus.wire import ERR_IN_FLIGHT_PROPOSAL, ERR_WRONG_LAST_SEQUENCE

LEASE_ACQUIRE_ATTEMPTS = 4  # create/get/update races inside one acquire()



class LeaseLost(Exception):
    """The lease's revision CAS failed: someone else holds it, or it expired."""


class LeaseValue(msgspec.Struct, frozen=True):
    """What a lease entry holds. expires_hint is informational only: the KV revision is the fence."""

    owner: str
    expires_hint: float


_lease_encoder = msgspec.json.Encoder()
_lease_decoder = msgspec.json.Decoder(LeaseValue)


class PartitionLease:
    """One partition's lease in the leases bucket: KV create / CAS-update / CAS-delete.

    The bucket's TTL (max_age) expires a lease that is not renewed; each renew writes a new message
    and so restarts its age. Owner ids must be unique per process incarnation: acquire() lets an
    owner re-take an entry that carries its own id.
    """

    def __init__(self, kv: KeyValue, partition: int | str, owner: str, *, ttl_hint_s: float = 10.0) -> None:
        self.kv = kv
        self.key = str(partition)
        self.owner = owner
        self.ttl_hint_s = ttl_hint_s
        self.revision: int | None = None

    def _value(self) -> bytes:
        return _lease_encoder.encode(LeaseValue(owner=self.owner, expires_hint=time.time() + self.ttl_hint_s))

    async def holder(self) -> tuple[LeaseValue, int] | None:
        """Current holder and revision, or None when free (never written, deleted or expired)."""
        try:
            entry = await self.kv.get(self.key)
        except nats.js.errors.KeyNotFoundError:
            return None
        if entry.value is None or entry.revision is None:
            return None
        return _lease_decoder.decode(entry.value), entry.revision

    async def acquire(self) -> int | None:
        """Take the lease if free (or already ours); the new revision, or None if held by another."""
        for _ in range(LEASE_ACQUIRE_ATTEMPTS):
            try:
                rev = int(await self.kv.create(self.key, self._value()))
                self.revision = rev
                return rev
            except nats.js.errors.KeyWrongLastSequenceError:
                pass
            except nats.js.errors.KeyNotFoundError:
                # the client's create re-reads a key it found taken; the bucket's max_age may expire
                # it between that write and that read: the lease is free, so try create again
                continue
            current = await self.holder()
            if current is None:
                continue  # expired or deleted between create and get: try create again
            value, rev = current
            if value.owner != self.owner:
                self.revision = None
                return None
            try:
                new_rev = int(await self.kv.update(self.key, self._value(), last=rev))
            except nats.js.errors.KeyWrongLastSequenceError:
                continue
            self.revision = new_rev
            return new_rev
        self.revision = None
        return None

    async def renew(self, revision: int | None = None) -> int:
        """CAS-update from revision (default: the last one this object saw); LeaseLost if stale."""
        last = self.revision if revision is None else revision
        if not last:
            raise LeaseLost(f"lease {self.key}: not held")
        try:
            rev = int(await self.kv.update(self.key, self._value(), last=last))
        except nats.js.errors.KeyWrongLastSequenceError as exc:
            self.revision = None
            raise LeaseLost(f"lease {self.key} lost (revision {last} is no longer current)") from exc
        self.revision = rev
        return rev

    async def release(self, revision: int | None = None) -> bool:
        """CAS-delete; False if the lease was already lost (then nothing is touched).

        Releasing what this object holds (no ``revision`` given): a renewal cancelled after it was
        sent (a shutdown cancels the lease rounds) may have moved the revision on without our
        knowing. The entry then still names us at a newer revision, and that one is released
        instead; left alone it kept the partition from everyone until the TTL (10 s of a rolling
        restart's stall in the fleet bench). An explicit ``revision`` is released or nothing is."""
        last = self.revision if revision is None else revision
        if not last:
            return False
        if await self._delete_at(last):
            return True
        if revision is None:
            current = await self.holder()
            if current is not None and current[0].owner == self.owner and current[1] != last:
                return await self._delete_at(current[1])  # ours, renewed behind our back
        return False

    async def _delete_at(self, revision: int) -> bool:
        """CAS-delete at ``revision``; False when that is no longer the entry's revision."""
        try:
            await self.kv.delete(self.key, last=revision)
        except nats.js.errors.APIError as exc:
            if exc.err_code not in (ERR_WRONG_LAST_SEQUENCE, *ERR_IN_FLIGHT_PROPOSAL):
                raise
            self.revision = None
            return False
        self.revision = None
        return True
