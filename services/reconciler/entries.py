"""How an input becomes its key's next log entry: decide, one fenced append, fold, then the
effects — the write path of ``Partition`` (``services/reconciler/partition.py``), which owns the
consuming, loading, the log tail and quarantine around it.

Inputs of one key that queue for its lock while its entry is being appended are decided together
into the next entry (a group commit of the key's log). A lost append race re-reads the key and
decides again; a re-read that lost entries the writer had folded rebuilds the key (``Rebuilt``).

The completion of a status write that succeeded decides only ``Done``: it is folded at
once but logged first in the key's next entry, or alone after ``done_linger_s`` (``_defer``). Two of
a pod's ~10 entries were such completions. Until it is logged, a crash or a lost race leaves the
write in the outbox of the log, and it is made again (rule 11: a write is idempotent).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from services.reconciler import metrics
from services.reconciler.effects import EffectRunner
from services.reconciler.inventory import InventoryIndex
from services.reconciler.keytable import KeySlot, pack_state, unpack_encoded
from services.reconciler.kube import KubeUnavailable
from shared.bus.append import LostRace, fenced_append
from shared.fence.decide import DecideEnv, decide, rebuild
from shared.fence.keys import Key
from shared.fence.schema import (
    MAX_ENTRY_BYTES,
    Commanded,
    ConfirmRequested,
    Decision,
    Done,
    Input,
    Inventoried,
    LogEntry,
    Placed,
    Rebuilt,
    Skipped,
    TimerArmed,
    WriteDone,
    WriteRequested,
    decision_name,
    encode,
    entry_msg_id,
)
from shared.fence.state import Effect, KeyState, decode_state, encode_state, fold_all
from shared.subjects import Subjects

log = logging.getLogger("services.reconciler.partition")  # one logger for the partition's lines

MAX_RACE_RETRIES = 8  # lost races on one input before giving up (and not acking it)
DEFERRABLE_VERBS = frozenset({"status"})  # writes whose completion may wait (events never enter the outbox)
MAX_DEFERRED = 8  # completions one key holds before they are logged with the next that comes
CONFIRM_INLINE_TIMEOUT_S = 5.0


class EntryTooLarge(Exception):
    """The log entry of an input's decisions exceeds MAX_ENTRY_BYTES: it can never be appended."""


def input_kind(inp: Input) -> str:
    return type(inp).__struct_config__.tag  # type: ignore[return-value]


class KeyWriter:
    """The write path, as a base of ``Partition``: what it uses of the partition is declared here."""

    p: int
    js: JetStreamContext
    subjects: Subjects
    writer: str
    effects: EffectRunner
    keys: dict[str, KeySlot]
    held: bool
    quarantined: dict[str, Any]
    stats: Counter[str]
    inventory: InventoryIndex
    confirm: Callable[..., Any] | None
    env: Callable[[], DecideEnv]
    on_placed: Callable[[str, int, int], None]
    _max_seen: int
    _inflight_floors: Counter[int]
    done_linger_s: float  # 0: every completion is logged at once
    _deferred_keys: dict[str, float]  # keys with deferred completions -> when the first was (monotonic)

    async def _behind(self, slot: KeySlot) -> bool:
        raise NotImplementedError

    async def _reload(self, slot: KeySlot, full: bool = False) -> int | None:
        raise NotImplementedError

    async def _dead_letter(self, msg: Msg, reason: str) -> None:
        raise NotImplementedError

    async def _decide_waiting(self, slot: KeySlot, inp: Input, msg: Msg | None) -> bool:
        """Decide ``inp`` under the key's lock, together with every input that waited for the lock
        meanwhile: while one entry of a key is being appended, the key's next inputs queue, and
        whoever takes the lock next decides all of them in order into one entry (a group commit of
        the key's log: one append, one fold, the same decisions in the same order as one entry per
        input would hold). True: decided (ack it); False: not (the key is not ours, or quarantined)."""
        waiting = _Waiting(inp, msg, asyncio.get_running_loop().create_future())
        if slot.waiting is None:
            slot.waiting = []
        slot.waiting.append(waiting)
        async with slot.lock:
            if not waiting.done.done():
                batch, slot.waiting = slot.waiting, None
                try:
                    if not self.held or slot.state.key in self.quarantined:
                        outcome = [False] * len(batch)
                    elif len(batch) == 1:
                        outcome = [await self._process(slot, inp, msg)]
                    else:
                        outcome = await self._process_together(slot, batch)
                except BaseException:
                    # this handler answers its own input; the others are decided again by whoever
                    # takes the lock next (as a redelivery would be: decide drops what is done)
                    rest = [w for w in batch if w is not waiting and not w.done.done()]
                    if rest:
                        slot.waiting = rest + (slot.waiting or [])
                    raise
                for w, ok in zip(batch, outcome, strict=True):
                    if not w.done.done():
                        w.done.set_result(ok)
        return waiting.done.result()

    async def _process_together(self, slot: KeySlot, batch: list[_Waiting]) -> list[bool]:
        """Several inputs of one key as one entry (see ``_decide_waiting``). Anything unusual — a
        batch that decides nothing, an entry too large, the partition lost — is handled one input
        at a time by ``_process``, as if they had arrived apart."""
        key = slot.state.key
        for _ in range(MAX_RACE_RETRIES):
            work, env = copy_state(slot.state), self.env()
            decisions: list[Decision] = []
            kinds: list[str] = []
            for w in batch:
                ds = decide(work, w.inp, env)
                if self.confirm is not None and len(ds) == 1 and isinstance(ds[0], ConfirmRequested):
                    ds = await self._confirm_inline(work, ds)
                fold_all(work, ds)
                decisions.extend(ds)
                kinds.append(input_kind(w.inp) if ds else "")
            if not decisions or not self.held:
                break
            try:
                await self._append(slot, decisions, "; ".join(k for k in kinds if k)[:1000])
            except EntryTooLarge:
                break
            except LostRace as race:
                await self._lost_race(slot, race)
                continue
            for w, k in zip(batch, kinds, strict=True):
                metrics.INPUTS.labels(input_kind(w.inp), "decided" if k else "dropped").inc()
                if not k:
                    self.stats["dropped"] += 1
            self.stats["entries"] += 1
            self.stats["decisions"] += len(decisions)
            self.stats["grouped"] += len(batch)
            self._after_append(key, decisions)
            return [True] * len(batch)
        return [await self._process(slot, w.inp, w.msg) for w in batch]

    async def _process(self, slot: KeySlot, inp: Input, msg: Msg | None) -> bool:
        kind = input_kind(inp)
        key = slot.state.key
        for _ in range(MAX_RACE_RETRIES):
            decisions = decide(slot.state, inp, self.env())
            if self.confirm is not None and len(decisions) == 1 and isinstance(decisions[0], ConfirmRequested):
                decisions = await self._confirm_inline(slot.state, decisions)
            if not decisions:
                if msg is not None and not isinstance(inp, Inventoried) and await self._behind(slot):
                    continue  # another writer moved the key on: decide again on what it wrote
                metrics.INPUTS.labels(kind, "dropped").inc()
                self.stats["dropped"] += 1
                return True
            if not self.held:
                return False
            if msg is None and self._deferrable(slot, inp, decisions):
                self._defer(slot, decisions)
                metrics.INPUTS.labels(kind, "deferred").inc()
                return True
            try:
                await self._append(slot, decisions, kind)
            except EntryTooLarge as big:
                # never appendable, so never retried: parked with its reason, and the key goes on
                log.error("input's entry too large; not decided: %s", big, extra={"key": key, "partition": self.p})
                metrics.INPUTS.labels(kind, "too_large").inc()
                self.stats["too_large"] += 1
                if msg is None:
                    return True  # an outcome of ours: its effect stays in the outbox (re-derived)
                await self._dead_letter(msg, f"entry too large: {big}")
                return False  # acked by the dead letter
            except LostRace as race:
                await self._lost_race(slot, race)
                continue
            metrics.INPUTS.labels(kind, "decided").inc()
            self.stats["entries"] += 1
            self.stats["decisions"] += len(decisions)
            self._after_append(key, decisions)
            return True
        log.error("gave up after %d lost races", MAX_RACE_RETRIES, extra={"key": key})
        return False

    async def _lost_race(self, slot: KeySlot, race: LostRace) -> None:
        """Another writer appended to the key first: re-read it (the whole log if ours is no longer
        a prefix of it) and rebuild when the re-read lost entries we had folded; the caller decides
        again on what is there now."""
        metrics.LOST_RACES.inc()
        self.stats["lost_races"] += 1
        log.info("lost append race; re-reading key", extra={"key": slot.state.key, "partition": self.p})
        full = race.actual_last_seq is None or race.actual_last_seq < slot.last_seq
        known = copy_state(slot.state)
        if lost_folded(known, await self._reload(slot, full=full)):
            await self._rebuild(slot, known)  # submits the rebuilt key's outbox
        else:
            # the re-read may have folded another writer's entries (whose effects die with it) or
            # our own whose append answer was lost (stored, never folded; the log tail skips our
            # own entries): deciding the input again then decides nothing, and nobody else would
            # send what they owe
            self._owe(slot)

    def _owe(self, slot: KeySlot) -> None:
        """Carry out the key's outbox: effects decided but maybe never carried out (a crash, a
        handover, a lifted quarantine, a re-read of entries this writer had not folded). Effects
        are idempotent (command ids, msg ids), so what was already sent is only sent again."""
        if slot.state.outbox and slot.state.key not in self.quarantined:
            self.effects.submit_all(slot.state.key, list(slot.state.outbox.values()))

    def _deferrable(self, slot: KeySlot, inp: Input, decisions: list[Decision]) -> bool:
        """A write of ours that succeeded, whose completion decides nothing but ``Done``."""
        if self.done_linger_s <= 0 or not isinstance(inp, WriteDone) or inp.outcome != "ok":
            return False
        if len(slot.deferred or ()) + len(decisions) > MAX_DEFERRED:
            return False
        outbox = slot.state.outbox
        for d in decisions:
            if not isinstance(d, Done):
                return False
            eff = outbox.get(d.effect_id)
            if not isinstance(eff, WriteRequested) or eff.write.verb not in DEFERRABLE_VERBS:
                return False
        return True

    def _defer(self, slot: KeySlot, decisions: list[Decision]) -> None:
        """Fold completions now and log them first in the key's next entry (see the module doc)."""
        if slot.deferred is None:
            slot.deferred_base, slot.deferred = pack_state(slot.state), []
            self._deferred_keys[slot.state.key] = time.monotonic()
        fold_all(slot.state, decisions)
        slot.deferred.extend(decisions)
        self.stats["deferred"] += len(decisions)

    def _drop_deferred(self, slot: KeySlot) -> None:
        """Back to the state the log holds: the deferred writes are in its outbox again."""
        if slot.deferred_base is not None:
            slot.state = decode_state(unpack_encoded(slot.deferred_base))
        slot.deferred = slot.deferred_base = None
        self._deferred_keys.pop(slot.state.key, None)

    async def flush_deferred(self, *, older_than_s: float | None = None) -> int:
        """Log the deferred completions alone: of keys whose first waited ``older_than_s`` (default
        ``done_linger_s``), or of every key (0: before the partition is handed over). Returns how
        many keys were written."""
        age = self.done_linger_s if older_than_s is None else older_than_s
        now, due = time.monotonic(), []
        for key, since in self._deferred_keys.items():  # in the order they were deferred
            if now - since < age:
                break
            due.append(key)
        written = 0
        for key in due:
            slot = self.keys.get(key)
            if slot is None:
                self._deferred_keys.pop(key, None)
                continue
            async with slot.lock:
                if not self.held or not slot.deferred:
                    continue
                try:
                    await self._append(slot, [], "write_done")
                    written += 1
                except LostRace as race:
                    await self._lost_race(slot, race)
                except EntryTooLarge:  # cannot be (a few Done), but never wedge the loop on it
                    self._drop_deferred(slot)
                    self._owe(slot)
            slot.release_idle()
        return written

    async def _append(self, slot: KeySlot, decisions: list[Decision], kind: str) -> None:
        """One fenced append of the key's next entry, then fold it (LostRace: nothing changed).
        While it is in flight its floor holds the snapshot watermark below its sequence. Deferred
        completions of the key go first in it (already folded)."""
        key = slot.state.key
        deferred = slot.deferred or []
        logged = deferred + decisions if deferred else decisions
        # the wall-clock time is for people reading the log (rule 12: no decision depends on it)
        label = f"write_done; {kind}"[:1000] if deferred and kind != "write_done" else kind
        entry = LogEntry(key, slot.state.n + 1, logged, input=label, writer=self.writer, at=time.time())
        payload = encode(entry)
        if len(payload) > MAX_ENTRY_BYTES:
            raise EntryTooLarge(f"{len(payload)} bytes, above the bound of {MAX_ENTRY_BYTES}")
        floor = self._max_seen
        self._inflight_floors[floor] += 1
        start = time.perf_counter()
        try:
            seq = await fenced_append(
                self.js,
                self.subjects.log(key_of(key)),
                payload,
                expected_last_subject_seq=slot.last_seq,
                msg_id=entry_msg_id(key, entry.n, self.writer, payload),
                stream=self.subjects.stream_log,
            )
        except nats.errors.MaxPayloadError as exc:  # a server configured below MAX_ENTRY_BYTES
            raise EntryTooLarge(f"{len(payload)} bytes, refused by the server: {exc}") from exc
        finally:
            self._inflight_floors[floor] -= 1
            if self._inflight_floors[floor] <= 0:
                del self._inflight_floors[floor]
        metrics.APPEND_SECONDS.observe(time.perf_counter() - start)
        fold_all(slot.state, decisions)
        if deferred:
            slot.deferred = slot.deferred_base = None
            self._deferred_keys.pop(key, None)
            for d in deferred:
                metrics.DECISIONS.labels(decision_name(d)).inc()
            self.stats["decisions"] += len(deferred)
        slot.state.n, slot.last_seq, slot.dirty = entry.n, seq, True
        self._max_seen = max(self._max_seen, seq)
        self.inventory.index(key, slot.state)

    async def _rebuild(self, slot: KeySlot, known: KeyState) -> None:
        """The log holds less than this writer had folded (its tail was lost, e.g. restored from an
        older copy): say so in the log, lift the epoch above all it knew, survey every host before
        any VM is made, and carry out what the re-read outbox still owes."""
        key = slot.state.key
        log.error(
            "log of key is behind what this writer had folded (%d < %d entries): rebuilding",
            slot.state.n, known.n, extra={"key": key, "partition": self.p},
        )
        metrics.POD_LIFECYCLE.labels("rebuild", "started", "log_tail_lost").inc()
        decisions = rebuild(slot.state, known.epoch, self.env(), f"log tail lost: {known.n - slot.state.n} entries")
        try:
            await self._append(slot, decisions, "rebuild")
        except LostRace:
            await self._reload(slot, full=True)
            return
        self._owe(slot)

    async def _confirm_inline(self, state: KeyState, decisions: list[Decision]) -> list[Decision]:
        """Carry out a lone consistent read before appending, and append the request, its answer
        and what follows as one entry: the same decisions in the same order as two entries would
        hold, one append and no outbox round trip. A failed read leaves the request to the outbox."""
        req = decisions[0]
        assert isinstance(req, ConfirmRequested) and self.confirm is not None
        if self.effects.reads_silent:
            # the API server is not answering: the read goes to the outbox (parked there, holding
            # no worker, tried again when it answers) rather than hold this input, and the inputs
            # of other keys behind it, for the read's timeout
            return decisions
        try:
            async with asyncio.timeout(CONFIRM_INLINE_TIMEOUT_S):  # no task per read, as wait_for makes
                read = await self.confirm(key_of(state.key), req.request)
        except Exception as exc:
            log.info("inline confirm failed (%r); leaving it to the outbox", exc, extra={"key": state.key})
            if isinstance(exc, KubeUnavailable | TimeoutError):
                self.effects.read_answered(False, state.key)
            return decisions
        self.effects.read_answered(True, state.key)
        after = fold_all(copy_state(state), decisions)
        return decisions + decide(after, read, self.env())

    def _after_append(self, key: str, decisions: list) -> None:  # type: ignore[type-arg]
        effects: list[Effect] = []
        for d in decisions:
            name = decision_name(d)
            metrics.DECISIONS.labels(name).inc()
            match d:
                case Skipped(reason=reason):
                    metrics.POD_LIFECYCLE.labels("input", "skipped", reason).inc()
                case Placed(host=host):
                    cur = self.keys[key].state.cur
                    if cur is not None:
                        self.on_placed(host, cur.spec.cpus, cur.spec.memory_mib)
                    metrics.POD_LIFECYCLE.labels("place", "ok", "").inc()
                case Commanded() | ConfirmRequested() | WriteRequested() | TimerArmed():
                    effects.append(d)
                case Done(effect_id=eid):
                    effects = [e for e in effects if not (isinstance(e, ConfirmRequested) and e.request == eid)]
                case Rebuilt(reason=reason):
                    # decide saw an agent hold an epoch of the key above its log's: a cut nobody saw
                    log.error("log of key lost entries no reconciler saw: rebuilding (%s)", reason,
                              extra={"key": key, "partition": self.p})
                    metrics.POD_LIFECYCLE.labels("rebuild", "started", "agent_epoch_ahead").inc()
                case _:
                    pass
        if effects:
            self.effects.submit_all(key, effects)

def lost_folded(known: KeyState, floor: int | None) -> bool:
    """A re-read log (``floor`` from ``_reload``) lost entries this writer had folded, and no
    ``Rebuilt`` in it already accounts for every epoch the writer knew."""
    return floor is not None and known.n > 0 and floor < known.epoch


@dataclass(slots=True)
class _Waiting:
    """An input waiting for its key's lock (``KeySlot.waiting``), and its handler's answer."""

    inp: Input
    msg: Msg | None
    done: asyncio.Future[bool]


def key_of(text: str) -> Key:
    return Key.parse(text)


def copy_state(state: KeyState) -> KeyState:
    return decode_state(encode_state(state))
