"""What the audit says it checked: every violation rule it can raise belongs to exactly one named
invariant, each invariant counts the positions it was checked at, and the writer's wall-clock time in
an entry changes nothing (rule 12: it is for people)."""

from __future__ import annotations

import ast
import random
import typing
from pathlib import Path

import msgspec

import shared.fence.audit as audit_mod
from shared.fence.audit import INVARIANTS, audit
from shared.fence.schema import Decision, Fence, LogEntry, Placed
from shared.fence.state import KeyState, fold_all
from tests.unit.test_audit import bring_up, entries


def _rules_raised_in_source() -> set[str]:
    """Every literal rule name the audit's source passes to _bad() or Violation()."""
    tree = ast.parse(Path(audit_mod.__file__).read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            pos = {"_bad": 3, "Violation": 2}.get(name)
            if pos is not None and len(node.args) > pos:
                arg = node.args[pos]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.add(arg.value)
        if isinstance(node, ast.IfExp) and all(isinstance(x, ast.Constant) for x in (node.body, node.orelse)):
            found |= {node.body.value, node.orelse.value}  # type: ignore[attr-defined]  # "gap" if … else "repeat"
    return found


def test_every_violation_rule_belongs_to_exactly_one_invariant() -> None:
    raised = _rules_raised_in_source()
    assert {"gap", "repeat", "unsettled_vm", "two_vms_for_key"} <= raised
    owners: dict[str, list[str]] = {}
    for name, _meaning, rules, _where in INVARIANTS:
        for r in rules:
            owners.setdefault(r, []).append(name)
    assert set(owners) == raised, f"rules without an invariant: {raised - set(owners)}; stale: {set(owners) - raised}"
    assert all(len(v) == 1 for v in owners.values()), owners


def test_invariants_are_checked_at_decision_types_that_exist() -> None:
    tags = {t.__struct_config__.tag for t in typing.get_args(Decision)}
    for name, meaning, _rules, where in INVARIANTS:
        assert meaning and set(where) <= tags | {"entry", "vm"}, name


def test_a_clean_log_reports_positions_checked_and_no_violation() -> None:
    log = entries("shop/a", bring_up("shop/a", "u1", 1, "vm-1"))
    report = audit(log)
    by_name = {c.name: c for c in report.invariants}
    assert [c.name for c in report.invariants] == [i[0] for i in INVARIANTS]
    assert by_name["contiguous"].positions == 3
    assert by_name["epochs_increase"].positions == 1
    assert by_name["commands_carry_the_current_fence"].positions == 2  # placed + commanded
    assert by_name["settled_at_the_end"].positions == 1  # one VM at the end, bound: settled
    assert all(c.violations == 0 for c in report.invariants)
    not_final = audit(log, final=False)
    assert not not_final.final and {c.name: c for c in not_final.invariants}["settled_at_the_end"].positions == 0


def test_a_planted_violation_is_counted_under_its_invariant() -> None:
    log = entries("shop/a", bring_up("shop/a", "u1", 1, "vm-1"))
    log.append(LogEntry("shop/a", 4, [Placed(Fence("shop/a", "u0", 1), "vm-2", "host-b")]))
    report = audit(log)
    broken = {c.name: c.violations for c in report.invariants if c.violations}
    assert broken["commands_carry_the_current_fence"] == 1
    assert broken["one_live_vm_per_key"] >= 1
    assert sum(broken.values()) == len(report.violations)


def _world_log(rounds: int) -> list[LogEntry]:
    """A real policy's log: the model world (decide and fold) taking pods through create and delete."""
    from services.testbed.world import World

    world = World(keys=3)
    world.churn(rounds)
    return world.log


def test_the_writers_clock_changes_no_fold_and_no_audit() -> None:
    rng = random.Random(7)
    log = _world_log(3)
    assert len(log) > 20
    timed = [msgspec.structs.replace(e, at=rng.uniform(0, 4e9)) for e in log]
    assert msgspec.to_builtins(audit(timed)) == msgspec.to_builtins(audit(log))
    for key in {e.key for e in log}:
        plain, clocked = KeyState(key=key), KeyState(key=key)
        for e, t in zip(log, timed, strict=True):
            if e.key == key:
                fold_all(plain, e.decisions)
                fold_all(clocked, t.decisions)
        assert plain == clocked


def test_an_entry_without_a_time_still_decodes() -> None:
    """Entries written before the field existed (no ``at``) replay as before."""
    from shared.fence.schema import decode_entry, encode

    old = msgspec.json.encode({"key": "shop/a", "n": 1, "decisions": []})
    assert decode_entry(old).at == 0.0
    assert decode_entry(encode(LogEntry("shop/a", 1, [], at=12.5))).at == 12.5
