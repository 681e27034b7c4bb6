"""The partition's key table: one ``KeySlot`` per key, small while the key is idle.

A reconciler holds every key of its partitions, and almost all of them are idle (bound or gone,
nothing in flight), so what an idle key costs is what the reconciler costs. An idle slot keeps its
state only as packed bytes — ``encode_state`` deflated against a preset dictionary that already
holds the field names and shape of a typical state (~120 B instead of ~1.9 KiB of live objects) —
and has no lock; the next access to ``state`` unpacks it (~3 µs; packing ~8 µs). Packed bytes
live only in memory: snapshots get plain ``encode_state`` bytes.

Keys with effects still out (waiting for an agent's result or a Kubernetes write) stay unpacked:
their next input is coming, and packing at every input cost ~13 % of ``vmfence bench decisions``
(packing only idle keys: within noise). In a burst most keys are in that state at once, which is
what bounds the reconciler's memory right after a burst (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import zlib
from dataclasses import dataclass
from typing import Any

from shared.fence.schema import Fence, PodStatusIntent, Spec
from shared.fence.state import Incarnation, KeyState, VMRec, decode_state, encode_state


def _typical_state() -> KeyState:
    """A bound key as a reconciler holds thousands of: only the shape matters (the dictionary)."""
    key = "namespace/pod-name-0"
    fence = Fence(key, "01234567-89ab-cdef-0123-456789abcdef", 1)
    vm_id = "pod-name-0-01234567-1"
    status = PodStatusIntent("Running", ready=True, vm_id=vm_id, host="host-a", ip="10.0.0.1", vnc_port=5900)
    cur = Incarnation(
        fence, Spec(), rv=1, phase="Running", vm_id=vm_id, bound=True, host="host-a", ip="10.0.0.1",
        vnc_port=5900, gen=1, ready=True, status=status, admitted_at=1,
    )  # fmt: skip
    return KeyState(
        key=key, n=1, epoch=1, admitted_rv=1, cur=cur, vms={vm_id: VMRec(vm_id, "host-a", fence, "running")}
    )


_ZDICT = encode_state(_typical_state())
_WBITS = -15  # raw deflate: no header or checksum (the bytes never leave this process)


def pack_state(s: KeyState) -> bytes:
    c = zlib.compressobj(6, zlib.DEFLATED, _WBITS, zdict=_ZDICT)
    return c.compress(encode_state(s)) + c.flush()


def unpack_encoded(packed: bytes) -> bytes:
    """The ``encode_state`` bytes a slot was packed from."""
    d = zlib.decompressobj(_WBITS, zdict=_ZDICT)
    return d.decompress(packed) + d.flush()


@dataclass(slots=True)
class KeySlot:
    """One key of a partition. While nothing of the key is in flight (no input being handled or
    waiting for its lock, an empty outbox: no command, write, confirm or timer pending) it holds
    its state packed and no lock; ``state`` unpacks it on the next access."""

    _state: KeyState | None
    last_seq: int = 0  # stream sequence of the key's last log entry (0: none)
    dirty: bool = False
    _lock: asyncio.Lock | None = None  # only while inputs of the key are in flight
    # inputs waiting for the lock, each with the future its handler awaits: whoever takes the lock
    # decides all of them into one entry (Partition._decide_waiting); None while none waits
    waiting: list[Any] | None = None
    _packed: bytes | None = None  # pack_state of the state while the key is idle
    # completions folded into ``state`` but not logged yet (KeyWriter._defer): they go first in the
    # key's next entry. ``deferred_base`` is pack_state of the state the log holds (what a snapshot
    # saves and a re-read starts from); both None while nothing is deferred
    deferred: list[Any] | None = None
    deferred_base: bytes | None = None

    @property
    def state(self) -> KeyState:
        s = self._state
        if s is None:
            assert self._packed is not None
            s = self._state = decode_state(unpack_encoded(self._packed))
            self._packed = None
        return s

    @state.setter
    def state(self, value: KeyState) -> None:
        self._state, self._packed = value, None

    @property
    def packed(self) -> bool:
        return self._packed is not None

    def peek(self) -> KeyState:
        """The state without unpacking the slot: a decoded copy while packed (never mutate it)."""
        if self._state is not None:
            return self._state
        assert self._packed is not None
        return decode_state(unpack_encoded(self._packed))

    def encoded(self) -> bytes:
        """``encode_state`` of the state, without unpacking the slot."""
        if self.deferred_base is not None:
            return unpack_encoded(self.deferred_base)  # what the log holds, not what is deferred
        if self._packed is not None:
            return unpack_encoded(self._packed)
        return encode_state(self.state)

    @property
    def lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def busy(self) -> bool:
        """An input of the key is being decided or waits to be (its state may be copied now)."""
        lock = self._lock
        return bool(self.waiting) or (lock is not None and (lock.locked() or bool(getattr(lock, "_waiters", None))))

    def release_idle(self) -> None:
        """Drop the lock and pack the state if nothing of the key is in flight any more. Called
        by the partition after an input is handled (the lock released) and before consuming."""
        lock = self._lock
        if lock is not None:
            if lock.locked() or getattr(lock, "_waiters", None) or self.waiting:
                return
            self._lock = None
        s = self._state
        if s is not None and not s.outbox:
            self._packed, self._state = pack_state(s), None
