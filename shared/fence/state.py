"""Per-key state and ``fold``: the one way a decision changes it.

The reconciler, the audit and the tests all fold the same decisions with this function, so a
replayed log re-derives exactly the state its writer had. ``fold`` is total and pure: it never
rejects a decision (that is the audit's job) and never looks at anything but its arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import msgspec

from shared.fence.schema import (
    NO_INCARNATION,
    Admitted,
    Adopted,
    AdoptTimer,
    Bound,
    BringUpFailed,
    Commanded,
    ConfirmRequested,
    Decision,
    DeleteClaimed,
    Discovered,
    Done,
    EvictionDeferred,
    EvictionRequested,
    Failed,
    Fence,
    Forgotten,
    Hibernated,
    Phase,
    Placed,
    PodStatusIntent,
    ReadyChanged,
    Rebuilt,
    Released,
    Restarting,
    RetryTimer,
    RewriteTimer,
    Skipped,
    Spec,
    SpecChanged,
    Succeeded,
    Superseded,
    SurveyTimer,
    TimerArmed,
    WriteRequested,
    purpose_text,
)

# How many superseded UIDs a key remembers. UIDs are never reused by Kubernetes, so an input for an
# incarnation older than this many generations is also caught by the epoch/uid checks that follow;
# the bound keeps an often-recreated key's state small.
TOMBSTONE_LIMIT = 64

# the stored purposes (schema.purpose_text) of timers that send a command on a VM again
_RESENDS = ("retry/", "adopt/")
_SURVEY = purpose_text(SurveyTimer())
_REWRITE_STATUS = purpose_text(RewriteTimer("status"))

VMState = Literal[
    "creating", "running", "exited", "removing", "hibernating", "waking", "adopting", "discovered"
]

Effect = Commanded | WriteRequested | ConfirmRequested | TimerArmed


class VMRec(msgspec.Struct, omit_defaults=True):
    """A VM this key has (or may have) somewhere, and the fence that owns it."""

    vm_id: str
    host: str
    fence: Fence
    state: VMState
    retries: int = 0  # re-sends of a command on it (RetryTimer, AdoptTimer) since its last ok: their backoff


class Incarnation(msgspec.Struct, omit_defaults=True):
    """The current incarnation of a key: the only one anything may be applied to."""

    fence: Fence
    spec: Spec
    rv: int = 0
    invalid: str | None = None
    phase: Phase = "Pending"
    deleting: bool = False
    delete_claim: bool = False
    vm_id: str | None = None  # the VM made (or being made) for this incarnation
    bound: bool = False
    host: str | None = None
    ip: str | None = None
    vnc_port: int | None = None
    gen: int = 0
    restart_count: int = 0
    ready: bool = False
    eviction_deferred: str | None = None
    evicting: bool = False
    snapshot: str | None = None
    snapshot_host: str | None = None
    hibernated: bool = False
    status: PodStatusIntent | None = None  # the last status requested
    admitted_at: int = 0  # log position of its admission
    # bring-ups that failed in a row (create/start/wake answered failed or not_found), and the last
    # one's cause: the next is placed after a backoff that doubles per failure (decide.results._up_failed)
    failures: int = 0
    failure: str | None = None
    failure_repeats: int = 0  # of those, the last ones in a row that failed for ``failure``
    unplaced: str | None = None  # why no host takes its VM now (the last Skipped(no_host)); None once placed
    unplaced_tries: int = 0  # Skipped(no_host) since it was last placed: the place timer's backoff
    write_failures: int = 0  # its Kubernetes writes that failed in a row: the rewrite timer's backoff
    hibernated_vm: str | None = None  # the VM a hibernation saved (its host holds the snapshot and address)


class KeyState(msgspec.Struct, omit_defaults=True):
    key: str
    n: int = 0  # entries folded so far (the next append is n + 1)
    epoch: int = 0
    admitted_rv: int = 0  # resourceVersion of the newest admitted incarnation's confirmed read
    cur: Incarnation | None = None
    tombstones: list[str] = msgspec.field(default_factory=list)
    vms: dict[str, VMRec] = msgspec.field(default_factory=dict)
    outbox: dict[str, Effect] = msgspec.field(default_factory=dict)
    rebuilding: bool = False  # after a lost tail: no VM is made until every host was surveyed
    # the uid the log gave ``epoch`` to ("" before any, or after a rebuild with no incarnation). An
    # agent showing another uid at that epoch shows a lost tail (decide.cut_evidence).
    epoch_uid: str = msgspec.field(default="", name="eu")
    # set by the shell, never by a decision: the writer loaded this key from the log (a restart, a
    # handover) and cannot know whether the log lost a tail before it did. The first VM it makes for
    # the key waits for a survey of every host; the fold of that survey's last answer clears it.
    unverified: bool = msgspec.field(default=False, name="uv")
    # survey commands issued while ``unverified``: only a round issued after the load verifies (a
    # round from before it, re-sent from the outbox, may describe hosts as they were long ago)
    verifying: list[str] = msgspec.field(default_factory=list, name="vf")
    # survey rounds with a failed answer (no answer to trust) since one every host answered: the
    # re-survey's backoff (decide.retry_backoff_s)
    survey_failures: int = msgspec.field(default=0, name="sf")

    def is_tombstoned(self, uid: str) -> bool:
        return uid in self.tombstones

    def is_current(self, fence: Fence) -> bool:
        return self.cur is not None and self.cur.fence == fence

    def live_vms(self) -> list[VMRec]:
        return list(self.vms.values())


def _tombstone(s: KeyState, uid: str) -> None:
    if uid not in s.tombstones:
        s.tombstones.append(uid)
        if len(s.tombstones) > TOMBSTONE_LIMIT:
            del s.tombstones[0 : len(s.tombstones) - TOMBSTONE_LIMIT]


def _cur_for(s: KeyState, fence: Fence) -> Incarnation | None:
    return s.cur if s.cur is not None and s.cur.fence == fence else None


# ``fold`` is a table, one function per decision type: a replay folds millions of decisions, and
# a dictionary lookup by type costs the same for every type where a chain of class patterns costs
# one isinstance test per case tried before the match. tests/unit/test_fold_table.py checks that
# every member of ``Decision`` has exactly one entry.


def _done(s: KeyState, d: Done) -> None:
    eid = d.effect_id
    done = s.outbox.pop(eid, None)
    if isinstance(done, Commanded) and d.outcome == "ok" and (rec := s.vms.get(done.command.vm_id)) is not None:
        rec.retries = 0
    if isinstance(done, WriteRequested) and (c := _cur_for(s, done.write.fence)) is not None:
        c.write_failures = c.write_failures + 1 if d.outcome == "failed" else 0
    if isinstance(done, Commanded) and done.command.op == "survey":
        if d.outcome == "ok" and not any(_is_survey(e) for e in s.outbox.values()):
            s.rebuilding = False  # the round's last answer, and none failed (its retry is armed)
            s.survey_failures = 0
        elif d.outcome not in ("ok", "fenced") and not survey_retry_armed(s):
            s.survey_failures += 1  # the round's first failed answer (its retry is not armed yet)
    if s.verifying and eid in s.verifying:
        if d.outcome != "ok":
            s.verifying.clear()  # the round failed; the next one verifies
        else:
            s.verifying.remove(eid)
            if not s.verifying and isinstance(done, Commanded) and done.command.fence.epoch >= s.epoch:
                # every host answered a survey sent since the load at the current epoch:
                # each has raised its key mark to it, so a command of a lost tail at or
                # below it is refused there, and what each has of the key is known
                s.unverified = False


def _write_requested(s: KeyState, d: WriteRequested) -> None:
    w = d.write
    verb = w.verb
    if verb != "event":
        s.outbox[w.id] = d
    if verb == "status" and (c := _cur_for(s, w.fence)) is not None:
        c.status = w.status


def _commanded(s: KeyState, d: Commanded) -> None:
    cmd = d.command
    op = cmd.op
    s.outbox[cmd.id] = d
    if s.unverified and op == "survey":
        s.verifying.append(cmd.id)
    rec = s.vms.get(cmd.vm_id)
    if rec is not None:
        if op == "remove":
            rec.state = "removing"
        elif op == "hibernate":
            rec.state = "hibernating"
        elif op == "adopt":
            rec.state = "adopting"
        elif op in ("start", "wake"):
            rec.state = "waking" if op == "wake" else "creating"
    elif op == "wake":
        s.vms[cmd.vm_id] = VMRec(cmd.vm_id, cmd.host, cmd.fence, "waking")
    elif op == "remove":
        s.vms[cmd.vm_id] = VMRec(cmd.vm_id, cmd.host, cmd.fence, "removing")
    elif op == "adopt":
        s.vms[cmd.vm_id] = VMRec(cmd.vm_id, cmd.host, cmd.fence, "adopting")


def _released(s: KeyState, d: Released) -> None:
    vm_id = d.vm_id
    s.vms.pop(vm_id, None)
    if (c := _cur_for(s, d.fence)) is not None and c.vm_id == vm_id:
        c.bound, c.ready, c.vm_id = False, False, None


def _skipped(s: KeyState, d: Skipped) -> None:
    if d.reason == "no_host" and s.cur is not None and s.cur.fence.uid == d.uid:
        s.cur.unplaced = d.detail
        s.cur.unplaced_tries += 1


def _ready_changed(s: KeyState, d: ReadyChanged) -> None:
    if (c := _cur_for(s, d.fence)) is not None:
        c.ready = d.ready


def _confirm_requested(s: KeyState, d: ConfirmRequested) -> None:
    s.outbox[d.request] = d


def _admitted(s: KeyState, d: Admitted) -> None:
    f = d.fence
    if f.epoch >= s.epoch:
        s.epoch_uid = f.uid
    s.epoch = max(s.epoch, f.epoch)
    s.admitted_rv = max(s.admitted_rv, d.resource_version)
    s.cur = Incarnation(fence=f, spec=d.spec, invalid=d.invalid, rv=d.resource_version, admitted_at=s.n + 1)
    for rec in s.vms.values():
        _note_name(s, rec.fence.uid, rec.vm_id)


def _placed(s: KeyState, d: Placed) -> None:
    f, vm_id, host = d.fence, d.vm_id, d.host
    s.vms[vm_id] = VMRec(vm_id=vm_id, host=host, fence=f, state="creating")
    if (c := _cur_for(s, f)) is not None:
        c.vm_id, c.host, c.bound, c.gen = vm_id, host, False, c.gen + 1
        c.unplaced, c.unplaced_tries = None, 0


def _bound(s: KeyState, d: Bound) -> None:
    f, vm_id, host = d.fence, d.vm_id, d.host
    rec = s.vms.get(vm_id)
    if rec is None:
        rec = s.vms[vm_id] = VMRec(vm_id, host, f, "running")
    rec.fence, rec.state, rec.host = f, "running", host
    if (c := _cur_for(s, f)) is not None:
        c.vm_id, c.host, c.bound, c.ip, c.vnc_port = vm_id, host, True, d.ip, d.vnc_port
        c.phase = "Running"
        c.hibernated = False
        c.snapshot = c.snapshot_host = c.hibernated_vm = None
        c.failures, c.failure, c.failure_repeats = 0, None, 0


def _delete_claimed(s: KeyState, d: DeleteClaimed) -> None:
    if (c := _cur_for(s, d.fence)) is not None:
        c.delete_claim, c.deleting = True, True


def _forgotten(s: KeyState, d: Forgotten) -> None:
    f = d.fence
    _tombstone(s, f.uid)
    if s.cur is not None and s.cur.fence.uid == f.uid:
        s.cur = None
    # its writes and timers can no longer matter; its commands still can (a late result
    # may move a VM's ownership), so they stay until answered -- and so does a survey's retry:
    # a survey belongs to the key, and a rebuilt or unverified key waits for its answers
    for eid, eff in list(s.outbox.items()):
        if _effect_fence(eff) == f and not isinstance(eff, Commanded) and not _is_survey(eff):
            del s.outbox[eid]


def _superseded(s: KeyState, d: Superseded) -> None:
    f = d.fence
    _tombstone(s, f.uid)
    if s.cur is not None and s.cur.fence.uid == f.uid:
        s.cur = None


def _adopted(s: KeyState, d: Adopted) -> None:
    rec = s.vms.get(d.vm_id)
    if rec is not None:
        rec.fence, rec.state, rec.host = d.fence, "running", d.host


def _eviction_requested(s: KeyState, d: EvictionRequested) -> None:
    if (c := _cur_for(s, d.fence)) is not None:
        c.evicting = True
        c.eviction_deferred = None


def _eviction_deferred(s: KeyState, d: EvictionDeferred) -> None:
    if (c := _cur_for(s, d.fence)) is not None:
        c.eviction_deferred = d.vm_id


def _hibernated(s: KeyState, d: Hibernated) -> None:
    vm_id = d.vm_id
    s.vms.pop(vm_id, None)
    if (c := _cur_for(s, d.fence)) is not None:
        c.hibernated, c.snapshot, c.snapshot_host = True, d.snapshot, d.host
        c.hibernated_vm = vm_id
        c.bound, c.ready, c.vm_id = False, False, None


def _restarting(s: KeyState, d: Restarting) -> None:
    if (c := _cur_for(s, d.fence)) is not None:
        c.restart_count, c.ready = d.restart_count, False
        if c.vm_id in s.vms:
            s.vms[c.vm_id].state = "exited"


def _bring_up_failed(s: KeyState, d: BringUpFailed) -> None:
    if (c := _cur_for(s, d.fence)) is not None:
        c.failures, c.failure, c.failure_repeats = d.failures, d.cause, d.repeats


def _failed(s: KeyState, d: Failed) -> None:
    if (c := _cur_for(s, d.fence)) is not None:
        c.phase, c.ready = "Failed", False


def _succeeded(s: KeyState, d: Succeeded) -> None:
    if (c := _cur_for(s, d.fence)) is not None:
        c.phase, c.ready = "Succeeded", False


def _spec_changed(s: KeyState, d: SpecChanged) -> None:
    if (c := _cur_for(s, d.fence)) is not None:
        c.spec, c.rv, c.invalid = d.spec, d.resource_version, d.invalid


def _timer_armed(s: KeyState, d: TimerArmed) -> None:
    s.outbox[d.timer_id] = d
    if d.purpose.startswith(_RESENDS):  # a command on a VM sent again: counted for its backoff
        timer = d.timer
        if isinstance(timer, RetryTimer | AdoptTimer) and (rec := s.vms.get(timer.vm_id)) is not None:
            rec.retries += 1


def _rebuilt(s: KeyState, d: Rebuilt) -> None:
    # Nothing the lost tail may have done is trusted: the current incarnation is fenced
    # anew above every epoch its writer knew, its VM knowledge is dropped (the survey
    # rediscovers what hosts really have), and commands still in flight are forgotten
    # (agents refuse them: their epochs are below the survey's).
    floor = d.epoch_floor
    s.epoch = max(s.epoch, floor) + 1
    s.rebuilding = True
    s.vms.clear()
    s.verifying.clear()
    for eid, eff in list(s.outbox.items()):
        if isinstance(eff, Commanded):
            del s.outbox[eid]
    s.epoch_uid = s.cur.fence.uid if s.cur is not None else NO_INCARNATION
    if s.cur is not None:
        c = s.cur
        c.fence = Fence(s.key, c.fence.uid, s.epoch)
        c.vm_id, c.bound, c.ready = None, False, False


def _discovered(s: KeyState, d: Discovered) -> None:
    f, vm_id, host = d.fence, d.vm_id, d.host
    _note_name(s, f.uid, vm_id)
    rec = s.vms.get(vm_id)
    if rec is None:
        s.vms[vm_id] = VMRec(vm_id=vm_id, host=host, fence=f, state="discovered")
    else:
        rec.fence, rec.host = f, host


FOLDS: dict[type[msgspec.Struct], Callable[[KeyState, Any], None]] = {
    Done: _done,
    WriteRequested: _write_requested,
    Commanded: _commanded,
    Released: _released,
    Skipped: _skipped,
    ReadyChanged: _ready_changed,
    ConfirmRequested: _confirm_requested,
    Admitted: _admitted,
    Placed: _placed,
    Bound: _bound,
    DeleteClaimed: _delete_claimed,
    Forgotten: _forgotten,
    Superseded: _superseded,
    Adopted: _adopted,
    EvictionRequested: _eviction_requested,
    EvictionDeferred: _eviction_deferred,
    Hibernated: _hibernated,
    Restarting: _restarting,
    BringUpFailed: _bring_up_failed,
    Failed: _failed,
    Succeeded: _succeeded,
    SpecChanged: _spec_changed,
    TimerArmed: _timer_armed,
    Rebuilt: _rebuilt,
    Discovered: _discovered,
}


def fold(s: KeyState, d: Decision) -> KeyState:
    """Apply one decision to ``s`` in place and return it (the table's function for its type)."""
    FOLDS[type(d)](s, d)
    return s


def vm_name(key: str, uid: str, gen: int) -> str:
    """The name of an incarnation's ``gen``-th VM: ``<pod name>-<uid[:8]>-<gen>``."""
    name = key.rsplit("/", 1)[-1]
    safe = "".join(ch if ch.isalnum() or ch == "-" else "-" for ch in name.lower())[:40].strip("-")
    return f"{safe or 'vm'}-{uid.replace('-', '')[:8]}-{gen}"


def _note_name(s: KeyState, uid: str, vm_id: str) -> None:
    """A VM of the current incarnation the log did not make (a lost tail did): its name is never
    given again, so the next VM's generation goes past it."""
    if s.cur is not None and s.cur.fence.uid == uid:
        s.cur.gen = max(s.cur.gen, _gen_of(s.key, uid, vm_id))


def _gen_of(key: str, uid: str, vm_id: str) -> int:
    """The generation in a VM name of this incarnation (0: not one of its names)."""
    prefix = vm_name(key, uid, 0)[:-1]
    tail = vm_id[len(prefix):] if vm_id.startswith(prefix) else ""
    return int(tail) if tail.isdigit() else 0


def survey_pending(s: KeyState) -> bool:
    """A survey round of the key is out, or its retry is armed."""
    return bool(s.verifying) or any(_is_survey(e) for e in s.outbox.values())


def survey_retry_armed(s: KeyState) -> bool:
    """A retry of the key's survey round is armed (one at a time: its round asks every host)."""
    return any(isinstance(e, TimerArmed) and e.purpose == _SURVEY for e in s.outbox.values())


def status_write_out(s: KeyState, fence: Fence) -> bool:
    """A status write of ``fence`` is on its way, or a rewrite of it armed: either writes the
    status wanted when it goes, so a failed one needs no retry of its own (one per status change,
    through an API-server outage, piled up)."""
    for e in s.outbox.values():
        if isinstance(e, WriteRequested) and e.write.verb == "status" and e.write.fence == fence:
            return True
        if isinstance(e, TimerArmed) and e.purpose == _REWRITE_STATUS and e.fence == fence:
            return True
    return False


def _is_survey(eff: Effect) -> bool:
    return (isinstance(eff, Commanded) and eff.command.op == "survey") or (
        isinstance(eff, TimerArmed) and isinstance(eff.timer, SurveyTimer)
    )


def _effect_fence(eff: Effect) -> Fence | None:
    match eff:
        case Commanded(command=c):
            return c.fence
        case WriteRequested(write=w):
            return w.fence
        case TimerArmed(fence=f):
            return f
        case ConfirmRequested():
            return None


def fold_all(s: KeyState, decisions: list[Decision]) -> KeyState:
    for d in decisions:
        fold(s, d)
    return s


_state_encoder = msgspec.msgpack.Encoder()
_state_decoder = msgspec.msgpack.Decoder(KeyState)


def encode_state(s: KeyState) -> bytes:
    return _state_encoder.encode(s)


def decode_state(data: bytes) -> KeyState:
    return _state_decoder.decode(data)
