"""The policy tables and the dispatch over them: ``decide`` looks up the input's kind in ``_INPUTS``,
a result's (op, outcome) in ``_RESULTS``, a write's outcome in ``_WRITES``, a timer's typed purpose in
``_KEY_TIMERS`` / ``_CURRENT_TIMERS`` and a rewrite's verb in ``_REWRITES``.

Every cell of every table is a rule or a named CannotHappen; tests/unit/test_policy_table.py checks
that each product is covered and that the reading guide (the package's docstring) shows these cells."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from shared.fence.decide.confirmation import _on_confirmed
from shared.fence.decide.inventory import (
    _fences_of,
    _on_inventory,
    _rebuild,
    agent_epoch,
    cut_evidence,
    epoch_out_of_bounds,
)
from shared.fence.decide.lifecycle import _on_exited, _on_gone, _on_probe, _skip_foreign
from shared.fence.decide.observations import _on_observed
from shared.fence.decide.results import (
    _adopt_again,
    _adopt_lost,
    _adopted,
    _Answer,
    _fenced,
    _hibernate_failed,
    _hibernated,
    _inspect_gone,
    _inspected,
    _rec_on,
    _removed,
    _resurvey,
    _retry,
    _surveyed,
    _up_failed,
    _up_ok,
)
from shared.fence.decide.run import DecideEnv, _copy, _Run, _sync_status, within_bounds
from shared.fence.decide.timers import (
    _rewrite_bind,
    _rewrite_delete,
    _rewrite_evict,
    _rewrite_status,
    _timer_adopt,
    _timer_place,
    _timer_restart,
    _timer_retry,
    _timer_survey,
)
from shared.fence.decide.writes import _write_failed, _write_gone, _write_superseded, _written
from shared.fence.schema import (
    AdoptTimer,
    Commanded,
    CommandOp,
    CommandResult,
    ConfirmedRead,
    Decision,
    Done,
    Fence,
    Input,
    Inventoried,
    KubeWrite,
    Observed,
    PlaceTimer,
    ProbeChanged,
    RestartTimer,
    ResultOutcome,
    RetryTimer,
    RewriteTimer,
    Skipped,
    SurveyTimer,
    TimerArmed,
    TimerFired,
    UnknownTimer,
    VMExited,
    VMGone,
    WriteDone,
    WriteOutcome,
    WriteRequested,
    WriteVerb,
    purpose_text,
)
from shared.fence.state import Incarnation, KeyState


def decide(state: KeyState, inp: Input, env: DecideEnv | None = None) -> list[Decision]:
    """Decisions for one input. ``state`` is not modified (a copy is folded)."""
    inp = within_bounds(inp)
    run = _Run(_copy(state), env or DecideEnv(), inp)
    bad = epoch_out_of_bounds(state, inp)
    if bad is not None:
        # a fence no log of this key can have given (above MAX_EPOCH, negative, or further above
        # the log's epoch than any lost tail reaches): never evidence of a cut, never applied
        run.add(Skipped("epoch_out_of_bounds", _fences_of(inp)[0].uid or None, bad))
        return run.out
    why = cut_evidence(state, inp)
    if why is not None:
        # an agent holds a fence of this key the log never assigned (an epoch above all it knows, or
        # its newest epoch under another uid): the log lost entries that no reconciler saw (all
        # restarted without their data, or from a snapshot older than the cut). Rebuild as for a
        # detected cut; the survey rediscovers what this input said.
        _rebuild(run, agent_epoch(state, inp), why)
        return run.out
    _INPUTS[type(inp)](run, inp)
    _sync_status(run)
    return run.out


class CannotHappen(msgspec.Struct, frozen=True):
    """A cell no input reaches, and why. Should one fire after all, it is logged as
    ``Skipped(cannot_happen)`` naming the cell (counted by the audit and the reconciler's
    ``vmfence_pod_lifecycle_total{reason="cannot_happen"}``) and nothing else is done."""

    why: str


def _cannot_happen(run: _Run, cell: str, c: CannotHappen, uid: str | None) -> None:
    run.add(Skipped("cannot_happen", uid or None, f"{cell}: {c.why}"))


InputRule = Callable[[_Run, Any], None]  # each takes its own input type: the key is that type


ResultRule = Callable[[_Run, _Answer], None]


TimerRule = Callable[[_Run, Fence, Any], None]  # each takes its own purpose type


WriteRule = Callable[[_Run, Incarnation, KubeWrite], None]


def _on_result(run: _Run, r: CommandResult) -> None:
    """Finds the cell (command op, outcome) of ``_RESULTS``; the op is the one the log commanded."""
    s = run.s
    pending = s.outbox.get(r.command_id)
    if not isinstance(pending, Commanded):
        return  # redelivered result of a finished command
    cmd = pending.command
    if cmd.fence != r.fence or cmd.vm_id != r.vm_id:
        run.add(Skipped("stale_effect", r.fence.uid, f"result fence does not match command {cmd.id}"))
        return
    if r.host != cmd.host or any(i.host != cmd.host for i in r.found):
        run.add(Skipped("wrong_host", r.fence.uid, f"answer to {cmd.id} (sent to {cmd.host}) names {r.host}"))
        return
    rebuilding = s.rebuilding
    run.add(Done(cmd.id, r.outcome))
    answer = _Answer(cmd, r, _rec_on(s, cmd.vm_id, cmd.host), s.cur, rebuilding)
    cell = _RESULTS[cmd.op][r.outcome]
    if isinstance(cell, CannotHappen):
        _cannot_happen(run, f"result {cmd.op}/{r.outcome}", cell, r.fence.uid)
    else:
        cell(run, answer)


def _on_write_done(run: _Run, w: WriteDone) -> None:
    """Finds the cell of ``_WRITES`` for the outcome of a write still outstanding (rule 6)."""
    s = run.s
    pending = s.outbox.get(w.write_id)
    if not isinstance(pending, WriteRequested):
        return
    run.add(Done(w.write_id, w.outcome))
    cur = s.cur
    if cur is None or cur.fence != w.fence:
        return
    if w.outcome == "failed" and pending.write.verb == "bind":
        _write_failed(run, cur, pending.write, w.node)
        return
    _WRITES[w.outcome](run, cur, pending.write)


def _on_timer(run: _Run, t: TimerFired) -> None:
    """Finds the cell of ``_KEY_TIMERS`` (any fence of the key) or ``_CURRENT_TIMERS`` (only the
    current incarnation's) for the armed timer's typed purpose (rule 12: every one re-checks)."""
    s = run.s
    armed = s.outbox.get(t.timer_id)
    if not isinstance(armed, TimerArmed):
        return
    run.add(Done(t.timer_id, "fired"))
    run.fired = armed
    purpose = armed.timer
    kind = type(purpose)
    if kind in _KEY_TIMERS:
        cell: TimerRule | CannotHappen = _KEY_TIMERS[kind]
    else:
        cur = s.cur
        if cur is None or cur.fence != t.fence:
            _skip_foreign(run, t.fence, f"timer {armed.purpose}")
            return
        cell = _CURRENT_TIMERS[kind]
    if isinstance(cell, CannotHappen):
        _cannot_happen(run, f"timer {armed.purpose}", cell, t.fence.uid)
    else:
        cell(run, t.fence, purpose)


def _timer_rewrite(run: _Run, fence: Fence, p: RewriteTimer) -> None:
    """Finds the cell of ``_REWRITES`` for the write's verb."""
    cur = run.s.cur
    assert cur is not None  # a current-incarnation timer: _on_timer checked it
    cell = _REWRITES[p.verb]
    if isinstance(cell, CannotHappen):
        _cannot_happen(run, f"timer {purpose_text(p)}", cell, cur.fence.uid)
    else:
        cell(run, cur)


_INPUTS: dict[type, InputRule] = {
    Observed: _on_observed,
    ConfirmedRead: _on_confirmed,
    CommandResult: _on_result,
    VMExited: _on_exited,
    VMGone: _on_gone,
    ProbeChanged: _on_probe,
    Inventoried: _on_inventory,
    WriteDone: _on_write_done,
    TimerFired: _on_timer,
}


def _row(
    ok: ResultRule | CannotHappen,
    failed: ResultRule | CannotHappen,
    fenced: ResultRule | CannotHappen,
    not_found: ResultRule | CannotHappen,
    inconclusive: ResultRule | CannotHappen,
) -> dict[ResultOutcome, ResultRule | CannotHappen]:
    return {"ok": ok, "failed": failed, "fenced": fenced, "not_found": not_found, "inconclusive": inconclusive}


# the op is the command's as the log holds it, never the answer's own claim
_RESULTS: dict[CommandOp, dict[ResultOutcome, ResultRule | CannotHappen]] = {
    #                ok           failed             fenced   not_found          inconclusive
    "create": _row(_up_ok, _up_failed, _fenced, _up_failed, _retry),
    "start": _row(_up_ok, _up_failed, _fenced, _up_failed, _retry),
    "wake": _row(_up_ok, _up_failed, _fenced, _up_failed, _retry),
    "remove": _row(_removed, _retry, _fenced, _removed, _retry),
    "hibernate": _row(_hibernated, _hibernate_failed, _fenced, _hibernate_failed, _retry),
    "adopt": _row(_adopted, _adopt_lost, _fenced, _adopt_lost, _adopt_again),
    "survey": _row(_surveyed, _resurvey, _fenced, _resurvey, _resurvey),
    "inspect": _row(_inspected, _retry, _fenced, _inspect_gone, _retry),
}


_WRITES: dict[WriteOutcome, WriteRule] = {
    "ok": _written,
    "superseded": _write_superseded,
    "gone": _write_gone,
    "failed": _write_failed,
}


# timers for the key or a VM's owner, whichever incarnation is current
_KEY_TIMERS: dict[type, TimerRule | CannotHappen] = {
    SurveyTimer: _timer_survey,
    RetryTimer: _timer_retry,
    UnknownTimer: CannotHappen("every purpose decide arms is one of the typed ones"),
}


# timers of the current incarnation only: any other fence's is Skipped(superseded | stale_effect)
_CURRENT_TIMERS: dict[type, TimerRule | CannotHappen] = {
    PlaceTimer: _timer_place,
    RestartTimer: _timer_restart,
    AdoptTimer: _timer_adopt,
    RewriteTimer: _timer_rewrite,
}


_REWRITES: dict[WriteVerb, Callable[[_Run, Incarnation], None] | CannotHappen] = {
    "status": _rewrite_status,
    "delete": _rewrite_delete,
    "evict": _rewrite_evict,
    "bind": _rewrite_bind,
    "event": CannotHappen("events are fire-and-forget: never in the outbox, so never answered"),
}
