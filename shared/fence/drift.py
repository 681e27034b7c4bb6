"""Drift: the log's end state beside the world — what hosts really run and what the API holds.

``vmfence replay`` proves the log is consistent with itself; it cannot see a VM that vanished
without a report, a VM nobody's log binds, or a pod the log never heard of. ``drift`` compares the
fold of the whole log with every host's inventory and the API's objects, purely: the shell (``vmfence
verify``, the reconciler) gathers the three and calls it. Transitional states are not drift (a VM
being created, woken or removed may be on either side of its report), and a key counts as stuck only
after ``stuck_after_s`` without an entry while its object changed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import msgspec

from shared.fence.state import KeyState

DriftKind = Literal[
    "log_vm_missing",  # the log says a host runs this VM; the host does not have it
    "vm_on_other_host",  # a host has a VM the log records on another host
    "vm_not_in_log",  # a host runs a VM that no key's log has
    "object_not_in_log",  # an API object of vmfence's whose incarnation the log never admitted
    "stuck_key",  # the object changed after the log's last look, and nothing was decided since
    "terminating_vm_gone",  # a Terminating object whose VM no host has, not finished in time
    "host_unanswered",  # a live host did not answer for its inventory
]

# VM states, on either side, that a check may trust: a VM in any other state is mid-transition.
SETTLED_LOG_STATES = frozenset({"running", "exited"})
LIVE_HOST_STATES = frozenset({"running", "paused", "exited", "creating", "stopped"})


class HostVM(msgspec.Struct, frozen=True):
    """One VM a host reports: its id, the key and uid its ledger says own it, its runtime state."""

    vm_id: str
    key: str
    uid: str
    state: str


class InventoryAnswer(msgspec.Struct, frozen=True, tag="inventory_answer"):
    """A host's answer to an inventory query: every VM its runtime lists or its ledger holds."""

    host: str
    vms: list[HostVM]
    v: int = 1


class ApiObject(msgspec.Struct, frozen=True):
    """A pod or VirtualMachine of vmfence's as the API holds it (a consistent list)."""

    key: str
    uid: str
    resource_version: int
    deleting: bool = False
    created_s: float = 0.0  # metadata.creationTimestamp (0: unknown, taken as long ago)


class Drift(msgspec.Struct, frozen=True):
    kind: DriftKind
    key: str = ""
    host: str = ""
    vm_id: str = ""
    detail: str = ""


class DriftReport(msgspec.Struct):
    keys: int
    vms_checked: int
    objects_checked: int
    drift: list[Drift]

    @property
    def clean(self) -> bool:
        return not self.drift


def drift(
    states: Mapping[str, KeyState],
    inventories: Mapping[str, Sequence[HostVM] | None],
    objects: Sequence[ApiObject],
    *,
    last_entry_s: Mapping[str, float],
    now_s: float,
    stuck_after_s: float = 60.0,
) -> DriftReport:
    """Every difference between the log's end state and the world; ``inventories[host] = None``
    for a host that did not answer (its VMs are then not judged)."""
    found: list[Drift] = []
    where: dict[str, str] = {}  # vm_id -> host, over every answering host
    host_vms: dict[str, HostVM] = {}
    for host, vms in sorted(inventories.items()):
        if vms is None:
            found.append(Drift("host_unanswered", host=host, detail="no inventory within the timeout"))
            continue
        for vm in vms:
            if vm.state in LIVE_HOST_STATES:
                where[vm.vm_id], host_vms[vm.vm_id] = host, vm
    answered = {h for h, vms in inventories.items() if vms is not None}
    in_log: dict[str, tuple[str, str]] = {}  # vm_id -> (key, host) as the log has it
    vms_checked = len(host_vms)
    for key, s in sorted(states.items()):
        for rec in s.vms.values():
            in_log[rec.vm_id] = (key, rec.host)
            if rec.state not in SETTLED_LOG_STATES or rec.host not in answered:
                continue
            vms_checked += 1
            if rec.vm_id not in where:
                found.append(Drift("log_vm_missing", key, rec.host, rec.vm_id,
                                   f"the log has it {rec.state} under {rec.fence.uid}/e{rec.fence.epoch}"))
            elif where[rec.vm_id] != rec.host:
                found.append(Drift("vm_on_other_host", key, where[rec.vm_id], rec.vm_id,
                                   f"the log records it on {rec.host}"))
    for vm_id, vm in sorted(host_vms.items()):
        owner = states.get(vm.key)
        if owner is not None and owner.rebuilding:
            continue  # a rebuild dropped the key's VM knowledge on purpose: its survey rediscovers them
        if vm_id not in in_log:
            found.append(Drift("vm_not_in_log", vm.key, where[vm_id], vm_id,
                               f"{vm.state}, labelled {vm.key} uid {vm.uid}"))
    for obj in objects:
        ks = states.get(obj.key)
        known = ks is not None and ((ks.cur is not None and ks.cur.fence.uid == obj.uid) or ks.is_tombstoned(obj.uid))
        if ks is None or not known:
            if now_s - obj.created_s >= stuck_after_s:  # one the log has not caught up with yet is not drift
                found.append(Drift("object_not_in_log", obj.key, detail=f"uid {obj.uid} rv {obj.resource_version}"))
            continue
        quiet_s = now_s - last_entry_s.get(obj.key, 0.0)
        cur = ks.cur
        if cur is not None and cur.fence.uid == obj.uid and obj.resource_version > cur.rv and quiet_s >= stuck_after_s:
            found.append(Drift("stuck_key", obj.key, detail=(
                f"rv {obj.resource_version} in the API, {cur.rv} in the log, {quiet_s:.0f}s since its last entry")))
        if obj.deleting and quiet_s >= stuck_after_s:
            vm_ids = {r.vm_id for r in ks.vms.values()} | ({cur.vm_id} if cur is not None and cur.vm_id else set())
            if not any(v in where for v in vm_ids):
                found.append(Drift("terminating_vm_gone", obj.key, detail=(
                    f"Terminating for {quiet_s:.0f}s since the log's last entry, and no host has its VM")))
    return DriftReport(keys=len(states), vms_checked=vms_checked, objects_checked=len(objects), drift=found)
