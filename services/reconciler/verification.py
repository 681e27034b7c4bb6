"""A partition writer's verification of its hosts (docs/architecture.md, "Partition verification
instead of a survey per new key"), as a base of ``Partition``: asking each live host once per lease,
reading their answers, the refusals of an older writer's commands, and what the answers vouch for
(keys first seen before them, held inputs of new keys, keys loaded from the log)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable

import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from services.reconciler.effects import EffectRunner
from services.reconciler.keytable import KeySlot
from shared.bus.append import publish_input
from shared.fence.decide import DecideEnv
from shared.fence.schema import (
    H_KIND,
    MAX_GEN,
    VERIFY_KIND,
    Commanded,
    CommandResult,
    Input,
    PartitionVerify,
    UnknownVersion,
    decode_verified,
    encode,
)
from shared.fence.state import survey_pending
from shared.subjects import Subjects

log = logging.getLogger("services.reconciler.partition")  # the partition's own log lines

# A live host the partition's writer has not verified (PartitionVerify) is asked again this often;
# a host that joins the live set is asked within it. Until every live host has answered, keys first
# seen survey the hosts one by one, as they did before partition verification existed.
VERIFY_RETRY_S = 2.0
# For this long after a partition is taken, inputs of keys first seen wait (unacked, in order) for
# the writer's verification instead of each sending a survey to every host: a survey costs the same
# round trip to each host as the verification, plus a command, an answer and an entry per host and
# key. A verification that has not finished by then (a host slow or gone) lets them go on as before.
NEW_KEY_HOLD_S = 2 * VERIFY_RETRY_S
# a refusal for another writer goes back to the stream for this long before it is delivered again
# (to the newer writer, or to us once we took the higher generation)
REFUSAL_REDELIVERY_S = 0.5


class PartitionVerifier:
    """What verification uses of the partition is declared here (``Partition`` sets it)."""

    p: int
    gen: int
    js: JetStreamContext
    subjects: Subjects
    writer: str
    effects: EffectRunner
    env: Callable[[], DecideEnv]
    keys: dict[str, KeySlot]
    held: bool
    stats: Counter[str]
    verified: set[str]
    _named: set[str]
    _asked: dict[str, float]
    _early: set[str]
    _held_inputs: dict[str, list[tuple[Input, Msg]]]
    _hold_until: float
    _verified_now: asyncio.Event

    def _owe(self, slot: KeySlot) -> None:
        raise NotImplementedError

    async def _dead_letter(self, msg: Msg, reason: str) -> None:
        raise NotImplementedError

    async def _decide_input(self, key: str, inp: Input, msg: Msg) -> None:
        raise NotImplementedError

    def forget_answered(self) -> None:
        raise NotImplementedError

    def partition_verified(self) -> bool:
        """Every live host has answered this writer's PartitionVerify (and there is one)."""
        live = {h.name for h in self.env().hosts}
        return bool(live) and live <= self.verified

    # ----------------------------------------------------------------- partition verification
    async def ask_hosts(self) -> list[str]:
        """Ask each live host not verified at ``gen`` (and not asked within ``VERIFY_RETRY_S``) to
        verify the partition; a host that left the live set must answer again when it returns.
        Returns the hosts asked."""
        if self.gen <= 0:
            return []  # no generation (a test's partition without a lease): nothing to verify with
        live = {h.name for h in self.env().hosts}
        self.verified &= live
        now = asyncio.get_running_loop().time()
        asked = []
        for host in sorted(live - self.verified):
            if now - self._asked.get(host, -VERIFY_RETRY_S) < VERIFY_RETRY_S:
                continue
            ask = PartitionVerify(self.p, self.gen, host, self.writer)
            await publish_input(self.js, self.subjects.command(host), encode(ask),
                                msg_id=f"verify:{self.p}:{self.gen}:{host}:{now:.3f}", headers={H_KIND: VERIFY_KIND})
            self._asked[host] = now
            asked.append(host)
        return asked

    async def _verify_hosts(self) -> None:
        while self.held:
            await self.ask_hosts()
            await asyncio.sleep(VERIFY_RETRY_S)  # a period, not a synchronisation

    def _outgrown(self, host: str, floor: int) -> None:
        """A writer of a later generation verified ``host`` first: only a lease bucket that lost its
        history gives a new lease a lower revision. Our commands would all be refused there: take a
        generation above it, verify every host again and send every key's outbox under it."""
        log.warning("host %s holds the partition at generation %d, above ours (%d): re-verifying every "
                    "host at %d", host, floor, self.gen, floor + 1, extra={"partition": self.p})
        self.gen = min(floor + 1, MAX_GEN)
        self.verified.clear()
        self._asked.clear()
        for slot in self.keys.values():
            self._owe(slot)

    def _refused_below_floor(self, key: str, r: CommandResult) -> bool:
        """A host refused a command sent under an older generation than its floor. Never decided:
        it says nothing of the command but that this copy did not run. If the command is in our
        outbox, the stream may have taken the predecessor's copy for ours (same Msg-Id): ours goes
        again under a Msg-Id of our generation. Above our generation, we are the older writer.

        False: the refusal is for another writer -- a newer one, while our lease is lost or about
        to be, or ours at the generation we now take -- and must be delivered again, not acked
        (acked here, the writer that owns the command would never send its copy)."""
        self.stats["refused_below_floor"] += 1
        if not self.held:
            return False
        if r.floor > self.gen:
            self._outgrown(r.host, r.floor)
            return False
        # remembered even when the command is not in our outbox (yet): the key's entries a
        # predecessor appended after our load may hold it, and the re-read carries it out
        self.effects.refused_copy(key, r.command_id, r.host)
        slot = self.keys.get(key)
        pending = slot.state.outbox.get(r.command_id) if slot is not None else None
        if isinstance(pending, Commanded) and pending.command.host == r.host:
            self.effects.submit(key, pending)
        return True

    async def _verified_answer(self, msg: Msg, p: int, sender: str) -> None:
        """A host's answer to our PartitionVerify."""
        try:
            answer = decode_verified(msg.data)
        except UnknownVersion as exc:
            await self._dead_letter(msg, f"unknown input version: {exc}")
            return
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            await self._dead_letter(msg, f"undecodable input: {exc}")
            return
        if answer.host != sender:
            await self._dead_letter(msg, f"wrong sender: partition verified naming host {answer.host!r} "
                                         f"on the subject of host {sender!r}")
            return
        if answer.partition != p or p != self.p:
            await self._dead_letter(msg, f"partition verified of partition {answer.partition} on the subject of {p}")
            return
        if answer.gen == self.gen and self.held:
            if answer.floor > self.gen:
                self._outgrown(sender, answer.floor)
            elif answer.truncated:
                log.warning("host %s has more keys of the partition than one answer carries: new keys "
                            "keep surveying every host", sender, extra={"partition": self.p})
            else:
                self._named.update(answer.keys)
                self.verified.add(sender)
                if self.partition_verified():
                    self._verified_now.set()
                    self._verify_early_keys()
                    log.info("partition verified by every live host at generation %d", self.gen,
                             extra={"partition": self.p})
        with contextlib.suppress(nats.errors.Error):
            await msg.ack()

    def _verify_early_keys(self) -> int:
        """Keys first seen while the partition was being verified (a hand-over's foreign log tail,
        an input before the hold began) that no host named and that have no survey out are verified
        now, as if first seen after it: the same answers vouch for them. One whose input is being
        decided keeps its flag (its state may be copied right now): it surveys, as before."""
        cleared = 0
        for key in self._early:
            slot = self.keys.get(key)
            if slot is None or key in self._named or slot.busy():
                continue
            s = slot.state
            if s.unverified and not s.rebuilding and not survey_pending(s):
                s.unverified, slot.dirty = False, True
                cleared += 1
            slot.release_idle()
        self._early.clear()
        self.stats["verified_early"] += cleared
        return cleared

    # ------------------------------------------------- new keys wait for the partition's verification
    def hold_new_keys(self, seconds: float = NEW_KEY_HOLD_S) -> None:
        """From now, for at most ``seconds``, inputs of keys first seen wait for this writer's
        verification of the partition (see NEW_KEY_HOLD_S); ``release_held`` lets them go."""
        if self.gen > 0 and not self.partition_verified():
            self._hold_until = asyncio.get_running_loop().time() + seconds

    def _holding(self) -> bool:
        return self._hold_until > 0 and asyncio.get_running_loop().time() < self._hold_until

    async def release_held(self) -> None:
        """Wait until the partition is verified or the hold ends, then decide what was held: each
        key's inputs in order (a key's later inputs keep joining its queue until it is empty), the
        keys side by side. Held once per lease: a host that joins later is surveyed per key."""
        remaining = self._hold_until - asyncio.get_running_loop().time()
        if remaining > 0 and not self.partition_verified():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._verified_now.wait(), remaining)
        self._hold_until = 0.0
        if self._held_inputs:
            self.stats["held_keys"] += len(self._held_inputs)
            log.info("partition %s: deciding %d new keys that waited for it", "verified" if
                     self.partition_verified() else "not verified in time", len(self._held_inputs),
                     extra={"partition": self.p})
        async with asyncio.TaskGroup() as tg:
            for key in list(self._held_inputs):
                tg.create_task(self._decide_held(key))
        self.forget_answered()

    async def _decide_held(self, key: str) -> None:
        queue = self._held_inputs[key]
        while queue:
            inp, msg = queue.pop(0)
            try:
                await self._decide_input(key, inp, msg)
            except Exception as exc:  # as _handle_released: not acked, redelivered
                log.warning("input not handled, left for redelivery: %r", exc, extra={"key": key, "partition": self.p})
        del self._held_inputs[key]
