"""The agent's fence tables (shared/fence/agentfence.py): every cell defined, and the rules of rule 4
hold for any fences, not only the ones a scenario happens to use. Then the executor's side: one
static table of steps, and one mapping of the runtime's doubts to outcomes for every op."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.agent.executor import Executor
from services.agent.ledger import Ledger
from services.agent.runtime.sim import SimDriver
from shared.fence import agentfence as af
from shared.fence.schema import Command, CommandOp, Fence, ResultOutcome, Spec

OPS: tuple[CommandOp, ...] = get_args(CommandOp)
VM_OPS = tuple(op for op in OPS if op != "survey")  # a survey names no VM

fences = st.builds(
    Fence,
    key=st.sampled_from(["default/web", "default/db"]),
    uid=st.sampled_from(["", "u1", "u2", "u3"]),
    epoch=st.integers(min_value=0, max_value=4),
)
owners = st.none() | fences
ops = st.sampled_from(OPS)
vm_ops = st.sampled_from(VM_OPS)


def _reference(op: str, fence: Fence, owner: Fence | None) -> str | None:
    """The executor's fence_verdict before it became a table: the table must say the same."""
    if owner is None or fence == owner:
        return None
    if fence.key != owner.key:
        return f"VM belongs to key {owner.key!r}"
    if fence.epoch < owner.epoch:
        return f"fence epoch {fence.epoch} is older than the owner's {owner.epoch}"
    if fence.epoch == owner.epoch:
        return f"owner at epoch {owner.epoch} is uid {owner.uid}"
    if op in ("remove", "adopt", "inspect"):
        return None
    return f"VM is owned by epoch {owner.epoch}; only adopt moves ownership"


def test_every_cell_is_defined_and_nothing_else() -> None:
    assert set(af.OP_CLASS) == set(OPS)
    assert set(af.OP_CLASS.values()) == set(af.OP_CLASSES)
    assert set(af.OWNER) == {(c, r) for c in af.OP_CLASSES for r in af.RELATIONS}
    assert set(af.MARK) == {(c, r) for c in af.OP_CLASSES for r in af.MARK_RELATIONS}
    assert set(af.BURIED) == set(af.OP_CLASSES) == set(af.RAISES_MARK) == set(af.BELOW_FLOOR)
    verdicts = set(get_args(af.Verdict))
    assert set(af.OWNER.values()) | set(af.MARK.values()) | set(af.BURIED.values()) <= verdicts


@given(vm_ops, fences, owners)
def test_the_table_says_what_the_executor_said(op: CommandOp, fence: Fence, owner: Fence | None) -> None:
    assert af.fence_verdict(op, fence, owner) == _reference(op, fence, owner)


@given(vm_ops, fences, fences)
def test_a_command_older_than_the_owner_is_refused(op: CommandOp, fence: Fence, owner: Fence) -> None:
    if fence.key == owner.key and fence.epoch < owner.epoch:
        assert af.fence_verdict(op, fence, owner) is not None


@given(vm_ops, fences)
def test_the_owner_itself_may_always_act_so_a_predecessor_cleans_up_its_own_vm(op: CommandOp, owner: Fence) -> None:
    assert af.fence_verdict(op, owner, owner) is None
    # the predecessor's own cleanup: a remove under the old owner fence, whatever the key's mark says
    assert af.mark_verdict("remove", owner, owner.epoch + 3, "a-successor") is None


@given(vm_ops, fences, fences)
def test_a_newer_fence_may_only_collect_adopt_or_look_at_a_predecessors_vm(
    op: CommandOp, fence: Fence, owner: Fence
) -> None:
    if fence.key == owner.key and fence.epoch > owner.epoch:
        allowed = af.fence_verdict(op, fence, owner) is None
        assert allowed == (op in ("remove", "adopt", "inspect"))


@given(vm_ops, fences, fences)
def test_a_vm_of_another_key_is_refused(op: CommandOp, fence: Fence, owner: Fence) -> None:
    if fence.key != owner.key:
        assert af.fence_verdict(op, fence, owner) == f"VM belongs to key {owner.key!r}"


@given(vm_ops, fences, fences)
def test_one_epoch_under_two_uids_is_refused(op: CommandOp, fence: Fence, owner: Fence) -> None:
    if fence.key == owner.key and fence.epoch == owner.epoch and fence.uid != owner.uid:
        assert af.fence_verdict(op, fence, owner) is not None


@given(ops, fences)
def test_an_unowned_vm_refuses_no_fence(op: CommandOp, fence: Fence) -> None:
    assert af.fence_verdict(op, fence, None) is None
    assert af.refusal(op, fence, "vm-1", None, None) is None


@given(ops, fences, st.integers(min_value=0, max_value=4), st.sampled_from(["", "u1", "u2", "-"]))
def test_the_key_mark_refuses_older_or_rival_fences_for_ops_that_make_or_move_a_vm(
    op: CommandOp, fence: Fence, mark: int, mark_uid: str
) -> None:
    why = af.mark_verdict(op, fence, mark, mark_uid)
    if op in ("remove", "inspect", "survey"):
        assert why is None  # exempt: they make, wake and move nothing
        return
    older = fence.epoch < mark
    rival = fence.epoch == mark and bool(mark_uid) and bool(fence.uid) and fence.uid != mark_uid
    assert (why is not None) == (older or rival)
    if older:
        assert why == f"fence epoch {fence.epoch} is older than epoch {mark} seen for the key"
    elif rival:
        assert why == f"epoch {mark} of the key belongs to uid {mark_uid} here, not {fence.uid}"


@given(ops, fences, owners, st.sampled_from(["removed", "hibernated", "lost"]))
def test_a_buried_vm_id_is_never_brought_back(op: CommandOp, fence: Fence, owner: Fence | None, why: str) -> None:
    refused = af.refusal(op, fence, "vm-1", owner, why)
    if op in ("create", "start", "wake"):
        assert refused == f"vm vm-1 was {why}; a vm_id is never brought back"
    else:
        assert refused == af.fence_verdict(op, fence, owner)


@given(ops, st.integers(min_value=0, max_value=5), st.integers(min_value=0, max_value=5))
def test_below_the_partition_floor_only_a_remove_runs(op: CommandOp, gen: int, floor: int) -> None:
    why = af.floor_verdict(op, gen, floor)
    if gen >= floor or op == "remove":
        assert why is None
    else:
        assert why == (f"sent by the partition's writer of generation {gen}; "
                       f"a writer of generation {floor} verified this host since")


def test_only_a_remove_leaves_the_mark_where_it_was() -> None:
    assert [op for op in OPS if not af.raises_mark(op)] == ["remove"]


@given(st.sampled_from(sorted(set(get_args(af.Verdict)) - {"allow"})), fences, fences)
def test_every_refusal_has_a_reason(verdict: af.Verdict, fence: Fence, owner: Fence) -> None:
    said = af.reason(verdict, fence, owner, vm_id="vm-1", why="removed")
    assert said and "{" not in said


def test_every_op_has_one_step_and_the_table_a_class() -> None:
    """The executor dispatches from a static table: every op has a step there, and a class here."""
    from services.agent.ops import OPS as STEPS

    assert set(STEPS) == set(OPS) == set(af.OP_CLASS)
    assert len({id(step) for step in STEPS.values()}) == len(STEPS)
    assert [op for op, step in STEPS.items() if not step.replay] == ["survey"]


# (op, whether the VM is in the ledger first) -> what a runtime failing the inspect answers; an
# inconclusive inspect answers "inconclusive" for every one of them
DOUBTS: dict[tuple[CommandOp, bool], ResultOutcome] = {
    ("create", False): "failed",
    ("remove", False): "failed",
    ("start", True): "failed",
    ("hibernate", True): "failed",
    ("adopt", True): "inconclusive",  # changes nothing until the runtime answers: asked again
    ("inspect", True): "inconclusive",
}


@pytest.mark.parametrize("doubt", ["inconclusive", "fail"])
@pytest.mark.parametrize(("op", "made"), list(DOUBTS))
async def test_a_doubtful_inspect_answers_the_same_way_for_every_op(
    tmp_path: Path, op: CommandOp, made: bool, doubt: str
) -> None:
    ledger = Ledger(str(tmp_path / "ledger.sqlite3"))
    await ledger.open()
    driver = SimDriver(state_dir=str(tmp_path / "rt"), vnc_displays=range(10, 20))
    await driver.open()
    ex = Executor(ledger=ledger, driver=driver, host="h1", snapshot_dir=str(tmp_path / "snap"), vnc=False)
    f = Fence("default/web", "u1", 1)
    try:
        if made:
            made_vm, _ = await ex.execute(Command("c-make", "create", f, "h1", "vm-1", Spec()))
            assert made_vm.outcome == "ok"
        if doubt == "inconclusive":
            driver.faults.inconclusive(vm_id="vm-1")
        else:
            driver.faults.fail("inspect", vm_id="vm-1", message="the runtime is down")
        result, replayed = await ex.execute(Command("c-doubt", op, f, "h1", "vm-1", Spec()))
        assert not replayed
        assert result.outcome == ("inconclusive" if doubt == "inconclusive" else DOUBTS[op, made])
        assert result.error and ("inspect" in result.error)
        if made:  # a doubt changes nothing in the ledger
            row = ledger.vm("vm-1")
            assert row is not None and row.state == "running" and row.fence == f
        else:
            assert ledger.vm("vm-1") is None and await driver.inspect("vm-1") is None
    finally:
        await driver.close()
        await ledger.close()
