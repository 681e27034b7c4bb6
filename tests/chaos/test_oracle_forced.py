"""The process oracle: two VMs of one key are a failure unless all but one belong to incarnations the
workload force-deleted (a force delete lets the successor start while the old host is not live)."""

from __future__ import annotations

from pathlib import Path

from services.testbed.chaos.oracles import Oracle, SeenVM


class _Fixed(Oracle):
    def __init__(self, vms: list[SeenVM], forced: set[tuple[str, str]]) -> None:
        super().__init__(Path("/nonexistent"), "sim", forced)
        self.vms = vms

    def scan(self) -> list[SeenVM]:
        return self.vms


OLD = SeenVM("c-0-aaaaaaaa-1", "default/c-0", "aaaaaaaa", None, "host-b")
NEW = SeenVM("c-0-bbbbbbbb-1", "default/c-0", "bbbbbbbb", None, "host-a")


def test_two_vms_of_one_key_count_unless_the_older_was_force_deleted() -> None:
    strict = _Fixed([OLD, NEW], set())
    strict.sample()
    assert strict.max_per_key == 2 and strict.worst and not strict.forced_overlaps

    forced = _Fixed([OLD, NEW], {("default/c-0", "aaaaaaaa")})
    forced.sample()
    assert forced.max_per_key == 1 and not forced.worst and len(forced.forced_overlaps) == 1
    assert forced.max_per_incarnation == 1


def test_two_vms_of_one_incarnation_always_count() -> None:
    twin = SeenVM("c-0-aaaaaaaa-2", "default/c-0", "aaaaaaaa", None, "host-a")
    o = _Fixed([OLD, twin], {("default/c-0", "aaaaaaaa")})
    o.sample()
    assert o.max_per_incarnation == 2
