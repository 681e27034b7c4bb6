"""Inventory (rule 8) and lost log tails: a host's inventory, inspect before adopt, discovered VMs,
the epoch bounds and the evidence of a cut, the rebuild and its survey."""

from __future__ import annotations

from shared.fence.decide.run import PLACE_RETRY_MAX_S, PLACE_RETRY_S, DecideEnv, _arm, _command, _copy, _Run
from shared.fence.schema import (
    ABSENT,
    MAX_EPOCH,
    MAX_EPOCH_LEAP,
    NO_INCARNATION,
    SURVEY_VM_ID,
    Commanded,
    CommandResult,
    Decision,
    Discovered,
    Fence,
    Input,
    Inventoried,
    ProbeChanged,
    Rebuilt,
    RetryTimer,
    Skipped,
    SurveyTimer,
    TimerArmed,
    TimerFired,
    VMExited,
    VMGone,
    WriteDone,
)
from shared.fence.state import Incarnation, KeyState, VMRec


def _on_inventory(run: _Run, i: Inventoried) -> None:
    """Inventories are the backstop for runtime news whose own report never arrived (the agent
    died between the event and the report): an exit (exit code unknown), a VM the runtime lost,
    readiness."""
    if _wrong_host(run, i.vm_id, i.host, "inventory"):
        return
    rec = run.s.vms.get(i.vm_id)
    ours = rec is not None and rec.host == i.host and rec.fence == i.fence  # our record of that VM
    if i.state == "lost":
        if ours:
            _on_gone(run, VMGone(i.fence, i.host, i.vm_id))
        return  # a lost VM is never discovered: there is nothing to adopt or remove
    if i.state == ABSENT:
        if ours and rec is not None:
            _inspect(run, rec)
        return  # absence of a VM we do not bind there says nothing
    if rec is None:
        _discover(run, i, run.s.rebuilding)
    elif not ours:
        return
    elif i.state == "exited":
        if rec.state == "running":
            _on_exited(run, VMExited(i.fence, i.host, i.vm_id, None))
    elif i.state == "running" and i.ready is not None and (cur := run.s.cur) is not None \
            and cur.bound and cur.fence == i.fence and cur.vm_id == i.vm_id:
        # the probe's own report was decided before the binding (a redelivery reordered them) and
        # dropped, or never stored: the readiness the host last reported wins
        _on_probe(run, ProbeChanged(i.fence, i.host, i.vm_id, i.ready))


def _inspect(run: _Run, rec: VMRec) -> None:
    """A complete inventory of the VM's host lacked it (a forged remove, a lost vm-gone): evidence,
    not proof. The agent asks its runtime (rule 8); only its not_found takes the VM-gone path, an
    inconclusive answer is asked again (rule 12). One inspect of a VM at a time."""
    s, cur = run.s, run.s.cur
    if cur is None or cur.fence != rec.fence or cur.vm_id != rec.vm_id or not cur.bound or cur.deleting:
        return
    if rec.state != "running" or _inspecting(s, rec.vm_id):
        return
    _command(run, "inspect", rec.fence, rec.host, rec.vm_id, None)


def _inspecting(s: KeyState, vm_id: str) -> bool:
    return any(
        (isinstance(e, Commanded) and e.command.op == "inspect" and e.command.vm_id == vm_id)
        or (isinstance(e, TimerArmed) and e.timer == RetryTimer("inspect", vm_id))
        for e in s.outbox.values()
    )


def _discover(run: _Run, i: Inventoried, rebuilding: bool) -> None:
    """A VM the log does not know: record it under its agent-side owner, then adopt it if it is
    the current incarnation's only VM (after the agent inspects it), else remove it — never a
    leak, never a second VM for a key. ``rebuilding``: the report came while a lost tail was being
    rebuilt (a survey answer's own Done may have ended the rebuild since)."""
    s = run.s
    run.add(Discovered(i.fence, i.vm_id, i.host))
    cur = s.cur
    if (
        cur is not None
        and (cur.fence.uid == i.fence.uid or _adopts_predecessor(s, cur, i, rebuilding))
        and cur.vm_id is None
        and not (cur.deleting or cur.hibernated)
        and len(s.vms) == 1
    ):
        _command(run, "adopt", cur.fence, i.host, i.vm_id, cur.spec)
        return
    if not s.is_tombstoned(i.fence.uid) and (cur is None or cur.fence.uid != i.fence.uid):
        # an incarnation the log never admitted (its admission was in a lost tail): the VM may be
        # the live pod's. It stays ``discovered`` (no VM is made beside it) until a consistent read
        # says who owns the name: that incarnation adopts it, or it is removed (_collect_discovered)
        _request_confirm(run, i.fence.uid)
        return
    run.add(Skipped("orphan", i.fence.uid, f"VM {i.vm_id} on {i.host} belongs to no live incarnation"))
    _command(run, "remove", i.fence, i.host, i.vm_id, None)


def _collect_discovered(run: _Run) -> None:
    """VMs kept ``discovered`` while a read was out whose incarnation is now known dead: removed."""
    s = run.s
    for rec in list(s.vms.values()):
        if rec.state == "discovered" and s.is_tombstoned(rec.fence.uid):
            run.add(Skipped("orphan", rec.fence.uid, f"VM {rec.vm_id} on {rec.host} belongs to no live incarnation"))
            _command(run, "remove", rec.fence, rec.host, rec.vm_id, None)


def _adopts_predecessor(s: KeyState, cur: Incarnation, i: Inventoried, rebuilding: bool) -> bool:
    """After a lost log tail the predecessor's VM is known only from the survey: a successor with
    ``on-recreate: adopt`` takes it over as it would have at its admission (rule 8)."""
    return (
        rebuilding
        and cur.spec.on_recreate == "adopt"
        and s.is_tombstoned(i.fence.uid)
        and i.state not in ("removing", "hibernating")
    )


def rebuild(state: KeyState, known_epoch: int, env: DecideEnv | None = None, reason: str = "") -> list[Decision]:
    """Decisions for a key whose log turned out to be behind what its writer had seen (a lost
    tail): say so, lift the epoch above any the writer knew (so no agent holds a fence as new as
    the next incarnation's: rule 4), and survey every host before any VM is made again, since the
    lost tail's claims are known only to the agents now (rule 2; the fault campaign's scenario 17,
    ``log_tail_lost``)."""
    run = _Run(_copy(state), env or DecideEnv())
    _rebuild(run, known_epoch, reason or "log behind its writer")
    return run.out


def _rebuild(run: _Run, known_epoch: int, reason: str) -> None:
    run.add(Rebuilt(reason, epoch_floor=max(known_epoch, run.s.epoch)))
    _survey(run)


def agent_epoch(state: KeyState, inp: Input) -> int:
    """The newest epoch of this key an agent's report shows (0: none): the fences it carries (the
    owner of a VM it reports, a command's fence, the owners a fenced answer or a survey names) and
    a fenced answer's key mark. Epochs are assigned only by the key's log, so one above
    ``state.epoch`` proves the log lost entries; a stale copy of the log (another writer appended
    meanwhile) loses its append race and decides again on the re-read log."""
    return max([0, *(f.epoch for f in _agent_fences(state, inp))])


def epoch_out_of_bounds(state: KeyState, inp: Input) -> str | None:
    """Why a fence the input carries cannot be believed, or None: an epoch below 0 or above
    ``MAX_EPOCH``, or (for this key) more than ``MAX_EPOCH_LEAP`` above the log's epoch."""
    ceiling = min(MAX_EPOCH, state.epoch + MAX_EPOCH_LEAP)
    for f in _fences_of(inp):
        limit = ceiling if f.key == state.key else MAX_EPOCH
        if not 0 <= f.epoch <= limit:
            return f"epoch {f.epoch} outside 0..{limit} (the log of the key is at epoch {state.epoch})"
    return None


def _fences_of(inp: Input) -> list[Fence]:
    """Every fence an input carries (none for observations and reads)."""
    match inp:
        case CommandResult():
            return [inp.fence, *(i.fence for i in inp.found), Fence(inp.fence.key, inp.key_uid, inp.key_epoch)]
        case Inventoried() | VMExited() | VMGone() | ProbeChanged() | WriteDone() | TimerFired():
            return [inp.fence]
        case _:
            return []


def cut_evidence(state: KeyState, inp: Input) -> str | None:
    """Why an agent's report proves the key's log lost entries, or None. Epochs are assigned only by
    the key's log, each to one uid: a fence above ``state.epoch``, or at ``state.epoch`` under a uid
    other than ``state.epoch_uid``, was assigned by entries the log no longer holds."""
    seen = agent_epoch(state, inp)
    if seen > state.epoch:
        return f"an agent holds epoch {seen} of the key; the log knows only {state.epoch}"
    if not state.epoch_uid or seen < state.epoch:
        return None
    for f in _agent_fences(state, inp):
        if f.epoch == state.epoch and f.uid and f.uid != state.epoch_uid:
            return f"an agent holds epoch {f.epoch} of the key for {f.uid}; the log gave it to {state.epoch_uid}"
    return None


def _agent_fences(state: KeyState, inp: Input) -> list[Fence]:
    match inp:
        case CommandResult():
            fences = [inp.fence, *(i.fence for i in inp.found), Fence(state.key, inp.key_uid, inp.key_epoch)]
        case Inventoried() | VMExited() | VMGone() | ProbeChanged():
            fences = [inp.fence]
        case _:
            return []
    return [f for f in fences if f.key == state.key]


def _survey(run: _Run) -> None:
    s = run.s
    # under the owner of the key's epoch ("" if none: agents then hold that epoch for no incarnation)
    owner = s.cur.fence.uid if s.cur is not None else s.epoch_uid
    fence = Fence(s.key, "" if owner == NO_INCARNATION else owner, s.epoch)
    if not run.env.hosts:
        # no live host to ask: again after twice the wait that just ended (2 s, 4 s, … up to a
        # minute), as placement backs off; a host coming live fires it at once (the reconciler)
        last = run.fired.delay_s if run.fired is not None and isinstance(run.fired.timer, SurveyTimer) else 0.0
        _arm(run, fence, SurveyTimer(), min(max(PLACE_RETRY_S, 2 * last), PLACE_RETRY_MAX_S))
        return
    for host in run.env.hosts:
        _command(run, "survey", fence, host.name, SURVEY_VM_ID, None)


# The sections' rules call each other (a bring-up may wake, a wake may survey first, a VM found
# gone is brought up again): each imports the others' after its own definitions, so the
# package imports in any order.
from shared.fence.decide.lifecycle import _on_exited, _on_gone, _on_probe, _wrong_host  # noqa: E402
from shared.fence.decide.observations import _request_confirm  # noqa: E402
