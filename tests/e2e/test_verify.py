"""`vmfence verify` on a whole local stack: clean while the world agrees with the log; a VM removed by
a forged command is drift the next verify names — while `vmfence replay` stays clean, since the log
itself is consistent. A VM its host loses behind the agent's back is noticed by the agent (VM gone,
the pod evicted): no drift once that is done."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import msgspec

from services.cli.verify import look, persistent
from shared.fence.schema import Command, Fence
from tests.e2e.conftest import NS, Env

ROOT = Path(__file__).resolve().parents[2]


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


async def _bound(env: Env, name: str) -> tuple[str, str, Fence]:
    pod = await env.wait_running(name)
    ann = pod.metadata.annotations
    fence = Fence(f"{NS}/{name}", pod.metadata.uid, int(ann["vmfence.io/epoch"]))
    return ann["vmfence.io/host"], ann["vmfence.io/vm-id"], fence


async def test_verify_is_clean_then_names_a_forged_remove_and_a_lost_vm(env: Env, tmp_path: Path) -> None:
    for name in ("steady", "forged", "lost"):
        await env.create(name)
    bound = {name: await _bound(env, name) for name in ("steady", "forged", "lost")}
    await env.settle()
    assert env.stack.bus is not None
    bus = env.stack.bus

    # the whole command, from a stack directory as an operator runs it
    workdir = tmp_path / "operator"
    env.stack.record(str(workdir / ".vmfence" / "stack.json"))
    clean = await asyncio.to_thread(_cli, workdir, "verify", "--json")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    report = json.loads(clean.stdout)
    assert report["clean"] and report["keys"] >= 3 and report["vms_checked"] >= 6 and report["api_checked"]
    assert report["objects_checked"] >= 3

    # a forged remove, executed by the agent as if it came from the reconciler (what NATS
    # permissions now refuse on the bus; the agent itself cannot tell)
    host, vm_id, fence = bound["forged"]
    agent = env.stack.agents[host]
    assert agent.executor is not None
    result, _ = await agent.executor.execute(Command("forged-remove-1", "remove", fence, host, vm_id))
    assert result.outcome == "ok"
    # a VM its host forgets without telling anyone
    lost_host, lost_vm, _ = bound["lost"]
    env.stack.agents[lost_host].driver.lose_vm(lost_vm)  # type: ignore[attr-defined]

    await env.wait_gone("lost")  # the agent saw its VM gone; the pod was evicted (rule 7)
    await env.settle()
    first = await look(bus, env.stack.kubeconfig_path, stuck_after_s=60)
    second = persistent(first, await look(bus, env.stack.kubeconfig_path, stuck_after_s=60))
    found = sorted((d.kind, d.key, d.vm_id) for d in second.drift)
    assert found == [("log_vm_missing", f"{NS}/forged", vm_id)], found

    out = await asyncio.to_thread(_cli, workdir, "verify", "--json", "--interval", "0.5")
    assert out.returncode == 1, out.stderr
    drift = msgspec.json.decode(out.stdout)["drift"]
    assert {d["key"] for d in drift} == {f"{NS}/forged"}
    assert all({"kind", "key", "host", "vm_id", "detail"} <= d.keys() for d in drift)
    text = await asyncio.to_thread(_cli, workdir, "verify", "--interval", "0.5")
    assert text.returncode == 1 and "DRIFT log_vm_missing: key default/forged" in text.stdout
    # the log itself is still consistent: only verify can see this
    replay = await asyncio.to_thread(_cli, workdir, "replay", "--json", "--not-final")
    assert json.loads(replay.stdout)["clean"]
