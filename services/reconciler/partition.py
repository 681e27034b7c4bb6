"""One owned partition: its keys' states, its input consumer, and the fenced appends to the log.

Inputs of one key are handled strictly in stream order (a FIFO lock per key); different keys run
concurrently up to ``MAX_INFLIGHT``. Appends for one key are awaited one at a time; a lost race
means someone else wrote the key's log: re-read it, re-fold, decide again (rule 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from services.reconciler import metrics
from services.reconciler.effects import EffectRunner
from services.reconciler.entries import KeyWriter, input_kind, key_of, lost_folded
from services.reconciler.images import ImageStore
from services.reconciler.inventory import InventoryIndex
from services.reconciler.keytable import KeySlot
from services.reconciler.snapshot import SnapshotStore
from services.reconciler.verification import REFUSAL_REDELIVERY_S, PartitionVerifier
from shared.bus.deadletter import dead_letter
from shared.bus.read import last_on_subject, read_stream, read_subject
from shared.bus.wire import H_MSG_ID
from shared.fence.decide import DecideEnv
from shared.fence.keys import Key
from shared.fence.schema import (
    ABSENT,
    MAX_INPUT_BYTES,
    SCHEMA_VERSION,
    CommandResult,
    ConfirmedRead,
    Input,
    Inventoried,
    LogEntry,
    Rebuilt,
    UnknownVersion,
    decode_entry,
    decode_input,
)
from shared.fence.state import KeyState, fold_all
from shared.subjects import Subjects
from shared.tasks import cancel_and_wait

log = logging.getLogger(__name__)

MAX_INFLIGHT = 1024  # inputs being handled at once in one partition
DONE_LINGER_S = 30.0  # a write's completion waits this long for its key's next entry (entries.py)
FETCH_TIMEOUT_S = 1.0
STOP_SETTLE_S = 0.5  # beyond its last fetch, for a partition handed over to stop deciding by itself
CONSUMER_RESTART_S = 0.5
H_TRUNCATED = "Vmfence-Truncated"  # on a dead letter cut to MAX_INPUT_BYTES: the original's length


# A bound VM that no inventory round of its live host has named for this long is inspected (a
# re-check, rule 12: only the agent's not_found takes the VM-gone path). Three rounds at the agent's
# default interval (60 s): the backstop for a partition that sees no other VM of that host, so never
# sees its rounds complete.
INVENTORY_STALE_S = 180.0
INVENTORY_SWEEP_S = 30.0
# A quarantined key's log is read again this often: once an operator has removed the entry that
# does not decode (docs/operations.md#vmfencekeyquarantined), the key is loaded and goes on.
QUARANTINE_RECHECK_S = INVENTORY_SWEEP_S


class Undecodable(Exception):
    """A stored message on a key's log subject that is no entry of that key: it does not decode
    (bit rot, a bad restore, a forged append), is of a schema version this reader does not know, or
    names another key. The key's state is unknown from there on (rule 12)."""

    def __init__(self, key: str, seq: int, reason: str) -> None:
        super().__init__(f"log entry at stream sequence {seq}: {reason}")
        self.key, self.seq, self.reason = key, seq, reason


@dataclass(frozen=True, slots=True)
class Quarantine:
    """Why a key decides nothing: the stream sequence of the entry that could not be read, and why."""

    seq: int
    reason: str


class Partition(KeyWriter, PartitionVerifier):
    def __init__(
        self,
        p: int,
        *,
        js: JetStreamContext,
        subjects: Subjects,
        writer: str,
        effects: EffectRunner,
        snapshots: SnapshotStore | None,
        env: Callable[[], DecideEnv],
        images: ImageStore | None = None,
        on_placed: Callable[[str, int, int], None] = lambda host, cpus, mib: None,
        confirm: Callable[[Key, str], Awaitable[ConfirmedRead]] | None = None,
        ack_wait_s: float = 10.0,
        max_ack_pending: int = 4096,
        fetch_batch: int = 256,
        inventory_stale_s: float = INVENTORY_STALE_S,
        gen: int = 0,
        done_linger_s: float = DONE_LINGER_S,
    ) -> None:
        self.p = p
        self.done_linger_s = done_linger_s
        self._deferred_keys: dict[str, float] = {}
        # this writer's generation of the partition (its lease's revision when taken): every command
        # it sends carries it, and hosts it verified refuse what an older generation sent
        self.gen = gen
        self.verified: set[str] = set()  # live hosts that answered our PartitionVerify at ``gen``
        self._named: set[str] = set()  # keys those hosts said they have a VM of
        self._asked: dict[str, float] = {}  # host -> when it was last asked (loop time)
        # inputs of keys first seen before the partition was verified, in arrival order, held until
        # it is (or until ``_hold_until``, loop time; 0: nothing is held) -- see NEW_KEY_HOLD_S
        self._held_inputs: dict[str, list[tuple[Input, Msg]]] = {}
        # inputs fetched and not yet answered (acked, nak'd or dead-lettered), by identity: what
        # ``hand_back`` returns to the stream when the partition goes
        self._unanswered: dict[int, Msg] = {}
        self._hold_until = 0.0
        self._verified_now = asyncio.Event()
        # keys slotted unverified only because the partition was not verified yet (named by no host)
        self._early: set[str] = set()
        self.js = js
        self.subjects = subjects
        self.writer = writer
        self.effects = effects
        self.snapshots = snapshots
        self.images = images
        self._snapshot_whole = False  # the next flush writes every row (the load came from an image)
        self.env = env
        self.on_placed = on_placed
        self.confirm = confirm
        self.ack_wait_s = ack_wait_s
        self.max_ack_pending = max_ack_pending
        self.fetch_batch = fetch_batch
        self.keys: dict[str, KeySlot] = {}
        self._loaded = False  # keys first seen after load() start unverified (KeyState.unverified)
        self.held = True  # cleared the moment the lease is lost: no append after that
        self._max_seen = 0  # highest log sequence this partition has folded
        self._inflight_floors: Counter[int] = Counter()
        self.stats: Counter[str] = Counter()
        self.inventory = InventoryIndex()  # what the log binds where, against the hosts' rounds
        self.inventory_stale_s = inventory_stale_s
        # keys whose log holds an entry that is no entry of theirs: nothing is decided, commanded or
        # written for them (rule 12: their state is unknown), their inputs are dead-lettered
        self.quarantined: dict[str, Quarantine] = {}
        metrics.QUARANTINED_KEYS.watch(self)

    def __hash__(self) -> int:  # held in the gauge's WeakSet by identity
        return id(self)

    # ------------------------------------------------------------------------- quarantine
    def _entry(self, seq: int, subject: str, data: bytes, key: str | None = None) -> LogEntry:
        """The log entry stored at ``seq`` on ``subject`` (the log subject of ``key``, when the
        caller knows it); ``Undecodable`` for anything else. The subject, not the entry's own
        ``key`` field, says whose log a message is in: that is what a key's reader reads."""
        if key is None:
            try:
                owner = self.subjects.key_of_log_subject(subject)
            except ValueError:
                owner = None
            # a subject that is no key's log subject (bad tokens, or a key of another partition
            # under this one's prefix) is read by no key's reader: it belongs to nobody
            key = str(owner) if owner is not None and self.subjects.log(owner) == subject else ""
        try:
            entry = decode_entry(data)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # ValidationError is a DecodeError
            raise Undecodable(key, seq, f"does not decode: {exc}") from None
        if entry.v > SCHEMA_VERSION:
            raise Undecodable(key, seq, f"schema version {entry.v}; this reader reads 1..{SCHEMA_VERSION}")
        if entry.key != key:
            raise Undecodable(key, seq, f"an entry of key {entry.key[:200]!r} on the log subject of {key!r}")
        return entry

    async def _quarantine(self, bad: Undecodable) -> None:
        """Decide nothing more for the key (its state is unknown): forget its state and what it
        binds, carry out none of its effects, dead-letter its inputs; said once and counted."""
        if not bad.key:
            metrics.LOG_UNDECODABLE.inc()
            log.error("log entry on no key's log subject ignored: %s", bad, extra={"partition": self.p, "seq": bad.seq})
            return
        if bad.key in self.quarantined:
            return
        self.quarantined[bad.key] = Quarantine(bad.seq, bad.reason)
        self.keys.pop(bad.key, None)
        self.inventory.index(bad.key, KeyState(key=bad.key))  # what it bound is not known any more
        self.effects.halt(bad.key)
        self.stats["quarantined"] += 1
        metrics.LOG_UNDECODABLE.inc()
        log.error(
            "key quarantined: its log holds an entry it cannot read (seq %d: %s); nothing is decided "
            "for it until the entry is removed", bad.seq, bad.reason,
            extra={"key": bad.key, "partition": self.p, "seq": bad.seq},
        )
        if self.snapshots is not None:
            # a row would bring the key back at the next load without the log's say
            with contextlib.suppress(Exception):
                await self.snapshots.forget(bad.key)

    async def _quarantine_locked(self, bad: Undecodable) -> None:
        """``_quarantine`` once no input of the key is being handled (its slot's lock)."""
        slot = self.keys.get(bad.key)
        if slot is None:
            await self._quarantine(bad)
            return
        async with slot.lock:
            await self._quarantine(bad)

    async def recheck_quarantined(self) -> list[str]:
        """Read each quarantined key's log again from its start; a key whose log now reads (the
        entry was removed) is loaded as at a partition load — unverified, its outbox carried out.
        Returns the keys lifted."""
        lifted = []
        for key, why in list(self.quarantined.items()):
            if not self.held:
                break
            slot = KeySlot(KeyState(key=key, unverified=True))
            try:
                await self._reload(slot, full=True)
            except Undecodable as bad:
                if bad.seq != why.seq:
                    self.quarantined[key] = Quarantine(bad.seq, bad.reason)
                continue
            if self.quarantined.pop(key, None) is None:
                continue
            self.keys[key] = slot
            self.inventory.index(key, slot.state)
            self.effects.resume(key)
            log.warning("quarantine lifted: the key's log reads again (%d entries)", slot.state.n,
                        extra={"key": key, "partition": self.p})
            self._owe(slot)
            lifted.append(key)
        return lifted

    # ----------------------------------------------------------------------------- loading
    async def load(self) -> None:
        """Snapshot rows, then every log entry of this partition after the snapshot's watermark.

        A row is never trusted over the log: a row whose entries the log no longer holds (the log
        lost its tail, e.g. restored from an older copy) or whose positions the log fills with other
        entries is re-read from the log, and rebuilt if the log does not account for what it saw."""
        watermark = 0
        rows: dict[str, tuple[KeyState, int]] = {}
        unbacked: dict[str, KeyState] = {}  # rows the log does not back, with what they had seen
        if self.snapshots is not None:
            watermark, rows = await self.snapshots.load_partition(self.p)
        if self.images is not None:
            image = await self.images.get(self.p)
            if image is not None and image[0] > watermark:  # another writer's, further along than ours
                watermark, rows = image
                self.stats["from_image"] = 1
                self._snapshot_whole = True  # our file holds none of these rows yet
                metrics.PARTITION_IMAGES.labels("used").inc()
        for key, (state, seq) in rows.items():
            self.keys[key] = KeySlot(state, seq)
            self._max_seen = max(self._max_seen, seq)
        if rows:
            for key in await self._rows_ahead_of_log(rows):
                unbacked[key] = self.keys[key].state
        self._max_seen = max(self._max_seen, watermark)
        caught = 0
        async for msg in read_stream(
            self.js, self.subjects.stream_log, self.subjects.log_partition(self.p), start_seq=watermark + 1
        ):
            try:
                entry = self._entry(msg.seq, msg.subject, msg.data)
            except Undecodable as bad:
                await self._quarantine(bad)
                unbacked.pop(bad.key, None)
                continue
            if entry.key in unbacked or entry.key in self.quarantined:
                continue
            slot = self._slot(entry.key)
            if entry.n <= slot.state.n:
                if msg.seq > slot.last_seq:
                    unbacked[entry.key] = slot.state  # the row's positions hold other entries now
                continue
            if entry.n != slot.state.n + 1:
                log.error(
                    "gap in log: entry %d after %d; rebuilding key from its log", entry.n, slot.state.n,
                    extra={"key": entry.key, "partition": self.p},
                )
                try:
                    await self._reload(slot, full=True)
                except Undecodable as bad:
                    await self._quarantine(bad)
                continue
            fold_all(slot.state, entry.decisions)
            slot.state.n, slot.last_seq, slot.dirty = entry.n, msg.seq, True
            self._max_seen = max(self._max_seen, msg.seq)
            caught += 1
        self.stats["caught_up"] = caught
        source = "image" if self.stats["from_image"] else "snapshot" if watermark else "log"
        metrics.PARTITION_LOAD_ENTRIES.labels(source).inc(caught)
        for key, known in unbacked.items():
            slot = self.keys[key]
            try:
                floor = await self._reload(slot, full=True)
                if lost_folded(known, floor):
                    await self._rebuild(slot, known)  # submits the rebuilt key's outbox
            except Undecodable as bad:
                await self._quarantine(bad)
        # nothing loaded from the log shows whether it lost a tail before this load (no memory of
        # ours covers its end): every key surveys the hosts before the first VM it makes (_slot
        # does the same for keys first seen later: their whole log may have been lost) -- unless
        # the partition's verification vouches for it first (_verify_early_keys): no live host has
        # a VM of a key it did not name, and each refuses what an older writer sends
        for key, slot in self.keys.items():
            slot.state.unverified = True
            self._early.add(key)
            self.inventory.index(key, slot.state)
        self._loaded = True
        # the outbox: effects decided but maybe not carried out before a crash or handover
        for key, slot in self.keys.items():
            if key not in unbacked:
                self._owe(slot)

    def _slot(self, key: str) -> KeySlot:
        slot = self.keys.get(key)
        if slot is None:
            # a key first seen after the load may have had a log tail that was lost: its first VM
            # waits for a survey of every host -- unless every live host has verified the partition
            # and none named the key (then no live host has a VM of it, nor will run a command of
            # an older writer)
            named = key in self._named
            unverified = self._loaded and (named or not self.partition_verified())
            if unverified and not named:
                self._early.add(key)
            slot = self.keys[key] = KeySlot(KeyState(key=key, unverified=unverified))
        return slot

    async def _behind(self, slot: KeySlot) -> bool:
        """An input that decides nothing is acked without an append, so no fence checks it: a
        writer whose copy of the key is stale (it held the lease and lost it while cut off) would
        consume, say, the answer to a command the new owner sent, and nobody would decide it. Before
        such an ack the key's log end is compared with ours (one direct get); True if it was ahead
        and has been re-read. Inventories are exempt: every round repeats them."""
        last = await last_on_subject(self.js, self.subjects.stream_log, self.subjects.log(key_of(slot.state.key)))
        if last is None or last.seq <= slot.last_seq:
            return False
        metrics.LOST_RACES.inc()
        log.info("a no-op input found the key's log ahead of ours; re-reading it",
                 extra={"key": slot.state.key, "partition": self.p})
        await self._reload(slot)
        self._owe(slot)
        return True

    async def _reload(self, slot: KeySlot, *, full: bool = False) -> int | None:
        """Re-read one key's log (after a lost race, or from scratch if ours is not a prefix).
        None if ours was a prefix of the log; else it was re-read from scratch, and the highest
        ``Rebuilt.epoch_floor`` the log holds is returned (-1: none)."""
        self._drop_deferred(slot)  # re-read from what the log holds
        key = slot.state.key
        subject = self.subjects.log(key_of(key))
        floor = -1
        if full:
            # re-read cold: another writer's entries, or a log that is not a continuation of ours
            slot.state, slot.last_seq = KeyState(key=key, unverified=True), 0
        async for msg in read_subject(self.js, self.subjects.stream_log, subject, after_seq=slot.last_seq):
            entry = self._entry(msg.seq, msg.subject, msg.data, key)  # Undecodable: the caller quarantines
            if entry.n != slot.state.n + 1:
                if not full:
                    return await self._reload(slot, full=True)
                log.error("gap in log of %s at entry %d", key, entry.n, extra={"key": key})
            for d in entry.decisions:
                if isinstance(d, Rebuilt):
                    floor = max(floor, d.epoch_floor)
            fold_all(slot.state, entry.decisions)
            slot.state.n, slot.last_seq, slot.dirty = entry.n, msg.seq, True
            self._max_seen = max(self._max_seen, msg.seq)
        self.inventory.index(key, slot.state)
        return floor if full else None

    async def _rows_ahead_of_log(self, rows: dict[str, tuple[KeyState, int]]) -> list[str]:
        """Snapshot rows that have folded more entries than their key's log holds. One request for
        the partition's per-subject counts; a key missing from the answer is asked for alone."""
        counts: dict[str, int] = {}
        with contextlib.suppress(nats.errors.Error, nats.js.errors.Error, TimeoutError):
            stream, subjects = self.subjects.stream_log, self.subjects.log_partition(self.p)
            info = await self.js.stream_info(stream, subjects_filter=subjects)
            counts = info.state.subjects or {}
        ahead = []
        for key, (state, last_seq) in rows.items():
            subject = self.subjects.log(key_of(key))
            if counts.get(subject, 0) >= state.n:
                continue
            # fewer entries than the row folded (or not in the answer): is the row's last one there?
            # (with a log max age, old entries of a key may have aged out below a healthy tail)
            try:
                last = await self.js.get_last_msg(self.subjects.stream_log, subject)
                if last.seq is not None and last.seq >= last_seq:
                    continue
            except nats.js.errors.NotFoundError:
                pass
            ahead.append(key)
        return ahead

    # ------------------------------------------------------------------------ consuming
    async def run(self) -> None:
        """Consume until the lease is gone; bus trouble (leader elections, reconnects) restarts
        the consumer after a pause instead of ending the partition. Beside it, the partition's own
        log is tailed for entries another writer appended after the load."""
        for i, slot in enumerate(list(self.keys.values())):
            slot.release_idle()  # keys loaded with nothing in flight are held packed
            if i % 1000 == 999:
                await asyncio.sleep(0)  # ~8 ms of packing at a time
        async with asyncio.TaskGroup() as tg:
            tail = tg.create_task(self._keep(self._tail_foreign, "log tail"))
            sweep = tg.create_task(self._keep(self._sweep, "inventory sweep"))
            verify = tg.create_task(self._keep(self._verify_hosts, "partition verification"))
            self.hold_new_keys()
            held = tg.create_task(self.release_held())
            loops = [tail, sweep, verify, held]
            if self.done_linger_s > 0:
                loops.append(tg.create_task(self._keep(self._log_lingering, "deferred completions")))
            await self._keep(self._consume, "consumer")
            await cancel_and_wait(loops, what="log tail")

    async def _log_lingering(self) -> None:
        """Completions deferred for ``done_linger_s`` with no next entry of their key are logged alone."""
        while self.held:
            await asyncio.sleep(min(1.0, self.done_linger_s / 4))  # a period, not a synchronisation
            await self.flush_deferred()

    async def _keep(self, loop: Callable[[], Awaitable[None]], what: str) -> None:
        while self.held:
            try:
                await loop()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("%s restarting after %r", what, exc, extra={"partition": self.p})
                await asyncio.sleep(CONSUMER_RESTART_S)

    async def _tail_foreign(self) -> None:
        """A previous owner that has not noticed yet that its lease is gone can still append (each
        append is fenced per key, so the log never forks, but the entry lands after our load): our
        copy of that key is then stale, and effects it decided — a timer, a write — die with that
        owner's effect runner, and nothing would bring the key up again until its next input. Each
        such foreign entry makes us re-read the key and carry out its outbox."""
        start = self._max_seen + 1
        queue: asyncio.Queue[Msg] = asyncio.Queue()

        async def on_msg(msg: Msg) -> None:
            queue.put_nowait(msg)

        # headers only: an entry's Msg-Id names its writer, so our own appends (nearly all of the
        # tail) are passed over without their bodies crossing the wire or being decoded
        cfg = api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start,
            ack_policy=api.AckPolicy.NONE, mem_storage=True, inactive_threshold=30.0, headers_only=True,
        )
        sub = await self.js.subscribe(self.subjects.log_partition(self.p), stream=self.subjects.stream_log,
                                      cb=on_msg, ordered_consumer=True, config=cfg)
        own = f"@{self.writer}:"
        try:
            while self.held:
                msg = await queue.get()
                if own in (msg.headers or {}).get(H_MSG_ID, ""):
                    continue
                seq = msg.metadata.sequence.stream
                try:
                    stored = await self.js.get_msg(self.subjects.stream_log, seq)
                except nats.js.errors.NotFoundError:
                    continue  # gone since (a cut tail): the key's next append finds out
                try:
                    entry = self._entry(seq, msg.subject, stored.data or b"")
                except Undecodable as bad:
                    if bad.key not in self.quarantined:
                        await self._quarantine_locked(bad)
                    continue
                if entry.writer == self.writer or entry.key in self.quarantined:
                    continue
                slot = self._slot(entry.key)
                async with slot.lock:
                    if not self.held or seq <= slot.last_seq or entry.key in self.quarantined:
                        continue
                    log.info("another writer appended to a key of ours; re-reading it",
                             extra={"key": entry.key, "partition": self.p, "writer": entry.writer})
                    metrics.LOST_RACES.inc()
                    try:
                        await self._reload(slot)
                    except Undecodable as bad:
                        await self._quarantine(bad)
                        continue
                    self._owe(slot)
                slot.release_idle()
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _consume(self) -> None:
        cfg = api.ConsumerConfig(
            durable_name=f"reconciler-p{self.p}",
            filter_subject=self.subjects.in_partition(self.p),
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s,
            max_ack_pending=self.max_ack_pending,
            deliver_policy=api.DeliverPolicy.ALL,
            max_deliver=-1,
        )
        psub = await self.js.pull_subscribe(
            self.subjects.in_partition(self.p),
            durable=f"reconciler-p{self.p}",
            stream=self.subjects.stream_in,
            config=cfg,
        )
        sem = asyncio.Semaphore(MAX_INFLIGHT)
        failed: Exception | None = None
        try:
            async with asyncio.TaskGroup() as tg:
                while self.held:
                    try:
                        msgs = await psub.fetch(self.fetch_batch, timeout=FETCH_TIMEOUT_S)
                    except (nats.errors.TimeoutError, TimeoutError):
                        continue
                    except Exception as exc:
                        # a fetch failed (a leader election, a reconnect): the inputs being handled
                        # finish first. Cancelled mid-append they would leave an entry stored whose
                        # answer never came: unfolded here, and its outbox owed by nobody
                        failed = exc
                        break
                    for m in msgs:
                        self._unanswered[id(m)] = m
                        await sem.acquire()
                        tg.create_task(self._handle_released(m, sem))
                    if msgs and msgs[-1].metadata.num_pending is not None:
                        metrics.CONSUMER_PENDING.labels(str(self.p)).set(msgs[-1].metadata.num_pending)
        finally:
            with contextlib.suppress(Exception):
                await psub.unsubscribe()
        if failed is not None:
            raise failed

    async def _handle_released(self, msg: Msg, sem: asyncio.Semaphore) -> None:
        try:
            await self.handle(msg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # not acked: JetStream redelivers it after ack_wait, to us or to the next owner
            log.warning("input not handled, left for redelivery: %r", exc, extra={"partition": self.p})
            self._unanswered.pop(id(msg), None)
        finally:
            sem.release()
            if msg.is_acked:  # else held for the partition's verification, or the partition went
                self._unanswered.pop(id(msg), None)

    async def stop(self, task: asyncio.Task[None] | None, *, settle: bool) -> None:
        """Stop deciding, and end ``task`` (this partition's ``run``). With ``settle`` (a hand-over
        on purpose) its consumer's fetch under way is let return first, within FETCH_TIMEOUT_S, so
        what it brings is left unanswered for ``hand_back``: cancelled, that fetch's inputs would
        reach no one and wait out ``ack_wait`` (10 s) before the next owner saw them."""
        self.held = False
        if task is None:
            return
        if settle:
            await asyncio.wait({task}, timeout=FETCH_TIMEOUT_S + STOP_SETTLE_S)
        await cancel_and_wait([task], what="partition")

    async def hand_back(self) -> int:
        """Once this writer has stopped deciding (``held`` cleared, its tasks ended): every input it
        fetched and did not answer goes back to the stream at once (nak) for the partition's next
        owner, instead of waiting out ``ack_wait`` (10 s by default) with the keys queued behind
        them. One decided but not acked yet is decided again by the next owner, and drops: a
        redelivery changes nothing. Returns how many went back."""
        assert not self.held, "handing back inputs while still deciding them"
        self.forget_answered()
        back, self._unanswered = list(self._unanswered.values()), {}
        for msg in back:
            with contextlib.suppress(nats.errors.Error, OSError):
                await msg.nak()
        self.stats["handed_back"] += len(back)
        return len(back)

    def forget_answered(self) -> None:
        """Drop what was answered since it was fetched (held inputs are answered later)."""
        self._unanswered = {i: m for i, m in self._unanswered.items() if not m.is_acked}

    async def handle(self, msg: Msg) -> None:
        if len(msg.data) > MAX_INPUT_BYTES:
            size = len(msg.data)
            await self._dead_letter(msg, f"input too large: {size} bytes, above the bound of {MAX_INPUT_BYTES}")
            return
        if (verified := self.subjects.partition_report_of(msg.subject)) is not None:
            await self._verified_answer(msg, *verified)
            return
        try:
            inp = decode_input(msg.data)
            key = str(self.subjects.key_of_in_subject(msg.subject))
        except UnknownVersion as exc:
            await self._dead_letter(msg, f"unknown input version: {exc}")
            return
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, UnicodeDecodeError) as exc:
            await self._dead_letter(msg, f"undecodable input: {exc}")
            return
        inp_key = getattr(inp, "key", None) or getattr(getattr(inp, "fence", None), "key", None)
        if inp_key != key:
            await self._dead_letter(msg, f"input for key {inp_key!r} on the subject of {key!r}")
            return
        sender = self.subjects.sender_of_in_subject(msg.subject)
        if sender is not None and getattr(inp, "host", None) != sender:
            # an agent's subject carries only its own reports (NATS lets it publish nowhere else
            # under .agent.): a report naming another host, or any other input, is forged
            claimed = getattr(inp, "host", None)
            await self._dead_letter(msg, f"wrong sender: {input_kind(inp)} naming host {claimed!r} "
                                         f"on the subject of host {sender!r}")
            return
        if key in self.quarantined:
            await self._dead_letter(msg, self._quarantined_reason(key))
            return
        if isinstance(inp, CommandResult) and inp.floor > 0:
            with contextlib.suppress(nats.errors.Error):
                if self._refused_below_floor(key, inp):
                    await msg.ack()
                else:  # another writer's: delivered again (to it, or to us at our new generation)
                    await msg.nak(delay=REFUSAL_REDELIVERY_S)
            return
        lacking = self.inventory.note(key, inp) if isinstance(inp, Inventoried) else []
        if key in self._held_inputs or ((key not in self.keys or key in self._early) and self._holding()):
            # a key first seen, or slotted by the log tail before the hosts answered (a hand-over's
            # foreign entries): held until they have, so it need not survey (``_verify_early_keys``).
            # (no await between the check and the append: a key's inputs are held in arrival order)
            self._held_inputs.setdefault(key, []).append((inp, msg))
        else:
            await self._decide_input(key, inp, msg)
        for other, vm_id, host, round_id in lacking:
            await self._absent(other, vm_id, host, round_id)

    async def _decide_input(self, key: str, inp: Input, msg: Msg) -> None:
        """Decide one input of the bus and ack it once decided."""
        slot = self._slot(key)
        try:
            done = await self._decide_waiting(slot, inp, msg)
        except Undecodable as bad:
            await self._quarantine(bad)
            done = False
        slot.release_idle()
        if not self.held:
            return  # not acked: the partition's next owner gets it
        if key in self.quarantined:
            await self._dead_letter(msg, self._quarantined_reason(key))
            return
        if done:
            with contextlib.suppress(nats.errors.Error):
                await msg.ack()

    # ------------------------------------------------------------ inventories against the log
    async def sweep_inventory(self, live_hosts: set[str]) -> int:
        """The backstop: a VM bound on a live host that no round has named for ``inventory_stale_s``
        is inspected (a re-check, never an eviction on its own). Returns how many were asked."""
        stale = self.inventory.stale(live_hosts, self.inventory_stale_s)
        for key, vm_id, host in stale:
            await self._absent(key, vm_id, host, "")
        return len(stale)

    async def _absent(self, key: str, vm_id: str, host: str, round_id: str) -> None:
        """Tell the key that a round of ``host`` lacked its bound VM; decide asks for an inspect."""
        slot = self.keys.get(key)
        if slot is None or not self.held:
            return
        cur = slot.state.cur
        if cur is None or cur.vm_id != vm_id or cur.host != host:
            return
        self.stats["absent"] += 1
        metrics.POD_LIFECYCLE.labels("inventory", "absent", "").inc()
        log.info("inventory round %s of %s lacks bound VM %s; inspecting", round_id or "(none lately)", host, vm_id,
                 extra={"key": key, "partition": self.p})
        await self.feed(key, Inventoried(cur.fence, host, vm_id, ABSENT, round=round_id))

    async def _sweep(self) -> None:
        while self.held:
            await asyncio.sleep(INVENTORY_SWEEP_S)  # a period, not a synchronisation
            await self.sweep_inventory({h.name for h in self.env().hosts})
            if self.quarantined:
                await self.recheck_quarantined()

    async def feed(self, key: str, inp: Input) -> bool:
        """Decide an outcome this process produced (see EffectRunner._outcome); False if not ours."""
        if not self.held or key in self.quarantined:
            return False  # a quarantined key's outcome goes through the bus to its dead letters
        slot = self._slot(key)
        try:
            done = await self._decide_waiting(slot, inp, None)
        except Undecodable as bad:
            await self._quarantine(bad)
            done = False
        slot.release_idle()
        return done

    def _quarantined_reason(self, key: str) -> str:
        why = self.quarantined[key]
        return f"quarantined key: its log entry at stream sequence {why.seq} cannot be read ({why.reason[:300]})"

    async def _dead_letter(self, msg: Msg, reason: str) -> None:
        log.warning("dead letter: %s", reason, extra={"partition": self.p})
        metrics.DEAD_LETTERS.labels(reason.split(":")[0]).inc()
        data, headers = msg.data, dict(msg.headers or {})
        if len(data) > MAX_INPUT_BYTES:
            # the dead letter must fit the server too: a prefix, and how long the original was
            data, headers[H_TRUNCATED] = data[:MAX_INPUT_BYTES], str(len(data))
        await dead_letter(
            self.js, self.subjects, source="reconciler", reason=reason, subject=msg.subject,
            data=data, headers=headers,
        )
        self.stats["dead_lettered"] += 1
        self.stats[f"dead_lettered:{reason.split(':')[0]}"] += 1
        await msg.ack()

    # ------------------------------------------------------------------------ snapshots
    def _watermark(self) -> int:
        """A sequence below which every entry of this partition is folded into the rows."""
        return min(self._inflight_floors) if self._inflight_floors else self._max_seen

    def _all_rows(self) -> tuple[list[tuple[str, int, bytes]], int]:
        """Every row, and the watermark, at one instant."""
        return [(key, slot.last_seq, slot.encoded()) for key, slot in self.keys.items()], self._watermark()

    def snapshot_rows(self) -> tuple[list[tuple[str, int, bytes]], int]:
        """Dirty rows and a watermark below which every entry of this partition is in them."""
        watermark = self._watermark()
        rows: list[tuple[str, int, bytes]] = []
        for key, slot in self.keys.items():
            if slot.dirty:
                rows.append((key, slot.last_seq, slot.encoded()))
                slot.dirty = False
        return rows, watermark

    async def put_image(self) -> None:
        """Every row, at one instant with its watermark, as this partition's image on the bus
        (``images.py``): what its next owner loads instead of the log since its own snapshot."""
        if self.images is None or not self._loaded:
            return
        rows, watermark = self._all_rows()
        if watermark:
            await self.images.put(self.p, rows, watermark)

    async def flush(self) -> None:
        if self.snapshots is None:
            return
        if self._snapshot_whole:  # loaded from an image: every row, and none of an earlier tenure's
            rows, watermark = self._all_rows()
            for slot in self.keys.values():
                slot.dirty = False
            await self.snapshots.replace(self.p, rows, watermark)
            self._snapshot_whole = False
            return
        rows, watermark = self.snapshot_rows()
        if rows or watermark:
            await self.snapshots.save(self.p, rows, watermark)



