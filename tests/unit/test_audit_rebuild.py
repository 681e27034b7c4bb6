"""The audit and a lost log tail: a log whose tail was lost and then rebuilt (``Rebuilt``, surveys,
the surveyed VM adopted) audits clean; a log with a hole, or a cut nobody rebuilt, does not."""

from __future__ import annotations

from shared.fence.audit import audit
from shared.fence.schema import Inventoried, LogEntry, Rebuilt
from tests.unit.driver import Driver, answer_surveys, lose_tail


def _rules(log: list[LogEntry], *, final: bool = True) -> set[str]:
    return {v.rule for v in audit(log, final=final).violations}


def _ran_up() -> tuple[Driver, Inventoried]:
    d = Driver()
    create = d.run_up("u1")
    return d, Inventoried(create.fence, create.host, create.vm_id, "running")


def test_a_rebuilt_log_audits_clean_to_the_end() -> None:
    d, vm = _ran_up()
    lose_tail(d, keep=3)  # admitted, bound to its node + create commanded survive; Bound and after are lost
    answer_surveys(d, {vm.host: [vm]})
    (adopt,) = d.commands("adopt")
    d.answer(adopt, ip="10.0.0.9")
    assert any(isinstance(x, Rebuilt) for e in d.log for x in e.decisions)
    assert d.state.cur is not None and d.state.cur.bound and d.state.cur.vm_id == vm.vm_id
    report = audit(d.log, final=True)
    assert report.clean, report.violations
    assert report.vms_bound_live == 1


def test_a_hole_in_the_log_is_a_gap_without_a_rebuild_and_with_one() -> None:
    d, _ = _ran_up()
    full = list(d.log)
    assert audit(full, final=True).clean
    assert "gap" in _rules([full[0], *full[2:]], final=False)  # an entry lost from the middle
    # a writer that went on numbering from what it had seen: the log jumps over the lost tail
    d2, _ = _ran_up()
    lose_tail(d2, keep=3)
    rebuilt = d2.log[-1]
    jumped = [*d2.log[:3], LogEntry(rebuilt.key, len(full) + 1, rebuilt.decisions)]
    assert "gap" in _rules(jumped, final=False), "a Rebuilt does not excuse a hole"
    assert _rules(d2.log, final=False) == set()


def test_a_cut_log_nobody_rebuilt_leaves_its_vm_unsettled() -> None:
    d, _ = _ran_up()
    cut = d.log[:3]  # the VM was placed and commanded; what became of it is lost
    assert _rules(cut, final=False) == set(), "a cut alone is a consistent prefix"
    assert "unsettled_vm" in _rules(cut, final=True)
