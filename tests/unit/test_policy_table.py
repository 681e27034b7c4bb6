"""The fence policy as data: every cell of every table is a rule or a named "cannot happen", the
reading guide in the decide package's docstring shows exactly these cells, a cannot-happen cell that fires
is logged and counted, and the typed vocabularies still read every log ever written."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from typing import Any, get_args

import msgspec
import pytest

from services.testbed.chaos.seeds import _step
from services.testbed.world import World
from shared.fence import decide as policy
from shared.fence.audit import audit
from shared.fence.decide import CannotHappen, decide
from shared.fence.schema import (
    AdoptTimer,
    Command,
    Commanded,
    CommandOp,
    CommandResult,
    Done,
    Fence,
    Input,
    LogEntry,
    PlaceTimer,
    RestartTimer,
    ResultOutcome,
    RetryTimer,
    RewriteTimer,
    Skipped,
    SurveyTimer,
    TimerArmed,
    TimerFired,
    TimerPurpose,
    UnknownTimer,
    WriteOutcome,
    WriteVerb,
    decode_entry,
    encode,
    parse_purpose,
    purpose_text,
)
from shared.fence.state import KeyState, fold_all
from tests.unit.driver import KEY, Driver, of

OPS: tuple[str, ...] = get_args(CommandOp)
OUTCOMES: tuple[str, ...] = get_args(ResultOutcome)


def _cell_name(cell: Callable[..., None] | CannotHappen) -> str:
    return "-" if isinstance(cell, CannotHappen) else cell.__name__.lstrip("_")


def _is_cell(cell: object) -> bool:
    return callable(cell) or (isinstance(cell, CannotHappen) and bool(cell.why))


# ------------------------------------------------------------------------- the product is covered


def test_every_input_kind_has_a_rule() -> None:
    kinds = get_args(Input)
    assert set(policy._INPUTS) == set(kinds) and len(policy._INPUTS) == len(kinds)
    assert all(callable(rule) for rule in policy._INPUTS.values())


def test_every_command_op_and_outcome_is_a_rule_or_a_named_cannot_happen() -> None:
    assert set(policy._RESULTS) == set(OPS)
    for op in OPS:
        row = policy._RESULTS[op]  # type: ignore[index]
        assert set(row) == set(OUTCOMES), op
        for outcome in OUTCOMES:
            assert _is_cell(row[outcome]), (op, outcome)  # type: ignore[index]


def test_every_write_outcome_timer_purpose_and_rewritten_verb_has_a_cell() -> None:
    assert set(policy._WRITES) == set(get_args(WriteOutcome))
    purposes = set(get_args(TimerPurpose))
    key_timers, current_timers = set(policy._KEY_TIMERS), set(policy._CURRENT_TIMERS)
    assert key_timers.isdisjoint(current_timers) and key_timers | current_timers == purposes
    assert set(policy._REWRITES) == set(get_args(WriteVerb))
    cells: list[Any] = [
        *policy._WRITES.values(), *policy._KEY_TIMERS.values(), *policy._CURRENT_TIMERS.values(),
        *policy._REWRITES.values(),
    ]
    assert all(_is_cell(c) for c in cells)


# ------------------------------------------------------------------ cannot happen: logged, counted


def _with_effect(effect: Commanded | TimerArmed) -> KeyState:
    d = Driver()
    d.run_up("u1")
    fold_all(d.state, [effect])
    return d.state


def test_a_cannot_happen_result_cell_is_logged_as_a_skip_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    # every result cell is a rule today (decide commands inspect since issue 10, finding 5): one is
    # made a named cannot-happen to show what such a cell does should one fire
    monkeypatch.setitem(policy._RESULTS["inspect"], "ok", CannotHappen("decide never commands inspect"))
    fence = Fence(KEY, "u1", 1)
    inspect = Command("insp-1", "inspect", fence, "host-a", "vm-x")
    state = _with_effect(Commanded(inspect))
    out = decide(state, CommandResult(fence, inspect.id, "inspect", "host-a", "vm-x", "ok"))
    assert of(out, Done) == [Done(inspect.id, "ok")], "the effect still leaves the outbox"
    (skip,) = of(out, Skipped)
    assert skip.reason == "cannot_happen" and skip.uid == "u1"
    assert skip.detail.startswith("result inspect/ok: ") and "never commands inspect" in skip.detail
    assert [type(x) for x in out] == [Done, Skipped], "nothing else is decided"
    report = audit([LogEntry(KEY, 1, out)], final=False)
    assert report.skipped == {"cannot_happen": 1}


@pytest.mark.parametrize(("purpose", "cell"), [("bogus", "timer bogus"), ("rewrite/event", "timer rewrite/event")])
def test_a_cannot_happen_timer_cell_is_logged_as_a_skip(purpose: str, cell: str) -> None:
    fence = Fence(KEY, "u1", 1)
    state = _with_effect(TimerArmed(fence, "t-1", 1.0, purpose))
    out = decide(state, TimerFired(fence, "t-1"))
    assert of(out, Done) == [Done("t-1", "fired")]
    assert [(s.reason, s.detail.split(":")[0]) for s in of(out, Skipped)] == [("cannot_happen", cell)]


def _campaign_logs(seeds: int) -> list[LogEntry]:
    entries: list[LogEntry] = []
    for seed in range(seeds):
        rng = random.Random(seed)
        world = World(keys=2, vm_keys=1 if rng.random() < 0.3 else 0)
        for _ in range(80):
            _step(world, rng, Counter())
        world.settle(limit=20000)
        entries += world.log
    return entries


def test_the_model_campaign_never_reaches_a_cannot_happen_cell_and_its_logs_decode() -> None:
    """The cells named impossible stay unreached under the fault model's churn, and every value the
    policy logs belongs to the typed vocabularies (a strict decode refuses anything else)."""
    entries = _campaign_logs(150)  # (a restart timer is rare in the churn: one in about 60 seeds)
    decisions = [d for e in entries for d in decode_entry(encode(e)).decisions]
    assert len(decisions) > 5000
    assert not [d for d in decisions if isinstance(d, Skipped) and d.reason == "cannot_happen"]
    assert not [d for d in decisions if isinstance(d, Commanded) and d.command.op == "inspect"]
    timers = [d.timer for d in decisions if isinstance(d, TimerArmed)]
    assert timers and not [t for t in timers if isinstance(t, UnknownTimer)]
    kinds = {type(t) for t in timers}
    assert RestartTimer in kinds and kinds <= set(get_args(TimerPurpose)) - {UnknownTimer}, kinds


# ------------------------------------------------------------------------ timer purposes, typed


@pytest.mark.parametrize(
    ("text", "typed"),
    [
        ("place", PlaceTimer()),
        ("survey", SurveyTimer()),
        ("restart/web-v1-u1-1", RestartTimer("web-v1-u1-1")),
        ("adopt/web-v1-u1-1", AdoptTimer("web-v1-u1-1")),
        ("retry/remove/web-v1-u1-1", RetryTimer("remove", "web-v1-u1-1")),
        ("retry/hibernate/web-v1-u1-1", RetryTimer("hibernate", "web-v1-u1-1")),
        ("rewrite/status", RewriteTimer("status")),
        ("rewrite/evict", RewriteTimer("evict")),
    ],
)
def test_stored_purposes_read_as_typed_values_and_write_back_unchanged(text: str, typed: TimerPurpose) -> None:
    assert parse_purpose(text) == typed
    assert purpose_text(typed) == text


@pytest.mark.parametrize(
    "text", ["", "restart", "restart/", "retry/reboot/vm-1", "retry/remove", "rewrite/patch", "x/y"]
)
def test_a_purpose_no_writer_stores_is_unknown_never_guessed(text: str) -> None:
    assert parse_purpose(text) == UnknownTimer(text)
    assert purpose_text(UnknownTimer(text)) == text


# An entry as writers before the typed vocabularies wrote it (the wire form is unchanged): timers
# with string purposes, reasons and outcomes as strings, and a skip reason no longer produced.
OLD_LOG = [
    b'{"key":"default/web","n":1,"decisions":[{"type":"confirm_requested","request":"confirm:0.1.0.ab12cd34",'
    b'"seen_uid":"u1","at":1}],"input":"observed","writer":"r1"}',
    b'{"key":"default/web","n":2,"decisions":[{"type":"done","effect_id":"confirm:0.1.0.ab12cd34",'
    b'"outcome":"confirmed"},{"type":"admitted","fence":["default/web","u1",1],"spec":{},"invalid":null,'
    b'"resource_version":3},{"type":"placed","fence":["default/web","u1",1],"vm_id":"web-u1-1","host":"h"},'
    b'{"type":"commanded","command":{"id":"u1:1:create:web-u1-1:1.2.2","op":"create","fence":'
    b'["default/web","u1",1],"host":"h","vm_id":"web-u1-1"}}],"writer":"r1"}',
    b'{"key":"default/web","n":3,"decisions":[{"type":"done","effect_id":"u1:1:create:web-u1-1:1.2.2",'
    b'"outcome":"failed"},{"type":"released","fence":["default/web","u1",1],"vm_id":"web-u1-1","host":"h",'
    b'"reason":"create_failed","command_id":"u1:1:create:web-u1-1:1.2.2"},{"type":"timer_armed","fence":'
    b'["default/web","u1",1],"timer_id":"timer:place:1.3.2","delay_s":1.0,"purpose":"place"},'
    b'{"type":"timer_armed","fence":["default/web","u1",1],"timer_id":"timer:retry/remove/old-1:1.3.3",'
    b'"delay_s":1.0,"purpose":"retry/remove/old-1"},{"type":"skipped","reason":"invalid_spec","uid":"u1",'
    b'"detail":"vmfence.io/cpus"}],"writer":"r1"}',
]


def test_entries_written_before_the_typed_vocabularies_decode_replay_and_encode_the_same() -> None:
    entries = [decode_entry(raw) for raw in OLD_LOG]
    report = audit(entries)
    assert report.clean, report.violations
    assert report.skipped == {"invalid_spec": 1}
    state = KeyState(key="default/web")
    for e in entries:
        fold_all(state, e.decisions)
    timers = sorted((t.timer_id, t.timer) for t in state.outbox.values() if isinstance(t, TimerArmed))
    assert [t for _, t in timers] == [PlaceTimer(), RetryTimer("remove", "old-1")]
    for raw, entry in zip(OLD_LOG, entries, strict=True):
        assert msgspec.json.decode(encode(entry)) == msgspec.json.decode(raw)


def test_a_value_outside_the_vocabulary_is_refused_not_misread() -> None:
    bad = OLD_LOG[2].replace(b'"reason":"create_failed"', b'"reason":"exploded"')
    with pytest.raises(msgspec.ValidationError):
        decode_entry(bad)


# ---------------------------------------------------------------- the reading guide is the table


def _guide() -> str:
    assert policy.__doc__ is not None
    return policy.__doc__


def _block(title: str) -> list[str]:
    """The indented lines under the guide's paragraph that starts with ``title``."""
    lines = _guide().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    body = lines[start + 1 :]
    while body and not body[0].startswith("    "):
        body = body[1:]  # the rest of the paragraph, then the blank line before the block
    end = next((i for i, line in enumerate(body) if not line.startswith("    ")), len(body))
    return [line[4:].rstrip() for line in body[:end]]


def render_results() -> list[str]:
    rows = [["op", *OUTCOMES]] + [
        [op, *(_cell_name(policy._RESULTS[op][o]) for o in OUTCOMES)]  # type: ignore[index]
        for op in OPS
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def render_timers() -> list[str]:
    rows = [
        *((t.__name__, "any fence", _cell_name(c)) for t, c in policy._KEY_TIMERS.items()),
        *((t.__name__, "current", _cell_name(c)) for t, c in policy._CURRENT_TIMERS.items()),
        *((f"  rewrite {v}", "current", _cell_name(c)) for v, c in policy._REWRITES.items()),
    ]
    return [f"{a:<18}{b:<11}{c}".rstrip() for a, b, c in rows]


def test_the_reading_guide_names_every_input_kind_in_the_tables_order() -> None:
    rows = _block("Reading guide")
    names = [line.split("  ")[0] for line in rows[2:] if line[:1] not in ("", " ")]
    assert names == [t.__name__ for t in policy._INPUTS]


def test_the_reading_guides_result_cells_are_the_tables() -> None:
    assert _block("Agent results") == render_results(), "\n" + "\n".join(render_results())


def test_the_reading_guides_timer_cells_are_the_tables() -> None:
    assert _block("Timers") == render_timers(), "\n" + "\n".join(render_timers())
