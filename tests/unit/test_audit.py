"""The audit on hand-written logs: each invariant it checks is broken once and named with its key and
position; a violation that lasts is reported at every position it lasts."""

from __future__ import annotations

from shared.fence.audit import audit
from shared.fence.schema import (
    Admitted,
    Bound,
    Command,
    Commanded,
    Decision,
    Done,
    Fence,
    Forgotten,
    LogEntry,
    Placed,
    ReadyChanged,
    Released,
    Skipped,
    Spec,
)

A, B = "shop/cart", "shop/till"


def bring_up(key: str, uid: str, epoch: int, vm: str, host: str = "host-a") -> list[list[Decision]]:
    f = Fence(key, uid, epoch)
    cid = f"{vm}-create"
    return [
        [Admitted(f, Spec(), resource_version=epoch)],
        [Placed(f, vm, host), Commanded(Command(cid, "create", f, host, vm))],
        [Done(cid, "ok"), Bound(f, vm, host, cid)],
    ]


def entries(key: str, batches: list[list[Decision]], start: int = 1) -> list[LogEntry]:
    return [LogEntry(key, start + i, ds) for i, ds in enumerate(batches)]


def rules(report: object) -> list[tuple[str, int, str]]:
    return [(v.key, v.n, v.rule) for v in report.violations]  # type: ignore[attr-defined]


def test_a_clean_lifecycle_is_clean_and_counted() -> None:
    f = Fence(A, "u1", 1)
    log = entries(A, [*bring_up(A, "u1", 1, "vm-1"), [ReadyChanged(f, True)],
                      [Commanded(Command("rm", "remove", f, "host-a", "vm-1"))],
                      [Done("rm", "ok"), Released(f, "vm-1", "host-a", "deleted", "rm"), Forgotten(f)],
                      [Skipped("superseded", "u0")]])  # fmt: skip
    report = audit(log)
    assert report.clean, rules(report)
    assert report.entries == 7 and report.decisions == 11 and report.vms_created == 1 and report.vms_released == 1
    assert report.decisions_by_type["done"] == 2 and report.decisions_by_type["commanded"] == 2
    assert report.skipped == {"superseded": 1}


def test_two_live_vms_are_reported_where_they_start_and_at_every_position_they_last() -> None:
    f = Fence(A, "u1", 1)
    log = entries(A, [*bring_up(A, "u1", 1, "vm-1"),
                      [Placed(f, "vm-2", "host-b")],  # 4: a second VM while vm-1 runs
                      [ReadyChanged(f, True)],  # 5: still two
                      [Released(f, "vm-2", "host-b", "removed")],  # 6: back to one
                      [ReadyChanged(f, False)]])  # fmt: skip
    got = [r for r in rules(audit(log, final=False)) if r[2] == "two_vms_for_key"]
    assert got == [(A, 4, "two_vms_for_key"), (A, 4, "two_vms_for_key"), (A, 5, "two_vms_for_key")]


def test_a_vm_bound_to_two_keys_results_without_commands_gaps_and_repeats() -> None:
    log = entries(A, bring_up(A, "u1", 1, "vm-1")) + entries(B, bring_up(B, "u9", 1, "vm-1"))
    assert (B, 3, "vm_bound_twice") in rules(audit(log))

    f = Fence(A, "u1", 1)
    stray = entries(A, [[Admitted(f, Spec())], [Placed(f, "vm-1", "host-a")], [Bound(f, "vm-1", "host-a", "nope")]])
    assert (A, 3, "result_fence_mismatch") in rules(audit(stray))

    ok = entries(A, bring_up(A, "u1", 1, "vm-1"))
    assert (A, 3, "gap") in rules(audit([ok[0], ok[2]], final=False))
    assert (A, 2, "repeat") in rules(audit([ok[0], ok[1], ok[1], ok[2]], final=False))

    wrong = entries(A, [[Admitted(Fence(A, "u1", 2), Spec())], [Admitted(Fence(A, "u2", 2), Spec())]])
    assert (A, 2, "epoch_not_increasing") in rules(audit(wrong, final=False))


def test_a_vm_left_behind_is_unsettled_at_the_end() -> None:
    f = Fence(A, "u1", 1)
    log = entries(A, [*bring_up(A, "u1", 1, "vm-1"), [Forgotten(f)]])
    assert rules(audit(log, final=False)) == []
    assert rules(audit(log)) == [(A, 4, "unsettled_vm")]


def test_a_result_is_checked_against_the_command_its_own_entry_finishes() -> None:
    """The policy decides a result with its command's Done, in one entry; a result that names a
    command finished in an earlier entry answers nothing (a replayed or forged result), so the
    audit keeps no finished command past its entry."""
    f = Fence(A, "u1", 1)
    same_entry = entries(A, [*bring_up(A, "u1", 1, "vm-1"),
                             [Commanded(Command("rm", "remove", f, "host-a", "vm-1"))],
                             [Done("rm", "ok"), Released(f, "vm-1", "host-a", "deleted", "rm"), Forgotten(f)]])
    assert audit(same_entry).clean
    later = entries(A, [*bring_up(A, "u1", 1, "vm-1"),
                        [Commanded(Command("rm", "remove", f, "host-a", "vm-1"))],
                        [Done("rm", "ok")],
                        [Released(f, "vm-1", "host-a", "deleted", "rm"), Forgotten(f)]])
    assert (A, 6, "result_fence_mismatch") in rules(audit(later))
    rebound = entries(A, [*bring_up(A, "u1", 1, "vm-1"), [Bound(f, "vm-1", "host-a", "vm-1-create")]])
    assert (A, 4, "result_fence_mismatch") in rules(audit(rebound))
