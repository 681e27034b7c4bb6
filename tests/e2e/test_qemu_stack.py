"""The whole stack on real QEMU (firmware-only VMs): pods become running QEMU processes bound in the
log, and scenario 8 — hibernate, reconcilers killed and restarted, wake from the snapshot — with
real migration files."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shared.fence.schema import Bound, Commanded
from tests.e2e.conftest import NS, Env, running_env

pytestmark = [
    pytest.mark.qemu,
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="qemu-system-x86_64 is not installed"),
]


@pytest.fixture
async def qenv(tmp_path: Path) -> AsyncIterator[Env]:
    async with running_env(tmp_path / "stack", runtime="qemu", partitions=4, restart_backoff_s=0.2, accel="tcg") as e:
        yield e


async def test_pods_become_real_vms_bound_in_the_log_and_hibernate_wake_across_restarts(qenv: Env) -> None:
    env = qenv
    names = ["q.0", "q.1", "q.2"]
    uids = {n: await env.create(n) for n in names}
    vms = {n: (await env.wait_running(n, uids[n])).metadata.annotations["vmfence.io/vm-id"] for n in names}
    for n in names:
        assert [v.vm_id for v in await env.vms(n)] == [vms[n]] and (await env.vms(n))[0].pid
    bound = {d.vm_id for r in await env.records() for d in r.entry.decisions if isinstance(d, Bound)}
    assert set(vms.values()) <= bound

    await env.annotate("q.0", "vmfence.io/hibernate", "true")

    async def hibernated() -> bool:
        return env.conditions(await env.get("q.0")).get("vmfence.io/Hibernated") == "True"

    await env.wait_for("hibernated", hibernated)
    assert await env.vms("q.0") == []
    for name in list(env.stack.recs):
        env.stack.kill_reconciler(name)
        env.stack.start_reconciler(name)
    for name in list(env.stack.recs):
        await env.stack.wait_reconciler_ready(name)
    await env.annotate("q.0", "vmfence.io/hibernate", "false")
    await env.wait_running("q.0", uids["q.0"])
    wakes = [
        d.command for r in await env.records() if r.entry.key == f"{NS}/q.0"
        for d in r.entry.decisions if isinstance(d, Commanded) and d.command.op == "wake"
    ]
    assert wakes and Path(wakes[-1].snapshot or "").name, "woke from the snapshot in the log"
    for n in names:
        await env.core.delete_namespaced_pod(n, NS)
    for n in names:
        await env.wait_gone(n)
    await env.settle()
    assert await env.vms() == [], "no QEMU left behind"
    await env.audit()
