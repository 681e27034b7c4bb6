"""Bring-up (rule 2): claim before bring-up, placement (a pod's ``spec.nodeName`` is law), binding
an unscheduled pod first, and waiting for a predecessor's VM."""

from __future__ import annotations

from collections.abc import Sequence

from shared.fence.decide.run import (
    DecideEnv,
    HostView,
    _arm,
    _command,
    _event,
    _place_pending,
    _Run,
    place_retry_s,
)
from shared.fence.schema import (
    Fence,
    KubeWrite,
    Placed,
    PlaceTimer,
    Skipped,
    Spec,
    SurveyTimer,
    TimerArmed,
    WriteRequested,
)
from shared.fence.state import Incarnation, KeyState
from shared.fence.state import vm_name as _vm_name


def _bring_up(run: _Run) -> None:
    """Create (or wake) the current incarnation's VM — only when no other VM of the key exists, so
    a key never has two VMs at once."""
    s = run.s
    cur = s.cur
    if cur is None or cur.deleting or cur.invalid is not None or cur.phase in ("Failed", "Succeeded"):
        return
    if s.rebuilding:
        return  # after a lost tail, no VM is made until every host said what it has
    if cur.vm_id is not None and cur.vm_id in s.vms:
        return  # has (or is making) its VM
    if s.vms and not _stranded(run, cur):
        return  # another VM of the key is still being removed or adopted: wait for its Released
    if _place_pending(s, cur.fence):
        return
    if _verify_first(run):
        return
    if cur.hibernated:
        _wake(run, cur)  # restores from the snapshot in the log; never a blank VM (rule 10)
        return
    if _is_pod(s.key) and cur.spec.node is None:
        _bind(run, cur)  # an unscheduled pod: bound first (or left to the scheduler), its VM after
        return
    host, why = _place(run.env, cur.spec)
    if host is None:
        # a node that is not a vmfence host never becomes one: said once, never re-checked
        _unplaced(run, cur, why, retry=cur.spec.node is None or cur.spec.node.startswith(NODE_PREFIX))
        return
    vm_id = _vm_name(s.key, cur.fence.uid, cur.gen + 1)
    run.add(Placed(cur.fence, vm_id, host))
    _command(run, "create", cur.fence, host, vm_id, cur.spec)


def _stranded(run: _Run, cur: Incarnation) -> bool:
    """Every other VM of the key is a predecessor's, being removed, on a host that is not live: the
    predecessor's object was force-deleted (vmfence never frees a name before its VM is confirmed
    gone, rule 12), which is the operator's word that its VM is out of the way, as for a pod on a
    down kubelet. Logged per VM as Skipped(stranded); the remove stays queued for its host. A
    removal on a live host is always waited for."""
    live = {h.name for h in run.env.hosts}
    others = list(run.s.vms.values())
    if not others or any(r.state != "removing" or r.fence.uid == cur.fence.uid or r.host in live for r in others):
        return False
    for r in others:
        run.add(Skipped("stranded", r.fence.uid, r.vm_id))
    return True


def _is_pod(key: str) -> bool:
    return not key.startswith("vm:")


def _bind(run: _Run, cur: Incarnation) -> None:
    """A pod without ``spec.nodeName``. With a scheduler (``bind_unscheduled`` off) nothing: the
    scheduler's binding arrives as an observation and brings the VM up. Without one, vmfence picks
    the host and binds the pod to it through ``pods/binding`` — a write in the outbox, before any
    command (rule 11): the VM is made only once the binding took (``_written``), so the pod's
    ``nodeName`` is always true, and a binding someone else won leads to their node, never to a VM
    elsewhere (``_write_failed``)."""
    if not run.env.bind_unscheduled or _binding(run.s, cur.fence):
        return
    host, why = _place(run.env, cur.spec)
    if host is None:
        _unplaced(run, cur, why)
        return
    run.add(WriteRequested(KubeWrite(run.effect_id("bind"), "bind", cur.fence, node=node_of(host))))


def _binding(s: KeyState, fence: Fence) -> bool:
    return any(
        isinstance(e, WriteRequested) and e.write.verb == "bind" and e.write.fence == fence
        for e in s.outbox.values()
    )


def _unplaced(run: _Run, cur: Incarnation, why: str, *, retry: bool = True) -> None:
    """No host takes the VM now: logged with why (the pod's status says it), a Warning Event the
    first time that reason appears, and a place timer re-checks (rule 12: never a VM elsewhere),
    backing off per check in a row that found no host (``place_retry_s``)."""
    if cur.unplaced != why:
        _event(run, cur.fence, "FailedPlacement", why, warning=True)
    delay = place_retry_s(cur.unplaced_tries)  # before the Skipped below counts this check
    run.add(Skipped("no_host", cur.fence.uid, why))
    if retry:
        _arm(run, cur.fence, PlaceTimer(), delay)


def _verify_first(run: _Run) -> bool:
    """The writer loaded the key from a log that may have lost a tail nobody saw (``unverified``):
    before its first VM, every host says what it has of the key and raises its key mark to the
    current fence, so a VM or an in-flight command of the lost tail shows the cut (cut_evidence) or
    is refused — never a second VM beside it. True while that survey is out."""
    s = run.s
    if not s.unverified:
        return False
    if not _verifying(s):
        _survey(run)
    return True


def _verifying(s: KeyState) -> bool:
    """A survey round sent since the load is out, or a retry of one is armed."""
    return bool(s.verifying) or (
        s.unverified and any(isinstance(e, TimerArmed) and isinstance(e.timer, SurveyTimer) for e in s.outbox.values())
    )


NODE_PREFIX = "vmfence-"  # a vmfence host's Node is ``vmfence-<host>`` (shared.fence.podspec.NODE_PREFIX)


def node_of(host: str) -> str:
    return f"{NODE_PREFIX}{host}"


def _place(env: DecideEnv, spec: Spec) -> tuple[str | None, str]:
    """The host for the VM, or None and why not. A pod's ``nodeName`` is law: its VM runs on that
    host or nowhere (a full, dead or unknown host is a reason, never a detour); a VirtualMachine's
    host selector names the only host it may use; anything else takes the emptiest live host."""
    size = f"{spec.cpus} CPU{'s' if spec.cpus != 1 else ''}, {spec.memory_mib} MiB"
    if spec.node is not None:
        if not spec.node.startswith(NODE_PREFIX):
            return None, f"the pod is bound to node {spec.node}, which is not a vmfence host"
        only: str | None = spec.node[len(NODE_PREFIX):]
        what = f"node {spec.node}"
    else:
        only = spec.host_selector
        what = f"host {only}"
    hosts = [h for h in env.hosts if only is None or h.name == only]
    if only is not None and not hosts:
        return None, f"{what} is not a live vmfence host (dead, unknown or not yet heartbeating)"
    fits = [h for h in hosts if h.cpus_free >= spec.cpus and h.memory_free_mib >= spec.memory_mib]
    if not fits:
        if only is not None:
            return None, f"{what} has no room for this VM ({size})"
        return None, f"no live vmfence host has room for this VM ({size})"
    return min(fits, key=lambda h: (h.vms, -h.memory_free_mib, h.name)).name, ""


def placeable(hosts: Sequence[HostView], spec: Spec) -> bool:
    """Whether one of ``hosts`` would take a VM of ``spec`` now, by the placement rules above: the
    reconciler asks it of the hosts that came live or have more room, to check again only the pods
    they could take."""
    return _place(DecideEnv(hosts=hosts), spec)[0] is not None


# The sections' rules call each other (a bring-up may wake, a wake may survey first, a VM found
# gone is brought up again): each imports the others' after its own definitions, so the
# package imports in any order.
from shared.fence.decide.hibernation import _wake  # noqa: E402
from shared.fence.decide.inventory import _survey  # noqa: E402
