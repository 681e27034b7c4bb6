"""A decision log that lost its tail (restored from an older copy of the stream), end to end on the
real local stack: reconcilers restarted from snapshots that are *ahead* of the cut log must not
trust them; they append ``Rebuilt``, survey the real agents, and adopt or remove what they find,
while Kubernetes changed under them (a pod deleted, one recreated under its name).

Oracles that are not vmfence's own state: the agents' runtime (``driver.list()``, sampled many times
a second by the ``Env`` oracle, and the agents' ledgers for the owner of an adopted VM), the
Kubernetes API, and the audit of the whole log."""

from __future__ import annotations

import asyncio
import signal

import pytest

from shared.bus.leases import PartitionLease
from shared.bus.read import read_subject
from shared.fence.keys import Key, partition_of
from shared.fence.schema import Admitted, Commanded, Fence, LogEntry, Rebuilt, decision_name, decode_entry
from tests.e2e.conftest import NS, Env

STOP_S = 20.0


async def _stop_reconciler(env: Env, name: str) -> None:
    """SIGTERM: the reconciler hands its partitions back and flushes its snapshot first."""
    proc = env.stack.recs[name].proc
    assert proc is not None and proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    await asyncio.to_thread(proc.wait, STOP_S)


async def _holders(env: Env) -> dict[int, str | None]:
    assert env.stack.bus is not None
    kv = await env.stack.bus.js.key_value(env.stack.subjects.kv_leases)
    out: dict[int, str | None] = {}
    for p in range(env.stack.partitions):
        held = await PartitionLease(kv, p, "observer").holder()
        out[p] = held[0].owner if held is not None else None
    return out


async def _log_of(env: Env, name: str) -> list[tuple[int, LogEntry]]:
    assert env.stack.bus is not None
    subjects = env.stack.subjects
    subject = subjects.log(Key("pod", NS, name))
    return [(m.seq, decode_entry(m.data)) async for m in read_subject(env.stack.bus.js, subjects.stream_log, subject)]


async def _cut_tail(env: Env, name: str, keep: int) -> int:
    """Delete every entry of the key's log after entry ``keep`` from the real stream."""
    assert env.stack.bus is not None
    cut = 0
    for seq, entry in await _log_of(env, name):
        if entry.n > keep:
            await env.stack.bus.js.delete_msg(env.stack.subjects.stream_log, seq)
            cut += 1
    return cut


def _owner(env: Env, vm_id: str) -> Fence | None:
    """The VM's owner fence in its agent's own ledger (after an adoption the runtime labels still
    name the incarnation that created it)."""
    for agent in env.stack.agents.values():
        assert agent.executor is not None
        row = agent.executor.ledger.vm(vm_id)
        if row is not None:
            return row.fence
    return None


def _summary(log: list[tuple[int, LogEntry]]) -> str:
    return "\n".join(
        f"  #{e.n} seq {seq} {e.input}: " + ", ".join(
            decision_name(d) + (f"({d.command.op} {d.command.vm_id})" if isinstance(d, Commanded) else "")
            for d in e.decisions
        )
        for seq, e in log
    )


async def _watch_pod_outliving_its_vm(env: Env, name: str, found: list[str]) -> None:
    """Runtime oracle: the pod object must not be gone while a VM of its key still runs."""
    while True:
        if await env.get(name) is None:
            vms = await env.vms(name)  # looked at after the pod was seen gone
            if vms:
                found.append(f"{name} deleted while {[v.vm_id for v in vms]} still ran")
            return
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("on_recreate", ["replace", "adopt"])
async def test_a_lost_log_tail_is_rebuilt_from_the_agents_and_kubernetes(env: Env, on_recreate: str) -> None:
    names = ("tail-a", "tail-b", "tail-c")
    both = set(env.stack.recs)

    async def shared_by_both() -> bool:
        return set((await _holders(env)).values()) == both

    await env.wait_for("partitions shared by both reconcilers", shared_by_both)
    # the reconciler holding tail-a's partition will come back last, with a row for tail-a of a
    # history the log no longer has (it gets the same partition back: the highest are handed over)
    p_a = partition_of(Key("pod", NS, "tail-a"), env.stack.partitions)
    assert p_a == env.stack.partitions - 1, "tail-a must sit in the last partition"
    last = (await _holders(env))[p_a]
    assert last is not None
    first = next(r for r in both if r != last)
    uids = {n: await env.create(n) for n in names}
    vm_of: dict[str, str] = {}
    host_of: dict[str, str] = {}
    for n in names:
        pod = await env.wait_running(n, uids[n])
        vm_of[n], host_of[n] = pod.metadata.annotations["vmfence.io/vm-id"], pod.metadata.annotations["vmfence.io/host"]
    await env.settle()
    known_epoch: dict[str, int] = {}
    for n in names:
        log = await _log_of(env, n)
        known_epoch[n] = max(d.fence.epoch for _, e in log for d in e.decisions if isinstance(d, Admitted))

    # one reconciler takes every partition and stops cleanly: its snapshot holds every key at the
    # end of the log, which is ahead of the log once its tail is cut
    await _stop_reconciler(env, last)

    async def one_owner() -> bool:
        return set((await _holders(env)).values()) == {first}

    await env.wait_for(f"{first} holding every partition", one_owner)
    await env.settle()
    await _stop_reconciler(env, first)

    # the stream loses the tail of each key's log: everything after its admission (the VM was
    # commanded; that it was made, bound and reported ready is lost)
    for n in names:
        assert await _cut_tail(env, n, keep=1) >= 2
        assert [e.n for _, e in await _log_of(env, n)] == [1]

    # reality moves on while the log is cut and nobody reconciles
    # tail-b's VM is slow to go: a pod deleted before its VM is removed shows in the runtime
    env.stack.agents[host_of["tail-b"]].driver.faults.delay("remove", 1.5, vm_id=vm_of["tail-b"])  # type: ignore[attr-defined]
    await env.core.delete_namespaced_pod("tail-b", NS)  # graceful: terminating until vmfence deletes it
    outlived: list[str] = []
    watch_b = asyncio.create_task(_watch_pod_outliving_its_vm(env, "tail-b", outlived))
    await env.force_delete("tail-c")
    await env.wait_gone("tail-c")
    ann = {"vmfence.io/on-recreate": "adopt"} if on_recreate == "adopt" else None
    uid_c2 = await env.create("tail-c", ann)

    env.stack.start_reconciler(first)
    await env.stack.wait_reconciler_ready(first)

    # tail-a: untouched in Kubernetes: its VM is surveyed and adopted under a new epoch, never made
    # again (the agent's ledger, not vmfence's state, says who owns it)
    async def a_adopted() -> bool:
        pod = await env.get("tail-a")
        owner = _owner(env, vm_of["tail-a"])
        return (
            env.is_running_ready(pod, uids["tail-a"]) and owner is not None
            and owner.uid == uids["tail-a"] and owner.epoch > known_epoch["tail-a"]
            and pod.metadata.annotations.get("vmfence.io/epoch") == str(owner.epoch)
            and pod.metadata.annotations.get("vmfence.io/vm-id") == vm_of["tail-a"]
        )

    await env.wait_for("tail-a's VM adopted under a rebuilt fence", a_adopted)
    pod_c = await env.wait_running("tail-c", uid_c2)
    await env.wait_gone("tail-b")
    await asyncio.wait_for(watch_b, 5)
    assert outlived == [], outlived

    # the other reconciler comes back with its own snapshot (rows of a history the log no longer
    # has) and takes the upper half of the partitions, tail-a's among them
    env.stack.start_reconciler(last)
    await env.stack.wait_reconciler_ready(last)

    async def a_moved_back() -> bool:
        holders = await _holders(env)
        return set(holders.values()) == both and holders[p_a] == last

    await env.wait_for(f"partitions shared again, tail-a's by {last}", a_moved_back)
    report = await env.audit()  # clean to the end, and never two VMs for a key at any sample
    logs = {n: await _log_of(env, n) for n in names}
    trail = "\n".join(f"{n}:\n{_summary(log)}" for n, log in logs.items())

    # a: one VM, the one it had
    assert [v.vm_id for v in await env.vms("tail-a")] == [vm_of["tail-a"]], trail
    # b: deleted: no VM anywhere
    assert await env.get("tail-b") is None and await env.vms("tail-b") == [], trail
    # c: recreated: exactly one VM, owned by the successor; the predecessor's survives only on adopt
    vm_c = pod_c.metadata.annotations["vmfence.io/vm-id"]
    assert [v.vm_id for v in await env.vms("tail-c")] == [vm_c], trail
    owner_c = _owner(env, vm_c)
    assert owner_c is not None and owner_c.uid == uid_c2, trail
    if on_recreate == "adopt":
        assert vm_c == vm_of["tail-c"], f"on-recreate: adopt, yet the predecessor's VM was replaced\n{trail}"
    else:
        assert vm_c != vm_of["tail-c"], f"on-recreate: replace, yet the predecessor's VM was kept\n{trail}"
    # the log says what happened: one rebuild per cut key, above every epoch its writer knew
    for n in names:
        rebuilt = [d for _, e in logs[n] for d in e.decisions if isinstance(d, Rebuilt)]
        assert len(rebuilt) == 1, f"{n}: {len(rebuilt)} Rebuilt decisions\n{trail}"
        assert rebuilt[0].epoch_floor >= known_epoch[n]
    assert report.vms_bound_live == 2, trail

    # the reconciler that loaded its diverged row goes on from the rebuilt log: a delete of tail-a
    # removes the VM under its real owner
    await env.core.delete_namespaced_pod("tail-a", NS)
    await env.wait_gone("tail-a")
    assert await env.vms("tail-a") == []
    await env.audit()

