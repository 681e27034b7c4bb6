"""What vmfence writes into a pod's or a VirtualMachine's status and runtime annotations for an
intent: pure functions of the current object and the ``PodStatusIntent`` (the gateway in
``services.reconciler.kube`` sends them; this module does no I/O). Conditions keep their
``lastTransitionTime`` while their status stays; a merge diff carries only what changes.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from shared.fence.schema import PodStatusIntent

JSON = dict[str, Any]

ANN_VM_ID = "vmfence.io/vm-id"
ANN_HOST = "vmfence.io/host"
ANN_IP = "vmfence.io/ip"
ANN_VNC_PORT = "vmfence.io/vnc-port"
ANN_EPOCH = "vmfence.io/epoch"
# the pod network of the VM's host when it gives the VM no reachable address ("user": QEMU user
# networking, "none"): the pod says so instead of showing no podIP without a word (issue 12 §1)
ANN_NETWORK = "vmfence.io/network"
COND_HIBERNATED = "vmfence.io/Hibernated"
COND_SPEC_VALID = "vmfence.io/SpecValid"


def now_rfc3339() -> str:
    """The current second as Kubernetes writes timestamps (UTC, ``Z``)."""
    return _rfc3339_second(int(time.time()))


@functools.lru_cache(maxsize=4)
def _rfc3339_second(second: int) -> str:
    # formatted once per second, not per call: a pod's writes ask for it several times each
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(second))


def meta(obj: JSON) -> JSON:
    """An object's metadata (empty when it has none)."""
    m = obj.get("metadata")
    return m if isinstance(m, dict) else {}


def _condition(cur: dict[str, JSON], ctype: str, status: bool, reason: str, message: str | None = None) -> JSON:
    """A condition; lastTransitionTime kept from the current one when the status did not change."""
    text = "True" if status else "False"
    prev = cur.get(ctype)
    ltt = prev.get("lastTransitionTime") if prev and prev.get("status") == text else None
    c: JSON = {"type": ctype, "status": text, "reason": reason, "lastTransitionTime": ltt or now_rfc3339()}
    if message:
        c["message"] = message
    return c


def _conditions(cur_list: list[JSON], ours: list[JSON]) -> list[JSON]:
    """Ours replace same-typed ones in place; other writers' conditions are kept."""
    by_type = {c["type"]: c for c in ours}
    out = [by_type.pop(c.get("type", ""), c) for c in cur_list if isinstance(c, dict)]
    return out + [c for c in ours if c["type"] in by_type]


def _same_condition(a: JSON, b: JSON) -> bool:
    return {k: v for k, v in a.items() if k != "lastTransitionTime"} == {
        k: v for k, v in b.items() if k != "lastTransitionTime"
    }


def _keep_unchanged_conditions(cur_list: list[JSON], new_list: list[JSON]) -> list[JSON]:
    """A condition whose fields did not change keeps its old timestamps exactly."""
    cur_by_type = {c.get("type"): c for c in cur_list if isinstance(c, dict)}
    out = []
    for c in new_list:
        old = cur_by_type.get(c["type"])
        out.append(old if old is not None and _same_condition(old, c) else c)
    return out


_NOT_CREATED = {False: "VMNotCreated", True: "FailedCreate"}  # Initialized=False, by whether a bring-up failed


def _pod_conditions(cur: JSON, intent: PodStatusIntent, node: str | None = None) -> list[JSON]:
    """``node``: the pod's ``spec.nodeName`` (bound: PodScheduled is True whatever its VM does — a
    dead or full host shows on Initialized, with the reason and why)."""
    cur_list = [c for c in cur.get("conditions") or [] if isinstance(c, dict)]
    cur_by_type = {c.get("type", ""): c for c in cur_list}
    running = intent.phase == "Running" and not intent.hibernated
    ready = intent.ready and running
    done = intent.phase in ("Succeeded", "Failed")
    # a pod refused for an invalid spec never had a host or a VM, whatever its phase says
    placed = bool(node) or intent.host is not None or (intent.phase != "Pending" and not intent.invalid)
    created = intent.vm_id is not None or (intent.phase != "Pending" and not intent.invalid)
    not_ready_reason = "PodCompleted" if done else ("Hibernated" if intent.hibernated else "ContainersNotReady")
    failed_create = intent.reason == "FailedCreate"  # the last bring-up failed: its cause, not "waiting"
    unplaced = intent.reason == "Unschedulable" and not created  # no host takes it now: why
    if placed:
        scheduled = _condition(cur_by_type, "PodScheduled", True, "Scheduled" if node else "Placed")
    else:
        scheduled = _condition(cur_by_type, "PodScheduled", False, "Unschedulable" if unplaced else "WaitingForHost",
                               intent.message if unplaced else None)
    if created:
        init_reason = "VMCreated"
    else:
        init_reason = "HostUnavailable" if unplaced and placed else _NOT_CREATED[failed_create]
    ours = [
        scheduled,
        _condition(cur_by_type, "Initialized", created, init_reason,
                   intent.message if (failed_create or (unplaced and placed)) and not created else None),
        _condition(cur_by_type, "ContainersReady", ready, "VMReady" if ready else not_ready_reason),
        _condition(cur_by_type, "Ready", ready, "VMReady" if ready else not_ready_reason),
    ]
    if intent.hibernated:
        ours.append(_condition(cur_by_type, COND_HIBERNATED, True, "Hibernated", "the VM is saved to a snapshot"))
    elif COND_HIBERNATED in cur_by_type:
        ours.append(_condition(cur_by_type, COND_HIBERNATED, False, "Woken"))
    if intent.invalid:
        ours.append(_condition(cur_by_type, COND_SPEC_VALID, False, "InvalidSpec", intent.invalid))
    elif COND_SPEC_VALID in cur_by_type:
        ours.append(_condition(cur_by_type, COND_SPEC_VALID, True, "Valid"))
    return _keep_unchanged_conditions(cur_list, _conditions(cur_list, ours))


def _container_statuses(obj: JSON, cur: JSON, intent: PodStatusIntent) -> list[JSON]:
    spec = obj.get("spec") or {}
    ann = meta(obj).get("annotations") or {}
    prev = {c.get("name"): c for c in cur.get("containerStatuses") or [] if isinstance(c, dict)}
    running = intent.phase == "Running" and not intent.hibernated and intent.vm_id is not None
    ready = intent.ready and running
    container_id = f"vmfence://{intent.vm_id}" if intent.vm_id else None
    out: list[JSON] = []
    for c in spec.get("containers") or []:
        if not isinstance(c, dict) or not c.get("name"):
            continue
        name = c["name"]
        old = prev.get(name) or {}
        old_state = old.get("state") or {}
        state: JSON
        if running:
            started = (old_state.get("running") or {}).get("startedAt")
            same_run = old.get("containerID") == container_id and old.get("restartCount") == intent.restart_count
            state = {"running": {"startedAt": started if started and same_run else now_rfc3339()}}
        elif intent.phase in ("Succeeded", "Failed"):
            term = old_state.get("terminated") or {}
            ok = intent.phase == "Succeeded"
            t: JSON = {
                "exitCode": 0 if ok else 1,
                "reason": "Completed" if ok else (intent.reason or "Error"),
                "finishedAt": term.get("finishedAt") or now_rfc3339(),
            }
            if intent.message and not ok:
                t["message"] = intent.message
            if container_id:
                t["containerID"] = container_id
            state = {"terminated": t}
        else:
            if intent.hibernated:
                reason = "Hibernated"
            elif intent.invalid:
                reason = "InvalidSpec"
            else:
                reason = intent.reason or "ContainerCreating"
            w: JSON = {"reason": reason}
            msg = intent.invalid if intent.invalid and not intent.hibernated else intent.message
            if msg:
                w["message"] = msg
            state = {"waiting": w}
        image = str(c.get("image") or "")
        vm_image = ann.get("vmfence.io/image") or image
        cs: JSON = {
            "name": name,
            "ready": ready,
            "started": running,
            "restartCount": intent.restart_count,
            "image": image,
            "imageID": f"vmfence-image://{vm_image}",
            "state": state,
        }
        if container_id:
            cs["containerID"] = container_id
        if old.get("lastState"):
            cs["lastState"] = old["lastState"]
        out.append(cs)
    return out


def pod_status(obj: JSON, intent: PodStatusIntent, host_ip: str | None) -> JSON:
    """The full pod status vmfence wants, built from the current object plus the intent."""
    cur: JSON = dict(obj.get("status") or {})
    new: JSON = dict(cur)
    new["phase"] = intent.phase
    node = (obj.get("spec") or {}).get("nodeName")
    new["conditions"] = _pod_conditions(cur, intent, node if isinstance(node, str) else None)
    new["containerStatuses"] = _container_statuses(obj, cur, intent)
    for k, v in (("reason", intent.reason), ("message", intent.message)):
        if v:
            new[k] = v
        else:
            new.pop(k, None)
    if intent.ip:
        new["podIP"], new["podIPs"] = intent.ip, [{"ip": intent.ip}]
    else:
        new.pop("podIP", None)
        new.pop("podIPs", None)
    if host_ip and intent.host:
        new["hostIP"], new["hostIPs"] = host_ip, [{"ip": host_ip}]
    elif not intent.host:
        new.pop("hostIP", None)
        new.pop("hostIPs", None)
    if not new.get("startTime"):
        new["startTime"] = now_rfc3339()
    return new


def vm_status(obj: JSON, intent: PodStatusIntent, epoch: int) -> JSON:
    """A VirtualMachine's status: phase, host, vmID, ip, restartCount, epoch, conditions."""
    cur: JSON = dict(obj.get("status") or {})
    cur_list = [c for c in cur.get("conditions") or [] if isinstance(c, dict)]
    cur_by_type = {c.get("type", ""): c for c in cur_list}
    ready = intent.ready and intent.phase == "Running" and not intent.hibernated
    ours = [_condition(cur_by_type, "Ready", ready, "VMReady" if ready else (intent.reason or "VMNotReady"))]
    if intent.hibernated or "Hibernated" in cur_by_type:
        ours.append(
            _condition(cur_by_type, "Hibernated", intent.hibernated, "Hibernated" if intent.hibernated else "Woken")
        )
    if intent.invalid:
        ours.append(_condition(cur_by_type, "SpecValid", False, "InvalidSpec", intent.invalid))
    elif "SpecValid" in cur_by_type:
        ours.append(_condition(cur_by_type, "SpecValid", True, "Valid"))
    new: JSON = {
        "phase": intent.phase,
        "restartCount": intent.restart_count,
        "epoch": epoch,
        "conditions": _keep_unchanged_conditions(cur_list, _conditions(cur_list, ours)),
    }
    for k, v in (("host", intent.host), ("vmID", intent.vm_id), ("ip", intent.ip)):
        if v:
            new[k] = v
    return new


def merge_diff(cur: JSON, new: JSON) -> JSON:
    """A merge patch turning ``cur`` into ``new`` at the top level (removed keys → null)."""
    out: JSON = {k: v for k, v in new.items() if cur.get(k) != v}
    out.update({k: None for k in cur if k not in new})
    return out


def runtime_annotations(intent: PodStatusIntent, epoch: int) -> dict[str, str | None]:
    return {
        ANN_VM_ID: intent.vm_id,
        ANN_HOST: intent.host,
        ANN_IP: intent.ip,
        ANN_VNC_PORT: str(intent.vnc_port) if intent.vnc_port is not None else None,
        ANN_EPOCH: str(epoch),
    }
