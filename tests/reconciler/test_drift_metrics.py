"""The reconciler's drift check (issue 10, "the reconcilers watch the same drift and expose it as
metrics"): every --drift-interval it asks each live host for its inventory — as its own NATS user,
under deploy/nats/accounts.conf — and compares it with the keys it holds; ``vmfence_drift{kind}``
says what it found, every kind, 0 when none."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from prometheus_client import REGISTRY

from services.agent.config import AgentConfig
from services.agent.service import Agent
from services.reconciler import metrics
from services.reconciler.config import ReconcilerConfig
from services.reconciler.kube import NullGateway
from services.reconciler.service import Reconciler
from services.testbed.natsserver import NatsUsers, local_accounts, start_nats
from shared.bus.append import publish_input
from shared.bus.connect import Bus
from shared.bus.provision import StreamsConfig, provision
from shared.fence.drift import DriftKind
from shared.fence.keys import Key
from shared.fence.schema import Command, Spec, encode
from shared.subjects import Subjects
from tests.reconciler.helpers import observe, wait_until


def _drift(kind: DriftKind) -> float | None:
    return REGISTRY.get_sample_value("vmfence_drift", {"kind": kind})


def _checks() -> float:
    return sum(REGISTRY.get_sample_value("vmfence_drift_checks_total", {"result": r}) or 0.0
               for r in ("clean", "drift"))


def _agent(url: str, users: NatsUsers, data_dir: Path) -> Agent:
    """host-a's sim agent, logged in as agent-host-a."""
    cfg = AgentConfig(
        nats_url=[url], host="host-a", runtime="sim", data_dir=str(data_dir / "host-a"), http_port=0,
        http_host="127.0.0.1", partitions=1, cpus=64, memory_mib=65536, heartbeat_interval=1.0, vnc_range=None,
        nats_user="agent-host-a", nats_password=users.password("agent-host-a"),
    ).validate()
    return Agent(cfg)


async def test_a_vm_removed_behind_the_logs_back_is_drift_until_the_world_agrees(tmp_path: Path) -> None:
    text, users = local_accounts(("host-a",))
    server = await start_nats(store_dir=str(tmp_path / "nats"), config_text=text)
    subjects = Subjects(partitions=1)
    admin = await Bus.open(server.url, name="test", subjects=subjects, auth=users.auth("admin"))
    try:
        await provision(admin.js, subjects, StreamsConfig(partitions=1))
        gateway = NullGateway()
        key = Key("pod", "default", "drifter")
        gateway.objects[str(key)] = ("uid-d", 1, Spec())
        cfg = ReconcilerConfig(
            nats_url=[server.url], id="rec-drift", partitions=1, data_dir=str(tmp_path / "rec"), kube="none",
            http_port=0, drift_interval_s=0.1, nats_user="reconciler", nats_password=users.password("reconciler"),
        )
        rec = Reconciler(cfg, gateway=gateway, health=False)
        async with _agent(server.url, users, tmp_path) as agent, asyncio.TaskGroup() as tg:
            run = tg.create_task(rec.run())
            await asyncio.wait_for(rec.ready.wait(), 30)
            await wait_until(lambda: len(rec.hosts.live()) == 1, "host-a's heartbeat")
            await observe(admin, key, "uid-d", 1)

            def bound() -> bool:
                slot = rec.partitions[0].keys.get(str(key))
                cur = slot.peek().cur if slot is not None else None
                return cur is not None and cur.bound and not slot.peek().outbox  # type: ignore[union-attr]

            await wait_until(bound, "the pod's VM bound")
            state = rec.partitions[0].keys[str(key)].peek()
            assert state.cur is not None and state.cur.vm_id
            fence, vm_id = state.cur.fence, state.cur.vm_id

            # a clean world: every kind 0 once a check ran over the bound VM, and host-a answered
            # (the reconciler's user may ask: accounts.conf's RECONCILER_PERMISSIONS)
            checks = _checks()
            await wait_until(lambda: _checks() >= checks + 2, "two drift checks after the binding")
            assert {k: _drift(k) for k in metrics.DRIFT_KINDS} == dict.fromkeys(metrics.DRIFT_KINDS, 0.0)

            # a forged remove (the admin identity, which NATS lets publish anything) removes the VM
            # behind the log's back: the log still binds it, the host no longer has it
            forged = Command("forged-remove-1", "remove", fence, "host-a", vm_id)
            await publish_input(admin.js, subjects.command("host-a"), encode(forged), msg_id=forged.id)
            await wait_until(lambda: vm_id not in agent.driver.all_vms(), "the forged remove executed")  # type: ignore[attr-defined]
            await wait_until(lambda: _drift("log_vm_missing") == 1, "the drift of the vanished VM")
            assert _drift("vm_not_in_log") == 0 and _drift("host_unanswered") == 0

            # the world agrees again: the inventory backstop asks the host, whose not_found ends the binding
            part = rec.partitions[0]
            part.inventory_stale_s = 0.0
            assert await part.sweep_inventory({"host-a"}) == 1
            await wait_until(lambda: _drift("log_vm_missing") == 0, "the drift cleared")
            cur = rec.partitions[0].keys[str(key)].peek().cur
            assert cur is not None and cur.evicting, "the pod whose VM vanished is evicted (rule 7)"
            rec.stop()
            await run
        assert _drift("log_vm_missing") is None, "a stopped reconciler judges nothing"
    finally:
        await admin.close()
        await server.stop()


async def test_a_drift_interval_of_zero_runs_no_check(tmp_path: Path) -> None:
    cfg = ReconcilerConfig(nats_url=["nats://127.0.0.1:1"], id="rec-off", partitions=1, data_dir=str(tmp_path),
                           kube="none", http_port=0, drift_interval_s=0.0)
    rec = Reconciler(cfg, gateway=NullGateway(), health=False)
    await asyncio.wait_for(rec._drift_loop(), 1.0)  # returns at once: no loop
    assert rec.drift_counts is None


async def test_a_reconciler_whose_run_is_cancelled_reports_nothing(tmp_path: Path) -> None:
    """A run that ends without its orderly stop (a crash, its task cancelled, as a failed test or an
    exception in a sibling task does) must not leave the process's gauges on its last figures: the
    partitions it held and its drift report go with it."""
    server = await start_nats(store_dir=str(tmp_path / "nats"))
    try:
        cfg = ReconcilerConfig(nats_url=[server.url], id="rec-cancelled", partitions=1, data_dir=str(tmp_path / "rec"),
                               kube="none", http_port=0, drift_interval_s=0.1)
        rec = Reconciler(cfg, gateway=NullGateway(), health=False)
        run = asyncio.create_task(rec.run())
        await asyncio.wait_for(rec.ready.wait(), 30)
        await wait_until(lambda: rec.drift_counts is not None, "a drift check over the held partition")
        assert _drift("log_vm_missing") == 0
        assert REGISTRY.get_sample_value("vmfence_quarantined_keys", {"partition": "0"}) == 0
        part = rec.partitions[0]
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run
        assert not part.held and rec.drift_counts is None
        assert _drift("log_vm_missing") is None, "a cancelled reconciler judges nothing"
        assert REGISTRY.get_sample_value("vmfence_quarantined_keys", {"partition": "0"}) is None
    finally:
        await server.stop()
