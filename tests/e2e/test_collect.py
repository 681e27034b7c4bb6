"""Snapshots and addresses do not outlive their pods (issue 12 §4), on a local stack (sim runtime):
a hibernated pod keeps its snapshot and its address; deleting it makes its host remove the
hibernated VM, which deletes the snapshot and releases the address; a hibernate/wake leaves no
snapshot behind either (about 10 s)."""

from __future__ import annotations

import os

from services.agent.ledger import ADDRESS_KIND
from tests.e2e.conftest import NS, Env


def snapshots(env: Env) -> list[str]:
    return sorted(f for a in env.stack.agents.values() for f in os.listdir(a.config.snapshots))


async def held(env: Env) -> dict[str, str]:
    out = {}
    for a in env.stack.agents.values():
        out.update({ip: holder[0] for ip, holder in (await a.ledger.held(ADDRESS_KIND)).items()})
    return out


async def hibernate(env: Env, name: str) -> None:
    await env.annotate(name, "vmfence.io/hibernate", "true")

    async def done() -> bool:
        return env.conditions(await env.get(name)).get("vmfence.io/Hibernated") == "True"

    await env.wait_for(f"{name} hibernated", done)


async def test_a_deleted_hibernated_pod_leaves_no_snapshot_and_no_address(env: Env) -> None:
    uids = {n: await env.create(n) for n in ("h-del", "h-wake")}
    pods = {n: await env.wait_running(n, uids[n]) for n in uids}
    ips = {n: p.status.pod_ip for n, p in pods.items()}
    assert ips["h-del"] and ips["h-wake"] and ips["h-del"] != ips["h-wake"]
    for n in uids:
        await hibernate(env, n)
    assert len(snapshots(env)) == 2 and set(ips.values()) <= set(await held(env))  # kept while hibernated

    await env.annotate("h-wake", "vmfence.io/hibernate", "false")
    woken = await env.wait_running("h-wake", uids["h-wake"])
    assert woken.status.pod_ip == ips["h-wake"]  # the address came back with the guest

    await env.core.delete_namespaced_pod("h-del", NS)
    await env.wait_gone("h-del")
    await env.settle()
    assert snapshots(env) == [], "a snapshot outlived its pod or the wake that used it"
    assert set(await held(env)) == {ips["h-wake"]}, "the deleted hibernated pod's address is still held"
    await env.core.delete_namespaced_pod("h-wake", NS)
    await env.wait_gone("h-wake")
    await env.settle()
    assert await held(env) == {}
    await env.audit()
