"""What pods waiting for a host cost while they wait: log entries and reconciler CPU.

``python -m services.testbed.bench.waiting PODS SECONDS [churn] [writes-fail] [recovers] [no-early]``
runs a real nats-server, the fake agents' process (host-a and host-b live, heartbeating) and a
reconciler in this process, then admits PODS pods bound to a node that never comes (``vmfence-host-z``)
and prints JSON: the log's entry count every 10 s of SECONDS and the reconciler process's
CPU over them. Each check that finds no host is an entry (``Skipped(no_host)`` and the next place
timer); its backoff (``decide.place_retry_s``) sets how many a fleet that lost its hosts appends for
as long as it waits. With ``churn``, host-a also reports more free room every second, as a busy host
whose VMs come and go does: the checks fired early (``hosts.worth_checking``) must not include these
pods, which host-a cannot take. With ``writes-fail``, every Kubernetes write fails too, unanswered,
as while an API server is down: each pod's status write is written again after its backoff
(``rewrite_backoff_s``). With ``recovers`` as well, the API server answers again after SECONDS and
the JSON says how long until every pod's status was written (``recovered_s``): the reconciler fires
the rewrites that waited for it (``EffectRunner.fire_server_waits``); ``no-early`` leaves them to
their backoff instead, as before that existed, for a comparison in the same run.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
import tempfile
import time
from typing import Any

import msgspec

from services.reconciler.kube import NullGateway
from services.reconciler.metrics import REWRITES_EARLY
from services.testbed.bench.command import FAKE_HOSTS, fake_heartbeat, until_hosts_live
from services.testbed.natsserver import start_nats
from shared.bus.connect import Bus
from shared.bus.provision import StreamsConfig, provision
from shared.fence.keys import Key
from shared.fence.schema import KubeWrite, Observed, Spec, WriteDone, encode
from shared.subjects import Subjects
from shared.tasks import cancel_and_wait, run_main

PARTITIONS = 4
MARK_EVERY_S = 10.0
DEAD_NODE = "vmfence-host-z"  # no agent of that name ever heartbeats


class _WritesFail(NullGateway):
    """An API server that does not answer writes (down) until ``up()``; then takes them all."""

    def __init__(self, pods: int) -> None:
        super().__init__()
        self.down = True
        self.pods = pods
        self.written: set[str] = set()  # keys whose status was written once the server was up
        self.all_written = asyncio.Event()

    def up(self) -> None:
        self.down = False

    async def write(self, key: Key, write: KubeWrite) -> WriteDone:
        self.counts[write.verb] += 1
        if self.down:
            why = "0 Transport: the bench's API server is down"
            return WriteDone(fence=write.fence, write_id=write.id, outcome="failed", detail=why, unanswered=True)
        if write.verb == "status":
            self.written.add(str(key))
            if len(self.written) >= self.pods:
                self.all_written.set()
        return WriteDone(fence=write.fence, write_id=write.id, outcome="ok")


async def _churn(hosts: Any) -> None:
    """host-a reports one more free CPU each second (against its previous report: more room)."""
    for extra in itertools.count():
        beat = msgspec.structs.replace(fake_heartbeat("host-a"), cpus_free=10**6 + extra)
        await hosts.put("host-a", encode(beat))
        await asyncio.sleep(1.0)  # a period, not a synchronisation


async def run_waiting(pods: int, seconds: float, tmp: str | None = None, *, churn: bool = False,
                      writes_fail: bool = False, recovers: bool = False, early: bool = True) -> dict[str, object]:
    from services.reconciler.config import ReconcilerConfig
    from services.reconciler.effects import EffectRunner
    from services.reconciler.service import Reconciler

    fire_server_waits = EffectRunner.fire_server_waits
    tmp = tmp or tempfile.mkdtemp(prefix="vmfence-bench-")
    server = await start_nats(store_dir=os.path.join(tmp, "nats"))
    agents = None
    try:
        subjects = Subjects(partitions=PARTITIONS)
        bus = await Bus.open(server.url, name="bench-waiting", subjects=subjects)
        await provision(bus.js, subjects, StreamsConfig(partitions=PARTITIONS))
        hosts = await bus.js.key_value(subjects.kv_hosts)
        for host in FAKE_HOSTS:
            await hosts.put(host, encode(fake_heartbeat(host)))
        agents = await asyncio.create_subprocess_exec(
            sys.executable, "-c",
            f"from services.testbed.bench.command import fake_agents_main; "
            f"fake_agents_main({server.url!r}, {PARTITIONS})",
        )
        spec = Spec(node=DEAD_NODE)
        keys = [Key("pod", "bench", f"waiting-{i}") for i in range(pods)]
        gateway = _WritesFail(pods) if writes_fail else NullGateway()
        for i, key in enumerate(keys):
            gateway.objects[str(key)] = (f"uid-{i:08d}", 1, spec)
        cfg = ReconcilerConfig(nats_url=[server.url], partitions=PARTITIONS, id="bench-waiting",
                               data_dir=os.path.join(tmp, "rec"), kube="none", http_port=0)
        rec = Reconciler(cfg, gateway=gateway, health=False)
        if not early:  # the comparison: the rewrites sit out their backoff, as before they were fired
            EffectRunner.fire_server_waits = lambda self: 0  # type: ignore[method-assign]

        async def log_entries() -> int:
            return int((await bus.js.stream_info(subjects.stream_log)).state.messages)

        async with asyncio.TaskGroup() as tg:
            run = tg.create_task(rec.run())
            churning = tg.create_task(_churn(hosts)) if churn else None
            await asyncio.wait_for(rec.ready.wait(), 60)
            await until_hosts_live(rec)
            for i, key in enumerate(keys):
                obs = Observed(str(key), f"uid-{i:08d}", 1, spec=spec)
                await bus.js.publish(subjects.observation(key), encode(obs), timeout=10)
            at_start = await log_entries()
            while at_start < pods:  # until each pod is admitted (its first check is in that entry)
                await asyncio.sleep(0.1)  # the server's count is polled: no event says so
                at_start = await log_entries()
            cpu_start = time.process_time()
            marks = []
            for _ in range(max(1, int(seconds // MARK_EVERY_S))):
                await asyncio.sleep(MARK_EVERY_S)  # the period sampled, not a synchronisation
                marks.append(await log_entries())
            cpu = time.process_time() - cpu_start
            recovered_s, early_before = None, REWRITES_EARLY._value.get()
            if recovers and isinstance(gateway, _WritesFail):
                # the server answers again: every pod's status is written, how soon?
                gateway.up()
                up_at = time.perf_counter()
                await asyncio.wait_for(gateway.all_written.wait(), 120)
                recovered_s = round(time.perf_counter() - up_at, 2)
            if churning is not None:
                await cancel_and_wait([churning], what="churn")
            rec.stop()
            await run
        await bus.close()
    finally:
        EffectRunner.fire_server_waits = fire_server_waits  # type: ignore[method-assign]
        if agents is not None:
            agents.terminate()
            await agents.wait()
        await server.stop()
    span = MARK_EVERY_S * len(marks)
    return {
        "bench": "waiting",
        "pods": pods,
        "churn": churn,
        "writes_fail": writes_fail,
        "seconds": span,
        "entries_when_admitted": at_start,
        "entries_every_10s": marks,
        "entries_per_pod_per_minute": round((marks[-1] - at_start) / max(1, pods) * 60.0 / span, 2),
        "reconciler_cpu_s": round(cpu, 2),
        "kubernetes_writes": dict(gateway.counts),
        "recovered_s": recovered_s,
        "rewrites_fired_early": early,
        "rewrites_early": int(REWRITES_EARLY._value.get() - early_before),
    }


def main(argv: list[str]) -> int:
    pods, seconds = int(argv[0]), float(argv[1])
    flags = set(argv[2:])
    print(json.dumps(run_main(run_waiting(
        pods, seconds, churn="churn" in flags, writes_fail="writes-fail" in flags or "recovers" in flags,
        recovers="recovers" in flags, early="no-early" not in flags,
    ))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
