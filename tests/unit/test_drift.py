"""drift(): the log's end state beside hosts' inventories and the API's objects — each kind of
drift found once where it is, and nothing found in a world that agrees with its log."""

from __future__ import annotations

from shared.fence.drift import ApiObject, HostVM, drift
from shared.fence.schema import Fence, Spec
from shared.fence.state import Incarnation, KeyState, VMRec

NOW = 10_000.0


def bound(key: str, uid: str, vm: str, host: str = "host-a", rv: int = 5, state: str = "running") -> KeyState:
    f = Fence(key, uid, 1)
    s = KeyState(key=key, epoch=1, n=3)
    s.cur = Incarnation(fence=f, spec=Spec(), rv=rv, vm_id=vm, bound=True, host=host)
    s.vms[vm] = VMRec(vm, host, f, state)  # type: ignore[arg-type]
    return s


def kinds(report: object) -> list[tuple[str, str, str]]:
    return [(d.kind, d.key, d.vm_id) for d in report.drift]  # type: ignore[attr-defined]


def test_a_world_that_agrees_with_its_log_has_no_drift() -> None:
    states = {"shop/a": bound("shop/a", "u1", "vm-a"), "shop/b": bound("shop/b", "u2", "vm-b", host="host-b")}
    inv = {"host-a": [HostVM("vm-a", "shop/a", "u1", "running")], "host-b": [HostVM("vm-b", "shop/b", "u2", "running")]}
    objs = [ApiObject("shop/a", "u1", 5), ApiObject("shop/b", "u2", 5)]
    report = drift(states, inv, objs, last_entry_s={"shop/a": NOW - 500, "shop/b": NOW - 500}, now_s=NOW)
    assert report.clean and report.vms_checked == 4 and report.objects_checked == 2 and report.keys == 2


def test_a_forged_remove_or_a_kill_behind_the_agents_back_is_a_missing_vm() -> None:
    report = drift({"shop/a": bound("shop/a", "u1", "vm-a")}, {"host-a": []}, [ApiObject("shop/a", "u1", 5)],
                   last_entry_s={"shop/a": NOW}, now_s=NOW)
    assert kinds(report) == [("log_vm_missing", "shop/a", "vm-a")]


def test_vms_nobody_binds_and_vms_on_the_wrong_host() -> None:
    states = {"shop/a": bound("shop/a", "u1", "vm-a")}
    inv = {"host-a": [HostVM("vm-x", "shop/x", "u9", "running")], "host-b": [HostVM("vm-a", "shop/a", "u1", "running")]}
    report = drift(states, inv, [], last_entry_s={}, now_s=NOW)
    assert sorted(kinds(report)) == [("vm_not_in_log", "shop/x", "vm-x"), ("vm_on_other_host", "shop/a", "vm-a")]


def test_transitions_are_not_drift() -> None:
    """A VM being created is in the log before the host has it; one being removed may be on the host
    after the log released it; a host's removing VM is not live."""
    states = {"shop/a": bound("shop/a", "u1", "vm-a", state="creating")}
    inv = {"host-a": [HostVM("vm-old", "shop/a", "u0", "removing")]}
    assert drift(states, inv, [], last_entry_s={}, now_s=NOW).clean


def test_objects_the_log_never_saw_and_stuck_keys_only_after_the_bound() -> None:
    states = {"shop/a": bound("shop/a", "u1", "vm-a", rv=5)}
    inv = {"host-a": [HostVM("vm-a", "shop/a", "u1", "running")]}
    fresh_objs = [ApiObject("shop/a", "u1", 9), ApiObject("shop/new", "u7", 3, created_s=NOW - 1)]
    fresh = drift(states, inv, fresh_objs, last_entry_s={"shop/a": NOW - 1}, now_s=NOW, stuck_after_s=60)
    assert fresh.clean  # the log may simply not have caught up yet
    objs = [ApiObject("shop/a", "u1", 9), ApiObject("shop/new", "u7", 3, created_s=NOW - 600)]
    late = drift(states, inv, objs, last_entry_s={"shop/a": NOW - 600}, now_s=NOW, stuck_after_s=60)
    assert sorted(d.kind for d in late.drift) == ["object_not_in_log", "stuck_key"]


def test_a_tombstoned_uid_is_known_and_a_terminating_object_without_its_vm_is_drift() -> None:
    s = bound("shop/a", "u2", "vm-a")
    s.tombstones.append("u1")
    objs = [ApiObject("shop/a", "u1", 3), ApiObject("shop/a", "u2", 5, deleting=True)]
    report = drift({"shop/a": s}, {"host-a": []}, objs, last_entry_s={"shop/a": NOW - 600}, now_s=NOW)
    assert sorted(d.kind for d in report.drift) == ["log_vm_missing", "terminating_vm_gone"]


def test_a_host_that_does_not_answer_is_named_and_its_vms_not_judged() -> None:
    report = drift({"shop/a": bound("shop/a", "u1", "vm-a")}, {"host-a": None}, [], last_entry_s={}, now_s=NOW)
    assert kinds(report) == [("host_unanswered", "", "")] and report.drift[0].host == "host-a"


def test_a_key_being_rebuilt_has_no_vm_in_the_log_and_that_is_not_drift() -> None:
    """After a lost tail the key's VM knowledge is dropped until its survey rediscovers the VMs
    (found by chaos --hostile: a host's lost-tail evidence, verified within the rebuild's window)."""
    s = KeyState(key="shop/a", epoch=3, n=9, rebuilding=True)
    inv = {"host-a": [HostVM("vm-a", "shop/a", "u1", "running")]}
    assert drift({"shop/a": s}, inv, [], last_entry_s={}, now_s=NOW).clean
    s.rebuilding = False
    assert kinds(drift({"shop/a": s}, inv, [], last_entry_s={}, now_s=NOW)) == [("vm_not_in_log", "shop/a", "vm-a")]

