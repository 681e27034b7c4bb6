"""The working state one input is decided in (``_Run``), what else a decision may depend on
(``DecideEnv``, ``HostView``), the named bounds, and the helpers every rule uses to command, arm a
timer, emit an Event and keep the pod's status in step."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

from shared.fence.schema import (
    MAX_OBJECT_BYTES,
    Command,
    Commanded,
    CommandOp,
    ConfirmedRead,
    Decision,
    EventReason,
    Fence,
    Input,
    KubeWrite,
    Observed,
    PlaceTimer,
    PodStatusIntent,
    Spec,
    StatusReason,
    TimerArmed,
    TimerPurpose,
    WriteRequested,
    purpose_text,
)
from shared.fence.state import Incarnation, KeyState, fold

# Named bounds (seconds) for the re-checks timers trigger.
PLACE_RETRY_S = 2.0


def doubling_s(base: float, steps: int, cap: float) -> float:
    """``base`` doubled ``steps`` times (none below 0), at most ``cap``: every backoff below."""
    return min(base * 2.0 ** min(max(steps, 0), 32), cap)


# A pod no host takes is checked again after a delay that doubles per check in a row that found none,
# from PLACE_RETRY_S up to PLACE_RETRY_MAX_S: a fleet whose hosts are all gone does not log an entry
# per pending pod every 2 s for as long as it lasts. The reconciler fires these timers early when a
# host comes live or reports more room (services.reconciler.hosts), so the cap bounds only what no
# heartbeat shows; the kube-scheduler backs off unschedulable pods and requeues them on node events alike.
PLACE_RETRY_MAX_S = 60.0


def place_retry_s(tries: int) -> float:
    """The delay before the placement check that follows ``tries`` checks in a row with no host."""
    return doubling_s(PLACE_RETRY_S, tries, PLACE_RETRY_MAX_S)


EFFECT_RETRY_S = 1.0


# A Kubernetes write that failed (an API server down or timing out, a 403 of a role the chart
# forgot) is written again after a delay that doubles per failure in a row, from EFFECT_RETRY_S up
# to REWRITE_MAX_S: not an entry and a request every second per pod for as long as it lasts.
REWRITE_MAX_S = 30.0


def rewrite_backoff_s(failures: int) -> float:
    """The delay before the write that follows ``failures`` failed ones in a row."""
    return doubling_s(EFFECT_RETRY_S, failures - 1, REWRITE_MAX_S)


# A command on a VM that answered inconclusive (a runtime that did not say), or a remove that failed,
# is sent again after a delay that doubles per re-send since the VM's last ok answer, from
# EFFECT_RETRY_S up to RETRY_MAX_S (VMRec.retries): a host whose runtime hangs is not asked once a
# second per VM for as long as it lasts. An inconclusive adopt's inspect backs off alike.
RETRY_MAX_S = 30.0


def retry_backoff_s(retries: int) -> float:
    """The delay before the re-send that follows ``retries`` re-sends since the VM's last ok."""
    return doubling_s(EFFECT_RETRY_S, retries, RETRY_MAX_S)


# A failed bring-up (a missing image, a full disk) is placed again after a backoff that doubles per
# failure in a row, from CREATE_BACKOFF_BASE_S up to CREATE_BACKOFF_MAX_S (as a kubelet's image-pull
# backoff), and the count starts again once a VM is bound: never once a second forever.
CREATE_BACKOFF_BASE_S = 1.0


CREATE_BACKOFF_MAX_S = 300.0


MAX_CAUSE_CHARS = 1024  # of an agent's error text kept in the log, a condition and an Event


def create_backoff_s(failures: int) -> float:
    """The delay before the bring-up that follows ``failures`` failed ones in a row."""
    return doubling_s(CREATE_BACKOFF_BASE_S, failures - 1, CREATE_BACKOFF_MAX_S)


class HostView(msgspec.Struct, frozen=True):
    """A live host as its heartbeat describes it, plus VMs the reconciler has placed there since."""

    name: str
    cpus_free: int
    memory_free_mib: int
    vms: int = 0


class DecideEnv(msgspec.Struct, frozen=True):
    """Everything besides state and input that a decision may depend on. Decisions that depend on
    it (placement, backoff) are logged, so replay never needs it."""

    hosts: Sequence[HostView] = ()
    restart_backoff_base_s: float = 10.0
    restart_backoff_max_s: float = 300.0
    writer: str = ""
    # a pod without ``spec.nodeName``: True — vmfence places it and binds it (pods/binding) before
    # its VM is made, as a scheduler does (no scheduler runs: the development server); False — it
    # waits for the scheduler's binding (a real control plane). The reconciler's --bind-unscheduled.
    bind_unscheduled: bool = True


class _Run:
    """Collects decisions while folding them into a working copy of the state."""

    def __init__(self, state: KeyState, env: DecideEnv, inp: Input | None = None) -> None:
        self.s = state
        self.env = env
        self.out: list[Decision] = []
        self.inp = inp
        self._tag: str | None = None
        self.fired: TimerArmed | None = None  # the armed timer whose firing is being decided

    def add(self, d: Decision) -> None:
        self.out.append(d)
        fold(self.s, d)

    @property
    def next_n(self) -> int:
        return self.s.n + 1

    def effect_id(self, *parts: object) -> str:
        """Deterministic effect ids: derived from the log position and the input, so replay and a
        redelivered input re-derive them. The key's epoch counter is part of it: after a lost tail
        the positions repeat, the epoch does not (Rebuilt lifts it). After a cut nobody saw, position
        and epoch both repeat: a digest of the input decided keeps an answer to a lost effect (a
        consistent read asked for another observation) from completing a new one."""
        if self._tag is None:
            self._tag = _digest(self.inp) if self.inp is not None else ""
        pos = f"{self.s.epoch}.{self.next_n}.{len(self.out)}"
        return ":".join(str(p) for p in (*parts, f"{pos}.{self._tag}" if self._tag else pos))


_digest_encoder = msgspec.msgpack.Encoder()


def _digest(inp: Input) -> str:
    return hashlib.blake2b(_digest_encoder.encode(inp), digest_size=4).hexdigest()


_size_encoder = msgspec.json.Encoder()


def within_bounds(inp: Input) -> Input:
    """An observation or consistent read whose encoding exceeds ``MAX_OBJECT_BYTES`` (a huge
    annotation: copies of its spec in one entry would pass the server's max payload, and the input
    would be redelivered forever) is decided as an invalid spec: a Warning Event and a condition say
    why, nothing of it is logged, and the key goes on."""
    if isinstance(inp, Observed | ConfirmedRead):
        size = len(_size_encoder.encode(inp))
        if size > MAX_OBJECT_BYTES:
            why = f"the object's vmfence fields take {size} bytes, above the bound of {MAX_OBJECT_BYTES}"
            return msgspec.structs.replace(inp, spec=Spec(), invalid=why)
    return inp


_copier = msgspec.msgpack.Encoder()


_copy_decoder = msgspec.msgpack.Decoder(KeyState)


def _copy(s: KeyState) -> KeyState:
    return _copy_decoder.decode(_copier.encode(s))


def _command(
    run: _Run, op: CommandOp, fence: Fence, host: str, vm_id: str, spec: Spec | None,
    snapshot: str | None = None,
) -> None:
    cmd = Command(
        # agents dedupe by id across all keys: the uid makes it global (the key stands in for a
        # survey, which belongs to no incarnation)
        id=run.effect_id(fence.uid or fence.key, fence.epoch, op, vm_id),
        op=op,
        fence=fence,
        host=host,
        vm_id=vm_id,
        spec=spec or Spec(),
        snapshot=snapshot,
    )
    run.add(Commanded(cmd))


# what a command re-sent by a RetryTimer carries from the incarnation, by op (as the first one did)
_CARRIES_SPEC: frozenset[CommandOp] = frozenset({"create", "start", "wake", "hibernate", "adopt"})


_CARRIES_SNAPSHOT: frozenset[CommandOp] = frozenset({"wake"})


# ops a RetryTimer re-sends only while their fence is current: an inspect checks a binding, and
# nothing may make, wake, snapshot or take over a VM for an incarnation that was superseded since
# the first try went unanswered (a create refused inconclusive by a host a newer writer verified)
_RETRY_WHILE_CURRENT: frozenset[CommandOp] = frozenset({"inspect", "create", "start", "wake", "hibernate", "adopt"})


def _cur_of(s: KeyState, fence: Fence) -> Incarnation | None:
    """The current incarnation if ``fence`` is its fence."""
    return s.cur if s.cur is not None and s.cur.fence == fence else None


def _arm(run: _Run, fence: Fence, purpose: TimerPurpose, delay_s: float) -> None:
    """Timers only ever re-check (rule 12); the purpose is stored, and named in the id, as text."""
    text = purpose_text(purpose)
    run.add(TimerArmed(fence, run.effect_id("timer", text), delay_s, text))


def _place_pending(s: KeyState, fence: Fence) -> bool:
    return any(
        isinstance(e, TimerArmed) and e.fence == fence and isinstance(e.timer, PlaceTimer)
        for e in s.outbox.values()
    )


def _event(
    run: _Run, fence: Fence, reason: EventReason, message: str, *, warning: bool = False, count: int = 1
) -> None:
    write = KubeWrite(
        run.effect_id("event"),
        "event",
        fence,
        event_reason=reason,
        event_type="Warning" if warning else "Normal",
        message=message,
        count=count,
    )
    run.add(WriteRequested(write))


def status_of(cur: Incarnation) -> PodStatusIntent:
    """The status a pod (or VirtualMachine) should show, derived from its incarnation."""
    reason: StatusReason | None = None
    if cur.invalid is not None:
        reason = "InvalidSpec"
    elif cur.hibernated:
        reason = "Hibernated"
    return PodStatusIntent(
        phase=cur.phase,
        ready=cur.ready and cur.bound,
        reason=reason,
        message=cur.invalid,
        vm_id=cur.vm_id if (cur.bound or cur.hibernated) else None,
        host=cur.host if cur.bound else None,
        ip=cur.ip if cur.bound else None,
        vnc_port=cur.vnc_port if cur.bound else None,
        restart_count=cur.restart_count,
        hibernated=cur.hibernated,
        invalid=cur.invalid,
    )


def wanted_status(s: KeyState, cur: Incarnation) -> PodStatusIntent | None:
    """The status the pod should show now; None while a pending VM is on its way (nothing worth
    writing until it is up)."""
    if cur.phase == "Pending" and not cur.invalid and not cur.hibernated:
        if not _place_pending(s, cur.fence):
            return None
        # the VM waits for a place: say why on the pod instead of leaving it silent — the last
        # bring-up's real cause while it backs off, else no live host fits
        reason: StatusReason = "FailedCreate" if cur.failures else "Unschedulable"
        message = (cur.failure or "the last bring-up failed") if cur.failures else \
            (cur.unplaced or "no live vmfence host has room for this VM")
        return msgspec.structs.replace(status_of(cur), reason=reason, message=message)
    return status_of(cur)


def _sync_status(run: _Run) -> None:
    cur = run.s.cur
    if cur is None or cur.delete_claim:
        return
    want = wanted_status(run.s, cur)
    if want is None or cur.status == want:
        return
    run.add(WriteRequested(KubeWrite(run.effect_id("status"), "status", cur.fence, status=want)))
