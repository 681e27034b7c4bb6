"""A report's epoch and host are not simply believed (issue 10, finding 4): a fence above
MAX_EPOCH, below 0, or further above the log's epoch than MAX_EPOCH_LEAP is Skipped(epoch_out_of_bounds)
— never a rebuild, a survey or a re-adoption — and a report whose host contradicts the placement the
log records is Skipped(wrong_host), never acted on (no eviction)."""

from __future__ import annotations

import pytest

from shared.fence.decide import epoch_out_of_bounds
from shared.fence.schema import (
    MAX_EPOCH,
    MAX_EPOCH_LEAP,
    Commanded,
    CommandResult,
    Decision,
    EvictionRequested,
    Fence,
    Inventoried,
    ProbeChanged,
    ReadyChanged,
    Rebuilt,
    Released,
    Restarting,
    Skipped,
    VMExited,
    VMGone,
    WriteRequested,
)
from tests.unit.driver import KEY, Driver, of

HOSTILE_EPOCHS = [1000, MAX_EPOCH + 1, 2**63, 2**64 - 1, -1]


def _bound() -> tuple[Driver, str, str]:
    d = Driver()
    create = d.run_up("u1")
    return d, create.vm_id, create.host


def _nothing_acted_on(out: list[Decision]) -> None:
    assert of(out, Rebuilt) == [] and of(out, Commanded) == [] and of(out, Released) == []
    assert of(out, EvictionRequested) == [] and of(out, WriteRequested) == [] and of(out, Restarting) == []


@pytest.mark.parametrize("epoch", HOSTILE_EPOCHS)
def test_a_vm_gone_with_a_hostile_epoch_is_skipped_never_a_rebuild(epoch: int) -> None:
    d, vm, host = _bound()
    out = d.feed(VMGone(Fence(KEY, "u1", epoch), host, vm))
    _nothing_acted_on(out)
    assert [s.reason for s in of(out, Skipped)] == ["epoch_out_of_bounds"]
    assert d.state.epoch == 1 and d.state.cur is not None and d.state.cur.bound


@pytest.mark.parametrize("epoch", HOSTILE_EPOCHS)
def test_an_inventory_of_an_unknown_vm_with_a_hostile_epoch_is_never_adopted(epoch: int) -> None:
    d, _, host = _bound()
    out = d.feed(Inventoried(Fence(KEY, "u9", epoch), host, "forged-vm", "running"))
    _nothing_acted_on(out)
    assert [s.reason for s in of(out, Skipped)] == ["epoch_out_of_bounds"]
    assert "forged-vm" not in d.state.vms


def test_a_result_whose_key_mark_is_hostile_is_skipped_and_its_command_stays_out() -> None:
    d = Driver()
    d.admit("u1")
    (create,) = d.commands("create")
    out = d.feed(CommandResult(create.fence, create.id, "create", create.host, create.vm_id, "fenced",
                               key_epoch=2**64 - 1, key_uid="evil"))
    _nothing_acted_on(out)
    assert [s.reason for s in of(out, Skipped)] == ["epoch_out_of_bounds"]
    assert d.commands("create") == [create], "the real answer is still awaited"


def test_a_fence_a_few_epochs_ahead_is_still_evidence_of_a_lost_tail() -> None:
    d, _, host = _bound()
    out = d.feed(Inventoried(Fence(KEY, "u1", 1 + MAX_EPOCH_LEAP), host, "tail-vm", "running"))
    assert of(out, Rebuilt), "a real cut (a handful of epochs) is still detected"


def test_the_bound_is_relative_to_the_logs_epoch_and_capped_by_max_epoch() -> None:
    d, vm, host = _bound()
    ok = VMGone(Fence(KEY, "u1", 1 + MAX_EPOCH_LEAP), host, vm)
    assert epoch_out_of_bounds(d.state, ok) is None
    far = VMGone(Fence(KEY, "u1", 2 + MAX_EPOCH_LEAP), host, vm)
    assert epoch_out_of_bounds(d.state, far) is not None
    d.state.epoch = MAX_EPOCH
    assert epoch_out_of_bounds(d.state, VMGone(Fence(KEY, "u1", MAX_EPOCH), host, vm)) is None
    assert epoch_out_of_bounds(d.state, VMGone(Fence(KEY, "u1", MAX_EPOCH + 1), host, vm)) is not None
    assert MAX_EPOCH < 2**63 // 1024, "well below what a signed 64-bit ledger column holds"


def test_a_vm_gone_from_another_host_than_the_logs_is_skipped_never_an_eviction() -> None:
    d, vm, host = _bound()
    other = "host-b" if host == "host-a" else "host-a"
    out = d.feed(VMGone(Fence(KEY, "u1", 1), other, vm))
    _nothing_acted_on(out)
    (skip,) = of(out, Skipped)
    assert skip.reason == "wrong_host" and other in skip.detail and host in skip.detail
    assert d.state.cur is not None and d.state.cur.bound and not d.state.cur.evicting


@pytest.mark.parametrize("kind", ["exit", "probe", "inventory"])
def test_other_reports_from_another_host_are_skipped(kind: str) -> None:
    d, vm, host = _bound()
    other = "host-b" if host == "host-a" else "host-a"
    fence = Fence(KEY, "u1", 1)
    report = {
        "exit": VMExited(fence, other, vm, 1),
        "probe": ProbeChanged(fence, other, vm, True),
        "inventory": Inventoried(fence, other, vm, "lost"),
    }[kind]
    out = d.feed(report)
    _nothing_acted_on(out)
    assert of(out, ReadyChanged) == []
    assert [s.reason for s in of(out, Skipped)] == ["wrong_host"]


def test_an_answer_from_another_host_than_the_command_went_to_is_skipped() -> None:
    d = Driver()
    d.admit("u1")
    (create,) = d.commands("create")
    other = "host-b" if create.host == "host-a" else "host-a"
    out = d.feed(CommandResult(create.fence, create.id, "create", other, create.vm_id, "ok"))
    assert [s.reason for s in of(out, Skipped)] == ["wrong_host"]
    assert d.state.cur is not None and not d.state.cur.bound and d.commands("create") == [create]
    # a survey answer may name only VMs of the host that answers
    found = [Inventoried(create.fence, other, "elsewhere", "running")]
    out = d.feed(CommandResult(create.fence, create.id, "create", create.host, create.vm_id, "ok", found=found))
    assert [s.reason for s in of(out, Skipped)] == ["wrong_host"]
