"""Carrying out effects: commands to agents, Kubernetes writes, consistent reads, timers.

Effects of one key run in log order (a consistent read answered later must never overtake one
answered earlier); different keys run concurrently on a bounded set of workers. Every effect is
idempotent and its outcome comes back as an input on the key's report subject, so a crash at any
point is repaired by re-deriving the outbox from state and running it again (rule 11).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
from nats.js import JetStreamContext

from services.reconciler import metrics
from services.reconciler.kube import KubeGateway, KubeUnavailable
from services.reconciler.silence import Silence
from shared.bus.append import publish_input
from shared.fence.decide import doubling_s
from shared.fence.keys import Key
from shared.fence.schema import (
    MAX_COMMAND_BYTES,
    Commanded,
    CommandResult,
    ConfirmRequested,
    Input,
    PlaceTimer,
    SurveyTimer,
    TimerArmed,
    TimerFired,
    WriteDone,
    WriteRequested,
    encode,
    purpose_text,
)
from shared.fence.state import Effect
from shared.subjects import Subjects
from shared.tasks import join

log = logging.getLogger(__name__)

# after a failed publish or confirm, the key's effects wait (parked: no worker held) before the same
# effect is tried again, doubling per failure in a row up to RETRY_MAX_DELAY_S
RETRY_DELAY_S = 1.0
RETRY_MAX_DELAY_S = 30.0
QUEUE_LIMIT_PER_KEY = 10_000
REFUSED_COPIES_LIMIT = 10_000  # refusals remembered for commands not (yet) in our outbox; oldest dropped
# checks that wait for a host: a placement (no host takes the VM), a survey (no host is live)
HOST_WAIT_PURPOSES = frozenset({purpose_text(PlaceTimer()), purpose_text(SurveyTimer())})
# a Kubernetes write again (RewriteTimer): one armed while the API server did not answer is fired
# as soon as it answers again, not left to a backoff of up to REWRITE_MAX_S
REWRITE_PREFIX = "rewrite/"
# while it stays silent, one of those goes ahead of its backoff this often, as a canary: the first
# the API server answers fires the rest, though no other write happens to be made meanwhile
SERVER_CANARY_S = 1.0
PARKED = "parked"  # what a key parked for a read waits as (Silence.wait's kind)


@dataclass(frozen=True)
class _Fire:
    timer: TimerArmed


Work = Effect | _Fire


class EffectRunner:
    def __init__(
        self,
        js: JetStreamContext,
        subjects: Subjects,
        gateway: KubeGateway,
        *,
        workers: int = 64,
        owns: Callable[[int], bool] = lambda p: True,
        feed: Callable[[str, Input], Awaitable[bool]] | None = None,
        gen: Callable[[int], int] = lambda p: 0,
    ) -> None:
        self.js = js
        self.subjects = subjects
        self.gateway = gateway
        self.workers = workers
        self.owns = owns
        self.feed = feed
        self.gen = gen  # partition -> its writer's generation here, stamped on every command sent
        self._queues: dict[str, collections.deque[Work]] = {}
        self._ready: asyncio.Queue[str] = asyncio.Queue()
        self._timers: dict[tuple[str, str], tuple[asyncio.TimerHandle, TimerArmed]] = {}
        self._halted: set[str] = set()  # quarantined keys: nothing of theirs is carried out
        self.idle = asyncio.Event()
        self.idle.set()
        self._busy = 0
        # (command id, host) -> key: a host refused a predecessor's copy of the command (same id),
        # which the stream's dedupe would let stand for ours: whenever ours is carried out (now, or
        # after a hand-over's foreign tail is read), it goes under a Msg-Id of our generation
        self._refused: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()
        # whether the API server answers writes and reads, and what waits for its next answer
        # (silence.py): rewrite timers for a write's, parked keys for a read's
        self.writes, self.reads = Silence(), Silence()
        self._silent = asyncio.Event()  # set while either is silent: the canaries run
        # keys whose next effect failed (a publish, a confirm): their queue waits, holding no worker,
        # until the handle puts them back (_unpark); failures in a row per key, for the delay
        self._parked: dict[str, asyncio.TimerHandle] = {}
        self._failures: dict[str, int] = {}

    def submit(self, key: str, effect: Work) -> None:
        if key in self._halted:
            return  # a quarantined key's state is unknown (rule 12); its outbox is re-derived on lift
        q = self._queues.get(key)
        if q is None:
            q = self._queues[key] = collections.deque()
            self._ready.put_nowait(key)
        if len(q) >= QUEUE_LIMIT_PER_KEY:
            log.error("effect queue full; dropping (the outbox re-derives it)", extra={"key": key})
            return
        q.append(effect)
        self.idle.clear()

    def submit_all(self, key: str, effects: list[Effect]) -> None:
        for e in effects:
            if isinstance(e, TimerArmed):
                self._arm(key, e)
            else:
                self.submit(key, e)

    def _arm(self, key: str, timer: TimerArmed) -> None:
        handle_key = (key, timer.timer_id)
        if handle_key in self._timers:
            return
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self._timers.pop(handle_key, None)
            self.writes.drop(key, timer.timer_id)
            self.writes.waited_out(key, timer.purpose)
            self.submit(key, _Fire(timer))

        self._timers[handle_key] = (loop.call_later(max(0.0, timer.delay_s), fire), timer)
        if timer.purpose.startswith(REWRITE_PREFIX) and self.writes.wait(key, timer.timer_id, timer.purpose):
            self._fire_now(handle_key)  # its write failed in a silence that ended meanwhile

    def fire_host_waits(self, worth: Callable[[str, TimerArmed], bool] = lambda key, timer: True) -> int:
        """Fire now every armed check that waits for a host and that ``worth`` says a host that came
        live or has more room could answer, and return how many. A timer only re-checks (rule 12):
        fired early, it is the same check, sooner, and the pods waiting for a host need not sit out
        their backoff (``decide.place_retry_s``)."""
        fired = 0
        for handle_key, (handle, timer) in list(self._timers.items()):
            if timer.purpose in HOST_WAIT_PURPOSES and worth(handle_key[0], timer):
                handle.cancel()
                del self._timers[handle_key]
                self.submit(handle_key[0], _Fire(timer))
                fired += 1
        return fired

    def fire_server_waits(self) -> int:
        """Fire now every rewrite timer that waits for the API server to answer a write, and return
        how many: it answers again, and the writes that failed for its silence need not sit out their
        backoff (``decide.rewrite_backoff_s``, up to 30 s; a timer only re-checks, rule 12). The
        effect workers bound how many are written at once."""
        return sum(self._fire_now(ident) for ident in self.writes.release())

    def _fire_now(self, handle_key: tuple[str, str]) -> bool:
        entry = self._timers.pop(handle_key, None)
        if entry is None:
            return False
        entry[0].cancel()
        self.submit(handle_key[0], _Fire(entry[1]))
        return True

    def refused_copy(self, key: str, command_id: str, host: str) -> None:
        """``host`` refused an older writer's copy of ``command_id``: ours goes under our generation."""
        self._refused[(command_id, host)] = key
        self._refused.move_to_end((command_id, host))
        while len(self._refused) > REFUSED_COPIES_LIMIT:
            self._refused.popitem(last=False)

    def cancel_partition(self, partition: int) -> None:
        for (key, tid), (handle, _) in list(self._timers.items()):
            if self.subjects.partition(key) == partition:
                handle.cancel()
                del self._timers[(key, tid)]
        in_partition = self._in_partition(partition)
        self.writes.drop_keys(in_partition)
        self.reads.drop_keys(in_partition)
        # the partition's next load judges its keys' logs afresh
        self._halted = {k for k in self._halted if self.subjects.partition(k) != partition}
        for ref, key in list(self._refused.items()):
            if self.subjects.partition(key) == partition:
                del self._refused[ref]

    def halt(self, key: str) -> None:
        """Carry out nothing more for ``key`` (its log holds an entry nobody can read): queued
        effects and armed timers are dropped, later submits ignored, until ``resume``. An effect
        being carried out at this instant finishes; its outcome is refused by the partition."""
        self._halted.add(key)
        q = self._queues.get(key)
        if q is not None:
            q.clear()
        for (k, tid), (handle, _) in list(self._timers.items()):
            if k == key:
                handle.cancel()
                del self._timers[(k, tid)]
        self.writes.drop_keys(key.__eq__)
        self.reads.drop_keys(key.__eq__)

    def resume(self, key: str) -> None:
        self._halted.discard(key)

    def halted(self, key: str) -> bool:
        return key in self._halted

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(self._worker()) for _ in range(self.workers)]
            await join([*tasks, tg.create_task(self._canaries())], what="effect worker")

    async def _canaries(self) -> None:
        """While the API server is silent, every SERVER_CANARY_S the oldest key parked for a read it
        did not answer is tried again, and the oldest write that waits for it goes (its timer fired
        early): the first one it answers releases the rest (``read_answered``, ``_write_answered``)."""
        while True:
            await self._silent.wait()
            await asyncio.sleep(SERVER_CANARY_S)  # the canaries' period, not a synchronisation
            if self.reads.silent and (read := self.reads.canary()) is not None:
                self._unpark(read[0])
            if self.writes.silent and (write := self.writes.canary()) is not None:
                self._fire_now(write)

    def _in_partition(self, partition: int) -> Callable[[str], bool]:
        return lambda key: self.subjects.partition(key) == partition

    def close(self) -> None:
        for handle, _ in self._timers.values():
            handle.cancel()
        self._timers.clear()
        self.writes.clear()
        self.reads.clear()
        for handle in self._parked.values():
            handle.cancel()
        self._parked.clear()

    async def _worker(self) -> None:
        while True:
            key = await self._ready.get()
            q = self._queues.get(key)
            self._busy += 1
            parked = False
            try:
                while q:
                    work = q[0]
                    partition = self.subjects.partition(key)
                    if not self.owns(partition) or key in self._halted:
                        q.clear()  # the new owner (or the lifted quarantine) re-derives these from the log
                        break
                    try:
                        await self._execute(Key.parse(key), work)
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:
                        # the same effect again later, the key's later ones behind it (their order
                        # holds); meanwhile this worker serves other keys: an API server or a bus
                        # that is away must not take every worker from the keys it does not concern
                        parked = True
                        self._park(key, exc)
                        break
                    if self._failures.pop(key, None) is not None:
                        self.reads.done(key, PARKED)
                    q.popleft()
            finally:
                self._busy -= 1
                if not parked:
                    self._queues.pop(key, None)
                    self._failures.pop(key, None)
                if not self._queues and self._busy == 0:
                    self.idle.set()

    def _park(self, key: str, exc: Exception) -> None:
        failures = self._failures[key] = self._failures.get(key, 0) + 1
        delay = doubling_s(RETRY_DELAY_S, failures - 1, RETRY_MAX_DELAY_S)
        log.warning("effect failed, retrying in %.0fs: %r", delay, exc, extra={"key": key})
        self._parked[key] = asyncio.get_running_loop().call_later(delay, self._unpark_due, key)
        metrics.EFFECTS_PARKED.set(len(self._parked))
        if isinstance(exc, KubeUnavailable):  # a read the API server did not answer: waits for its next
            self.read_answered(False, key)
            self.reads.wait(key, key, PARKED)

    def _unpark_due(self, key: str) -> None:
        """Its own delay ran out."""
        self.reads.drop(key, key)
        self.reads.waited_out(key, PARKED)
        self._unpark(key)

    def _unpark(self, key: str) -> None:
        handle = self._parked.pop(key, None)
        if handle is not None:
            handle.cancel()
            metrics.EFFECTS_PARKED.set(len(self._parked))
            if key in self._queues:
                self._ready.put_nowait(key)

    async def _execute(self, key: Key, work: Work) -> None:
        start = time.perf_counter()
        kind = type(work).__name__
        # its host refused the copy the stream's dedupe would let stand for ours
        resend = isinstance(work, Commanded) and (work.command.id, work.command.host) in self._refused
        match work:
            case Commanded(command=cmd):
                # the writer that sends a command vouches for it now (after a handover, the new
                # writer re-sends its log's outbox): it carries this writer's generation. Its
                # Msg-Id is the command's id, so a predecessor's copy still queued (the same
                # command, decided in the same log) stands for it; if a host refuses that copy for
                # its generation, ours goes again under a Msg-Id naming ours (refused_copy)
                gen = self.gen(self.subjects.partition(key))
                payload = encode(msgspec.structs.replace(cmd, gen=gen))
                if len(payload) > MAX_COMMAND_BYTES:
                    # never sendable: it ends as a failed result, and the kernel decides (a create
                    # backs off, a remove is retried) — never a publish retried every second
                    log.error("command too large (%d bytes); answered failed", len(payload), extra={"key": str(key)})
                    why = f"command too large: {len(payload)} bytes, above the bound of {MAX_COMMAND_BYTES}"
                    failed = CommandResult(cmd.fence, cmd.id, cmd.op, cmd.host, cmd.vm_id, "failed", error=why)
                    await self._outcome(key, failed, f"{key}|{cmd.id}|too-large")
                    return
                await publish_input(self.js, self.subjects.command(cmd.host), payload,
                                    msg_id=f"{cmd.id}@{gen}" if resend else cmd.id)
                kind = f"command_{cmd.op}"
            case ConfirmRequested(request=req):
                read = await self.gateway.confirm(key, req)  # KubeUnavailable: parked (_park)
                self.read_answered(True, str(key))
                await self._outcome(key, read, f"{key}|{req}")
                kind = "confirm"
            case WriteRequested(write=w):
                done: WriteDone = await self.gateway.write(key, w)
                metrics.K8S_WRITES.labels(w.verb, done.outcome).inc()
                if done.outcome == "failed" and w.verb != "event":  # (events log their own failure)
                    # rewritten after a timer until it takes: say why each time (a 403 of a role the
                    # chart forgot, a 422 of a body the real server refuses) — never a silent retry
                    log.warning("kubernetes %s write failed: %s", w.verb, done.detail,
                                extra={"key": str(key), "uid": w.fence.uid, "epoch": w.fence.epoch})
                self._write_answered(not done.unanswered, str(key))
                if done.outcome == "ok":
                    self.writes.done(str(key), REWRITE_PREFIX + w.verb)
                if w.verb != "event":
                    await self._outcome(key, done, f"{key}|{w.id}")
                kind = f"write_{w.verb}"
            case _Fire(timer=t):
                await self._outcome(key, TimerFired(t.fence, t.timer_id), f"{key}|{t.timer_id}")
                kind = "timer"
            case TimerArmed():
                self._arm(str(key), work)
                return
        metrics.EFFECT_SECONDS.labels(kind).observe(time.perf_counter() - start)

    @property
    def reads_silent(self) -> bool:
        """The API server did not answer the last read (a consistent read of a new pod)."""
        return self.reads.silent

    def read_answered(self, answered: bool, key: str) -> None:
        """A read's answer (or silence), made here or elsewhere (a partition's inline confirm of
        ``key``): the first answer after a silence unparks the keys that waited for one."""
        if self._heard(self.reads, answered, key):
            for parked, _ in self.reads.release():
                self._unpark(parked)

    def _write_answered(self, answered: bool, key: str) -> None:
        """A write's answer (or silence): the first answer after a silence fires the rewrites that
        waited for one."""
        if self._heard(self.writes, answered, key):
            fired = self.fire_server_waits()
            if fired:
                log.info("the API server answers writes again: %d write(s) again now", fired)
                metrics.REWRITES_EARLY.inc(fired)

    def _heard(self, kind: Silence, answered: bool, key: str) -> bool:
        """``key``'s request of ``kind`` was answered or not; True when that ends a silence."""
        if not answered:
            kind.failed(key)
            self._silent.set()
            return False
        if not kind.answered():
            return False
        if not (self.reads.silent or self.writes.silent):
            self._silent.clear()
        return True

    async def _outcome(self, key: Key, inp: Input, msg_id: str) -> None:
        """Outcomes this reconciler produced itself go straight to the key's decide loop: they need
        no durability of their own, because the effect that produced them stays in the outbox until
        the outcome is decided, and a crash re-derives it. When the partition is not (or no longer)
        ours in-process, the outcome goes through the bus to whoever owns it."""
        if self.feed is not None and await self.feed(str(key), inp):
            return
        await publish_input(self.js, self.subjects.report(key), encode(inp), msg_id=msg_id)
