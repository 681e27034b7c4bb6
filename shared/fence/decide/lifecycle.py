"""VM lifecycle (rule 7): exits, VMs gone, probes, and reports from a host the log never placed on."""

from __future__ import annotations

from shared.fence.decide.run import _arm, _command, _event, _Run
from shared.fence.schema import (
    EvictionDeferred,
    EvictionRequested,
    Failed,
    Fence,
    KubeWrite,
    ProbeChanged,
    ReadyChanged,
    Released,
    Restarting,
    RestartTimer,
    Skipped,
    Succeeded,
    VMExited,
    VMGone,
    WriteRequested,
)


def _on_exited(run: _Run, e: VMExited) -> None:
    s = run.s
    if _wrong_host(run, e.vm_id, e.host, "exit"):
        return
    rec = _rec_on(s, e.vm_id, e.host)
    cur = s.cur
    if rec is None or rec.fence != e.fence or cur is None or cur.fence != e.fence:
        _skip_foreign(run, e.fence, f"exit of {e.vm_id}")
        return
    if cur.vm_id != e.vm_id or rec.state != "running":
        return  # an exit while it is being removed/hibernated is expected
    policy = cur.spec.restart_policy
    failed = e.exit_code != 0  # an unknown exit code (None) counts as a failure, as a signal would
    if policy == "Always" or (policy == "OnFailure" and failed):
        count = cur.restart_count + 1
        backoff = min(
            run.env.restart_backoff_base_s * (2 ** (count - 1)), run.env.restart_backoff_max_s
        )
        run.add(Restarting(cur.fence, e.vm_id, count, backoff))
        _event(run, cur.fence, "BackOff", f"VM exited ({e.exit_code}); restart {count} in {backoff:.0f}s")
        _arm(run, cur.fence, RestartTimer(e.vm_id), backoff)
        return
    if not failed:
        run.add(Succeeded(cur.fence))
    else:
        run.add(Failed(cur.fence, "VMExited", f"exit code {'unknown' if e.exit_code is None else e.exit_code}"))
    _command(run, "remove", rec.fence, rec.host, rec.vm_id, None)


def _on_gone(run: _Run, g: VMGone) -> None:
    s = run.s
    if _wrong_host(run, g.vm_id, g.host, "vm-gone"):
        return  # never an eviction on a report the log contradicts
    rec = _rec_on(s, g.vm_id, g.host)
    # lost after the agent moved it to the adopting fence, before the adopt's answer came back: it
    # is gone all the same (as an adopt answered not_found: released, a new VM made)
    lost_while_adopted = rec is not None and rec.state == "adopting" and s.is_current(g.fence)
    if rec is None or (rec.fence != g.fence and not lost_while_adopted):
        _skip_foreign(run, g.fence, f"vm-gone of {g.vm_id}")
        return
    cur = s.cur
    was_bound = cur is not None and cur.fence == rec.fence and cur.vm_id == g.vm_id and cur.bound
    run.add(Released(rec.fence, g.vm_id, rec.host, "gone"))
    if not was_bound or cur is None:
        _after_release(run)
        return
    if s.key.startswith("vm:"):
        # a VirtualMachine gets exactly one replacement per failure
        run.add(Restarting(cur.fence, g.vm_id, cur.restart_count + 1, 0.0))
        _bring_up(run)
        return
    if cur.delete_claim:
        run.add(EvictionDeferred(cur.fence, g.vm_id))
        _after_release(run)
        return
    run.add(EvictionRequested(cur.fence, g.vm_id))
    run.add(WriteRequested(KubeWrite(run.effect_id("evict"), "evict", cur.fence, message="VM gone")))
    _event(run, cur.fence, "VMGone", f"VM {g.vm_id} vanished from {g.host}; evicting", warning=True)


def _on_probe(run: _Run, p: ProbeChanged) -> None:
    s = run.s
    if _wrong_host(run, p.vm_id, p.host, "probe"):
        return
    cur = s.cur
    if cur is None or cur.fence != p.fence or cur.vm_id != p.vm_id or cur.host != p.host or not cur.bound:
        _skip_foreign(run, p.fence, f"probe of {p.vm_id}")
        return
    if cur.ready != p.ready:
        run.add(ReadyChanged(cur.fence, p.ready))


def _wrong_host(run: _Run, vm_id: str, host: str, what: str) -> bool:
    """A report about a VM from a host other than the one the log placed it on contradicts the log:
    logged as Skipped(wrong_host), never acted on. True if it was."""
    rec = run.s.vms.get(vm_id)
    if rec is None or rec.host == host:
        return False
    run.add(Skipped("wrong_host", rec.fence.uid, f"{what} of {vm_id} from {host}; the log placed it on {rec.host}"))
    return True


def _skip_foreign(run: _Run, fence: Fence, what: str) -> None:
    """Rule 4: work reported for a fence that is not current is logged and never applied."""
    s = run.s
    if s.is_tombstoned(fence.uid):
        run.add(Skipped("superseded", fence.uid, what))
    elif not s.is_current(fence):
        run.add(Skipped("stale_effect", fence.uid, what))


# The sections' rules call each other (a bring-up may wake, a wake may survey first, a VM found
# gone is brought up again): each imports the others' after its own definitions, so the
# package imports in any order.
from shared.fence.decide.bringup import _bring_up  # noqa: E402
from shared.fence.decide.results import _after_release, _rec_on  # noqa: E402
