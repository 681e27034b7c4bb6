"""A 3-node JetStream cluster on loopback with R3 streams: one node is SIGKILLed mid-run, appends
continue, and the audit of the resulting log is clean."""

from __future__ import annotations

import asyncio
from pathlib import Path

from services.reconciler.config import ReconcilerConfig
from services.reconciler.kube import NullGateway
from services.reconciler.service import Reconciler
from services.testbed.natsserver import start_cluster
from shared.bus.connect import Bus
from shared.bus.provision import StreamsConfig, provision
from shared.fence.audit import audit
from shared.fence.keys import Key
from shared.fence.schema import Spec
from shared.subjects import Subjects
from tests.reconciler.helpers import log_entries, observe, per_key, sim_agent, wait_until

PODS = 40


def _unbound(rec: Reconciler, keys: list[Key]) -> list[str]:
    """Each key not bound, with what the reconciler holds of it (names a failure's stuck step)."""
    out = []
    for k in keys:
        p = rec.partitions.get(rec.subjects.partition(k))
        slot = p.keys.get(str(k)) if p is not None else None
        if slot is None:
            out.append(f"{k}: {'partition not held' if p is None else 'never seen'}")
        elif slot.state.cur is None or not slot.state.cur.bound or slot.state.outbox:
            out.append(f"{k}: n={slot.state.n} cur={slot.state.cur!r} outbox={slot.state.outbox!r}")
    return out


async def test_r3_cluster_survives_a_node_kill_with_a_clean_audit(tmp_path: Path) -> None:
    cluster = await start_cluster(3, base_dir=str(tmp_path / "nats"))
    async with cluster:
        subjects = Subjects(partitions=4)
        bus = await Bus.open(cluster.urls, name="test", subjects=subjects)
        await provision(bus.js, subjects, StreamsConfig(partitions=4, replicas=3))
        gateway = NullGateway()
        keys = [Key("pod", "default", f"r3.{i}") for i in range(PODS)]
        for i, k in enumerate(keys):
            gateway.objects[str(k)] = (f"uid-{i}", 1, Spec())
        cfg = ReconcilerConfig(
            nats_url=cluster.urls, partitions=4, replicas=3, id="rec-r3", data_dir=str(tmp_path / "rec"),
            kube="none", http_port=0,
        )
        rec = Reconciler(cfg, gateway=gateway, health=False)
        async with sim_agent(cluster.urls, "host-a", tmp_path, 4), asyncio.TaskGroup() as tg:
            run = tg.create_task(rec.run())
            await asyncio.wait_for(rec.ready.wait(), 30)
            await wait_until(lambda: len(rec.hosts.live()) == 1, "the agent's heartbeat")
            for i, k in enumerate(keys):
                await observe(bus, k, f"uid-{i}", 1)
                if i == PODS // 2:
                    victim = next(n for n in cluster.nodes if n.running)
                    victim.kill()  # whichever node it is, leader or follower

            def bound() -> int:
                return sum(
                    1 for p in rec.partitions.values() for s in p.keys.values()
                    if s.state.cur is not None and s.state.cur.bound and not s.state.outbox
                )

            try:
                await wait_until(lambda: bound() == PODS, "every key bound after the node kill", within_s=60)
            except AssertionError as exc:
                raise AssertionError(f"{exc}; not bound: {_unbound(rec, keys)}") from None
            rec.stop()
            await run
        entries = await log_entries(bus)
        for key, log in per_key(entries).items():
            assert [e.n for e in log] == list(range(1, len(log) + 1)), key
        report = audit(entries)
        assert report.clean, report.violations
        assert report.vms_bound_live == PODS
        await bus.close()
